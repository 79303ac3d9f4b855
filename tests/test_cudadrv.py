"""mpack/cudadrv.py without a GPU: the lazy import, the one missing-package message, the one
error class. (Its driver calls run in the GPU tests of cuda_repack and cuda_vmm.)"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from mpack import cudadrv
from mpack.errors import MpackError, UsageError, exit_code_for


def test_import_loads_neither_cuda_bindings_nor_torch() -> None:
    code = (
        "import sys, mpack.cudadrv\n"
        "print(sorted(m for m in ('torch', 'cuda.bindings') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_missing_bindings_is_one_usage_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails as if not installed
    with pytest.raises(UsageError) as e:
        cudadrv.driver()
    assert str(e.value) == "--device cuda needs the cuda-bindings package"
    assert e.value.hint == cudadrv.INSTALL_HINT and exit_code_for(e.value) == 2
    with pytest.raises(UsageError, match="^the kernel needs the cuda-bindings package$"):
        cudadrv.nvrtc("the kernel")


def test_check_unpacks_values_and_raises_the_one_error(monkeypatch) -> None:
    fake = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=0),
        cuGetErrorName=lambda err: (0, b"CUDA_ERROR_OUT_OF_MEMORY"),
        cuGetErrorString=lambda err: (0, b"out of memory"),
    )
    monkeypatch.setattr(cudadrv, "driver", lambda needed_by="--device cuda": fake)
    assert cudadrv.check((0,), "a") is None
    assert cudadrv.check((0, 5), "a") == 5
    assert cudadrv.check((0, 1, 2), "a") == (1, 2)
    with pytest.raises(cudadrv.CudaError) as e:
        cudadrv.check((2, None), "cuMemCreate(4096 bytes)")
    assert str(e.value) == (
        "CUDA driver call cuMemCreate(4096 bytes) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
    )
    assert isinstance(e.value, MpackError) and isinstance(e.value, RuntimeError)
    assert "nvidia-smi" in e.value.hint


def test_the_repack_kernel_error_is_the_one_class() -> None:
    pytest.importorskip("torch")
    from mpack.convert import cuda_repack

    assert cuda_repack.CudaKernelError is cudadrv.CudaError


def test_library_files_finds_the_driver_and_nvrtc_on_ld_library_path(tmp_path, monkeypatch):
    """What the driver path maps, found by name without loading it (Note [prefetch]): libcuda
    and libnvrtc from LD_LIBRARY_PATH's folders, links resolved to their files, each once."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "libcuda.so.1").write_bytes(b"\x7fELF driver")
    (first / "libnvrtc.so.13.0.88").write_bytes(b"\x7fELF nvrtc")
    (first / "libnvrtc.so.13").symlink_to("libnvrtc.so.13.0.88")
    (first / "libnvrtc-builtins.so.13.0").write_bytes(b"only for a compile")
    (first / "libcublas.so.13").write_bytes(b"not the driver path's")
    (second / "libcuda.so.1").symlink_to(first / "libcuda.so.1")  # the same file again
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{first}:{second}")
    got = [p for p in cudadrv.library_files() if tmp_path in p.parents]
    assert got == [first / "libcuda.so.1", first / "libnvrtc.so.13.0.88"]
    assert len(set(cudadrv.library_files())) == len(cudadrv.library_files())
