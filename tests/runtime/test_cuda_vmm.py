"""The CUDA VMM backend in one process (the multi-process suite is test_serve_attach.py[cuda]).

On a GPU (marked ``gpu``): device UUIDs, export, read-only import, memory freed, and the
daemon's fill without torch. Anywhere: the driver-only fill (``DriverDest``, Note [torch-free
daemon fill]) and ``DeviceExport.create`` against a stand-in driver
(tests/runtime/fake_driver.py) that runs copies as late as a GPU may and checks every piece of
host memory is left alone until its copy ran; and that the daemon's CUDA path imports no torch.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpack.errors import CudaError, VerificationError
from tests.conftest import flip_byte
from tests.runtime.fake_driver import GRANULARITY, FakeDriver, install
from tests.runtime.sidecar_factory import expected_tensors, make_sidecar

gpu = pytest.mark.gpu
FAKE_DRIVER = Path(__file__).with_name("fake_driver.py")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from mpack.runtime.allocation import plan_rank

    return plan_rank(
        make_sidecar(tmp_path_factory.mktemp("sc") / "s", layers=2, hidden=1024, inter=2048), 0
    )


@gpu
def test_device_uuid_is_nvidia_smi_s():
    import torch

    from mpack.runtime.cuda_vmm import device_uuid

    uuid = device_uuid(0)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid)
    assert uuid[4:] == str(torch.cuda.get_device_properties(0).uuid).removeprefix("GPU-")


@gpu
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


GPU_CHILD = """
import json, os, sys
from mpack.runtime.allocation import plan_rank
from mpack.runtime.cuda_vmm import DeviceExport, map_readonly

