"""The streaming part of ``convert``: read -> transform -> write, overlapped, in bounded memory.

Three stages run at once, each on its own thread, with bounded queues between them:

- **read** (``mpack-read``): the checkpoint bytes of unit i+1, i+2, ... (a unit is one fused
  layer on every rank). On a torch CUDA device they are read straight into a ring of pinned
  host pieces and copied to the GPU on a copy stream (``cudaMemcpyAsync`` from pinned memory,
  no staging copy inside the driver); elsewhere into plain arrays or tensors.
- **transform** (the caller's thread): fuse, requantize, repack, scales, bias for unit i. On
  the host path (no device: Note [host path] in :mod:`mpack.convert.host`) these are numpy
  arrays and torch is never imported; the driver path (Note [driver path] in
  :mod:`mpack.convert.driver`) is the host path with page-locked arrays and the weight repacked
  on the GPU inside the transform. On a torch CUDA device the weight goes through the fused
  kernel on a compute stream, and the result goes back into a second ring of pinned pieces with
  asynchronous copies; the small scale and bias tensors are computed on the host, where they
  already are.
- **write** (``mpack-write``): waits for each piece's copy event, appends it to its file
  (:class:`mpack.sidecar.HashingWriter`, which starts the disk writeback and the chunk hashing
  behind it), and hands the piece back to the ring.

The staging rings (Note [staging rings] in mpack/iokit.py): every buffer on the host side of
the GPU is a piece of one of two pinned rings (``PIECE`` bytes, ``IN_PIECES`` + ``OUT_PIECES``
of them: 256 MiB in all), bounded whatever the layer size. A piece is reused only after the
copy that last used it has finished (the writer is done with a piece when it gives it back).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mpack import iokit
from mpack.convert.checkpoint import Checkpoint
from mpack.convert.plan import OutLayer, Plan
from mpack.convert.timeline import Timeline
from mpack.iokit import Aborted, PinnedRing, Slot, get_or_abort, put_or_abort
from mpack.sidecar import HashingWriter, rank_file_name

if TYPE_CHECKING:  # imported by the torch paths only (Note [host path])
    import torch

PIECE = 16 * 1024 * 1024
IN_PIECES = 8
OUT_PIECES = 8
READS_AT_ONCE = 4  # pinned pieces filled by parallel preads before their copies are queued
UNITS_AHEAD = 3  # units read (and on the GPU) before the transform needs them
WRITE_QUEUE = 16  # CPU path: result tensors waiting for the writer

Transform = Callable[[OutLayer, dict[str, Any]], list[Any]]  # torch tensors or numpy arrays
ReadUnit = Callable[[Checkpoint, list[OutLayer]], dict[str, Any]]


@dataclass
class WriteItem:
    writer: HashingWriter
    offset: int
    data: Any  # bytes-like (a numpy array or a memoryview: both have ``nbytes``)
    slot: Slot | None = None
    ready: Any = None  # torch.cuda.Event to wait for before reading ``data``
    owner: np.ndarray | None = None  # a host result: handed to ``recycle`` once written


class Streamer:
    """Runs the three stages over ``plan.units`` into ``writers`` (see the module docstring).

    ``device``: a torch device, or None for the host path (``read_unit`` then gives the
    transform numpy arrays: :func:`mpack.convert.host.read_unit`). ``read_unit``: how a unit's
    checkpoint tensors are read on the CPU (default :func:`mpack.convert.transform.read_unit`).
    ``recycle``: called with every host array nothing reads any more (a unit's inputs once it
    is transformed, a result once it is written): Note [recycled buffers] in
    :mod:`mpack.convert.host`.
    """

    def __init__(
        self,
        plan: Plan,
        writers: dict[str, HashingWriter],
        device: torch.device | None,
        transform: Transform,
        on_written: Callable[[int], None],
        on_unit: Callable[[int], None] | None = None,
        timeline: Timeline | None = None,
        read_unit: ReadUnit | None = None,
        recycle: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.plan, self.writers, self.dev = plan, writers, device
        self.timeline = timeline or Timeline()
        self.transform, self.on_written, self.on_unit = transform, on_written, on_unit
        if read_unit is None:
            from mpack.convert.transform import read_unit
        self.read_unit, self.recycle = read_unit, recycle
        self.abort = threading.Event()
        self.cuda = device is not None and device.type == "cuda"
        self._units: queue.Queue = queue.Queue(UNITS_AHEAD)
        self._writes: queue.Queue = queue.Queue(0 if self.cuda else WRITE_QUEUE)
        if self.cuda:
            import torch

            self.copy_stream = torch.cuda.Stream(device)
            self.compute_stream = torch.cuda.Stream(device)
            self.in_ring = PinnedRing(IN_PIECES, PIECE, abort=self.abort, name="convert")
            self.out_ring = PinnedRing(OUT_PIECES, PIECE, abort=self.abort, name="convert")

    # --- read ---------------------------------------------------------------------------

    def _read_loop(self) -> None:
        ck = self.plan.ckpt
        try:
            for unit in self.plan.units:
                t = time.perf_counter()
                src, ready = self._read_unit(ck, unit)
                self.timeline.add("read", "unit", t, time.perf_counter())
                put_or_abort(self._units, (unit, src, ready), self.abort)
            put_or_abort(self._units, None, self.abort)
        except BaseException:
            self.abort.set()
            raise

    def _read_unit(self, ck: Checkpoint, unit: list[OutLayer]) -> tuple[dict[str, Any], Any]:
        if not self.cuda:
            return self.read_unit(ck, unit), None
        import torch

        src = self.read_unit(
            ck, unit, lambda name: self._upload(ck, name).view(ck.tensors[name].shape)
        )
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        return src, ready

    def _upload(self, ck: Checkpoint, name: str) -> torch.Tensor:
        """Disk -> pinned pieces (several preads at once) -> GPU, on the copy stream."""
        import torch

        nbytes = ck.tensors[name].nbytes
        with torch.cuda.stream(self.copy_stream):
            dev = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        spans = [(a, min(a + PIECE, nbytes)) for a in range(0, nbytes, PIECE)]
        batch = max(1, min(READS_AT_ONCE, self.in_ring.count // 2))  # never more than the ring
        for i in range(0, len(spans), batch):
            group = spans[i : i + batch]
            t = time.perf_counter()
            slots = [self.in_ring.acquire() for _ in group]
            self.timeline.add("read", "wait-ring", t, time.perf_counter())
            pairs = list(zip(slots, group, strict=True))
            ck.read_pieces(name, [(s.view[: b - a], a) for s, (a, b) in pairs])
            for s, (a, b) in pairs:
                s.to_device(dev[a:b], self.copy_stream)
                self.in_ring.release(s)
        return dev

    # --- write --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            while True:
                t = time.perf_counter()
                item = get_or_abort(self._writes, self.abort)
                if item is None:
                    return
                if item.ready is not None:
                    item.ready.synchronize()
                t1 = self.timeline.add("write", "wait", t, time.perf_counter())
                item.writer.write_at(item.offset, item.data)
                if item.slot is not None:
                    self.out_ring.release(item.slot)
                if item.owner is not None and self.recycle is not None:
                    self.recycle(item.owner)
                self.timeline.add("write", item.writer.path.name, t1, time.perf_counter())
                self.on_written(item.data.nbytes)
        except BaseException:
            self.abort.set()
            raise

    def _emit(self, layer: OutLayer, outs: list[Any]) -> None:
        """Queue a layer's tensors for the writer; device tensors go through the out ring."""
        w = self.writers[rank_file_name(layer.rank, self.plan.tp)]
        for spec, tensor in zip(layer.tensor_specs(self.plan.act_dtype), outs, strict=True):
            entry = w.layout.entry(spec.name)
            flat = _flat_bytes(tensor)
            assert flat.nbytes == entry.nbytes, spec.name
            if isinstance(flat, np.ndarray):
                owner = tensor if isinstance(tensor, np.ndarray) else None
                item = WriteItem(w, entry.offset, flat, owner=owner)
                put_or_abort(self._writes, item, self.abort)
                continue
            for a in range(0, entry.nbytes, PIECE):
                b = min(a + PIECE, entry.nbytes)
                t = time.perf_counter()
                slot = self.out_ring.acquire()
                self.timeline.add("transform", "wait-ring", t, time.perf_counter())
                ev = slot.from_device(flat[a:b], self.compute_stream)
                item = WriteItem(w, entry.offset + a, slot.view[: b - a], slot, ev)
                put_or_abort(self._writes, item, self.abort)

    # --- the run ------------------------------------------------------------------------

    def run(self) -> None:
        with iokit.pool("stream", 2) as pool:
            reader = pool.submit(self._read_loop)
            writer = pool.submit(self._write_loop)
            try:
                for i, (unit, src, ready) in enumerate(self._incoming()):
                    t = time.perf_counter()
                    self._transform_unit(unit, src, ready)
                    if self.recycle is not None:
                        for x in src.values():
                            if isinstance(x, np.ndarray):
                                self.recycle(x)
                    del src
                    self.timeline.add("transform", "unit", t, time.perf_counter())
                    if self.on_unit:
                        self.on_unit(i + 1)
                put_or_abort(self._writes, None, self.abort)
            except BaseException:
                self.abort.set()
                # the first failure wins: a stage's own error over the Aborted it caused here
                for f in (reader, writer):
                    e = f.exception()
                    if e is not None and not isinstance(e, Aborted):
                        raise e from None
                raise
            for f in (reader, writer):
                f.result()

    def _incoming(self) -> Iterator[tuple[list[OutLayer], dict[str, Any], Any]]:
        while True:
            t = time.perf_counter()
            item = get_or_abort(self._units, self.abort)
            self.timeline.add("transform", "wait-read", t, time.perf_counter())
            if item is None:
                return
            yield item

    def _transform_unit(self, unit: list[OutLayer], src: dict[str, Any], ready: Any) -> None:
        on_gpu: Any = contextlib.nullcontext()
        if self.cuda:
            import torch

            self.compute_stream.wait_event(ready)
            for x in src.values():
                if x.is_cuda:
                    x.record_stream(self.compute_stream)
            on_gpu = torch.cuda.stream(self.compute_stream)
        with on_gpu:
            for layer in unit:
                t = time.perf_counter()
                outs = self.transform(layer, src)
                self.timeline.add("transform", "compute", t, time.perf_counter())
                self._emit(layer, outs)


def _flat_bytes(x: Any) -> Any:
    """A result's bytes, flat: a numpy array for host data (numpy, or a CPU tensor's view), a
    uint8 CUDA tensor for device data."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).view(np.uint8).reshape(-1)
    import torch

    flat = x.contiguous().view(torch.uint8).reshape(-1)
    return flat if flat.is_cuda else flat.numpy()
