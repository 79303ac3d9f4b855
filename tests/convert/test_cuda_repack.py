"""convert/cuda_repack.py: the fused repack kernel against the torch path and the golden vectors.

The ``gpu`` tests need a CUDA device (``make test-gpu``); on a GPU they fail, not skip, when
the kernel cannot be built there. The other tests run anywhere: the CPU fallback, the lean
import, and (where cuda-bindings finds NVRTC) an NVRTC compile of the kernel for sm_90.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from mpack.convert import cuda_repack as cr
from mpack.convert import marlin as m
from tests.convert.helpers import python_c
from tests.convert.reference import load_vectors, rand_bytes

REPO_KERNEL = Path(__file__).resolve().parents[2] / "cuda" / "marlin_repack.cu"
# An installed mpack (the GPU box installs the wheel) may not ship cuda/: read the checkout's.
if REPO_KERNEL.is_file():
    os.environ.setdefault("MPACK_REPACK_SOURCE", str(REPO_KERNEL))

LLAMA8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
PADDED_SHAPES = [(64, 64), (96, 192), (960, 576), (200, 300), (1, 4), (130, 132)]


# --- anywhere ----------------------------------------------------------------------------------


def test_the_kernel_says_why_it_is_not_available():
    ok = cr.available()
    assert isinstance(ok, bool)
    if not torch.cuda.is_available():
        assert ok is False and cr.unavailable_reason()


def test_pack_weight_cuda_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA tensor"):
        cr.pack_weight_cuda(rand_bytes(64, 128))


def test_import_is_lean():
    """Importing the module adds no cuda-bindings module beyond torch's own, and no CUDA init."""
    code = (
        "import sys, torch\n"
        "before = {m for m in sys.modules if m.startswith('cuda')}\n"
        "import mpack.convert.cuda_repack\n"
        "after = {m for m in sys.modules if m.startswith('cuda')}\n"
        "print(sorted(after - before), torch.cuda.is_initialized())\n"
    )
    assert python_c(code, timeout=120).strip() == "[] False"


def test_kernel_source_matches_the_launcher():
    src = cr.kernel_source_path()
    assert src.is_file(), src
    text = src.read_text()
    for name in cr.KERNEL_NAMES.values():
        assert f'extern "C" __global__ void __launch_bounds__(MPACK_THREADS)\n{name}(' in text
    defines = dict(re.findall(r"^#define (MPACK_\w+) (\d+)", text, flags=re.M))
    assert int(defines["MPACK_THREADS"]) == cr.THREADS
    assert int(defines["MPACK_BLOCK_N"]) == cr.BLOCK_N
    assert int(defines["MPACK_BLOCK_K"]) == cr.BLOCK_K


def _nvrtc_or_skip() -> tuple[int, int]:
    try:
        return cr.nvrtc_version()
    except Exception as e:  # no cuda-bindings, or no libnvrtc for it to load
        pytest.skip(f"NVRTC is not usable here ({type(e).__name__}: {str(e).splitlines()[0]})")


def test_nvrtc_compiles_for_sm90(tmp_path, monkeypatch):
    """NVRTC needs no GPU: the source compiles to PTX and a cubin, and the cache is reused."""
    _nvrtc_or_skip()
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path))
    ptx = cr.compile_kernel("sm_90", ptx=True)
    for name in cr.KERNEL_NAMES.values():
        assert f".entry {name}(".encode() in ptx
    assert ptx.endswith(b"\0")  # cuModuleLoadData needs NUL-terminated PTX
    cubin = cr.compile_kernel((9, 0))
    assert cubin.startswith(b"\x7fELF")
    cached = sorted(p.suffix for p in (tmp_path / "kernels").iterdir())
    assert cached == [".cubin", ".ptx"], cached
    assert cr.compile_kernel("sm_90") == cubin  # from the cache
    assert cr.compile_kernel("sm_90", use_cache=False) == cubin  # deterministic


def test_nvrtc_compile_error_is_reported(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void f() { this is not C++; }\n')
    monkeypatch.setenv("MPACK_REPACK_SOURCE", str(bad))
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cr.CudaKernelError, match="could not compile"):
        cr.compile_kernel("sm_90")


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel() -> None:
    if not cr.available():
        pytest.fail(f"the repack kernel is not available on this GPU: {cr.unavailable_reason()}")


def _check(w: torch.Tensor, np_: int | None = None, kp: int | None = None) -> None:
    """Kernel bytes == the torch path's on the CPU copy of ``w`` (uint8/fp8 [N, K], CUDA)."""
    got = cr.pack_weight_cuda(w, np_, kp)
    expect = m.pack_weight(w.cpu().contiguous(), np_, kp)
    assert got.is_cuda and got.dtype == torch.int32 and got.shape == expect.shape
    assert torch.equal(got.cpu(), expect)