plan = plan_rank(sys.argv[1], 0)
export = DeviceExport.create(plan, 0)
torch_before = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
base = map_readonly(export.fd, export.size, 0).cpu().numpy()  # torch from here on
same = [bytes(base[r.offset : r.offset + r.size]) == r.path.read_bytes() for r in plan.regions]
export.close()
print(json.dumps({"torch": torch_before, "same": same}))
"""


@gpu
def test_the_daemon_fill_on_a_gpu_needs_no_torch_and_gives_the_file_bytes(plan, tmp_path):
    """``DeviceExport.create`` on cuda:0 in a fresh process: the driver alone fills (Note
    [torch-free daemon fill]); the bytes read back through a read-only mapping are the files'."""
    r = subprocess.run(
        [sys.executable, "-c", GPU_CHILD, str(plan.sidecar)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the repo root, whose ./mpack would shadow an installed package
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["torch"] == []
    assert got["same"] == [True] * len(plan.regions)


# --- the driver-only fill, against a stand-in driver ---------------------------------------


@pytest.fixture
def fake(monkeypatch) -> FakeDriver:
    d = FakeDriver()
    install(d, monkeypatch)
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A sidecar whose files are one chunk each (the fill reads them in order)."""
    return make_sidecar(tmp_path_factory.mktemp("small") / "s", layers=2)


@pytest.fixture(scope="module")
def chunked(small, tmp_path_factory) -> Path:
    """``small`` with 16 KiB chunk digests (the fill reads its chunks in parallel)."""
    from mpack.iokit import chunk_digests
    from mpack.sidecar import MANIFEST_NAME, write_manifest

    dst = tmp_path_factory.mktemp("chunked") / "s"
    shutil.copytree(small, dst)
    m = json.loads((dst / MANIFEST_NAME).read_text())
    for f in m["files"]:
        if f["name"].endswith(".safetensors"):
            f["chunks"] = {"bytes": 16384, "sha256": chunk_digests(dst / f["name"], 16384)}
            f.pop("sha256", None)
    write_manifest(dst, m)
    return dst


class _Device:
    """A read-write mapping of ``size`` bytes on the stand-in's device 0 (as the daemon's)."""

    def __init__(self, size: int) -> None:
        from mpack.cudadrv import check, on_device
        from mpack.runtime.cuda_vmm import _map

        self.size = -(-size // GRANULARITY) * GRANULARITY
        with on_device(0) as d:
            self.handle = check(d.cuMemCreate(self.size, None, 0), "cuMemCreate")
            self.rw = _map(d, self.handle, self.size, 0, writable=True)

    def close(self, fake: FakeDriver) -> bytes:
        data = fake.device_bytes(self.handle)
        self.rw.unmap()
        fake.cuMemRelease(self.handle)
        return data


def _regions_equal(data: bytes, plan) -> list[bool]:
    return [data[r.offset : r.offset + r.size] == r.path.read_bytes() for r in plan.regions]


DEPTH, PIECE = 3, 16384


@pytest.mark.parametrize("which", ["in order", "parallel"])
def test_the_driver_fill_gives_the_file_bytes_and_reuses_a_piece_only_after_its_copy(
    fake, small, chunked, which
):
    from mpack.runtime.allocation import plan_rank
    from mpack.runtime.cuda_vmm import DriverDest
    from mpack.runtime.loader import fill

    plan = plan_rank(small if which == "in order" else chunked, 0)
    assert all((r.chunk_bytes > PIECE) == (which == "in order") for r in plan.regions)
    dev = _Device(plan.size)
    dest = DriverDest(dev.rw.ptr, 0, depth=DEPTH, piece=PIECE)
    stats = fill(plan, dest, chunk=PIECE, depth=DEPTH)
    assert stats.bytes == plan.size
    # finish synchronised the stream and freed the ring: only the test's own mapping is left
    assert fake.live() == {"handles": 1, "reserved": 1, "mapped": 1}
    last_copy = max(i for i, c in enumerate(fake.calls) if c == "cuMemcpyHtoDAsync")
    assert "cuStreamSynchronize" in fake.calls[last_copy:]
    pieces = sum(-(-r.size // PIECE) for r in plan.regions)
    assert fake.calls.count("cuMemcpyHtoDAsync") == pieces > 2 * DEPTH  # the ring went round
    assert fake.calls.count("cuEventRecord") == pieces
    assert fake.problems == []  # no piece rewritten or queued again before its copy ran
    assert _regions_equal(dev.close(fake), plan) == [True] * len(plan.regions)
    assert fake.live() == {}


def test_a_destination_that_does_not_wait_is_caught(fake, small):
    """The check above can fail: a ring that hands a piece out again without waiting for its
    copy leaves the stand-in's copies reading rewritten bytes."""
    from mpack.runtime.allocation import plan_rank
    from mpack.runtime.cuda_vmm import DriverDest
    from mpack.runtime.loader import fill

    class NoWait(DriverDest):
        def wait(self, i: int) -> None:
            pass

    plan = plan_rank(small, 0)
    dev = _Device(plan.size)
    fill(plan, NoWait(dev.rw.ptr, 0, depth=DEPTH, piece=PIECE), chunk=PIECE, depth=DEPTH)
    assert any("before its copy ran" in p for p in fake.problems)
    assert _regions_equal(dev.close(fake), plan) != [True] * len(plan.regions)


def test_the_ring_waits_only_for_recorded_copies_and_refuses_a_long_read(fake):
    from mpack.runtime.cuda_vmm import DriverDest

    dev = _Device(1)
    dest = DriverDest(dev.rw.ptr, 0, depth=2, piece=64)
    dest.wait(0)
    assert "cuEventSynchronize" not in fake.calls  # nothing was copied from piece 0 yet
    with pytest.raises(ValueError, match="65 bytes"):
        dest.slot(1, 0, 65)
    dest.slot(1, 100, 64)[:] = b"x" * 64
    dest.submit(1, 100, 64)
    dest.wait(1)
    assert fake.calls[-1] == "cuCtxPopCurrent" and "cuEventSynchronize" in fake.calls
    dest.finish()
    dest.finish()  # a second finish frees nothing twice
    assert fake.calls.count("cuMemFreeHost") == 1 and fake.calls.count("cuStreamDestroy") == 1
    assert fake.calls.count("cuEventDestroy") == 2
    assert fake.live() == {"handles": 1, "reserved": 1, "mapped": 1}
    assert dev.close(fake)[100:164] == b"x" * 64


def test_a_failed_fill_frees_the_ring(fake, small, tmp_path):
    from mpack.runtime.allocation import plan_rank
    from mpack.runtime.cuda_vmm import DriverDest
    from mpack.runtime.loader import fill

    bad = tmp_path / "bad"
    shutil.copytree(small, bad)
    plan = plan_rank(bad, 0)
    flip_byte(plan.regions[0].path, plan.regions[0].size - 10)
    dev = _Device(plan.size)
    with pytest.raises(VerificationError):
        fill(plan, DriverDest(dev.rw.ptr, 0, depth=DEPTH, piece=PIECE), chunk=PIECE, depth=DEPTH)
    assert fake.live() == {"handles": 1, "reserved": 1, "mapped": 1}
    assert fake.problems == []  # every queued copy ran before the pieces were freed
    dev.close(fake)


@pytest.mark.parametrize(
    ("call", "k"),
    [("cuMemHostAlloc", 1), ("cuStreamCreate", 1), ("cuEventCreate", 2), ("cuMemcpyHtoDAsync", 4)],
)
def test_a_failed_driver_call_frees_everything(fake, small, call, k):
    from mpack.runtime.allocation import plan_rank
    from mpack.runtime.cuda_vmm import DriverDest
    from mpack.runtime.loader import fill

    plan = plan_rank(small, 0)
    dev = _Device(plan.size)
    fake.fail[call] = k
    with pytest.raises(CudaError, match=call):
        fill(plan, DriverDest(dev.rw.ptr, 0, depth=DEPTH, piece=PIECE), chunk=PIECE, depth=DEPTH)
    assert fake.live() == {"handles": 1, "reserved": 1, "mapped": 1}
    assert fake.problems == []
    dev.close(fake)
    assert fake.live() == {}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_device_export_fills_through_the_driver_and_keeps_only_the_handle(fake, small):
    from mpack.runtime.allocation import plan_rank
    from mpack.runtime.cuda_vmm import DeviceExport

    plan = plan_rank(small, 0)
    fds = _open_fds()
    export = DeviceExport.create(plan, 0)
    assert export.size % GRANULARITY == 0 and export.size >= plan.size
    assert fake.live() == {"handles": 1}  # ring, stream, events and the mapping are gone
    assert fake.problems == []
    data = fake.device_bytes(export.handle)
    assert _regions_equal(data, plan) == [True] * len(plan.regions)
    os.fstat(export.fd)  # the exported fd is open
    export.close()
    assert fake.live() == {} and export.fd == -1 and _open_fds() == fds


def test_device_export_of_a_damaged_sidecar_frees_everything(fake, small, tmp_path):
    from mpack.runtime.allocation import plan_rank
    from mpack.runtime.cuda_vmm import DeviceExport

    bad = tmp_path / "bad"
    shutil.copytree(small, bad)
    plan = plan_rank(bad, 0)
    flip_byte(plan.regions[-1].path, plan.regions[-1].size // 2)
    fds = _open_fds()
    with pytest.raises(VerificationError):
        DeviceExport.create(plan, 0)
    assert fake.live() == {} and fake.problems == [] and _open_fds() == fds


# --- the daemon's CUDA path imports no torch ------------------------------------------------

#: A fresh interpreter with the stand-in driver: the modules of ``mpack serve --device cuda:N``
#: imported, one rank exported; which heavy modules got loaded.
NO_TORCH_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("fake_driver", sys.argv[1])
fake_driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake_driver)
fake = fake_driver.FakeDriver()
fake_driver.install(fake)

import mpack.cli
from mpack import device, hub_sidecar, ui
from mpack.runtime import allocation, cuda_vmm, daemon, protocol

plan = allocation.plan_rank(sys.argv[2], 0)
export = cuda_vmm.DeviceExport.create(plan, 0)
data = fake.device_bytes(export.handle)
same = [data[r.offset : r.offset + r.size] == r.path.read_bytes() for r in plan.regions]
export.close()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
print(json.dumps({"same": same, "problems": fake.problems, "live": fake.live(), "heavy": heavy}))
"""


def _child(code: str, *args: str, cwd: Path) -> dict:
    xdg = cwd / "xdg"  # the daemon's runtime directory (not in cwd: its mpack/ would be imported)
    xdg.mkdir(mode=0o700)
    r = subprocess.run(
        [sys.executable, "-c", code, str(FAKE_DRIVER), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,  # not the repo root, whose ./mpack would shadow an installed package
        env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_the_daemon_cuda_fill_imports_no_torch(small, tmp_path):
    """Note [torch-free daemon fill]: the serve command's modules and a whole
    ``DeviceExport.create`` (allocate, fill, verify, export) in a fresh process load neither torch
    nor numpy."""
    got = _child(NO_TORCH_CHILD, str(small), cwd=tmp_path)
    assert got["heavy"] == []
    assert got["same"] == [True, True] and got["problems"] == [] and got["live"] == {}


#: ``mpack serve``'s own function on "cuda:0" with the stand-in driver, up to READY.
SERVE_CHILD = """
import importlib.util, json, os, signal, sys
spec = importlib.util.spec_from_file_location("fake_driver", sys.argv[1])
fake_driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake_driver)
fake_driver.install(fake_driver.FakeDriver())

from mpack.runtime import daemon

seen = {}

def ready(info):
    seen["device"] = info["device_label"]
    seen["torch"] = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
    os.kill(os.getpid(), signal.SIGTERM)  # a clean stop

daemon.serve(sys.argv[2], device="cuda:0", socket_path=sys.argv[3], on_ready=ready)
print(json.dumps(seen))
"""


@gpu
def test_serve_on_cuda_imports_no_torch_before_ready(small, tmp_path):
    got = _child(SERVE_CHILD, str(small), str(tmp_path / "d.sock"), cwd=tmp_path)
    assert got["device"] == "cuda:0"
    assert got["torch"] == []
