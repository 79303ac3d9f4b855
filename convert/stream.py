"""The streaming part of ``convert``: read -> transform -> write, overlapped, in bounded memory.

Three stages run at once, each on its own thread, with bounded queues between them:

- **read** (``mpack-read``): the checkpoint bytes of unit i+1, i+2, ... (a unit is one fused
  layer on every rank), as the backend reads them (``Backend.read_unit``: numpy arrays, or torch
  tensors already on their way to a GPU);
- **transform** (the caller's thread): the backend's transform of unit i (fuse, requantize,
  repack, scales, bias);
- **write** (``mpack-write``): waits for each piece of a result to be ready, writes it at its
  offset (:class:`mpack.sidecar.HashingWriter`, which starts the disk writeback and the chunk
  hashing behind it), and tells the backend it is done with it.

What runs where, and what memory it uses, is the backend's (:mod:`mpack.convert.backends`): this
module is the same for all of them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpack import iokit
from mpack.convert.plan import OutLayer, Plan
from mpack.convert.timeline import Timeline
from mpack.iokit import Aborted, get_or_abort, put_or_abort
from mpack.sidecar import HashingWriter, rank_file_name

if TYPE_CHECKING:
    from mpack.convert.backends import Backend

UNITS_AHEAD = 3  # units read (and on their way to the device) before the transform needs them

#: ``(layer, the unit's arrays, act dtype) -> results``: the backend's transform, or one that
#: wraps it (verify's, which reads the layout back too).
Transform = Callable[[OutLayer, dict[str, Any], str], list[Any]]


@dataclass
class WriteItem:
    writer: HashingWriter
    offset: int
    data: Any  # bytes-like (a numpy array or a memoryview: both have ``nbytes``)
    ready: Any = None  # something with ``synchronize()`` to wait for before reading ``data``
    done: Callable[[], None] | None = None  # called once ``data`` is written


class Streamer:
    """Runs the three stages over ``plan.units`` into ``writers`` on ``backend`` (see the module
    docstring). ``transform``: default the backend's; ``on_written(nbytes)`` after each write,
    ``on_unit(i)`` after each unit is transformed."""

    def __init__(
        self,
        plan: Plan,
        writers: dict[str, HashingWriter],
        backend: Backend,
        on_written: Callable[[int], None] | None = None,
        on_unit: Callable[[int], None] | None = None,
        timeline: Timeline | None = None,
        transform: Transform | None = None,
    ) -> None:
        self.plan, self.writers, self.backend = plan, writers, backend
        self.timeline = timeline or Timeline()
        self.transform = transform or backend.transform
        self.on_written, self.on_unit = on_written, on_unit
        self.abort = threading.Event()
        self._units: queue.Queue = queue.Queue(UNITS_AHEAD)
        self._writes: queue.Queue = queue.Queue(backend.write_queue)

    # --- read ---------------------------------------------------------------------------

    def _read_loop(self) -> None:
        ck, act = self.plan.ckpt, self.plan.act_dtype
        try:
            for unit in self.plan.units:
                t = time.perf_counter()
                src, ready = self._read_unit(ck, unit, act)
                self.timeline.add("read", "unit", t, time.perf_counter())
                put_or_abort(self._units, (unit, src, ready), self.abort)
            put_or_abort(self._units, None, self.abort)
        except BaseException:
            self.abort.set()
            raise

    def _read_unit(self, ck: Any, unit: list[OutLayer], act: str) -> tuple[dict[str, Any], Any]:
        return self.backend.read_unit(ck, unit, act)

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
                if item.done is not None:
                    item.done()
                self.timeline.add("write", item.writer.path.name, t1, time.perf_counter())
                if self.on_written:
                    self.on_written(item.data.nbytes)
        except BaseException:
            self.abort.set()
            raise

    def _emit(
        self,
        backend: Backend,
        plan: Plan,
        writers: dict[str, HashingWriter],
        layer: OutLayer,
        outs: list[Any],
    ) -> None:
        """Queue a layer's results for the writer, piece by piece as ``backend`` hands them."""
        w = writers[rank_file_name(layer.rank, plan.tp)]
        for spec, result in zip(layer.tensor_specs(plan.act_dtype), outs, strict=True):
            entry = w.file_map.entry(spec.name)
            got = 0
            for offset, data, ready, done in backend.pieces(result):
                item = WriteItem(w, entry.offset + offset, data, ready, done)
                put_or_abort(self._writes, item, self.abort)
                got += data.nbytes
            assert got == entry.nbytes, spec.name

    # --- the run ------------------------------------------------------------------------

    def _streaming(self) -> contextlib.AbstractContextManager[None]:
        return self.backend.streaming(self.abort, self.timeline)

    def run(self) -> None:
        with self._streaming(), iokit.pool("stream", 2) as pool:
            reader = pool.submit(self._read_loop)
            writer = pool.submit(self._write_loop)
            try:
                for i, (unit, src, ready) in enumerate(self._incoming()):
                    t = time.perf_counter()
                    self._transform_unit(i, unit, src, ready)
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

    def _transform_unit(
        self, i: int, unit: list[OutLayer], src: dict[str, Any], ready: Any
    ) -> None:
        be, act = self.backend, self.plan.act_dtype
        with be.on_unit(src, ready):
            for layer in unit:
                t = time.perf_counter()
                outs = self.transform(layer, src, act)
                self.timeline.add("transform", "compute", t, time.perf_counter())
                self._emit(be, self.plan, self.writers, layer, outs)
        be.done_with(src)
