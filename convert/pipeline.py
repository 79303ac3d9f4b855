"""The conversion run, for one target or many: validate, plan, then read -> transform -> write,
atomically.

Order of work (ARCHITECTURE.md "Data flow"), as :func:`run_convert` reads:

1. resolve the source, take ``-o``'s lock and stamp the source files; hashing them starts on a
   thread, and with compressed-tensors not yet imported, its check of the config starts in a
   forked child (Note [scheme check in a child] in :mod:`mpack.convert.scheme_check`);
2. parse every header, validate every layer's structure and plan every output tensor of every
   target (:func:`mpack.convert.plan.open_and_plan`), from the headers alone: no torch yet;
3. take each target's lock; a target whose directory already holds its sidecar (same source
   files, same target) is up to date and left alone (:func:`mpack.convert.output.staged_sidecar`,
   which owns the output directory); when all are, stop;
4. in a hidden work directory: start copying the pass-through tensors on a thread, then open the
   backend that converts the layers (:func:`mpack.convert.backends.open_backend`: the host
   backend imports no torch at all; the torch backend imports it here, Note [torch off the
   critical path]: the copy and the source hashing run while the interpreter imports), check
   every layer's scale values, and stream the fused layers through three stages on their own
   threads — read (from the shards, once for every target), transform (each target's backend),
   write (at the planned offset, chunk digests and disk writeback behind it) — with a few units
   in flight (:mod:`mpack.convert.stream`), so memory is bounded whatever the model; the config
   and tokenizer files are copied after;
5. wait for the source hashes and the scheme check's verdict, check that no source file changed
   under the run (Note [stable source] in :mod:`mpack.convert.source`), write each target's
   manifest, and swap the work directories into place last (Note [atomic output] in
   :mod:`mpack.convert.output.swap`).

Note [many targets]: a CI job that pre-bakes a checkpoint for several engines (TP sizes,
profiles, activation dtypes) would otherwise read the source once per target; on an 8B model the
read is most of a conversion. One run makes them all from one read: the source is resolved,
stamped, hashed and its scheme checked once, every target is planned before any output is
touched (an invalid one refuses the run, naming it, unless ``skip_invalid``), the fused layers
stream once (Note [one read for every target] in :mod:`mpack.convert.stream`), the pass-through
tensors are read once and written into every target's ``common.safetensors``, and the config and
tokenizer files are copied once and from that copy to the others. Each target is its own sidecar
with its own lock, up-to-date check, work directory and swap; the swaps come last, so an
interrupted run leaves no target (or, interrupted between two swaps, only finished ones). One
target is the same run over a list of one; the only difference is where it goes: ``-o`` itself
is the sidecar, where several go to ``OUT/<name>`` (:func:`mpack.target.dir_name`), as one does
with ``layout="targets"`` or into an ``OUT`` that already holds targets (Note [target layout]
in mpack/target_dirs.py). Targets already in ``OUT`` that the run does not make are kept as they
are, and reported (``MultiConvertResult.kept``).

Every phase is timed on one :class:`~mpack.convert.timeline.Timeline`; ``ConvertResult.seconds``
is read from it (:data:`SECONDS`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpack.cache import remember_source_dir
from mpack.convert.backends import Backend, check_device_here, open_backend, report, turned_off
from mpack.convert.checkpoint import Checkpoint, check_scale_values, read_scale_arrays
from mpack.convert.options import ConvertOptions
from mpack.convert.output import (
    check_apart,
    output_lock,
    output_path,
    staged_sidecar,
    target_output,
)
from mpack.convert.plan import Plan, layout, open_and_plan
from mpack.convert.scheme_check import SchemeCheck
from mpack.convert.source import (
    ResolvedSource,
    SourceChangedError,
    Stamp,
    candidate_files,
    check_sources_unchanged,
    hash_sources,
    hashing,
    provenance,
    resolve_source,
    source_changes,
    source_files,
    stamp_sources,
)
from mpack.convert.stream import Sink, Streamer
from mpack.convert.timeline import Timeline
from mpack.errors import MpackError, OutputExistsError, arg
from mpack.iokit import Aborted, copy_file, copy_tensors, pool, usable_cores
from mpack.sidecar import (
    CHUNK_BYTES,
    COMMON_NAME,
    COPIED_FILES,
    MANIFEST_NAME,
    MODEL_CONFIG_KEYS,
    HashingWriter,
    load_manifest,
    new_manifest,
    open_writer,
)
from mpack.target import ACT_DTYPES, SCALE, dir_name
from mpack.target_dirs import target_names, uses_target_dirs

Progress = Callable[[str, int, int], None]  # (stage, done, total): "bytes" / "layers"

#: ``ConvertResult.seconds`` key -> the timeline's ``(lane, what)`` it sums (what None: the
#: lane's work, its waits left out); a key is there when its spans are. ``total`` is added when
#: the work was done.
SECONDS: dict[str, tuple[str, str | None]] = {
    "validate": ("main", "validate"),  # from the start of the run: options, source, plan
    "import_torch": ("main", "torch"),  # torch imported, the device checked (and CUDA started)
    "open_gpu": ("main", "driver"),  # the driver path: CUDA started, the kernel loaded, checked
    "validate_values": ("main", "validate-values"),  # every layer's scales
    "hash_sources": ("main", "hash-sources"),  # deciding whether OUT is up to date
    "finish": ("main", "finish"),
    "wait_source_hashes": ("main", "wait-source-hashes"),
    "wait_scheme_check": ("main", "wait-scheme-check"),
    "read_busy": ("read", "unit"),
    "transform_busy": ("transform", "unit"),
    "write_busy": ("write", None),
    "passthrough_busy": ("copy", None),
    "read_wait": ("transform", "wait-read"),
    "write_wait": ("write", "wait"),
}


@dataclass
class ConvertResult:
    """What a conversion did: the manifest it wrote (or found), and how long each phase took.

    ``out``: the sidecar directory (symlinks resolved); ``digest``: the manifest digest;
    ``up_to_date``: ``out`` already held this sidecar, nothing was done; ``seconds``: phase ->
    seconds (``"total"`` once work was done), read from the timeline (:data:`SECONDS`);
    ``bytes_written``: bytes of the safetensors files written (0 when up to date);
    ``timeline``: ``(lane, what, start, end)`` spans, for benchmarks; ``backend``: the backend
    that converted the layers and why the ones before it did not
    (:func:`mpack.convert.backends.report`; empty when up to date).
    """

    out: Path
    manifest: dict[str, Any]
    digest: str
    up_to_date: bool
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_written: int = 0
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)
    backend: dict[str, Any] = field(default_factory=dict)


@dataclass
class MultiConvertResult:
    """What a run into a directory of sidecars did (several targets, or ``layout="targets"``,
    or an ``OUT`` that held targets already: Note [target layout] in mpack/target_dirs.py):
    ``out`` (the directory), ``results`` (one :class:`ConvertResult` per target written or up
    to date, ``out`` being ``OUT/<name>``), ``skipped`` (``(name, why)`` of each invalid target
    left out with ``skip_invalid``), ``kept`` (the folders of ``OUT`` holding a sidecar this
    run did not make: left as they are, never deleted)."""

    out: Path
    results: list[ConvertResult]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def up_to_date(self) -> bool:
        return all(r.up_to_date for r in self.results)


def _seconds(tl: Timeline, *, done: bool) -> dict[str, float]:
    """``ConvertResult.seconds`` from the run's timeline; ``done``: the work was done, with a
    ``total``."""
    got = {key: tl.total(lane, what) for key, (lane, what) in SECONDS.items()}
    seconds = {key: s for key, s in got.items() if s is not None}
    if done:
        seconds["total"] = tl.elapsed()
    return seconds


# --- the run ------------------------------------------------------------------------------


def run_convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    options: ConvertOptions = ConvertOptions(),
    *,
    progress: Progress | None = None,
    scheme_check: SchemeCheck | None = None,
) -> ConvertResult | MultiConvertResult:
    """Convert a compressed-tensors FP8 checkpoint into a Marlin sidecar per target of
    ``options`` (:attr:`ConvertOptions.specs`), reading the source once (Note [many targets]).

    One target: the sidecar is ``out``, and a :class:`ConvertResult` comes back. Several (or
    ``options.layout`` ``"targets"``, or an ``out`` that already holds targets: Note [target
    layout]): each is ``out/<name>`` (:func:`mpack.target.dir_name`), and a
    :class:`MultiConvertResult`. The
    options' meaning: :func:`mpack.convert.convert`. Raises an ``MpackError`` (exit code 2) for
    bad input, with nothing written (some checks finish while the work directories fill; they
    are removed then). ``scheme_check``: the check of this source, already started by the
    caller (the CLI forks it before importing torch); it is used when its directory is the
    resolved source, and cancelled otherwise.

    ``out`` is resolved through symbolic links and the sidecar written at the target, keeping
    the link (Note [output path]); an empty ``out``, the current directory, a mount point, an
    output inside the source or a source inside the output are refused up front. The run holds
    each target's lock throughout (Note [output lock]): ``BusyError`` if another run writes it.
    A source file that changes while it is converted stops the run with ``SourceChangedError``,
    nothing written (Note [stable source] in :mod:`mpack.convert.source`).

    Long on purpose: its body is the order of work of the module docstring, step by step, in
    one place, each step a call.

    Raises:
        UnsupportedSchemeError: a target that cannot be planned (named, with why), unless
            ``skip_invalid`` and another target can; every target when none can.
        OutputExistsError: ``out`` holds another sidecar (``force`` off), or, where the
            targets go to ``out/<target>/``, ``out`` is itself a sidecar.
    """
    tl = Timeline()
    out = output_path(out)
    nested = uses_target_dirs(out, count=len(options.specs), layout=options.layout)
    if nested and (out / MANIFEST_NAME).exists():
        raise _sidecar_in_the_way(out, options)
    check_device_here(options.device_spec)  # a GPU asked for where there is none: before the read
    src = resolve_source(str(source), options.revision, show_progress=progress is not None)
    check_apart(out, src.path)
    with _watched(src, scheme_check, tl) as watch:
        with tl.span("main", "validate", start=tl.t0):
            ck, plans, skipped = open_and_plan(
                src.path,
                watch.check,
                options.specs,
                fuse=options.fuse,
                passthrough=options.passthrough,
                skip_invalid=options.skip_invalid,
            )
        names = source_files(src, ck.files)
        records = functools.partial(watch.records, names)
        made: dict[int, tuple[dict[str, Any], str, dict[str, Any]]] = {}  # target -> manifest,
        # digest, backend
        with contextlib.ExitStack() as stack:
            nest_in = out if nested else None
            stages = _stage_all(stack, nest_in, out, plans, options, src, records, tl)
            todo = [i for i, s in enumerate(stages) if not s.up_to_date]
            if not todo:
                watch.check_unchanged()  # the digests compared are of these files
            else:
                works = [stages[i].work for i in todo]
                todo_plans = [plans[i] for i in todo]
                written, used = _write_all(todo_plans, works, options, watch.check, progress, tl)
                with tl.span("main", "copy-files"):
                    copied = _copy_files(src, names, works)
                with tl.span("main", "wait-source-hashes"):
                    files_src = records()
                with tl.span("main", "wait-scheme-check"):
                    watch.check.agree(ck)
                with tl.span("main", "manifest"):
                    watch.check_unchanged()  # every read of the source is done: the bytes
                    # converted and hashed are those stamped
                    for i, w, b in zip(todo, written, used, strict=True):
                        manifest = _manifest(plans[i], src, files_src, w, copied)
                        made[i] = (manifest, stages[i].write_manifest(manifest), b)
        # every stage swapped into place (in reverse order) when the stack closed
    results = []
    for i, (plan, stage) in enumerate(zip(plans, stages, strict=True)):
        if i in made:
            m, digest, used_by = made[i]
            results.append(_result(stage.out, m, digest, tl, plan, used_by))
        else:
            results.append(_result(stage.out, *stage.current, tl))
    if src.kind == "local":  # the manifest records its name only: Note [source path]
        for r in results:  # one entry per distinct record: the same for every new target
            remember_source_dir(r.manifest["source"], r.out, src.path)
    if not nested:
        return results[0]
    ours = {r.out.name for r in results}
    kept = [n for n in target_names(out) if n not in ours]
    return MultiConvertResult(out, results, skipped, kept)


def _sidecar_in_the_way(out: Path, options: ConvertOptions) -> OutputExistsError:
    """The refusal of targets that go to ``out/<target>/`` where ``out`` is one sidecar
    (Note [target layout]): what to run to keep it at the path the targets' layout gives it."""
    why = "several targets go" if options.many else f"{arg('layout', 'targets')} writes"
    try:
        name = dir_name(load_manifest(out)[0]["target"])
    except MpackError:
        name = "<its target>"
    parked = out.with_name(out.name + ".single")
    return OutputExistsError(
        f"{out} is a sidecar (one target at {out} itself); {why} into a directory of sidecars, "
        "OUT/<target>/",
        hint=f"choose another {arg('out')} directory; or move that sidecar to where the "
        f"targets' layout keeps it, then run again: mv {out} {parked} && mkdir {out} && "
        f"mv {parked} {out / name}",
    )


