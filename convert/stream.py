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
TP sizes on the host), that backend reads the unit its own way (``Backend.read_units``: into its
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
from mpack.convert.checkpoint import Checkpoint, read_scale_arrays
from mpack.convert.plan import OutLayer, Plan
from mpack.convert.timeline import Timeline
from mpack.iokit import Aborted, get_or_abort, put_or_abort
from mpack.sidecar import HashingWriter, rank_file_name
from mpack.target import BIAS, SCALE, WEIGHT

if TYPE_CHECKING:
    from mpack.convert.backends import Backend

UNITS_AHEAD = 3  # batches read (and on their way to the device) before the transform needs them
#: Checkpoint weight bytes of one batch of experts, at most (Note [expert batches]).
BATCH_BYTES = 64 << 20

# Note [expert batches]: a MoE model is thousands of small expert layers (Qwen3-30B-A3B: 128
# experts x 3 linears x 48 layers of 1.5 MB each) where a dense one is a few hundred layers of
# tens of MB, and each layer the stream moves costs the same whatever its size: Python in every
# stage, a read per tensor, a write per result, and on a GPU copies in and out through 16 MiB
# pinned pieces and the launches and waits of its transform. So consecutive units that are
# experts of one stacked tensor (the same layer name on the same ranks, consecutive indices) go
# through the stream as one batch of at most BATCH_BYTES of checkpoint weights: read together
# (``Backend.read_units``: one open per shard, the pieces filled), transformed together into
# their part of the stacked tensors (``Backend.transform_stack``), and written as one piece per
# stacked tensor. Every other unit is a batch of its own. The plan's units do not change, so
# neither does the manifest (its layer indices) nor a byte of what is written. A sink whose
# transform is not its backend's (verify's, which reads each layer back) takes unit by unit.

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
        self.stacks = self.transform is None  # the backend's own: batches of experts too
        if self.transform is None:
            self.transform = self.backend.transform


def batches(plans: list[Plan], limit: int = BATCH_BYTES) -> list[range]:
    """The units of ``plans`` (the targets of one run: the same checkpoint modules unit by
    unit) cut into batches (Note [expert batches]): runs of consecutive experts of one stacked
    tensor in every plan, each of at most ``limit`` bytes of checkpoint weights (0: every unit
    alone), and every other unit alone."""
    ck = plans[0].ckpt
    out: list[range] = []
    size = 0
    for i, unit in enumerate(plans[0].units):
        nbytes = sum(ck.tensors[f"{m}.{WEIGHT}"].nbytes for m in unit[0].modules())
        joins = all(_follows(p.units[i - 1], p.units[i]) for p in plans) if i else False
        if out and size + nbytes <= limit and joins:
            out[-1] = range(out[-1].start, i + 1)
            size += nbytes
        else:
            out.append(range(i, i + 1))
            size = nbytes
    return out


def _follows(prev: list[OutLayer], unit: list[OutLayer]) -> bool:
    """Whether ``unit`` is the next expert after ``prev`` in the same stacked tensors, on the
    same ranks."""
    return len(prev) == len(unit) and all(
        a.stack is not None
        and b.stack is not None
        and (a.name, a.rank) == (b.name, b.rank)
        and b.stack.index == a.stack.index + 1
        for a, b in zip(prev, unit, strict=True)
    )


def read_raw(ck: Checkpoint, units: list[list[OutLayer]], buffers: Buffers) -> dict[str, Any]:
    """A batch's checkpoint tensors as they are stored, for backends to adopt (Note [one read
    for every target]): weights uint8 ``[N, K]`` (into ``buffers``' arrays), scales float32,
    biases ``(bytes, dtype)``."""
    modules = [m for unit in units for m in unit[0].modules()]
    weights = {m: ck.tensors[f"{m}.{WEIGHT}"] for m in modules}
    arrays = {m: buffers.take(t.nbytes) for m, t in weights.items()}
    ck.read_parts([(t.name, arrays[m], 0) for m, t in weights.items()])  # one open per shard
    src: dict[str, Any] = {t.name: arrays[m].reshape(t.shape) for m, t in weights.items()}
    src.update((f"{m}.{SCALE}", s) for m, s in read_scale_arrays(ck, modules).items())
    for unit in units:
        for module in unit[0].modules() if unit[0].has_bias else ():
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
        plans = [s.plan for s in sinks]
        self.batches = batches(plans, BATCH_BYTES if all(s.stacks for s in sinks) else 0)
        self._units: queue.Queue = queue.Queue(UNITS_AHEAD)
        # bounded by the backends that bound it (0: one that bounds its results itself, its ring)
        bounds = [b.write_queue for b in self.backends if b.write_queue]
        # each file's entries by name (FileMap.entry looks through them one by one)
        self._entries = {
            id(w): {e.name: e for e in w.file_map.entries}
            for sink in sinks
            for w in sink.writers.values()
        }
        self._writes: queue.Queue = queue.Queue(min(bounds, default=0))

    # --- read ---------------------------------------------------------------------------

    def _read_loop(self) -> None:
        plan = self.sinks[0].plan
        try:
            for batch in self.batches:
                t = time.perf_counter()
                units = [plan.units[i] for i in batch]
                if self.reader is not None:
                    src, ready = self.reader.read_units(self.ckpt, units, plan.act_dtype)
                else:
                    src, ready = read_raw(self.ckpt, units, self.buffers), None  # type: ignore[arg-type]
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

    def _emit(self, sink: Sink, layers: list[OutLayer], outs: list[Any]) -> None:
        """Queue the results of a layer, or of a run of experts of one stacked tensor (their
        slots one after another), for the writer, piece by piece as the backend hands them."""
        plan = sink.plan
        first = layers[0]
        w = sink.writers[rank_file_name(first.rank, plan.tp)]
        for spec, result in zip(first.tensor_specs(plan.act_dtype), outs, strict=True):
            entry = self._entries[id(w)][spec.name]
            start, one = first.slot(entry.offset, entry.nbytes)
            nbytes = one * len(layers)
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
                for batch, (src, ready) in zip(self.batches, self._incoming(), strict=True):
                    t = time.perf_counter()
                    self._transform_batch(batch, src, ready)
                    del src
                    self.timeline.add("transform", "unit", t, time.perf_counter())
                    if self.on_unit:
                        self.on_unit(batch.stop)
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

    def _transform_batch(self, batch: range, src: dict[str, Any], ready: Any) -> None:
        """The units of ``batch`` for every target, from the arrays read once (Note [one read
        for every target]); they are handed back once every target has transformed them. A
        batch of experts goes to the backend as one stack per rank (Note [expert batches])."""
        adopted: dict[tuple[int, str], dict[str, Any]] = {}
        for sink in self.sinks:
            be, act = sink.backend, sink.plan.act_dtype
            mine = src
            if self.reader is None:
                key = (id(be), act)
                if key not in adopted:
                    adopted[key] = be.from_raw(src, self.ckpt, act)
                mine = adopted[key]
            units = [sink.plan.units[i] for i in batch]
            with be.on_unit(mine, ready):
                for layers in zip(*units, strict=True):  # one rank's layers of the batch
                    t = time.perf_counter()
                    if len(layers) == 1:
                        outs = sink.transform(layers[0], mine, act)  # type: ignore[misc]
                    else:
                        outs = be.transform_stack(list(layers), mine, act)
                    self.timeline.add("transform", "compute", t, time.perf_counter())
                    self._emit(sink, list(layers), outs)
        if self.reader is not None:
            self.reader.done_with(src)
        else:
            for x in src.values():
                if isinstance(x, np.ndarray):
                    self.buffers.give(x)  # type: ignore[union-attr]
