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
    assert str(e.value) == "device='cuda' needs the cuda-bindings package"  # the API's words
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
    and the first libnvrtc of LD_LIBRARY_PATH's folders, links resolved to their files."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "libnvrtc.so.13.0.88").write_bytes(b"\x7fELF nvrtc")
    (first / "libnvrtc.so.13").symlink_to("libnvrtc.so.13.0.88")
    (first / "libnvrtc-builtins.so.13.0").write_bytes(b"only for a compile")
    (first / "libcublas.so.13").write_bytes(b"not the driver path's")
    (second / "libcuda.so.580.1").write_bytes(b"\x7fELF driver")
    (second / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    (second / "libnvrtc.so.13").write_bytes(b"a second NVRTC, not the one loaded")
    monkeypatch.setattr(cudadrv, "_package_dirs", lambda name: [])  # no wheels here
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{first}:{second}")
    assert cudadrv.library_files() == [first / "libnvrtc.so.13.0.88", second / "libcuda.so.580.1"]
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "none"))
    assert all(tmp_path not in p.parents for p in cudadrv.library_files())


def test_library_files_takes_the_bindings_the_driver_path_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "cuda" / "bindings"
    (pkg / "_bindings").mkdir(parents=True)
    for name in ("driver", "nvrtc", "runtime", "nvml", "_bindings/cydriver", "_bindings/cyruntime"):
        (pkg / f"{name}.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    monkeypatch.setattr(
        cudadrv, "_package_dirs", lambda n: [str(pkg)] if n == "cuda.bindings" else []
    )
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    got = [
        p.relative_to(pkg).as_posix().split(".")[0]
        for p in cudadrv.library_files()
        if pkg in p.parents
    ]
    assert got == ["_bindings/cydriver", "driver", "nvrtc"]