def _stage_all(
    stack: contextlib.ExitStack,
    nest_in: Path | None,
    out: Path,
    plans: list[Plan],
    options: ConvertOptions,
    src: ResolvedSource,
    records: Callable[..., list[dict[str, Any]]],
    tl: Timeline,
) -> list[Any]:
    """Each target's lock and stage (:func:`mpack.convert.output.staged_sidecar`), entered on
    ``stack``: at ``out`` itself (``nest_in`` None: one target), else at ``nest_in/<name>``
    (Note [target layout] in mpack/target_dirs.py), each place checked apart from the source
    (:func:`target_output`: ``OUT/<name>`` may be a symbolic link into it). Closing ``stack``
    swaps them into place, in reverse order."""
    stages = []
    for plan in plans:
        where = out if nest_in is None else nest_in / dir_name(plan.target)
        out_t = target_output(where, src.path)
        parent = stack.enter_context(output_lock(out_t))
        stage = staged_sidecar(
            out_t,
            plan.target,
            common=COMMON_NAME in plan.files,
            src=src,
            files=records,
            force=options.force,
            timeline=tl,
            parent=parent,
        )
        stages.append(stack.enter_context(stage))
    return stages


def _result(
    out: Path,
    manifest: dict[str, Any],
    digest: str,
    tl: Timeline,
    plan: Plan | None = None,
    backend: dict[str, Any] | None = None,
) -> ConvertResult:
    """A run's result for one target: up to date (no ``plan``: nothing done), or written from
    ``plan`` on ``backend`` (its :func:`~mpack.convert.backends.report`)."""
    if plan is None:
        return ConvertResult(
            out, manifest, digest, up_to_date=True, seconds=_seconds(tl, done=False)
        )
    return ConvertResult(
        out,
        manifest,
        digest,
        up_to_date=False,
        seconds=_seconds(tl, done=True),
        bytes_written=plan.total_bytes,
        timeline=tl.spans(),
        backend=backend or {},
    )


