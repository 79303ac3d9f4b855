"""CUDA backend (``--device cuda:N``): one VMM allocation per served rank, shared by POSIX fd.

Uses the CUDA driver's virtual memory management API through :mod:`mpack.cudadrv`, which
imports cuda-bindings lazily (``import mpack.runtime`` never loads it nor initialises CUDA). No
torch.multiprocessing, no legacy cudaIpc handles (they cannot map read-only and die with the
exporter).

Note [read-only CUDA mapping]: the daemon creates the allocation with ``cuMemCreate``
(requesting POSIX-fd handles), maps it read-write only to fill it, then unmaps it and keeps just
the allocation handle and its exported fd. A client imports the fd
(``cuMemImportFromShareableHandle``), reserves a VA range, maps it, releases the handle (the
mapping keeps the memory) and grants its device ``CU_MEM_ACCESS_FLAGS_PROT_READ`` only. A kernel
that writes there faults in the writer's context alone (that process's CUDA context is lost; no
other process sees the fault) and copies into it are rejected. The torch tensor is built through
``__cuda_array_interface__`` whose ``readonly`` flag stays False because torch rejects True: the
driver, not the flag, enforces read-only. Imported memory stays valid after the exporting
daemon dies; it is freed when the last handle and mapping anywhere are gone
(Note [lifetime of a mapping] in weights.py).

Note [torch-free daemon fill]: ``mpack serve --device cuda:N`` needs torch for nothing: it
allocates, maps and exports through the driver, and the fill only copies bytes from page-locked
host memory to a device pointer. Importing torch was most of the daemon's time to READY, so the
fill goes through the driver as well (:class:`DriverDest`, a ``loader.Destination``): one
``cuMemHostAlloc`` block cut into ``depth`` pieces (the ring of Note [pinned rings] in
mpack/iokit.py, without torch tensors), ``cuMemcpyHtoDAsync`` of a piece into the read-write
mapping on a stream of its own, and an event per piece recorded after its copy: the loader hands
piece ``i`` out again only after ``wait(i)``, which waits for that event. Every call runs in
device ``N``'s primary context (``cudadrv.on_device``), the one the mapping lives in, pushed on
the calling thread: the loader's workers submit copies from several threads. Allocation, fill
and export import no torch (tests/runtime/test_cuda_vmm.py checks it with a stand-in driver);
the client side (:func:`map_readonly`) still hands out torch tensors, and
``mpack.runtime.load`` to a CUDA device still fills a torch tensor (``loader.CudaDest``).

Note [early device start]: before its fill, a CUDA daemon waits for things that need nothing
from the sidecar: cuda-bindings' import, ``cuInit``, the primary context, and the fill's
page-locked ring (``cuMemHostAlloc`` pins ``DEPTH`` x ``CHUNK`` bytes, 640 MiB with 16 cores:
every fill worker holds a piece while it reads, and one more is in flight to the GPU; with the
chunk digests one chunk per read, a smaller ring means fewer workers). :func:`prestart` does
them on a thread of their own as soon as ``serve`` knows the device, while the main thread
reads and checks the manifest and headers, plans, takes the locks (the driver calls release
the GIL). ``DeviceExport.create`` then takes that ring (waiting for the thread if it is still
at work); where the thread failed, the main thread does it all again and reports the error
itself. The thread imports cuda-bindings, which imports nothing of mpack's: the main thread
waits for that import only where it needs the driver before the thread is done with it, and
the two never wait on each other.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from mpack.cudadrv import check, device, init, on_device, preload
from mpack.runtime.loader import CHUNK, DEPTH, FillStats, Progress, fill

if TYPE_CHECKING:
    import torch

    from mpack.cache import VerifiedFiles
    from mpack.runtime.allocation import Allocation


def device_uuid(ordinal: int) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` of CUDA device ``ordinal`` (as nvidia-smi)."""
    d = init()
    raw = check(d.cuDeviceGetUuid(device(ordinal)), "cuDeviceGetUuid").bytes
    h = (raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _location(d: Any, ordinal: int) -> Any:
    loc = d.CUmemLocation()
    loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    return loc


def _posix_fd(d: Any) -> Any:
    return d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class DeviceMapping:
    """A VA range of ``size`` bytes on device ``ordinal`` with an allocation mapped into it.

    Exposes ``__cuda_array_interface__`` (uint8 [size]) so torch can view it without a copy;
    torch keeps this object alive while any view exists. Unmapped by ``unmap()`` or when
    collected.
    """

    def __init__(self, ptr: int, size: int, ordinal: int) -> None:
        self.ptr, self.size, self.ordinal = ptr, size, ordinal
        self._finalizer = weakref.finalize(self, _unmap, ptr, size, ordinal)
        self._finalizer.atexit = False  # the process exit unmaps everything anyway

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # readonly must be False: torch refuses True (Note [read-only CUDA mapping]).
        return {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        """uint8 [size] on ``cuda:<ordinal>``, a view of this mapping."""
        import torch

        return torch.as_tensor(self, device=f"cuda:{self.ordinal}")

    def unmap(self) -> None:
        self._finalizer()


def _unmap(ptr: int, size: int, ordinal: int) -> None:
    with on_device(ordinal) as d:
        d.cuMemUnmap(ptr, size)
        d.cuMemAddressFree(ptr, size)


def _map(d: Any, handle: Any, size: int, ordinal: int, *, writable: bool) -> DeviceMapping:
    ptr = check(d.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    try:
        check(d.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        try:
            desc = d.CUmemAccessDesc()
            desc.location = _location(d, ordinal)
            flags = d.CUmemAccess_flags
            desc.flags = (
                flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                if writable
                else flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            )
            check(d.cuMemSetAccess(ptr, size, [desc], 1), "cuMemSetAccess")
        except BaseException:
            d.cuMemUnmap(ptr, size)
            raise
    except BaseException:
        d.cuMemAddressFree(ptr, size)
        raise
    return DeviceMapping(int(ptr), size, ordinal)


class DriverDest:
    """Device memory at ``ptr`` on device ``ordinal`` (a raw pointer: the daemon's read-write
    mapping) as a ``loader.Destination``, filled by the driver alone through a ring of ``depth``
    page-locked pieces of ``piece`` bytes (Note [torch-free daemon fill]).

    ``slot(i, offset, n)`` is piece ``i``'s first ``n`` bytes (``n <= piece``), writable host
    memory; ``submit`` queues their copy to ``ptr + offset`` on the ring's stream; ``wait(i)``
    returns once piece ``i``'s last copy is done; ``finish`` waits for every copy and frees the
    pieces, events and stream (also after a failed fill; a second call does nothing). The views
    ``slot`` returned must not be used after ``finish``.

    Raises:
        CudaError: a failed driver call (the constructor frees what it made before raising).
        ValueError: ``slot`` asked for more than ``piece`` bytes.
    """

    def __init__(self, ptr: int, ordinal: int, *, depth: int = DEPTH, piece: int = CHUNK) -> None:
        self.ptr, self.ordinal, self.depth, self.piece = int(ptr), ordinal, depth, piece
        self._host = 0  # the pieces' page-locked block; 0 once freed
        self._stream: Any = None
        self._events: list[Any] = []
        self._recorded = [False] * depth  # piece i has a copy whose event was not waited on
        try:
            with on_device(ordinal) as d:
                self._host = int(check(d.cuMemHostAlloc(depth * piece, 0), "cuMemHostAlloc"))
                flags = int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
                self._stream = check(d.cuStreamCreate(flags), "cuStreamCreate")
                no_timing = int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
                for _ in range(depth):
                    self._events.append(check(d.cuEventCreate(no_timing), "cuEventCreate"))
        except BaseException:
            self._free()
            raise
        block = memoryview((ctypes.c_char * (depth * piece)).from_address(self._host)).cast("B")
        self._slots = [block[i * piece : (i + 1) * piece] for i in range(depth)]

    def slot(self, i: int, offset: int, n: int) -> memoryview:
        if n > self.piece:
            raise ValueError(f"a read of {n} bytes does not fit a ring piece of {self.piece}")
        return self._slots[i][:n]

    def submit(self, i: int, offset: int, n: int) -> None:
        with on_device(self.ordinal) as d:
            check(
                d.cuMemcpyHtoDAsync(
                    self.ptr + offset, self._host + i * self.piece, n, self._stream
                ),
                f"cuMemcpyHtoDAsync({n} bytes)",
            )
            check(d.cuEventRecord(self._events[i], self._stream), "cuEventRecord")
        self._recorded[i] = True

    def wait(self, i: int) -> None:
        if self._recorded[i]:
            with on_device(self.ordinal) as d:
                check(d.cuEventSynchronize(self._events[i]), "cuEventSynchronize")
            self._recorded[i] = False

    def finish(self) -> None:
        try:
            if self._stream is not None:
                with on_device(self.ordinal) as d:
                    check(d.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        finally:
            self._free()

    def _free(self) -> None:
        """Destroy the events and the stream, free the pieces; each at most once."""
        self._slots = []
        self._recorded = [False] * self.depth
        events, stream, host = self._events, self._stream, self._host
        self._events, self._stream, self._host = [], None, 0
        if not (events or stream is not None or host):
            return
        with on_device(self.ordinal) as d:
            for ev in events:
                d.cuEventDestroy(ev)
            if stream is not None:
                d.cuStreamDestroy(stream)
            if host:
                d.cuMemFreeHost(host)


class DeviceExport:
    """The daemon's side: a filled VMM allocation on device ``ordinal`` and its exported fd."""

    backend = "cuda"

    def __init__(
        self, ordinal: int, handle: Any, fd: int, size: int, stats: FillStats, alloc_s: float = 0.0
    ) -> None:
        self.ordinal, self.handle, self.fd, self.size, self.stats = ordinal, handle, fd, size, stats
        self.alloc_s = alloc_s  # seconds from the start of ``create`` to the fill's

    @classmethod
    def create(
        cls,
        plan: Allocation,
        ordinal: int,
        progress: Progress | None = None,
        verified: VerifiedFiles | None = None,
    ) -> DeviceExport:
        """Allocate (rounded up to the granularity), fill while verifying (``progress`` and
        ``verified`` as ``loader.fill`` takes them), export. The fill's ring is the one
        :func:`prestart` made, where it did (Note [early device start]).

        Raises what ``loader.fill`` raises, or ``CudaError`` for a failed driver call.
        """
        t0 = time.perf_counter()
        with on_device(ordinal) as d:
            prop = d.CUmemAllocationProp()
            prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location = _location(d, ordinal)
            prop.requestedHandleTypes = _posix_fd(d)
            gran = check(
                d.cuMemGetAllocationGranularity(
                    prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
            size = (plan.size + gran - 1) // gran * gran
            handle = check(d.cuMemCreate(size, prop, 0), f"cuMemCreate({size} bytes)")
            fd = -1
            try:
                fd = int(
                    check(
                        d.cuMemExportToShareableHandle(handle, _posix_fd(d), 0),
                        "cuMemExportToShareableHandle",
                    )
                )
                rw = _map(d, handle, size, ordinal, writable=True)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                d.cuMemRelease(handle)
                raise
        try:  # the driver alone copies (Note [torch-free daemon fill])
            dest = _prestarted(ordinal)
            if dest is None:
                piece = max(1, min(CHUNK, plan.size))  # no read is longer than a file
                dest = DriverDest(rw.ptr, ordinal, depth=DEPTH, piece=piece)
            dest.ptr = int(rw.ptr)
            alloc_s = time.perf_counter() - t0
            stats = fill(plan, dest, progress=progress, verified=verified)
        except BaseException:
            rw.unmap()
            os.close(fd)
            with on_device(ordinal) as d:
                d.cuMemRelease(handle)
            raise
        rw.unmap()  # the daemon keeps no mapping at all, only the handle and the fd
        return cls(ordinal, handle, fd, size, stats, alloc_s)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with on_device(self.ordinal) as d:
                d.cuMemRelease(self.handle)


class _Prestart(threading.Thread):
    """The thread of :func:`prestart`: ``dest``, the ring it made (None until it is done, or
    where it failed)."""

    def __init__(self, ordinal: int) -> None:
        super().__init__(name="mpack-cuda-start", daemon=True)
        self.ordinal = ordinal
        self.dest: DriverDest | None = None

    def run(self) -> None:
        try:
            with on_device(self.ordinal):  # cuda-bindings loaded, cuInit, the primary context
                pass
            self.dest = DriverDest(0, self.ordinal, depth=DEPTH, piece=CHUNK)  # aimed later
        except Exception:  # noqa: BLE001 - the main thread does it again and reports it
            self.dest = None


_prestarts: dict[int, _Prestart] = {}
_prestart_lock = threading.Lock()


def prestart(ordinal: int) -> None:
    """Start initialising device ``ordinal`` for a daemon's fill on a thread (Note [early
    device start]): the driver, its primary context, the fill's pinned ring. One per device
    until a fill takes it; never raises (a failure shows when the main thread needs the device)."""
    from mpack.device import no_cuda_here

    if no_cuda_here():
        return
    with _prestart_lock:
        if ordinal not in _prestarts:
            t = _prestarts[ordinal] = _Prestart(ordinal)
            t.start()


def _prestarted(ordinal: int) -> DriverDest | None:
    """The ring :func:`prestart` made for device ``ordinal`` (waiting for its thread), taken:
    a later fill starts its own. None where none was started or it failed."""
    with _prestart_lock:
        t = _prestarts.pop(ordinal, None)
    if t is None:
        return None
    t.join()
    return t.dest


def prepare() -> None:
    """Pay now what the first :func:`map_readonly` of a process would pay that needs no device
    (Note [warm attach] in runtime/__init__.py): cuda-bindings imported, the driver library
    loaded and its entry points looked up (:func:`mpack.cudadrv.preload`: no ``cuInit``, no
    context), the enum members and structs of the mapping made once. Never raises."""
    d = preload()
    if d is not None:
        _posix_fd(d)
        _location(d, 0)  # a struct filled on the host: no device is asked


def map_readonly(fd: int, size: int, ordinal: int) -> torch.Tensor:
    """Import an exported allocation and map it read-only: uint8 [size] on ``cuda:<ordinal>``.

    The caller may close ``fd`` afterwards; the mapping lives as long as any view of the tensor.
    """
    import torch

    # torch's CUDA state first (a no-op once torch used the device): the tensor below lives in
    # torch's context, the primary one the driver calls use. Creating it touches the device, so
    # prepare() cannot do it for a process that has not used CUDA yet.
    torch.cuda.init()
    with on_device(ordinal) as d:
        handle = check(
            d.cuMemImportFromShareableHandle(fd, _posix_fd(d)), "cuMemImportFromShareableHandle"
        )
        try:
            mapping = _map(d, handle, size, ordinal, writable=False)
        finally:
            d.cuMemRelease(handle)  # the mapping holds the memory from here on
    return mapping.tensor()
