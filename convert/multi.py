"""Many targets from one read: ``mpack convert SRC -o OUT --tp 1,2 --profile w8a16,w8a8-marlin``.

Note [many targets]: a CI job that pre-bakes a checkpoint for several engines (TP sizes,
profiles, activation dtypes) would otherwise read the source once per target; on an 8B model
the read is most of a conversion. :func:`run_convert_many` reads it once:

1. the source is resolved, stamped, hashed and its scheme checked once (as in
   :func:`mpack.convert.pipeline.run_convert`), and every target is planned from the headers
   before any output is touched. An invalid target (a TP that does not divide the heads)
   refuses the whole run, naming it, unless ``skip_invalid``;
2. each target is its own sidecar at ``OUT/<name>`` (:func:`mpack.target.dir_name`), with its
   own lock, up-to-date check, work directory and swap (:mod:`mpack.convert.staging`): Note
   [atomic output] holds per target. The swaps come last, after every manifest is written, so
   an interrupted run leaves no target at all (or, interrupted between two swaps, only
   finished ones);
3. the fused layers stream once: the read stage reads a unit's checkpoint tensors (the same
   modules for every target: the fusion is one for the run), and the transform stage runs
   each target's transform on them and queues the results for the one writer
   (:class:`MultiStreamer`). The pass-through tensors are read once and written into every
   target's ``common.safetensors``; the config and tokenizer files are copied from the source
   once and from that copy to the others.

Each target's bytes are those a single-target run writes: the same plan, the same transform
functions, the same manifest (tests/convert/test_multi_target.py compares every file). Each
target's backend is the one a single run of it opens (:func:`mpack.convert.backends.open_backend`),
opened once for all the targets it takes. The read is on the host: the host and driver backends
read from those arrays as a single run does; the torch backend (``w8a8-marlin`` requantization,
or ``MPACK_NO_HOST_REPACK``) gets tensors over them (on CUDA, its weights are copied to the
device: same bytes, not a single run's speed).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpack import target as tgt
from mpack.convert.backends import Backend, check_backend_name, check_device_here, report
from mpack.convert.backends.host import Buffers
from mpack.convert.checkpoint import (
    Checkpoint,
    check_scale_values,
    find_layers,
    open_checkpoint,
    read_scale_array,
)
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import (
    ConvertResult,
    Progress,
    _act_dtype,
    _bump_unless,
    _Counter,
    _finish,
    _manifest,
    _open_writers,
    _result,
    _watched,
)
from mpack.convert.plan import OutLayer, Plan, check_fusion_tp, make_plan
from mpack.convert.scheme_check import SchemeCheck
from mpack.convert.source import ResolvedSource, resolve_source, source_files
from mpack.convert.staging import check_apart, output_lock, output_path, staged_sidecar
from mpack.convert.stream import Streamer
from mpack.convert.timeline import Timeline
from mpack.errors import (
    MpackError,
    OutputExistsError,
    UnsupportedSchemeError,
    UsageError,
)
from mpack.iokit import COPY_BYTES, copy_file, pool
from mpack.sidecar import (
    CHUNK_BYTES,
    COMMON_NAME,
    COPIED_FILES,
    MANIFEST_NAME,
    HashingWriter,
    target_of,
)
from mpack.target import ACT_DTYPES, BIAS, FUSIONS, PROFILES, SCALE, WEIGHT


@dataclass(frozen=True)
class TargetSpec:
    """One target asked for: a TP size, a profile and an activation dtype (None: the
    checkpoint's)."""

    tp: int
    profile: str
    act_dtype: str | None


def target_specs(
    tp: int | Sequence[int], profile: str | Sequence[str], act_dtype: str | Sequence[str] | None
) -> list[TargetSpec]:
    """The cross product of the lists (a single value is a list of one), in the order given,
    repeats dropped."""
    tps = [tp] if isinstance(tp, int) else list(tp)
    profiles = [profile] if isinstance(profile, str) else list(profile)
    acts = [act_dtype] if act_dtype is None or isinstance(act_dtype, str) else list(act_dtype)
    for what, values in (("--tp", tps), ("--profile", profiles), ("--act-dtype", acts)):
        if not values:
            raise UsageError(f"{what} is empty; give at least one value")
    specs = [TargetSpec(*t) for t in itertools.product(tps, profiles, acts)]
    return list(dict.fromkeys(specs))


@dataclass
class MultiConvertResult:
    """What a run of several targets did: ``out`` (the directory of sidecars), ``results`` (one
    :class:`~mpack.convert.pipeline.ConvertResult` per target written or up to date, ``out``
    being ``OUT/<name>``), ``skipped`` (``(name, why)`` of each invalid target left out with
    ``skip_invalid``)."""

    out: Path
    results: list[ConvertResult]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def up_to_date(self) -> bool:
        return all(r.up_to_date for r in self.results)


# --- the run ------------------------------------------------------------------------------


def run_convert_many(
    source: str | os.PathLike,
    out: str | os.PathLike,
    options: ConvertOptions,
    *,
    progress: Progress | None = None,
    scheme_check: SchemeCheck | None = None,
) -> MultiConvertResult:
    """Convert ``source`` into one sidecar per target of ``options`` (their cross product:
    :meth:`ConvertOptions.targets`) at ``OUT/<name>``, reading the source once (Note [many
    targets]). The other options are those of :func:`mpack.convert.pipeline.run_convert`;
    ``skip_invalid``: leave out the targets that cannot be planned (reported in ``skipped``)
    instead of refusing the run.

    Raises:
        UsageError: a misspelt profile, activation dtype, fusion or device, a TP below 1.
        UnsupportedSchemeError: a target that cannot be planned (named, with why), unless
            ``skip_invalid`` and another target can; every target when none can.
        OutputExistsError: ``out`` is itself a sidecar; or (per target) as ``run_convert``.
    """
    tl = Timeline()
    specs = options.targets()
    revision, fuse, device = options.revision, options.fuse, options.device
    passthrough, force, skip_invalid = options.passthrough, options.force, options.skip_invalid
    _check_options(specs, fuse, device, options.backend)
    out = output_path(out)
    if (out / MANIFEST_NAME).exists():
        raise OutputExistsError(
            f"{out} is a sidecar; several targets go into a directory of sidecars (OUT/<target>/)",
            hint="choose another -o directory for the targets",
        )
    src = resolve_source(str(source), revision, show_progress=progress is not None)
    check_apart(out, src.path)
    with _watched(src, scheme_check, tl) as watch:
        with tl.span("main", "validate", start=tl.t0):
            ck, plans, skipped = _open_and_plan_all(
                src,
                watch.check,
                specs,
                fuse=fuse,
                passthrough=passthrough,
                skip_invalid=skip_invalid,
            )
        names = source_files(src, ck.files)
        records = functools.partial(watch.records, names)
        made: dict[int, tuple[dict[str, Any], str, dict[str, Any]]] = {}  # id(stage) -> manifest,
        # digest, backend
        with contextlib.ExitStack() as stack:
            stages = []
            for plan in plans:
                out_t = output_path(out / tgt.dir_name(plan.target))
                parent = stack.enter_context(output_lock(out_t))
                stages.append(
                    stack.enter_context(
                        staged_sidecar(
                            out_t,
                            plan.target,
                            common=COMMON_NAME in plan.files,
                            src=src,
                            files=records,
                            force=force,
                            timeline=tl,
                            parent=parent,
                        )
                    )
                )
            todo = [(p, s) for p, s in zip(plans, stages, strict=True) if not s.up_to_date]
            if not todo:
                watch.check_unchanged()  # the digests compared are of these files
            else:
                works = [s.work for _, s in todo]
                written, used = _write_all(
                    [p for p, _ in todo], works, options, watch.check, progress, tl
                )
                with tl.span("main", "copy-files"):
                    copied = _copy_files(src, names, works)
                with tl.span("main", "wait-source-hashes"):
                    files_src = records()
                with tl.span("main", "wait-scheme-check"):
                    watch.check.agree(ck)
                with tl.span("main", "manifest"):
                    watch.check_unchanged()
                    for (plan, stage), w, b in zip(todo, written, used, strict=True):
                        manifest = _manifest(plan, src, files_src, w, copied)
                        made[id(stage)] = (manifest, stage.write_manifest(manifest), b)
        # every stage swapped into place (in reverse order) when the stack closed
    results = []
    for plan, stage in zip(plans, stages, strict=True):
        if stage.up_to_date:
            results.append(_result(stage.out, *stage.current, tl))
        else:
            m, digest, used_by = made[id(stage)]
            results.append(_result(stage.out, m, digest, tl, plan, used_by))
    return MultiConvertResult(out, results, skipped)


def _check_options(specs: Sequence[TargetSpec], fuse: str, device: str, backend: str) -> None:
    """Misspelt values refuse the run whatever ``skip_invalid`` says: they are typos, not
    targets this checkpoint cannot have."""
    for s in specs:
        if s.profile not in PROFILES:
            raise UsageError(f"--profile must be one of {', '.join(PROFILES)}, got {s.profile!r}")
        if s.act_dtype is not None and s.act_dtype not in ACT_DTYPES:
            raise UsageError(f"--act-dtype must be {' or '.join(ACT_DTYPES)}, got {s.act_dtype!r}")
        if s.tp < 1:
            raise UsageError(f"--tp must be at least 1, got {s.tp}")
    if fuse not in FUSIONS:
        raise UsageError(f"--fuse must be one of {', '.join(FUSIONS)}, got {fuse!r}")
    check_device_here(device)
    check_backend_name(backend)


def _open_and_plan_all(
    src: ResolvedSource,
    check: SchemeCheck,
    specs: Sequence[TargetSpec],
    *,
    fuse: str,
    passthrough: bool,
    skip_invalid: bool,
) -> tuple[Checkpoint, list[Plan], list[tuple[str, str]]]:
    """Parse the headers and find the layers once, then plan every target. Errors of the
    checkpoint itself (any target would hit them) stop the run as in a single one."""
    with check.errors_first():
        ck = open_checkpoint(src.path, scheme=not check.deferred)
        find_layers(ck)
        plans: dict[str, Plan] = {}
        bad: list[tuple[str, MpackError]] = []
        for s in specs:
            act = _act_dtype(ck, s.act_dtype)
            name = tgt.dir_name(target_of(profile=s.profile, act_dtype=act, tp=s.tp, fusion=fuse))
            if name in plans or any(n == name for n, _ in bad):
                continue  # the checkpoint's dtype named both ways
            try:
                check_fusion_tp(fuse, s.tp)
                plans[name] = make_plan(
                    ck,
                    profile=s.profile,
                    act_dtype=act,
                    tp=s.tp,
                    fusion=fuse,
                    passthrough=passthrough,
                )
            except (UnsupportedSchemeError, UsageError) as e:
                bad.append((name, e))
    if bad and not plans and len({str(e) for _, e in bad}) == 1:
        raise bad[0][1]  # one error for every target: the checkpoint's own
    if bad and (not skip_invalid or not plans):
        listed = "; ".join(f"{n}: {e}" for n, e in bad)
        raise UnsupportedSchemeError(
            f"{len(bad)} of {len(bad) + len(plans)} targets cannot be made: {listed}",
            hint="drop them from --tp / --profile / --act-dtype, or pass --skip-invalid to "
            "convert the others",
        )
    units = [[(ly.name, _modules(ly)) for ly in (u[0] for u in p.units)] for p in plans.values()]
    assert all(u == units[0] for u in units), "targets of one fusion share their units"
    return ck, list(plans.values()), [(n, str(e)) for n, e in bad]


def _modules(layer: OutLayer) -> list[str]:
    return list(dict.fromkeys(p.module for p in layer.pieces))


# --- stream every target ------------------------------------------------------------------


def _write_all(
    plans: list[Plan],
    works: list[Path],
    options: ConvertOptions,
    check: SchemeCheck,
    progress: Progress | None,
    tl: Timeline,
) -> tuple[list[dict[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Stream every target's files into its work directory; ``{file: {size, chunks}}`` and the
    backend's report per target (as :func:`mpack.convert.pipeline._write_all` does for one)."""
    ck = plans[0].ckpt
    with contextlib.ExitStack() as stack:
        with tl.span("main", "setup"):
            writers = [_open_writers(p, w, stack) for p, w in zip(plans, works, strict=True)]
            count = _Counter(progress, plans[0])
            count.total = sum(p.total_bytes for p in plans)
            for ws in writers:
                for w in ws.values():
                    count.add_bytes(w.position)
        stop = threading.Event()
        with pool("copy", 1) as copier:
            copied = None
            commons = [ws[COMMON_NAME] for ws in writers if COMMON_NAME in ws]
            if commons:
                bump = functools.partial(_bump_unless, stop, count.add_bytes)
                copied = copier.submit(copy_tensors_many, ck.read_into, commons, bump, tl)
            try:
                sinks = _sinks(plans, writers, options, tl, stack)
                with tl.span("main", "validate-values"), check.errors_first():
                    _validate_values(ck, {p.act_dtype for p in plans})
                with tl.span("main", "stream"):
                    _stream(sinks, count, tl)
            except BaseException:
                stop.set()
                raise
            if copied is not None:
                copied.result()
        with tl.span("main", "finish"):
            files = [{name: _finish(w) for name, w in ws.items()} for ws in writers]
            return files, [report(s.backend) for s in sinks]


def copy_tensors_many(
    read_into: Callable[[str, memoryview, int], None],
    writers: list[HashingWriter],
    bump: Callable[[int], None],
    tl: Any,
) -> None:
    """:func:`mpack.iokit.copy_tensors` into several files that plan the same tensors (each at
    its own offset: their headers differ): each piece is read once and written to all."""
    buf = memoryview(bytearray(COPY_BYTES))
    for entry in writers[0].file_map.entries:
        at = [w.file_map.entry(entry.name).offset for w in writers]
        for pos in range(0, entry.nbytes, COPY_BYTES):
            view = buf[: min(COPY_BYTES, entry.nbytes - pos)]
            t = time.perf_counter()
            read_into(entry.name, view, pos)
            t = tl.add("copy", "read", t, time.perf_counter())
            for w, off in zip(writers, at, strict=True):
                w.write_at(off + pos, view)
                bump(len(view))
            tl.add("copy", "write", t, time.perf_counter())


def _copy_files(src: ResolvedSource, names: list[str], works: list[Path]) -> list[dict[str, Any]]:
    """The config and tokenizer files: from the source into the first work directory, from
    there into the others (the same bytes, so the same records)."""
    records = []
    for n in names:
        if n not in COPIED_FILES:
            continue
        rec = copy_file(src.path / n, works[0] / n, CHUNK_BYTES)
        for w in works[1:]:
            assert copy_file(works[0] / n, w / n, CHUNK_BYTES) == rec
        records.append(rec)
    return records


def _validate_values(ck: Checkpoint, acts: set[str]) -> None:
    """Every layer's scale values (SPEC §1), read once, for each activation dtype."""
    for module in ck.layers:
        scale = read_scale_array(ck, module)
        for act in sorted(acts):
            check_scale_values(ck, module, scale, act)


@dataclass
class _Sink:
    """One target of the stream: its plan, its writers and its backend."""

    plan: Plan
    writers: dict[str, HashingWriter]
    backend: Backend


def _sinks(
    plans: list[Plan],
    writers: list[dict[str, HashingWriter]],
    options: ConvertOptions,
    tl: Timeline,
    stack: contextlib.ExitStack,
) -> list[_Sink]:
    """Each target's backend, as a single run of it opens one; each backend opened once for all
    the targets it takes (``opened``), closed with ``stack``."""
    opened: list[Backend] = []
    sinks = []
    for plan, ws in zip(plans, writers, strict=True):
        b = options.open_backend(plan, tl, opened)
        if all(b is not o for o in opened):
            opened.append(b)
            stack.callback(b.close)
        sinks.append(_Sink(plan, ws, b))
    return sinks


def _stream(sinks: list[_Sink], count: _Counter, tl: Timeline) -> None:
    MultiStreamer(sinks, count.add_bytes, count.unit_done, tl).run()


def read_raw(ck: Checkpoint, unit: list[OutLayer], buffers: Buffers) -> dict[str, Any]:
    """A unit's checkpoint tensors as they are stored, read once for every target: weights
    uint8 ``[N, K]`` (into ``buffers``' arrays), scales float32, biases ``(bytes, dtype)``."""
    src: dict[str, Any] = {}
    for module in _modules(unit[0]):
        wname = f"{module}.{WEIGHT}"
        t = ck.tensors[wname]
        src[wname] = ck.read_bytes(wname, buffers.take(t.nbytes)).reshape(t.shape)
        src[f"{module}.{SCALE}"] = read_scale_array(ck, module)
        if unit[0].has_bias:
            bname = f"{module}.{BIAS}"
            src[bname] = (ck.read_bytes(bname), ck.tensors[bname].dtype)
    return src


class MultiStreamer(Streamer):
    """:class:`mpack.convert.stream.Streamer`'s three stages for several targets: the read
    stage reads each unit once (:func:`read_raw`, into the page-locked arrays of a driver
    backend when there is one), the transform stage runs every target's transform on it, and
    the one writer writes every target's results. The unit's arrays are handed back once every
    target has transformed it."""

    def __init__(
        self,
        sinks: list[_Sink],
        on_written: Callable[[int], None],
        on_unit: Callable[[int], None] | None,
        timeline: Timeline,
    ) -> None:
        super().__init__(
            sinks[0].plan, sinks[0].writers, sinks[0].backend, on_written, on_unit, timeline
        )
        self.sinks = sinks
        self.backends = list({id(s.backend): s.backend for s in sinks}.values())
        by_name = {b.name: b for b in self.backends}
        own = by_name.get("driver") or by_name.get("host")
        self.buffers: Buffers = own.buffers if own is not None else Buffers()  # type: ignore[attr-defined]
        self._owned = own is None
        # bounded by the backends that bound it (0: one that bounds its results itself, its ring)
        bounds = [b.write_queue for b in self.backends if b.write_queue]
        self._writes = queue.Queue(min(bounds, default=0))

    def _streaming(self) -> contextlib.AbstractContextManager[None]:
        stack = contextlib.ExitStack()
        for b in self.backends:
            stack.enter_context(b.streaming(self.abort, self.timeline))
        if self._owned:
            stack.callback(self.buffers.close)
        return stack

    def _read_unit(
        self, ck: Checkpoint, unit: list[OutLayer], act: str
    ) -> tuple[dict[str, Any], Any]:
        return read_raw(ck, unit, self.buffers), None

    def _transform_unit(
        self, i: int, unit: list[OutLayer], src: dict[str, Any], ready: Any
    ) -> None:
        ck = self.plan.ckpt
        adopted: dict[tuple[int, str], dict[str, Any]] = {}
        for s in self.sinks:
            act, b = s.plan.act_dtype, s.backend
            key = (id(b), act)
            if key not in adopted:
                adopted[key] = b.from_raw(src, ck, act)
            mine = adopted[key]
            with b.on_unit(mine, None):
                for layer in s.plan.units[i]:
                    outs = b.transform(layer, mine, act)
                    self._emit(b, s.plan, s.writers, layer, outs)
        for x in src.values():
            if isinstance(x, np.ndarray):
                self.buffers.give(x)