# --- the source during the run ------------------------------------------------------------


@dataclass
class _Watch:
    """The source while a run reads it: its stamps, its hashes (computed on a thread from the
    start, which also warms the page cache for the reads) and the check of its scheme."""

    src: ResolvedSource
    stamps: dict[str, Stamp]
    check: SchemeCheck
    early: Future[list[dict[str, Any]]]  # the hashes of candidate_files(src)
    _records: list[dict[str, Any]] | None = None

    def records(
        self, names: list[str], forms: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """The file records of ``names`` (waiting for their hashes); ``forms``: digests of
        another form, as an older manifest recorded them (:func:`hash_sources`)."""
        if forms is not None:
            return hash_sources(self.src, names, forms=forms)
        if self._records is None:
            got = {r["name"]: r for r in self.early.result()}
            missing = [n for n in names if n not in got]
            got.update((r["name"], r) for r in hash_sources(self.src, missing) if missing)
            self._records = [got[n] for n in names]
        return self._records

    def check_unchanged(self) -> None:
        """Raise ``SourceChangedError`` if a source file changed since it was stamped."""
        check_sources_unchanged(self.src, self.stamps)


@contextlib.contextmanager
def _watched(
    src: ResolvedSource, scheme_check: SchemeCheck | None, tl: Timeline
) -> Iterator[_Watch]:
    """Stamp the source, start its scheme check and its hashing; stop both at the end. A failure
    on a source that changed meanwhile (a shard truncated or removed under a read) is reported
    as that change: the cause to fix."""
    stamps = stamp_sources(src)  # before anything of the source is read
    try:
        with _started(src, scheme_check, tl) as (check, early):
            yield _Watch(src, stamps, check, early)
    except Exception as e:
        changed = None
        if not isinstance(e, SourceChangedError):
            with contextlib.suppress(MpackError, OSError):
                changed = source_changes(src, stamps)
        if changed is None:
            raise
        raise changed from e


@contextlib.contextmanager
def _started(
    src: ResolvedSource, scheme_check: SchemeCheck | None, tl: Timeline
) -> Iterator[tuple[SchemeCheck, Future[list[dict[str, Any]]]]]:
    """The scheme check of ``src`` and the hashing of its files, started; both stopped at the
    end. The check may run in a forked child while this process plans from the headers and
    streams (Note [scheme check in a child]): it is forked before any thread starts."""
    check = scheme_check
    if check is None or check.root.resolve() != src.path.resolve():
        if check is not None:
            check.cancel()
        check = SchemeCheck(src.path)
    try:
        with hashing(src, candidate_files(src), timeline=tl) as early:
            yield check, early
    finally:
        check.cancel()


def validate_values(ck: Checkpoint, acts: set[str]) -> None:
    """Every layer's scale values (SPEC §1), read once, for each activation dtype; before any
    heavy work. A few MB of them are read at a time, with one open per shard, and checked
    together; only a group with a bad value is checked layer by layer, for the error that names
    it (a MoE model has tens of thousands of scale tensors: one open and one check each was
    most of this step)."""
    limit = min(ACT_DTYPES[act].fold_limit for act in acts)
    for group in _scale_groups(ck):
        values = np.concatenate(list(group.values()))
        if np.isfinite(values).all() and (values > 0).all() and (values <= limit).all():
            continue
        for module, scale in group.items():
            for act in sorted(acts):
                check_scale_values(ck, module, scale, act)


#: Bytes of scale tensors :func:`validate_values` reads and checks at a time.
SCALE_READ_BYTES = 16 << 20


def _scale_groups(ck: Checkpoint) -> Iterator[dict[str, np.ndarray]]:
    """Every layer's float32 scales, ``{module: scales}`` of about :data:`SCALE_READ_BYTES` at a
    time, in layer order."""
    group: list[str] = []
    size = 0
    for module in ck.layers:
        nbytes = ck.tensors[f"{module}.{SCALE}"].nbytes
        if group and size + nbytes > SCALE_READ_BYTES:
            yield read_scale_arrays(ck, group)
            group, size = [], 0
        group.append(module)
        size += nbytes
    if group:
        yield read_scale_arrays(ck, group)


# --- stream into the stage ----------------------------------------------------------------


# Note [torch off the critical path]: a fresh process spends its first seconds importing torch
# (more with a cold disk; figures: docs/BENCHMARKS.md, section 9) and starting CUDA. Nothing
# before the Marlin layers needs it: resolving the source, planning from the headers, the
# output's lock and work directory, the source hashes, and the pass-through tensors (a plain byte
# copy into their own file, a quarter of an 8B model's bytes). So the backend opens (the torch
# backend imports torch) only in :func:`_write_all`, after the pass-through copy has started on
# its thread: the copy and the hashing run while the interpreter imports. Then every layer's
# scale values are checked (an error stops the copy, and the work directory goes), and the
# Marlin layers go through :class:`mpack.convert.stream.Streamer` (read, transform and write on
# their own threads). Each file hashes as it is written (:class:`mpack.sidecar.HashingWriter`).
def _write_all(
    plans: list[Plan],
    works: list[Path],
    options: ConvertOptions,
    check: SchemeCheck,
    progress: Progress | None,
    tl: Timeline,
) -> tuple[list[dict[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Stream every target's files into its work directory; return ``{file: {size, chunks}}``
    and the backend's :func:`~mpack.convert.backends.report`, per target (Note [torch off the
    critical path])."""
    ck = plans[0].ckpt
    with contextlib.ExitStack() as stack:
        with tl.span("main", "setup"):
            direct = direct_files(plans, options)
            writers = [
                _open_writers(p, w, stack, direct.get(i, ()))
                for i, (p, w) in enumerate(zip(plans, works, strict=True))
            ]
            count = _Counter(progress, plans)
            for ws in writers:
                for w in ws.values():
                    count.add_bytes(w.position)
        stop = threading.Event()
        with pool("copy", 1) as copier:
            copied = None
            commons = [_entries(ws[COMMON_NAME]) for ws in writers if COMMON_NAME in ws]
            if commons:
                bump = functools.partial(_bump_unless, stop, count.add_bytes)
                copied = copier.submit(copy_tensors, ck.read_into, commons, bump, tl)
            try:
                sinks = _sinks(plans, writers, options, tl, stack)
                with tl.span("main", "validate-values"), check.errors_first():
                    validate_values(ck, {p.act_dtype for p in plans})
                with tl.span("main", "stream"):
                    Streamer(sinks, count.add_bytes, count.unit_done, tl).run()
            except BaseException:
                stop.set()  # the copy stops at its next piece
                raise
            if copied is not None:
                copied.result()
        with tl.span("main", "finish"):
            files = [{name: _finish(w) for name, w in ws.items()} for ws in writers]
            return files, [report(s.backend) for s in sinks]


def _entries(w: HashingWriter) -> tuple[HashingWriter, list[Any]]:
    """``(writer, its file's entries)``: what :func:`mpack.iokit.copy_tensors` copies into."""
    return w, w.file_map.entries


def _bump_unless(stop: threading.Event, bump: Callable[[int], None], n: int) -> None:
    """``bump(n)``, or raise ``Aborted`` once ``stop`` is set (the copy's way out)."""
    if stop.is_set():
        raise Aborted("convert stopped")
    bump(n)


def _sinks(
    plans: list[Plan],
    writers: list[dict[str, HashingWriter]],
    options: ConvertOptions,
    tl: Timeline,
    stack: contextlib.ExitStack,
) -> list[Sink]:
    """Each target's backend, the one a run of it alone opens; each backend opened once for all
    the targets it takes, and closed with ``stack``."""
    opened: list[Backend] = []
    sinks = []
    for plan, ws in zip(plans, writers, strict=True):
        b = open_backend(
            options.device_spec,
            plan,
            backend=options.backend,
            disabled=options.disable,
            tl=tl,
            opened=opened,
        )
        if all(b is not o for o in opened):
            opened.append(b)
            stack.callback(b.close)
        sinks.append(Sink(plan, ws, b))
    return sinks


#: Files of one conversion written O_DIRECT, at most (each holds two chunks of staging memory).
DIRECT_FILES = 2
#: Below this many usable cores a conversion writes O_DIRECT (Note [direct writes]).
DIRECT_BELOW_CORES = 8


def direct_files(plans: list[Plan], options: ConvertOptions) -> dict[int, list[str]]:
    """The writer policy, for any number of targets: which files a run writes O_DIRECT, by
    target index (Note [direct writes] in mpack/iokit.py). On fewer than
    :data:`DIRECT_BELOW_CORES` usable cores, unless ``direct-write`` is turned off, the first
    :data:`DIRECT_FILES` files in write order: the first target's pass-through file (which the
    pass-through copy then reads straight into) and its first rank file; else none."""
    if usable_cores() >= DIRECT_BELOW_CORES or "direct-write" in turned_off(options.disable):
        return {}
    order = [(i, n) for i, p in enumerate(plans) for n in sorted(p.files, key=_write_order)]
    chosen: dict[int, list[str]] = {}
    for i, name in order[:DIRECT_FILES]:
        chosen.setdefault(i, []).append(name)
    return chosen


def _write_order(name: str) -> tuple[bool, str]:
    """A target's files in the order a policy takes them: the pass-through file first."""
    return name != COMMON_NAME, name


def _open_writers(
    plan: Plan, work: Path, stack: contextlib.ExitStack, direct: Iterable[str] = ()
) -> dict[str, HashingWriter]:
    """A writer per planned file; ``stack`` closes them all, in order. The files named in
    ``direct`` write O_DIRECT where the file system allows (:func:`direct_files`)."""
    writers: dict[str, HashingWriter] = {}
    direct = set(direct)

    def close_all() -> None:
        for w in writers.values():
            w.close()

    stack.callback(close_all)
    for name, file_map in plan.files.items():
        writers[name] = open_writer(work / name, file_map, direct=name in direct)
    return writers


class _Counter:
    """Feeds ``progress``: bytes written (from any thread), layers done."""

    def __init__(self, progress: Progress | None, plans: list[Plan]) -> None:
        self.progress, self.units = progress, len(plans[0].units)
        self.total = sum(p.total_bytes for p in plans)
        self.done = 0
        self._lock = threading.Lock()

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.progress:
                self.progress("bytes", self.done, self.total)

    def unit_done(self, i: int) -> None:
        if self.progress:
            self.progress("layers", i, self.units)


def _finish(w: HashingWriter) -> dict[str, Any]:
    """Flush a written file: its size and chunk digests (FORMAT.md, format version 2)."""
    size, _ = w.finish()
    return {"size": size, "chunks": {"bytes": w.chunk_bytes, "sha256": w.chunks}}


# --- the manifest -------------------------------------------------------------------------


def _manifest(
    plan: Plan,
    src: ResolvedSource,
    files_src: list[dict[str, Any]],
    written: dict[str, dict[str, Any]],
    copied: list[dict[str, Any]],
) -> dict[str, Any]:
    """The new sidecar's manifest: target, source provenance, model, layers and every file."""
    ck = plan.ckpt
    records = [{"name": n, **written[n]} for n in sorted(written)] + copied
    return new_manifest(
        target=plan.target,
        source=provenance(src, files_src),
        model=_model(ck),
        layers=plan.layers_manifest(),
        files=sorted(records, key=lambda f: f["name"]),
    )


def _model(ck: Checkpoint) -> dict[str, Any]:
    """The manifest's ``model``: the architecture, a wrapper's ``text_architecture`` (the
    language model the dimensions are of), and the dimensions."""
    lay = layout(ck)
    text = {"text_architecture": lay.text_architecture} if lay.wrapper is not None else {}
    return {"architecture": ck.architecture, **text, "config": _model_summary(ck)}


def _model_summary(ck: Checkpoint) -> dict[str, Any]:
    c = ck.text_config
    return {k: c[k] for k in MODEL_CONFIG_KEYS if k in c} | {"dtype": ck.dtype}


def _copy_files(src: ResolvedSource, names: list[str], works: list[Path]) -> list[dict[str, Any]]:
    """The config and tokenizer files: from the source into the first work directory, from
    there into the others (the same bytes, so the same records)."""
    records = []
    for n in names:
        if n not in COPIED_FILES:
            continue
        rec = copy_file(src.path / n, works[0] / n, CHUNK_BYTES)
        for w in works[1:]:
            if copy_file(works[0] / n, w / n, CHUNK_BYTES) != rec:
                raise AssertionError(f"{n}: copied twice, two records")
        records.append(rec)
    return records
