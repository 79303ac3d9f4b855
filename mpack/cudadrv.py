"""The CUDA driver and NVRTC through cuda-bindings: the one import, error class and context.

Both users of the driver go through here: :mod:`mpack.convert.cuda_repack` (build, load and
launch the repack kernel) and :mod:`mpack.runtime.cuda_vmm` (allocate, export and map device
memory). What they share:

* :func:`driver` / :func:`nvrtc`: the ``cuda.bindings`` modules, imported on first use, or a
  ``UsageError`` that says which package to install;
* :func:`check` / :func:`check_nvrtc`: unpack a cuda-bindings ``(result, *values)`` tuple and
  raise :class:`CudaError`, naming the call, when the result is not success;
* :func:`on_device`: device ``N``'s primary context (the one torch uses) made current for the
  driver calls inside a ``with`` block, so driver objects and torch tensors live in one context.

Importing this module imports neither cuda-bindings nor touches CUDA: both happen on the first
call that needs them.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from mpack.errors import CudaError, UsageError, arg

__all__ = [
    "CudaError",
    "check",
    "check_nvrtc",
    "device",
    "device_count",
    "driver",
    "init",
    "library_files",
    "nvrtc",
    "on_device",
    "preload",
]

#: How to get cuda-bindings (the ``cuda`` extra).
INSTALL_HINT = "pip install 'mpack-marlin[cuda]' (in a checkout: pip install -e '.[cuda]')"

_lock = threading.Lock()
_contexts: dict[int, Any] = {}  # device ordinal -> its retained primary context
_initialised = [False]
_preloaded = [False]


def driver(needed_by: str | None = None) -> ModuleType:
    """``cuda.bindings.driver``; raises ``UsageError`` ("``needed_by`` needs the cuda-bindings
    package", with the install command) where it is not installed; ``needed_by`` defaults to
    ``device='cuda'`` (``--device cuda`` under the CLI: Note [API wording] in mpack/errors.py)."""
    try:
        from cuda.bindings import driver as d
    except ImportError:
        raise _missing(needed_by) from None
    return d


def nvrtc(needed_by: str | None = None) -> ModuleType:
    """``cuda.bindings.nvrtc``; raises like :func:`driver`."""
    try:
        from cuda.bindings import nvrtc as n
    except ImportError:
        raise _missing(needed_by) from None
    return n


def _missing(needed_by: str | None) -> UsageError:
    what = needed_by or arg("device", "cuda")
    return UsageError(f"{what} needs the cuda-bindings package", hint=INSTALL_HINT)


#: Where the dynamic loader finds the driver and NVRTC on the usual Linux installs (after
#: LD_LIBRARY_PATH's folders).
_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/local/nvidia/lib64",
    "/usr/local/cuda/lib64",
    "/usr/lib/wsl/lib",
)


#: cuda-bindings modules the driver path never imports (the runtime, NVML, cuFile ...): not read.
_UNUSED_BINDINGS = (
    "runtime",
    "cyruntime",
    "cyruntime_ptds",
    "nvml",
    "cynvml",
    "cufile",
    "cycufile",
    "cudla",
    "cycudla",
    "nvjitlink",
    "cynvjitlink",
    "nvvm",
    "cynvvm",
    "nvfatbin",
    "cynvfatbin",
)


def _package_dirs(name: str) -> list[str]:
    """Where package ``name`` lives, found without importing it (none where it is missing)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def library_files() -> list[Path]:
    """The shared objects a driver-path process maps, found without loading them: cuda-bindings'
    driver and NVRTC modules, ``libcuda`` and the first ``libnvrtc`` in the order cuda-bindings
    looks (its wheel, then LD_LIBRARY_PATH, then the system folders). Note [prefetch] in
    mpack/iokit.py: read ahead of the source, their page faults do not wait behind it on a cold
    disk. Best effort: what is not found is left out."""
    found = [
        p
        for d in _package_dirs("cuda.bindings")
        for p in sorted(Path(d).rglob("*.so"))
        if p.name.split(".")[0] not in _UNUSED_BINDINGS
    ]
    wheel_nvrtc = [os.path.join(glob.escape(d), "*", "lib") for d in _package_dirs("nvidia")]
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(_LIB_DIRS)
    for name, where in (
        ("libnvrtc.so.*[0-9]", wheel_nvrtc + [glob.escape(d) for d in dirs]),
        ("libcuda.so.1", [glob.escape(d) for d in dirs]),
    ):
        for pattern in where:
            hits = sorted(glob.glob(os.path.join(pattern, name)))
            if hits:
                found.append(Path(hits[0]))
                break
    out, seen = [], set()
    for p in found:
        real = Path(os.path.realpath(p))
        if real not in seen and real.is_file():
            seen.add(real)
            out.append(real)
    return out


def _values(values: list[Any]) -> Any:
    """None, the one value, or a tuple of them (how cuda-bindings calls return)."""
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def check(result: Any, what: str) -> Any:
    """Unpack a driver call's ``(CUresult, *values)``: None, the value, or a tuple of values.

    Raises:
        CudaError: the result is not ``CUDA_SUCCESS`` (the message names ``what`` and the
            driver's error name and text).
    """
    d = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        name = d.cuGetErrorName(err)[1] or b"?"
        text = d.cuGetErrorString(err)[1] or b""
        raise CudaError(
            f"CUDA driver call {what} failed: {name.decode()} ({text.decode()})",
            hint="check the device (nvidia-smi), free memory and the driver version",
        )
    return _values(values)


def check_nvrtc(result: Any, what: str) -> Any:
    """Unpack an NVRTC call's ``(nvrtcResult, *values)`` like :func:`check`; raises
    :class:`CudaError` on an error."""
    n = nvrtc()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != n.nvrtcResult.NVRTC_SUCCESS:
        name = n.nvrtcGetErrorString(err)[1] or b"?"
        raise CudaError(f"NVRTC call {what} failed: {name.decode()}")
    return _values(values)


def init() -> ModuleType:
    """The driver module, ``cuInit`` called (once per process)."""
    d = driver()
    if not _initialised[0]:
        check(d.cuInit(0), "cuInit")
        _initialised[0] = True
    return d


def preload() -> ModuleType | None:
    """Load the driver library and look up cuda-bindings' driver entry points now, without
    ``cuInit``: what the first driver call of a process pays otherwise (cuda-bindings resolves
    every entry point on the first call of any of them). No context is created and no device is
    touched, so a process may still fork and use CUDA in the child (Note [warm attach] in
    runtime/__init__.py). The driver module where it worked; None where cuda-bindings is
    missing, this process surely sees no GPU (:func:`mpack.device.no_cuda_here`) or the driver
    does not load. Never raises; cheap after the first call that worked."""
    from mpack.device import no_cuda_here

    try:
        d = driver()
    except UsageError:  # the first real call says so, with its hint
        return None
    if _preloaded[0]:
        return d
    if no_cuda_here():  # nothing to load: leave no failed load behind for later calls
        return None
    try:
        err, _ = d.cuDriverGetVersion()  # answers before cuInit and initialises nothing
    except Exception:  # no libcuda: the first real call says so
        return None
    if err != d.CUresult.CUDA_SUCCESS:
        return None
    _preloaded[0] = True
    return d


def device_count() -> int:
    """CUDA devices the driver sees here: 0 where there is no driver (no ``libcuda``) or no
    device (``CUDA_ERROR_NO_DEVICE``), or no cuda-bindings."""
    try:
        d = init()
        return int(check(d.cuDeviceGetCount(), "cuDeviceGetCount"))
    except Exception:  # no libcuda, no device, no cuda-bindings: none here
        return 0


def device(ordinal: int) -> Any:
    """The driver's ``CUdevice`` for CUDA device ``ordinal``."""
    return check(init().cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")


@contextmanager
def on_device(ordinal: int) -> Iterator[ModuleType]:
    """Make device ``ordinal``'s primary context (torch's) current for the driver calls inside;
    yields the driver module. The context is retained for the life of the process, as torch
    does."""
    d = init()
    with _lock:
        ctx = _contexts.get(ordinal)
        if ctx is None:
            ctx = check(d.cuDevicePrimaryCtxRetain(device(ordinal)), "cuDevicePrimaryCtxRetain")
            _contexts[ordinal] = ctx
    check(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield d
    finally:
        d.cuCtxPopCurrent()