@pytest.mark.gpu
def test_gpu_golden_layers(golden, kernel):
    t, index = load_vectors(golden / "vectors" / "layers.safetensors")
    assert index
    for lid, info in index.items():
        wck = t[f"{lid}.wck"].cuda()
        got = cr.pack_weight_cuda(wck)
        assert got.shape == (info["Kp"] // 16, 4 * info["Np"]), lid
        assert torch.equal(got.cpu(), t[f"{lid}.packed"]), lid


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", PADDED_SHAPES + [(64, 16), (1000, 1000), (320, 528)])
def test_gpu_padded_random_shapes(n, k, kernel):
    w = rand_bytes(n, k, seed=7 * n + k).cuda()
    _check(w)
    _check(w.view(torch.float8_e4m3fn))
    np_, kp = m.marlin_padded_nk(n, k)
    _check(w, np_ + 128, kp + 48)  # more padding than the rule asks for


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA8B_SHAPES)
def test_gpu_llama8b_shapes(n, k, kernel):
    g = torch.Generator(device="cuda").manual_seed(n ^ k)
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=g)
    got = cr.pack_weight_cuda(w)
    assert got.shape == (k // 16, 4 * n)
    assert torch.equal(got, m.pack_weight(w))  # the torch path on CUDA (same bytes as on CPU)
    assert torch.equal(m.unpack_weight(got, n, k), w)


@pytest.mark.gpu
def test_gpu_views_strided_misaligned_and_transposed(kernel):
    base = rand_bytes(300, 1040, seed=3).cuda()
    _check(base[:, 16 : 16 + 512])  # column slice: row stride 1040, 16-byte loads in place
    _check(base[:, 4 : 4 + 512])  # base 4 bytes off: 4-byte loads
    _check(base[:, 1 : 1 + 512])  # base 1 byte off: byte loads
    _check(base[:, 8 : 8 + 300])  # K % 16 != 0 inside a wider row
    _check(base[10:250:2, :576])  # every other row
    _check(base[:200, :640].t())  # stride(1) != 1: copied to contiguous first
    _check(base[:1, :4].expand(70, 4))  # stride(0) == 0
    assert not base[:, 1:513].is_contiguous()


@pytest.mark.gpu
def test_gpu_writes_every_output_word(kernel):
    n, k = 200, 300
    np_, kp = m.marlin_padded_nk(n, k)
    junk = torch.full((kp // 16, 4 * np_), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
    del junk  # the caching allocator hands the same block to the kernel's output
    got = cr.pack_weight_cuda(torch.zeros((n, k), dtype=torch.uint8, device="cuda"))
    assert int(got.count_nonzero()) == 0


@pytest.mark.gpu
def test_gpu_runs_on_the_current_stream(kernel):
    w = rand_bytes(960, 576, seed=11)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        wd = w.to("cuda", non_blocking=False)
        got = cr.pack_weight_cuda(wd)
        got_cpu = got.to("cpu", non_blocking=False)  # ordered after the kernel on stream s
    assert torch.equal(got_cpu, m.pack_weight(w))


@pytest.mark.gpu
def test_gpu_torch_backend_runs_the_kernel_it_chose(kernel, monkeypatch):
    """The torch backend on a GPU picks the kernel when it opens (torch's ops with the kernel
    turned off) and then runs it: no hidden fall-back to the ops."""
    from mpack.convert.backends import torch as tb
    from mpack.device import CONVERT, DeviceSpec

    spec = DeviceSpec.parse("cuda", CONVERT)
    assert tb.open_torch(spec, None, frozenset(), "--device").packer == "kernel"  # type: ignore[arg-type]
    off = frozenset({"cuda-kernel"})
    assert tb.open_torch(spec, None, off, "--device").packer == "ops"  # type: ignore[arg-type]
    w = rand_bytes(130, 132, seed=5).cuda()
    expect = m.pack_weight(w.cpu())

    def torch_ops_called(*a, **kw):
        raise AssertionError("the kernel's packer ran torch's ops")

    monkeypatch.setattr(m, "pack_weight", torch_ops_called)
    np_, kp = m.marlin_padded_nk(130, 132)
    assert torch.equal(tb.pack_weight(w, np_, kp, "kernel").cpu(), expect)


@pytest.mark.gpu
def test_gpu_rejects_bad_arguments(kernel):
    w = rand_bytes(96, 192).cuda()
    with pytest.raises(ValueError, match="smaller than the layer"):
        cr.pack_weight_cuda(w, 64, 192)
    with pytest.raises(ValueError, match="Np % 64"):
        cr.pack_weight_cuda(w, 160, 192)
    with pytest.raises(ValueError, match="Kp % 16"):
        cr.pack_weight_cuda(w, 128, 200)
    with pytest.raises(ValueError, match="2-D"):
        cr.pack_weight_cuda(w.reshape(2, 48, 192))
    with pytest.raises(TypeError, match="1-byte"):
        cr.pack_weight_cuda(w.to(torch.float16))
