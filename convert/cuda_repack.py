"""The Marlin FP8 weight repack as one fused CUDA kernel, built on demand with NVRTC.

``cuda/marlin_repack.cu`` turns checkpoint fp8 rows ``[N, K]`` into the Marlin int32 tiles
``[Kp/16, 4*Np]`` (SPEC §3.3 padding and §5 repack) in a single pass over device memory: every
input byte is read once and every output byte written once, where the torch-op path of
:func:`mpack.convert.marlin.pack_weight` makes a padded copy and then a permuted copy.

How it is built and run:

* the source is compiled with NVRTC (``cuda.bindings.nvrtc``) for the device's architecture
  (``sm_90`` on an H100/H200) into a cubin, cached in ``kernels`` of :mod:`mpack.cache` under
  a name keyed by the source hash, the options, the architecture and the NVRTC version, and
  read back only from an entry nobody else could have written (Note [cache trust] in
  :mod:`mpack.cache`);
* the cubin is loaded with ``cuModuleLoadData`` into the device's primary context (the one
  torch uses) and launched with ``cuLaunchKernel`` on torch's current stream, so it is ordered
  with the torch work around it like any torch op;
* :func:`available` says whether all of that works here (it never raises, and checks the
  kernel's bytes against the torch path once). Whether a conversion uses the kernel is not
  decided here: the torch backend (:mod:`mpack.convert.backends.torch`) asks :func:`available`
  when it opens, and the driver backend runs the kernel itself (Note [choosing a backend]).

Importing this module imports neither torch nor cuda-bindings, and touches no CUDA: each
happens on the first call that needs it. Building, loading and launching need no torch
(:mod:`mpack.convert.backends.driver` runs the kernel without it); :func:`pack_weight_cuda` and
:func:`available` are the torch wrappers. ``MPACK_REPACK_SOURCE`` points at another copy of
``marlin_repack.cu``; builds are cached in ``kernels`` of mpack's cache (:mod:`mpack.cache`,
``MPACK_CACHE_DIR``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack import cache, cudadrv, target
from mpack.errors import UsageError

if TYPE_CHECKING:  # the torch wrappers import it on use: the driver path runs without it
    import torch

__all__ = [
    "CudaKernelError",
    "available",
    "compile_kernel",
    "kernel_source_path",
    "pack_weight_cuda",
    "unavailable_reason",
]

#: Entry points of marlin_repack.cu by global-load width in bytes (the .cu's header says when).
KERNEL_NAMES: dict[int, str] = {
    16: "marlin_repack_v16",
    4: "marlin_repack_v4",
    1: "marlin_repack_v1",
}
#: Launch shape; these must match MPACK_THREADS / MPACK_BLOCK_N / MPACK_BLOCK_K in the .cu.
THREADS, BLOCK_N, BLOCK_K = 256, 128, 128
_MAX_GRID_Y = 65535
_NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)


#: NVRTC or the CUDA driver refused to build, load or launch the repack kernel (the one CUDA
#: error class, :class:`mpack.cudadrv.CudaError`, under the name this module always had).
CudaKernelError = cudadrv.CudaError


_lock = threading.RLock()
# device ordinal -> (CUmodule, {vec: CUfunction}); device ordinal -> (ok, reason)
_modules: dict[int, tuple[Any, dict[int, Any]]] = {}
_probed: dict[int, tuple[bool, str | None]] = {}
_last_reason: list[str | None] = [None]


def kernel_source_path() -> Path:
    """Where ``marlin_repack.cu`` is read from.

    ``$MPACK_REPACK_SOURCE`` if set, else ``<package root>/cuda/marlin_repack.cu``: the
    repository's ``cuda/`` in a source checkout or an editable install (an installed wheel has it
    only if the packaging ships ``cuda/`` as ``mpack/cuda``).
    """
    env = os.environ.get("MPACK_REPACK_SOURCE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "cuda" / "marlin_repack.cu"


# --- NVRTC -----------------------------------------------------------------------------------

_NEEDED_BY = "the fused repack kernel"


def _program_log(prog: Any) -> str:
    n = cudadrv.nvrtc(_NEEDED_BY)
    try:
        size = cudadrv.check_nvrtc(n.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        cudadrv.check_nvrtc(n.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        return buf.rstrip(b"\0").decode(errors="replace").strip()
    except Exception:  # the log is a courtesy; the compile error is raised by the caller
        return ""


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-bindings loads; raises if there is none."""
    major, minor = cudadrv.check_nvrtc(cudadrv.nvrtc(_NEEDED_BY).nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def _target(arch: str | int | tuple[int, int], ptx: bool) -> str:
    """``sm_90`` / ``compute_90`` from ``"sm_90"``, ``"90"``, ``90`` or ``(9, 0)``."""
    if isinstance(arch, tuple):
        num = f"{arch[0]}{arch[1]}"
    else:
        num = str(arch).removeprefix("sm_").removeprefix("compute_")
    if not num.rstrip("af").isdigit():
        raise ValueError(f"not a GPU architecture: {arch!r}")
    return f"{'compute' if ptx else 'sm'}_{num}"


def compile_kernel(
    arch: str | int | tuple[int, int] = "sm_90", *, ptx: bool = False, use_cache: bool = True
) -> bytes:
    """Compile ``marlin_repack.cu`` with NVRTC (needs no GPU).

    Args:
        arch: target architecture, e.g. ``"sm_90"`` or ``(9, 0)``.
        ptx: return PTX for ``compute_XY`` (NUL-terminated) instead of a ``sm_XY`` cubin.
        use_cache: read and write ``kernels`` of :mod:`mpack.cache` (an unwritable cache is
            skipped silently).

    Returns:
        The cubin (ELF) or PTX bytes, loadable with ``cuModuleLoadData``.

    Raises:
        CudaKernelError: the compile failed (the message carries NVRTC's log).
        OSError: the source file is missing.
    """
    src_path = kernel_source_path()
    src = src_path.read_bytes()
    target = _target(arch, ptx)
    major, minor = nvrtc_version()
    opts = [f"--gpu-architecture={target}".encode(), *(o.encode() for o in _NVRTC_OPTIONS)]
    key = hashlib.sha256(src + b"\0" + b"\0".join(opts)).hexdigest()[:20]
    name = f"marlin_repack-{target}-nvrtc{major}.{minor}-{key}.{'ptx' if ptx else 'cubin'}"
    image = cached_image(name, ptx) if use_cache else None
    if image is not None:
        return image
    failed = f"NVRTC {major}.{minor} could not compile {src_path} for {target}"
    image = _nvrtc_compile(src, src_path.name, opts, ptx, failed)
    if use_cache:
        cache.write_entry("kernels", name, image)
    return image


def cached_image(name: str, ptx: bool) -> bytes | None:
    """A build kept in ``kernels`` of mpack's cache, or None. The entry must pass Note [cache
    trust] in :mod:`mpack.cache` (ours, not group- or other-writable, no symlink, a regular file
    under a size cap): the image is loaded into the GPU and run. A cubin must start as an ELF
    file and PTX must end in the NUL that ``cuModuleLoadData`` needs (a torn write is compiled
    again rather than refused by the driver)."""
    image = cache.read_entry("kernels", name, then="the kernel is compiled again")
    if not image or not (image.endswith(b"\0") if ptx else image.startswith(b"\x7fELF")):
        return None
    return image


def _nvrtc_compile(src: bytes, name: str, opts: list[bytes], ptx: bool, failed: str) -> bytes:
    """Compile one NVRTC program: the PTX or the cubin. A failed compile raises
    ``CudaKernelError`` with ``failed`` and NVRTC's log."""
    n = cudadrv.nvrtc(_NEEDED_BY)
    ok = cudadrv.check_nvrtc
    prog = ok(n.nvrtcCreateProgram(src, name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = n.nvrtcCompileProgram(prog, len(opts), opts)
        if err != n.nvrtcResult.NVRTC_SUCCESS:
            raise CudaKernelError(f"{failed}:\n{_program_log(prog)}")
        if ptx:
            image = b" " * ok(n.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            ok(n.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
        else:
            image = b" " * ok(n.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            ok(n.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
    finally:
        n.nvrtcDestroyProgram(prog)
    return image


# --- CUDA driver -----------------------------------------------------------------------------


def compute_capability(ordinal: int) -> tuple[int, int]:
    """(major, minor) of CUDA device ``ordinal``, from the driver."""
    d = cudadrv.init()
    dev = cudadrv.device(ordinal)
    attr = d.CUdevice_attribute
    major = cudadrv.check(
        d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc"
    )
    minor = cudadrv.check(
        d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc"
    )
    return int(major), int(minor)


def functions(ordinal: int) -> dict[int, Any]:
    """The kernel's entry points on device ``ordinal``, compiled and loaded on first use."""
    with _lock:
        hit = _modules.get(ordinal)
        if hit is None:
            image = compile_kernel(compute_capability(ordinal))
            with cudadrv.on_device(ordinal) as d:
                module = cudadrv.check(d.cuModuleLoadData(image), "cuModuleLoadData")
                funcs = {
                    vec: cudadrv.check(d.cuModuleGetFunction(module, name.encode()), name)
                    for vec, name in KERNEL_NAMES.items()
                }
            hit = _modules[ordinal] = (module, funcs)
    return hit[1]


def load_width(ptr: int, ld: int, k: int) -> int:
    """Widest global load (16, 4 or 1 bytes) that the base pointer, row stride and K allow."""
    for vec in (16, 4):
        if ptr % vec == 0 and ld % vec == 0 and k % vec == 0:
            return vec
    return 1


def launch(
    func: Any,
    ordinal: int,
    src: int,
    ld: int,
    dst: int,
    shape: tuple[int, int, int, int],
    stream: int,
) -> None:
    """``cuLaunchKernel`` with the kernel's 7 parameters, packed by hand (any cuda-bindings)."""
    n, k, np_, kp = shape
    args = [
        ctypes.c_void_p(src),
        ctypes.c_longlong(ld),
        ctypes.c_void_p(dst),
        ctypes.c_int(n),
        ctypes.c_int(k),
        ctypes.c_int(np_),
        ctypes.c_int(kp),
    ]
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    grid_x, grid_y = -(-kp // BLOCK_K), -(-np_ // BLOCK_N)
    with cudadrv.on_device(ordinal) as d:
        cudadrv.check(
            d.cuLaunchKernel(
                func,
                grid_x,
                grid_y,
                1,
                THREADS,
                1,
                1,
                0,
                d.CUstream(stream),
                ctypes.addressof(params),
                0,
            ),
            "cuLaunchKernel(marlin_repack)",
        )


# --- public API ------------------------------------------------------------------------------


def check_dims(n: int, k: int, np_: int | None, kp: int | None) -> tuple[int, int]:
    """The padded ``(Np, Kp)`` of an ``[n, k]`` layer (default :func:`mpack.target.padded_nk`),
    checked against the kernel's limits; raises ``ValueError``."""
    if np_ is None or kp is None:
        np_, kp = target.padded_nk(n, k)
    if np_ < n or kp < k:
        raise ValueError(f"padded dims ({np_}, {kp}) smaller than the layer ({n}, {k})")
    if np_ % 64 or kp % 16:
        raise ValueError(f"padded dims need Np % 64 == 0 and Kp % 16 == 0, got ({np_}, {kp})")
    if -(-np_ // BLOCK_N) > _MAX_GRID_Y or np_ >= 2**31 or kp >= 2**31:
        raise ValueError(f"layer too large for the repack kernel's grid: ({np_}, {kp})")
    return np_, kp


def _bytes_2d(wck: torch.Tensor) -> torch.Tensor:
    from mpack.convert import marlin

    if wck.dim() != 2:
        raise ValueError(f"expected a 2-D [N, K] weight, got shape {tuple(wck.shape)}")
    return marlin._as_bytes(wck)


def pack_weight_cuda(
    wck: torch.Tensor,
    np_: int | None = None,
    kp: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Zero-pad to ``(Np, Kp)`` and repack in one kernel; same bytes as ``marlin.pack_weight``.

    Args:
        wck: float8_e4m3fn or uint8 ``[N, K]`` on a CUDA device. Rows may be strided (a column
            slice ``w[:, a:b]`` is read in place); any other layout is copied to contiguous.
        np_, kp: padded dims, ``np_ % 64 == 0``, ``kp % 16 == 0``, at least ``(N, K)``; default
            :func:`mpack.convert.marlin.marlin_padded_nk` ``(N, K)``.
        out: where to write (int32 ``[Kp/16, 4*Np]``, contiguous, on ``wck``'s device: an
            expert's slice of a stacked tensor); default a new tensor.

    Returns:
        int32 ``[Kp/16, 4*Np]`` on ``wck``'s device, written on torch's current stream.

    Raises:
        ValueError / TypeError: bad device, shape, dims or dtype.
        CudaKernelError: the kernel cannot be built, loaded or launched here.
    """
    if not wck.is_cuda:
        raise ValueError(f"pack_weight_cuda needs a CUDA tensor, got one on {wck.device}")
    import torch

    w = _bytes_2d(wck)
    n, k = w.shape
    np_, kp = check_dims(n, k, np_, kp)
    if k > 1 and w.stride(1) != 1:
        w = w.contiguous()
    ordinal = w.device.index if w.device.index is not None else torch.cuda.current_device()
    shape = (kp // 16, 4 * np_)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=w.device)
    elif (
        tuple(out.shape) != shape
        or out.dtype != torch.int32
        or out.device != w.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be contiguous int32 {shape} on {w.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if out.numel() == 0:
        return out
    ld = w.stride(0) if n > 1 else max(k, 1)
    vec = load_width(w.data_ptr(), ld, k)
    func = functions(ordinal)[vec]
    stream = torch.cuda.current_stream(w.device).cuda_stream
    launch(func, ordinal, w.data_ptr(), ld, out.data_ptr(), (n, k, np_, kp), stream)
    return out


def _probe(ordinal: int) -> tuple[bool, str | None]:
    """Can the kernel run on device ``ordinal``, and does it give the torch path's bytes?"""
    try:
        cudadrv.driver(_NEEDED_BY)
        cudadrv.nvrtc(_NEEDED_BY)
    except UsageError as e:
        return False, f"{e}: {e.hint}"
    try:
        import torch

        from mpack.convert import marlin

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        functions(ordinal)
        # One small self-check per device (padding in N and K, both fast paths): a wrong byte
        # here means a broken toolchain, and the torch path is used instead.
        dev = torch.device("cuda", ordinal)
        g = torch.Generator(device="cpu").manual_seed(0)
        for n, k in ((100, 240), (70, 132)):
            w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g).to(dev)
            if not torch.equal(pack_weight_cuda(w), marlin.pack_weight(w)):
                return False, f"self-check mismatch against the torch path at [N, K] = [{n}, {k}]"
    except Exception as e:  # anything at all: available() never raises
        return False, f"{type(e).__name__}: {e}"
    return True, None


def _ordinal(device: torch.device | int | None) -> int | None:
    import torch

    if device is None:
        try:
            return torch.cuda.current_device() if torch.cuda.is_available() else None
        except Exception:
            return None
    if isinstance(device, int):
        return device
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else 0


def available(device: torch.device | int | None = None) -> bool:
    """Whether the fused kernel works on ``device`` (default: the current CUDA device).

    True only when cuda-bindings and NVRTC import, a CUDA device is present, the kernel compiles
    and loads, and it matches the torch path on a small self-check. Cached per device; never
    raises; :func:`unavailable_reason` says why not.
    """
    ordinal = _ordinal(device)
    if ordinal is None:
        _last_reason[0] = "no CUDA device"
        return False
    with _lock:
        hit = _probed.get(ordinal)
        if hit is None:
            hit = _probed[ordinal] = _probe(ordinal)
    _last_reason[0] = hit[1]
    return hit[0]


def unavailable_reason() -> str | None:
    """Why the last :func:`available` call said False (None after a True)."""
    return _last_reason[0]
