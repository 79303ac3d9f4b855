"""The CUDA VMM backend in one process (the multi-process suite is test_serve_attach.py[cuda])."""

from __future__ import annotations

import gc
import os
import re

import pytest

from tests.runtime.sidecar_factory import expected_tensors, make_sidecar

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from mpack.runtime.allocation import plan_rank

    return plan_rank(
        make_sidecar(tmp_path_factory.mktemp("sc") / "s", layers=2, hidden=1024, inter=2048), 0
    )


def test_device_uuid_is_nvidia_smi_s():
    import torch

    from mpack.runtime.cuda_vmm import device_uuid

    uuid = device_uuid(0)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid)
    assert uuid[4:] == str(torch.cuda.get_device_properties(0).uuid).removeprefix("GPU-")


def test_export_import_read_only_and_freed(plan):
    import torch
    from cuda.bindings import driver as d

    from mpack.cudadrv import check
    from mpack.runtime.cuda_vmm import DeviceExport, _location, map_readonly
    from mpack.runtime.weights import build_views

    torch.empty(1, device="cuda:0")
    free0 = torch.cuda.mem_get_info(0)[0]
    export = DeviceExport.create(plan, 0)
    assert export.size >= plan.size and export.fd >= 0
    fd = os.dup(export.fd)  # what a client receives: its own descriptor of the handle
    try:
        base = map_readonly(fd, export.size, 0)
    finally:
        os.close(fd)
    assert base.device == torch.device("cuda", 0) and base.dtype == torch.uint8
    flags = check(d.cuMemGetAccess(_location(d, 0), base.data_ptr()), "cuMemGetAccess")
    assert int(flags) == int(d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
    views = build_views(base, plan.tensors)
    want = expected_tensors(plan.sidecar, 0)
    for name, data in want.items():
        got = views[name].cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert got == data, name
    # (writes are tried in separate processes: a faulting kernel ends its CUDA context)
    export.close()  # the daemon's handle goes; the mapping still holds the memory
    assert views["model.norm.weight"].cpu().numel() > 0
    torch.cuda.synchronize()
    free_mapped = torch.cuda.mem_get_info(0)[0]
    assert free_mapped <= free0 - export.size + 8 * 2**20, (
        "the mapping should still hold the memory"
    )
    del base, views
    gc.collect()
    torch.cuda.synchronize()
    # compared with the moment before the last mapping went (the first CUDA calls may grow the
    # context's own memory, which is not ours to account for)
    assert torch.cuda.mem_get_info(0)[0] >= free_mapped + export.size - 8 * 2**20
