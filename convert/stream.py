"""The streaming part of ``convert``: read -> transform -> write, overlapped, in bounded memory.

Three stages run at once, each on its own thread, with bounded queues between them:

- **read** (``mpack-read``): the checkpoint bytes of unit i+1, i+2, ... (a unit is one fused
  layer on every rank), read once for every target (Note [one read for every target]);
- **transform** (the caller's thread): each target's transform of unit i on its backend (fuse,
  requantize, repack, scales, bias);
- **write** (``mpack-write``): waits for each piece of a result to be ready, writes it at its
  offset (:class:`mpack.sidecar.HashingWriter`, which starts the disk writeback and the chunk
  hashing behind it), and tells the backend it is done with it.

What runs where, and what memory it uses, is the backend's (:mod:`mpack.convert.backends`): this
module is the same for all of them, and for one target or many (a :class:`Sink` each).

Note [one read for every target]: the targets of one run share their fusion, so unit i is the
same checkpoint modules for all of them (:func:`mpack.convert.plan.open_and_plan` checks it).
Where every target is converted by one backend at one activation dtype (one target; or several
TP sizes on the host), that backend reads the unit its own way (``Backend.read_unit``: into its
recycled or page-locked arrays, or, for torch on a GPU, through its pinned ring onto the
device) and every target transforms from those. Otherwise the unit is read as stored
(:func:`read_raw`, into the page-locked arrays of a driver backend where there is one) and each
backend adopts it for each activation dtype (``Backend.from_raw``: the biases cast, the weights
on the device). Either way each target's bytes are those a run of it alone writes.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mpack import iokit
from mpack.convert.backends.host import Buffers
from mpack.convert.checkpoint import Checkpoint, read_scale_array
from mpack.convert.plan import OutLayer, Plan
from mpack.convert.timeline import Timeline
from mpack.iokit import Aborted, get_or_abort, put_or_abort
from mpack.sidecar import HashingWriter, rank_file_name
from mpack.target import BIAS, SCALE, WEIGHT

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


@dataclass
class Sink:
    """One target of the stream: its plan, a writer per planned file, the backend that
    converts its layers, and the transform (default: the backend's; verify's wraps it to read
    the layout back too)."""

    plan: Plan
    writers: dict[str, HashingWriter]
    backend: Backend
    transform: Transform | None = field(default=None)

    def __post_init__(self) -> None:
        if self.transform is None:
            self.transform = self.backend.transform


def read_raw(ck: Checkpoint, unit: list[OutLayer], buffers: Buffers) -> dict[str, Any]:
    """A unit's checkpoint tensors as they are stored, for backends to adopt (Note [one read
    for every target]): weights uint8 ``[N, K]`` (into ``buffers``' arrays), scales float32,
    biases ``(bytes, dtype)``."""
    src: dict[str, Any] = {}
    for module in unit[0].modules():
        wname = f"{module}.{WEIGHT}"
        t = ck.tensors[wname]
        src[wname] = ck.read_bytes(wname, buffers.take(t.nbytes)).reshape(t.shape)
        src[f"{module}.{SCALE}"] = read_scale_array(ck, module)
        if unit[0].has_bias:
            bname = f"{module}.{BIAS}"
            src[bname] = (ck.read_bytes(bname), ck.tensors[bname].dtype)
    return src


class Streamer:
    """Runs the three stages over the units of ``sinks`` (one per target; see the module
    docstring). ``on_written(nbytes)`` after each write, ``on_unit(i)`` after each unit is
    transformed for every target."""

    def __init__(
        self,
        sinks: list[Sink],
        on_written: Callable[[int], None] | None = None,
        on_unit: Callable[[int], None] | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.sinks = sinks
        self.ckpt = sinks[0].plan.ckpt
        self.timeline = timeline or Timeline()
        self.on_written, self.on_unit = on_written, on_unit
        self.abort = threading.Event()
        self.backends = list({id(s.backend): s.backend for s in sinks}.values())
        acts = {s.plan.act_dtype for s in sinks}
        # the one backend reads (Note [one read for every target]), or the unit is read raw
        self.reader = self.backends[0] if len(self.backends) == 1 and len(acts) == 1 else None
        self.buffers: Buffers | None = None  # the raw read's arrays (None: the backend reads)
        self._made: Buffers | None = None  # those this streamer made, and closes
        if self.reader is None:
            by_name = {b.name: b for b in self.backends}
            own = by_name.get("driver") or by_name.get("host")
            if own is None:
                self._made = Buffers()
            self.buffers = own.buffers if own is not None else self._made  # type: ignore[attr-defined]
        self._units: queue.Queue = queue.Queue(UNITS_AHEAD)
        # bounded by the backends that bound it (0: one that bounds its results itself, its ring)
        bounds = [b.write_queue for b in self.backends if b.write_queue]
        self._writes: queue.Queue = queue.Queue(min(bounds, default=0))

    # --- read ---------------------------------------------------------------------------

    def _read_loop(self) -> None:
        act = self.sinks[0].plan.act_dtype
        try:
            for unit in self.sinks[0].plan.units:
                t = time.perf_counter()
                if self.reader is not None:
                    src, ready = self.reader.read_unit(self.ckpt, unit, act)
                else:
                    src, ready = read_raw(self.ckpt, unit, self.buffers), None  # type: ignore[arg-type]
                self.timeline.add("read", "unit", t, time.perf_counter())
                put_or_abort(self._units, (src, ready), self.abort)
            put_or_abort(self._units, None, self.abort)
        except BaseException:
            self.abort.set()
            raise

    # --- write --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        # Note [stacked experts]: an expert's weight and scales go to two stacked tensors, so
        # its scales come before the file reaches them. Those are copied and held (the
        # backend's buffer released) until the writes before them are done: every expert's
        # scales, a few KiB per MoE block. (A writer without a position, verify's comparer,
        # takes writes in any order.)
        held: dict[Any, dict[int, bytes]] = {}
        try:
            while True:
                t = time.perf_counter()
                item = get_or_abort(self._writes, self.abort)
                if item is None:
                    assert not any(held.values()), "stacked tensors left unwritten"
                    return
                if item.ready is not None:
                    item.ready.synchronize()
                t1 = self.timeline.add("write", "wait", t, time.perf_counter())
                w = item.writer
                if item.offset > getattr(w, "position", item.offset):
                    held.setdefault(w, {})[item.offset] = bytes(memoryview(item.data).cast("B"))
                else:
                    w.write_at(item.offset, item.data)
                    waiting = held.get(w, {})
                    while waiting and w.position in waiting:
                        w.write_at(w.position, waiting.pop(w.position))
                if item.done is not None:
                    item.done()
                self.timeline.add("write", w.path.name, t1, time.perf_counter())
                if self.on_written:
                    self.on_written(item.data.nbytes)
        except BaseException:
            self.abort.set()
            raise

    def _emit(self, sink: Sink, layer: OutLayer, outs: list[Any]) -> None:
        """Queue a layer's results for the writer, piece by piece as the backend hands them."""
        plan = sink.plan
        w = sink.writers[rank_file_name(layer.rank, plan.tp)]
        for spec, result in zip(layer.tensor_specs(plan.act_dtype), outs, strict=True):
            entry = w.file_map.entry(spec.name)
            start, nbytes = layer.slot(entry.offset, entry.nbytes)
            got = 0
            for offset, data, ready, done in sink.backend.pieces(result):
                item = WriteItem(w, start + offset, data, ready, done)
                put_or_abort(self._writes, item, self.abort)
                got += data.nbytes
            assert got == nbytes, spec.name

    # --- the run ------------------------------------------------------------------------

    def _streaming(self) -> contextlib.AbstractContextManager[None]:
        stack = contextlib.ExitStack()
        for b in self.backends:
            stack.enter_context(b.streaming(self.abort, self.timeline))
        if self._made is not None:
            stack.callback(self._made.close)
        return stack

    def run(self) -> None:
        with self._streaming(), iokit.pool("stream", 2) as pool:
            reader = pool.submit(self._read_loop)
            writer = pool.submit(self._write_loop)
            try:
                for i, (src, ready) in enumerate(self._incoming()):
                    t = time.perf_counter()
                    self._transform_unit(i, src, ready)
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

    def _incoming(self) -> Iterator[tuple[dict[str, Any], Any]]:
        while True:
            t = time.perf_counter()
            item = get_or_abort(self._units, self.abort)
            self.timeline.add("transform", "wait-read", t, time.perf_counter())
            if item is None:
                return
            yield item

    def _transform_unit(self, i: int, src: dict[str, Any], ready: Any) -> None:
        """Unit ``i`` for every target, from the arrays read once (Note [one read for every
        target]); they are handed back once every target has transformed it."""
        adopted: dict[tuple[int, str], dict[str, Any]] = {}
        for sink in self.sinks:
            be, act = sink.backend, sink.plan.act_dtype
            mine = src
            if self.reader is None:
                key = (id(be), act)
                if key not in adopted:
                    adopted[key] = be.from_raw(src, self.ckpt, act)
                mine = adopted[key]
            with be.on_unit(mine, ready):
                for layer in sink.plan.units[i]:
                    t = time.perf_counter()
                    outs = sink.transform(layer, mine, act)  # type: ignore[misc]
                    self.timeline.add("transform", "compute", t, time.perf_counter())
                    self._emit(sink, layer, outs)
        if self.reader is not None:
            self.reader.done_with(src)
        else:
            for x in src.values():
                if isinstance(x, np.ndarray):
                    self.buffers.give(x)  # type: ignore[union-attr]
