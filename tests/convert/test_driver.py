"""convert/backends/driver.py: ``--device cuda`` without torch (Note [driver path]).

The ``gpu`` tests need a CUDA device and cuda-bindings (``make test-gpu``): the kernel against
the native repack on fused, sliced and padded pieces and the golden layers, whole sidecars
against the host backend, and a CLI conversion on the GPU that never imports torch. The others run
anywhere: when the backend refuses and why, and the page-locked :class:`Buffers` bookkeeping with
a real allocator (libc's ``malloc``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mpack import target
from mpack.convert import host_repack
from mpack.convert.backends import Refused, driver, host
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.device import CONVERT, DeviceSpec
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import HOST_MODELS, cli_env, plan_of, python_c, safetensors_bytes
from tests.convert.reference import load_vectors

REPO_KERNEL = Path(__file__).resolve().parents[2] / "cuda" / "marlin_repack.cu"
if REPO_KERNEL.is_file():  # an installed mpack may not ship cuda/: read the checkout's
    os.environ.setdefault("MPACK_REPACK_SOURCE", str(REPO_KERNEL))

needs_native = pytest.mark.skipif(
    not host_repack.available(), reason="the host repack extension is not built here"
)

MODELS = HOST_MODELS


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("driver")
    return {name: make_checkpoint(root / name, **kw) for name, kw in MODELS.items()}


# --- anywhere ----------------------------------------------------------------------------------


CUDA = DeviceSpec.parse("cuda", CONVERT)


@needs_native
def test_the_backend_refuses_what_it_does_not_take(models):
    """A requantizing plan, the driver or the kernel turned off: refused before any CUDA call,
    each with its reason (what ``-v`` and ``--json`` show)."""
    plan = plan_of(models["tensor"], profile="w8a8-marlin", tp=2)
    assert "requantizing" in (host.unsupported(plan) or "")
    with pytest.raises(Refused, match="requantizing per-tensor shards"):
        driver.open_driver(CUDA, plan, frozenset())
    good = plan_of(models["tensor"])
    assert host.unsupported(good) is None
    with pytest.raises(Refused, match="MPACK_NO_DRIVER_PATH"):
        driver.open_driver(CUDA, good, frozenset({"driver"}))
    with pytest.raises(Refused, match="MPACK_NO_CUDA_KERNEL"):
        driver.open_driver(CUDA, good, frozenset({"cuda-kernel"}))


@needs_native
def test_no_gpu_here_is_a_usage_error(models):
    """Without a GPU, ``--device cuda:0`` says so whichever backend looked (the driver where
    cuda-bindings is installed, else torch), and ``auto`` takes the host backend. A fresh
    process: CUDA_VISIBLE_DEVICES counts only before CUDA starts."""
    code = (
        "import sys\n"
        "from mpack.convert.backends import open_backend\n"
        "from mpack.convert.checkpoint import find_layers, open_checkpoint\n"
        "from mpack.convert.plan import make_plan\n"
        "from mpack.errors import UsageError\n"
        "c = open_checkpoint(sys.argv[1]); find_layers(c)\n"
        "plan = make_plan(c, profile='w8a16', act_dtype='bfloat16', tp=1, fusion='vllm')\n"
        "b = open_backend('auto', plan); assert (b.name, b.where) == ('host', 'cpu'), b.name\n"
        "b.close()\n"
        "try:\n"
        "    open_backend('cuda:0', plan)\n"
        "except UsageError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = python_c(code, str(models["tensor"]), env=env, timeout=180)
    assert "device='cuda:0': no CUDA device here" in out  # the API's words (Note [API wording])


def _libc_alloc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    live: set[int] = set()

    def alloc(n: int) -> tuple[np.ndarray, int]:
        ptr = libc.malloc(n)
        live.add(ptr)
        return np.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=np.uint8), ptr

    def free(ptr: int) -> None:
        live.remove(ptr)  # a second free of one pointer fails here
        libc.free(ptr)

    return alloc, free, live


def test_buffers_with_an_allocator_free_what_they_cannot_keep():
    alloc, free, live = _libc_alloc()
    b = host.Buffers(keep=1, alloc=alloc, free=free)
    big = host.Buffers.MIN_BYTES
    x, y = b.take(big), b.take(big)
    assert len(live) == 2 and x.base is not None  # foreign memory, known as ours
    x[:] = 7
    b.give(x.view(np.int32).reshape(4, -1))  # any view of it
    assert b.take(big) is x and int(x[-1]) == 7
    b.give(x)
    b.give(y)  # no room: freed at once
    assert len(live) == 1
    b.give(x)  # cached already: kept once
    small = b.take(100)
    assert small.base is None and len(live) == 1  # small arrays come from numpy
    b.give(np.frombuffer(bytearray(big), np.uint8))  # not one of ours: ignored
    assert b.take(big) is x
    z = b.take(big)  # a new one; then close frees every array made, taken or cached
    assert len(live) == 2 and z is not x
    b.close()
    assert not live


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu(models):
    if not host_repack.available():
        pytest.fail("the host repack extension is not built on this GPU machine")
    try:
        b = driver.open_driver(CUDA, plan_of(models["tensor"]), frozenset())
    except Refused as e:
        pytest.fail(f"the driver backend does not open on this GPU: {e}")
    yield b.gpu
    b.close()


def _native(pieces, k, np_, kp):
    rows = [host_repack.rows_of(a, r, c[0]) for a, r, c in pieces]
    return host_repack.pack_rows(rows, k, np_, kp)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n1, n2, k, c0",
    [(60, 40, 240, 20), (100, 0, 132, 0), (7, 250, 64, 3), (640, 384, 512, 0), (1, 1, 4, 1)],
)
def test_gpu_pieces_match_the_native_repack(gpu, n1, n2, k, c0):
    rng = np.random.default_rng(n1 * 7 + k)
    a = rng.integers(0, 256, (n1 + 3, k + c0 + 5), dtype=np.uint8)
    b = rng.integers(0, 256, (n2 + 2, k + c0), dtype=np.uint8)
    pieces = [(a, (2, 2 + n1), (c0, c0 + k)), (b, (1, 1 + n2), (c0, c0 + k))]
    np_, kp = target.padded_nk(n1 + n2, k)
    want = _native(pieces, k, np_, kp)
    assert np.array_equal(gpu.pack(pieces, k, np_, kp), want)
    # into page-locked memory, with more padding than the rule asks for
    shape = target.packed_weight_shape(np_ + 64, kp + 32)
    arr, handle = gpu.pinned(4 * shape[0] * shape[1])
    out = arr.view(np.int32).reshape(shape)
    try:
        out[:] = -1
        got = gpu.pack(pieces, k, np_ + 64, kp + 32, out)
        assert got is out and np.array_equal(out, _native(pieces, k, np_ + 64, kp + 32))
    finally:
        del out, arr
        gpu.free_pinned(handle)


@pytest.mark.gpu
def test_gpu_golden_layers(gpu, golden):
    t, index = load_vectors(golden / "vectors" / "layers.safetensors")
    assert index
    for lid, info in index.items():
        w = t[f"{lid}.wck"].view(__import__("torch").uint8).numpy()
        n, k = w.shape
        got = gpu.pack([(w, (0, n), (0, k))], k, info["Np"], info["Kp"])
        assert np.array_equal(got, t[f"{lid}.packed"].numpy()), lid


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model, act, tp",
    [("tensor", "bfloat16", 2), ("channel-f16", "float16", 1), ("bias", "bfloat16", 2)],
)
def test_gpu_driver_path_writes_the_host_paths_sidecar(
    models, tmp_path, monkeypatch, model, act, tp
):
    ck = models[model]
    a = run_convert(ck, tmp_path / "driver", ConvertOptions(act_dtype=act, tp=tp, device="cuda"))
    assert a.backend["name"] == "driver" and a.backend["device"] == "cuda:0"
    assert "open_gpu" in a.seconds and "import_torch" not in a.seconds
    b = run_convert(ck, tmp_path / "host", ConvertOptions(act_dtype=act, tp=tp, device="cpu"))
    assert a.digest == b.digest and safetensors_bytes(a.out) == safetensors_bytes(b.out)
    monkeypatch.setenv("MPACK_NO_DRIVER_PATH", "1")  # the switch, read from the environment
    c = run_convert(ck, tmp_path / "torch", ConvertOptions(act_dtype=act, tp=tp, device="cuda"))
    assert c.backend["name"] == "torch" and "MPACK_NO_DRIVER_PATH" in str(c.backend["refused"])
    assert "import_torch" in c.seconds  # the driver backend refused: torch ran
    assert safetensors_bytes(c.out) == safetensors_bytes(a.out)


@pytest.mark.gpu
def test_gpu_recycling_every_array_keeps_the_bytes(models, tmp_path, monkeypatch):
    """Every page-locked array handed round again (no size floor, one kept per size, the rest
    freed at once): the sidecar is still the host path's."""
    monkeypatch.setattr(host.Buffers, "MIN_BYTES", 0)
    real_init = host.Buffers.__init__
    monkeypatch.setattr(
        host.Buffers, "__init__", lambda self, keep=3, **kw: real_init(self, 1, **kw)
    )
    a = run_convert(
        models["bias"],
        tmp_path / "driver",
        ConvertOptions(act_dtype="float16", tp=2, device="cuda"),
    )
    assert a.backend["name"] == "driver"
    b = run_convert(
        models["bias"], tmp_path / "host", ConvertOptions(act_dtype="float16", tp=2, device="cpu")
    )
    assert safetensors_bytes(a.out) == safetensors_bytes(b.out)


@pytest.mark.gpu
def test_gpu_cli_conversion_never_imports_torch(models, tmp_path):
    code = (
        "import json, sys; from mpack.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(json.dumps('torch' in sys.modules))"
    )
    args = ["convert", str(models["bias"]), "-o", str(tmp_path / "o"), "--device", "cuda", "--json"]
    out = python_c(code, *args, env=cli_env(), timeout=300)
    lines = out.strip().splitlines()
    assert json.loads(lines[-1]) is False, out
    assert (tmp_path / "o" / "mpack.json").is_file()
    assert "open_gpu" in out and "import_torch" not in out
