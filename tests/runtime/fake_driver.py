"""A stand-in for ``cuda.bindings.driver`` where there is no GPU: the driver calls of mpack's
CUDA daemon (primary context, page-locked host memory, a stream, events, asynchronous copies, the
VMM calls), simulated on host memory, each call recorded.

It is as strict as a driver may be and as late as a GPU may be:

* every call that needs a context checks that the calling thread has one current (a worker
  thread that did not push the primary context gets ``CUDA_ERROR_INVALID_CONTEXT``);
* a copy runs only when an event recorded after it, or its stream, is synchronised; its host
  bytes are compared then with what they were when it was queued, so a piece of host memory
  rewritten while its copy was still queued shows in :attr:`FakeDriver.problems` (as does a
  piece queued again before its previous copy ran, freed with a copy pending, or a stream
  destroyed with work queued);
* ``fail[name] = k`` makes the ``k``-th call of ``name`` fail with ``CUDA_ERROR_OUT_OF_MEMORY``.

:meth:`FakeDriver.live` lists what is allocated and not freed. Imports only the standard
library: a fresh interpreter can load it by path without importing torch or numpy.
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
from types import SimpleNamespace
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


OK = CUresult.CUDA_SUCCESS

CUstream_flags = SimpleNamespace(CU_STREAM_DEFAULT=0, CU_STREAM_NON_BLOCKING=1)
CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)
CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
CUmemAccess_flags = SimpleNamespace(
    CU_MEM_ACCESS_FLAGS_PROT_NONE=0,
    CU_MEM_ACCESS_FLAGS_PROT_READ=1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3,
)

GRANULARITY = 2 * 1024 * 1024
_VA_BASE = 1 << 46  # far from any host address of this process


class CUmemLocation:
    type: int = 0
    id: int = 0


class CUmemAllocationProp:
    type: int = 0
    location: CUmemLocation | None = None
    requestedHandleTypes: int = 0


class CUmemAccessDesc:
    location: CUmemLocation | None = None
    flags: int = 0


class _Stream:
    def __init__(self, ctx: int) -> None:
        self.ctx = ctx
        self.ops: list[tuple] = []  # queued, not yet run: ("copy", ...) or ("event", ev, token)
        self.error = OK


class _Event:
    def __init__(self) -> None:
        self.stream: _Stream | None = None
        self.token = 0  # of its last record


class FakeDriver:
    """The driver of a machine with ``count`` GPUs (see the module docstring)."""

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.CUresult = CUresult
        for name, value in globals().items():
            if name.startswith("CU") and name != "CUresult":
                setattr(self, name, value)
        self.calls: list[str] = []
        self.problems: list[str] = []
        self.fail: dict[str, int] = {}
        self.initialised = False
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._seen: dict[str, int] = {}
        self._token = 0
        self.host: dict[int, Any] = {}  # address -> ctypes buffer
        self.streams: set[_Stream] = set()
        self.events: set[_Event] = set()
        self.handles: dict[int, bytearray] = {}  # VMM allocation handle -> its memory
        self.reserved: dict[int, int] = {}  # VA -> bytes reserved
        self.mapped: dict[int, list] = {}  # VA -> [memory, size, access flags]
        self._next_va = _VA_BASE
        self._next_handle = 1

    # --- bookkeeping ----------------------------------------------------------------------

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("cu") and callable(attr):
            return object.__getattribute__(self, "_call")(name, attr)
        return attr

    def _call(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            with self._lock:
                self.calls.append(name)
                self._seen[name] = k = self._seen.get(name, 0) + 1
                if self.fail.get(name) == k:
                    return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            return fn(*args)

        return call

    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def _no_context(self) -> bool:
        return not self._stack()

    def live(self) -> dict[str, int]:
        """What is allocated and not freed (empty when everything was)."""
        got = {
            "host": len(self.host),
            "streams": len(self.streams),
            "events": len(self.events),
            "handles": len(self.handles),
            "reserved": len(self.reserved),
            "mapped": len(self.mapped),
        }
        return {k: v for k, v in got.items() if v}

    def device_bytes(self, handle: int) -> bytes:
        return bytes(self.handles[handle])

    # --- driver, devices, contexts --------------------------------------------------------

    def cuGetErrorName(self, err: int) -> tuple:
        return OK, CUresult(err).name.encode()

    def cuGetErrorString(self, err: int) -> tuple:
        return OK, b"fake driver"

    def cuDriverGetVersion(self) -> tuple:
        return OK, 12080

    def cuInit(self, flags: int) -> tuple:
        self.initialised = True
        return (OK,)

    def cuDeviceGetCount(self) -> tuple:
        return OK, self.count

    def cuDeviceGet(self, ordinal: int) -> tuple:
        if not 0 <= ordinal < self.count:
            return CUresult.CUDA_ERROR_INVALID_DEVICE, None
        return OK, ordinal

    def cuDeviceGetUuid(self, dev: int) -> tuple:
        return OK, SimpleNamespace(bytes=bytes(range(16 * dev, 16 * dev + 16)))

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        return OK, 1000 + dev

    def cuCtxPushCurrent(self, ctx: int) -> tuple:
        self._stack().append(ctx)
        return (OK,)

    def cuCtxPopCurrent(self) -> tuple:
        stack = self._stack()
        if not stack:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return OK, stack.pop()

    # --- page-locked host memory, streams, events, copies ---------------------------------

    def cuMemHostAlloc(self, n: int, flags: int) -> tuple:
        if self._no_context():
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        buf = ctypes.create_string_buffer(n)
        with self._lock:
            self.host[ctypes.addressof(buf)] = buf
        return OK, ctypes.addressof(buf)

    def cuMemFreeHost(self, ptr: int) -> tuple:
        with self._lock:
            buf = self.host.get(ptr)
            if buf is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            for s in self.streams:
                if any(op[0] == "copy" and self._in(op[2], ptr, len(buf)) for op in s.ops):
                    self.problems.append(f"host memory {ptr:#x} freed with a copy queued")
            del self.host[ptr]
        return (OK,)

    def cuStreamCreate(self, flags: int) -> tuple:
        if self._no_context():
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        s = _Stream(self._stack()[-1])
        with self._lock:
            self.streams.add(s)
        return OK, s

    def cuStreamSynchronize(self, s: _Stream) -> tuple:
        if self._no_context():
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            self._run(s, len(s.ops))
            return (s.error,)

    def cuStreamDestroy(self, s: _Stream) -> tuple:
        with self._lock:
            if s not in self.streams:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            if s.ops:
                self.problems.append(f"stream destroyed with {len(s.ops)} operations queued")
            self.streams.discard(s)
        return (OK,)

    def cuEventCreate(self, flags: int) -> tuple:
        if self._no_context():
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        ev = _Event()
        with self._lock:
            self.events.add(ev)
        return OK, ev

    def cuEventRecord(self, ev: _Event, s: _Stream) -> tuple:
        if self._no_context():
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            self._token += 1
            ev.stream, ev.token = s, self._token
            s.ops.append(("event", ev, ev.token))
        return (OK,)

    def cuEventSynchronize(self, ev: _Event) -> tuple:
        if self._no_context():
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            s = ev.stream
            if s is None:  # never recorded: complete
                return (OK,)
            last = [i for i, op in enumerate(s.ops) if op[0] == "event" and op[2] == ev.token]
            if last:
                self._run(s, last[0] + 1)
            return (s.error,)

    def cuEventDestroy(self, ev: _Event) -> tuple:
        with self._lock:
            if ev not in self.events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            self.events.discard(ev)
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, s: _Stream) -> tuple:
        if self._no_context():
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            if not any(self._in(src, a, len(b), n) for a, b in self.host.items()):
                self.problems.append(f"copy from {src:#x}: not page-locked memory of ours")
            for op in s.ops:
                if op[0] == "copy" and src < op[2] + op[3] and op[2] < src + n:
                    self.problems.append(f"host piece {src:#x} queued again before its copy ran")
            s.ops.append(("copy", int(dst), src, n, ctypes.string_at(src, n)))
        return (OK,)

    @staticmethod
    def _in(p: int, base: int, size: int, n: int = 1) -> bool:
        return base <= p and p + n <= base + size

    def _run(self, s: _Stream, upto: int) -> None:
        """Run ``s``'s first ``upto`` queued operations (the lock held)."""
        todo, s.ops = s.ops[:upto], s.ops[upto:]
        for op in todo:
            if op[0] != "copy" or s.error != OK:
                continue
            _, dst, src, n, queued = op
            now = ctypes.string_at(src, n)
            if now != queued:
                self.problems.append(f"host piece {src:#x} rewritten before its copy ran")
            target = self._device(dst, n)
            if target is None:
                s.error = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
                continue
            mem, off = target
            mem[off : off + n] = now

    def _device(self, va: int, n: int) -> tuple[bytearray, int] | None:
        """The memory and offset of a writable mapping holding ``[va, va + n)``."""
        for base, (mem, size, access) in self.mapped.items():
            if self._in(va, base, size, n):
                if access != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                    return None
                return mem, va - base
        return None

    # --- virtual memory management ---------------------------------------------------------

    def cuMemGetAllocationGranularity(self, prop: Any, flags: int) -> tuple:
        return OK, GRANULARITY

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:
        if self._no_context():
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        if size % GRANULARITY:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        with self._lock:
            h = self._next_handle
            self._next_handle += 1
            self.handles[h] = bytearray(size)
        return OK, h

    def cuMemRelease(self, h: int) -> tuple:
        with self._lock:
            if self.handles.pop(h, None) is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (OK,)

    def cuMemExportToShareableHandle(self, h: int, kind: int, flags: int) -> tuple:
        if h not in self.handles:
            return CUresult.CUDA_ERROR_INVALID_HANDLE, None
        return OK, os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple:
        with self._lock:
            va = self._next_va
            self._next_va += size + GRANULARITY
            self.reserved[va] = size
        return OK, va

    def cuMemAddressFree(self, va: int, size: int) -> tuple:
        with self._lock:
            if self.reserved.get(va) != size or va in self.mapped:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            del self.reserved[va]
        return (OK,)

    def cuMemMap(self, va: int, size: int, offset: int, h: int, flags: int) -> tuple:
        with self._lock:
            if self.reserved.get(va) != size or h not in self.handles:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.mapped[va] = [
                self.handles[h],
                size,
                CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE,
            ]
        return (OK,)

    def cuMemSetAccess(self, va: int, size: int, descs: list, count: int) -> tuple:
        with self._lock:
            if va not in self.mapped:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.mapped[va][2] = descs[0].flags
        return (OK,)

    def cuMemUnmap(self, va: int, size: int) -> tuple:
        with self._lock:
            for s in self.streams:
                if any(op[0] == "copy" and self._in(op[1], va, size) for op in s.ops):
                    self.problems.append(f"mapping {va:#x} unmapped with a copy queued")
            if self.mapped.pop(va, None) is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (OK,)


def install(fake: FakeDriver, monkeypatch: Any = None) -> None:
    """Make :mod:`mpack.cudadrv` use ``fake``, from a fresh process's state (not initialised,
    no contexts); undone by ``monkeypatch`` where one is given (else for good: a child
    process)."""
    from mpack import cudadrv

    values = {
        "driver": lambda needed_by="--device cuda": fake,
        "_initialised": [False],
        "_preloaded": [False],
        "_contexts": {},
    }
    for name, value in values.items():
        if monkeypatch is None:
            setattr(cudadrv, name, value)
        else:
            monkeypatch.setattr(cudadrv, name, value)
