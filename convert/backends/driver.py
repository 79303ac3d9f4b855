"""The driver backend: the host backend with the weight repack on a GPU, through cuda-bindings.

Note [driver path]: the CUDA path of ``convert`` spent half its time importing torch, more of
it from a cold disk (figures: docs/BENCHMARKS.md, section 9), and used it for three things:
pinned host memory, copies between host and device, and a stream to order them. The repack
itself is our own kernel (``cuda/marlin_repack.cu``), built with NVRTC and launched through the
driver already (:mod:`mpack.convert.cuda_repack`), and the scales and bias are numpy on the host
backend (:mod:`mpack.convert.backends.host`). So this backend is the host backend (read,
transform, write on their threads, numpy arrays throughout) with only the weight repack on the
GPU, through cuda-bindings:

* the checkpoint weights are read into page-locked arrays (``cuMemHostAlloc``), handed round
  again by :class:`mpack.convert.backends.host.Buffers` (Note [recycled buffers]), so a unit's
  bytes go from the file to the device with one DMA and no staging copy;
* per layer, each fused or sliced piece is one ``cuMemcpy2DAsync`` (its rows and columns,
  pitched) into a device buffer ``[N, K]``, the kernel writes the Marlin tiles into a second
  one, and ``cuMemcpyDtoHAsync`` brings them back into a page-locked array for the writer;
  then the stream is synchronised (a layer's round trip is a few milliseconds: the transform
  thread is not what bounds the run). A batch of experts (Note [expert batches] in
  mpack/convert/stream.py) is one round trip: every expert's copies and launch, then one copy
  back into the stacked array and one wait;
* the device buffers grow to the largest layer (or batch) and are reused.

The bytes are the host backend's and the torch backend's: :func:`open_driver` checks the kernel
against the native repack on fused and column-sliced pieces before it is used, and the tests
compare whole sidecars. Where this backend cannot run, :func:`open_driver` refuses and says why
(Note [choosing a backend] in :mod:`mpack.convert.backends`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from mpack import cudadrv, target
from mpack.convert import cuda_repack, host_repack
from mpack.convert.backends import Refused, check_cuda_here
from mpack.convert.backends.host import Buffers, HostBackend, unsupported
from mpack.convert.plan import Plan
from mpack.device import DeviceSpec, no_cuda_here
from mpack.errors import UsageError

__all__ = ["DriverBackend", "GpuRepack", "Piece", "open_driver"]

#: One piece of a layer's weight: a 2-D uint8 array (rows contiguous), its rows and its columns.
Piece = tuple[np.ndarray, tuple[int, int], tuple[int, int]]


def open_driver(
    spec: DeviceSpec, plan: Plan, off: frozenset[str], option: str = "device"
) -> DriverBackend:
    """The driver backend for ``plan`` on ``spec``'s GPU (``auto``: ``cuda:0``), or
    :class:`Refused` and why.

    Raises:
        UsageError: ``spec`` names a CUDA device that is not here (the torch backend's words).
    """
    if "driver" in off:
        raise Refused("turned off (MPACK_NO_DRIVER_PATH)")
    if "cuda-kernel" in off:
        raise Refused("the CUDA kernel is turned off (MPACK_NO_CUDA_KERNEL)")
    if spec.kind == "auto" and no_cuda_here():
        raise Refused("no CUDA device here")
    why = unsupported(plan)
    if why is not None:
        raise Refused(why)
    try:
        cudadrv.driver()
        cudadrv.nvrtc()
    except UsageError as e:
        raise Refused(e.message) from None
    count = cudadrv.device_count()
    if spec.kind == "cuda":
        check_cuda_here(spec, count, option)  # parsed: not parsed again
    elif count == 0:
        raise Refused("no CUDA device here")
    try:
        gpu = GpuRepack(spec.ordinal)
    except Exception as e:
        raise Refused(f"the repack kernel does not load here: {type(e).__name__}: {e}") from None
    if not gpu.self_check():
        gpu.close()
        raise Refused("the repack kernel failed its self-check against the native repack")
    return DriverBackend(gpu)


class DriverBackend(HostBackend):
    """The host backend with page-locked arrays and the weight repacked on ``gpu`` (Note [driver
    path]); closing it frees the GPU's buffers after the arrays."""

    name = "driver"

    def __init__(self, gpu: GpuRepack) -> None:
        what = "weights repacked by the fused repack kernel"
        super().__init__(gpu.buffers(), gpu.pack_many, f"cuda:{gpu.ordinal}", what)
        self.gpu = gpu

    def close(self) -> None:
        super().close()
        self.gpu.close()


class GpuRepack:
    """The Marlin weight repack on CUDA device ``ordinal``, from host arrays to a host array,
    and the page-locked memory the host path reads into (Note [driver path])."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self._funcs = cuda_repack.functions(ordinal)
        self._lock = threading.Lock()
        self._bufs: dict[str, tuple[int, int]] = {}  # "in" / "out" -> (device pointer, bytes)
        with cudadrv.on_device(ordinal) as d:
            flags = int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._stream = cudadrv.check(d.cuStreamCreate(flags), "cuStreamCreate")

    # --- page-locked host memory (the allocator of host.Buffers) ---------------------------

    def pinned(self, nbytes: int) -> tuple[np.ndarray, int]:
        """A page-locked uint8 array of ``nbytes`` and its handle for :meth:`free_pinned`."""
        with cudadrv.on_device(self.ordinal) as d:
            ptr = int(cudadrv.check(d.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return np.frombuffer(raw, dtype=np.uint8), ptr

    def free_pinned(self, ptr: int) -> None:
        with cudadrv.on_device(self.ordinal) as d:
            cudadrv.check(d.cuMemFreeHost(ptr), "cuMemFreeHost")

    def buffers(self) -> Buffers:
        """:class:`mpack.convert.backends.host.Buffers` of page-locked arrays from this device."""
        return Buffers(alloc=self.pinned, free=self.free_pinned)

    # --- the repack ------------------------------------------------------------------------

    def _buffer(self, d: Any, which: str, nbytes: int) -> int:
        """Device buffer ``which`` with room for ``nbytes`` (grown, never shrunk)."""
        ptr, size = self._bufs.get(which, (0, 0))
        if size < nbytes:
            if ptr:
                cudadrv.check(d.cuMemFree(ptr), "cuMemFree")
                self._bufs.pop(which)
            ptr = int(cudadrv.check(d.cuMemAlloc(nbytes), "cuMemAlloc"))
            self._bufs[which] = (ptr, nbytes)
        return ptr

    def pack(
        self, pieces: list[Piece], k: int, np_: int, kp: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The Marlin tiles of the rows ``pieces`` name, fused in order: int32 ``[Kp/16, 4*Np]``
        (into ``out`` when given), the bytes of :func:`mpack.convert.host_repack.pack_rows`."""
        n = sum(r1 - r0 for _, (r0, r1), _ in pieces)
        np_, kp = cuda_repack.check_dims(n, k, np_, kp)
        out = host_repack.packed_out(np_, kp, out)
        self.pack_many([pieces], k, np_, kp, out.reshape(1, *out.shape))
        return out

    def pack_many(
        self, jobs: list[list[Piece]], k: int, np_: int, kp: int, out: np.ndarray
    ) -> np.ndarray:
        """:meth:`pack` of each job (the pieces of one layer; every layer of the same shape) into
        ``out[j]``, int32 ``[len(jobs), Kp/16, 4*Np]`` C-contiguous, in one round trip: every
        copy and launch queued, one copy back, one wait (a MoE batch of experts: Note [expert
        batches] in mpack/convert/stream.py)."""
        n = sum(r1 - r0 for _, (r0, r1), _ in jobs[0])
        np_, kp = cuda_repack.check_dims(n, k, np_, kp)
        shape = (len(jobs), *target.packed_weight_shape(np_, kp))
        if out.shape != shape or out.dtype != np.int32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous int32 {shape}, got {out.dtype} {out.shape}")
        one = out.nbytes // len(jobs)
        with self._lock, cudadrv.on_device(self.ordinal) as d:
            src = self._buffer(d, "in", max(len(jobs) * n * k, 1))
            dst = self._buffer(d, "out", out.nbytes)
            stream = int(self._stream)
            for j, pieces in enumerate(jobs):
                base, row = src + j * n * k, 0
                for a, (r0, r1), (c0, c1) in pieces:
                    if a.ndim != 2 or a.itemsize != 1 or a.strides[1] != 1 or c1 - c0 != k:
                        raise ValueError(f"a piece must be [rows, >= {k}] bytes, got {a.shape}")
                    if r1 > r0:
                        self._copy_rows(d, a, r0, r1, c0, base + row * k, k)
                    row += r1 - r0
                if row != n:
                    raise ValueError(f"layer {j} has {row} rows, layer 0 {n}")
                vec = cuda_repack.load_width(base, k, k)
                shape4 = (n, k, np_, kp)
                cuda_repack.launch(
                    self._funcs[vec], self.ordinal, base, k, dst + j * one, shape4, stream
                )
            cudadrv.check(
                d.cuMemcpyDtoHAsync(out.ctypes.data, dst, out.nbytes, self._stream),
                "cuMemcpyDtoHAsync",
            )
            cudadrv.check(d.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        return out

    def _copy_rows(self, d: Any, a: np.ndarray, r0: int, r1: int, c0: int, to: int, k: int) -> None:
        """Rows ``[r0, r1)``, columns ``[c0, c0 + k)`` of host array ``a`` -> device
        ``[r1 - r0, k]`` at ``to``, on the stream."""
        c = d.CUDA_MEMCPY2D()
        c.srcMemoryType = d.CUmemorytype.CU_MEMORYTYPE_HOST
        c.srcHost = a.ctypes.data + r0 * a.strides[0] + c0
        c.srcPitch = a.strides[0]
        c.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.dstDevice = to
        c.dstPitch = k
        c.WidthInBytes = k
        c.Height = r1 - r0
        cudadrv.check(d.cuMemcpy2DAsync(c, self._stream), "cuMemcpy2DAsync")

    def self_check(self) -> bool:
        """Whether the kernel gives the native repack's bytes on small fused pieces (padding in
        N and K, a column slice, both load widths); a mismatch means a broken toolchain."""
        rng = np.random.default_rng(0)
        a = rng.integers(0, 256, (200, 300), dtype=np.uint8)
        for pieces, k in (
            ([(a, (0, 60), (20, 260)), (a, (100, 140), (20, 260))], 240),
            ([(a, (10, 80), (0, 132))], 132),
        ):
            rows = [host_repack.rows_of(x, r, c[0]) for x, r, c in pieces]
            n = sum(r1 - r0 for _, (r0, r1), _ in pieces)
            np_, kp = target.padded_nk(n, k)
            try:
                got = self.pack(pieces, k, np_, kp)
            except Exception:
                return False
            if not np.array_equal(got, host_repack.pack_rows(rows, k, np_, kp)):
                return False
        return True

    def close(self) -> None:
        """Free the device buffers and the stream (page-locked arrays are their Buffers')."""
        with self._lock, cudadrv.on_device(self.ordinal) as d:
            for ptr, _ in self._bufs.values():
                d.cuMemFree(ptr)
            self._bufs.clear()
            if self._stream is not None:
                d.cuStreamDestroy(self._stream)
                self._stream = None
