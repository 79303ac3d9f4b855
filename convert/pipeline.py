"""The streaming convert pipeline: validate, plan, then read -> transform -> write, atomically.

Order of work (ARCHITECTURE.md "Data flow"), as :func:`run_convert` reads:

1. resolve the source, take ``-o``'s lock and stamp the source files; hashing them starts on a
   thread, and with compressed-tensors not yet imported, its check of the config starts in a
   forked child (Note [scheme check in a child] in :mod:`mpack.convert.scheme_check`);
2. parse every header, validate every layer's structure and plan every output tensor
   (:mod:`mpack.convert.plan`), from the headers alone: no torch yet;
3. if OUT already holds this sidecar (same source files, same target), stop: up to date
   (:func:`mpack.convert.staging.staged_sidecar`, which owns the output directory);
4. in a hidden work directory: start copying the pass-through tensors on a thread, then open the
   backend that converts the layers (:func:`mpack.convert.backends.open_backend`: the host
   backend imports no torch at all; the torch backend imports it here, Note [torch off the
   critical path]: the copy and the source hashing run while the interpreter imports), check
   every layer's scale values, and stream the fused layers through three stages on their own
   threads — read (from the shards), transform (the backend's), write (at the planned offset,
   chunk digests and disk writeback behind it) — with a few units in flight
   (:mod:`mpack.convert.stream`), so memory is bounded whatever the model; the config and
   tokenizer files are copied after;
5. wait for the source hashes and the scheme check's verdict, check that no source file changed
   under the run (Note [stable source] in :mod:`mpack.convert.source`), write the manifest last,
   and swap the work directory into place (Note [atomic output] in
   :mod:`mpack.convert.staging`).

Every phase is timed on one :class:`~mpack.convert.timeline.Timeline`; ``ConvertResult.seconds``
is read from it (:data:`SECONDS`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpack.convert.backends import Backend, check_backend_name, check_device_here, report
from mpack.convert.checkpoint import (
    Checkpoint,
    check_scale_values,
    find_layers,
    open_checkpoint,
    read_scale_array,
)
from mpack.convert.options import ConvertOptions
from mpack.convert.plan import Plan, check_fusion_tp, make_plan
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
from mpack.convert.staging import check_apart, output_lock, output_path, staged_sidecar
from mpack.convert.timeline import Timeline
from mpack.errors import MpackError, UnsupportedSchemeError, UsageError
from mpack.iokit import Aborted, copy_file, copy_tensors, pool, usable_cores
from mpack.sidecar import (
    CHUNK_BYTES,
    COMMON_NAME,
    CONFIG_NAME,
    COPIED_FILES,
    MODEL_CONFIG_KEYS,
    HashingWriter,
    new_manifest,
    open_writer,
)
from mpack.target import ACT_DTYPES, FUSIONS, PROFILES

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
) -> ConvertResult:
    """Convert a compressed-tensors FP8 checkpoint into a Marlin sidecar at ``out``.

    ``options`` name one target (several: :func:`mpack.convert.multi.run_convert_many`); see
    :func:`mpack.convert.convert` for their meaning. Raises an ``MpackError`` (exit code 2)
    for bad input, with nothing written at ``out`` (some checks finish while the work
    directory fills; it is removed then). ``scheme_check``: the check of this source,
    already started by the caller (the CLI forks it before importing torch); it is used when its
    directory is the resolved source, and cancelled otherwise.

    ``out`` is resolved through symbolic links and the sidecar written at the target, keeping
    the link (Note [output path]); an empty ``out``, the current directory, a mount point, an
    output inside the source or a source inside the output are refused up front. The run holds
    ``out``'s lock throughout (Note [output lock]): ``BusyError`` if another run writes ``out``.
    A source file that changes while it is converted stops the run with ``SourceChangedError``,
    nothing written (Note [stable source] in :mod:`mpack.convert.source`).
    """
    tl = Timeline()
    profile, act_dtype, tp = options.target()
    revision, fuse, device = options.revision, options.fuse, options.device
    passthrough, force = options.passthrough, options.force
    _check_options(profile, act_dtype, tp, fuse, device, options.backend)
    out = output_path(out)
    src = resolve_source(str(source), revision, show_progress=progress is not None)
    check_apart(out, src.path)
    with output_lock(out) as parent, _watched(src, scheme_check, tl) as watch:
        with tl.span("main", "validate", start=tl.t0):
            ck, plan = _open_and_plan(
                src,
                watch.check,
                profile=profile,
                act_dtype=act_dtype,
                tp=tp,
                fuse=fuse,
                passthrough=passthrough,
            )
        names = source_files(src, ck.files)
        records = functools.partial(watch.records, names)
        with staged_sidecar(
            out,
            plan.target,
            common=COMMON_NAME in plan.files,
            src=src,
            files=records,
            force=force,
            timeline=tl,
            parent=parent,
        ) as stage:
            if stage.up_to_date:
                watch.check_unchanged()  # the digests compared are of these files
                m, digest = stage.current
                return _result(out, m, digest, tl)
            written, used = _write_all(plan, stage.work, options, watch.check, progress, tl)
            with tl.span("main", "copy-files"):
                copied = [
                    copy_file(src.path / n, stage.work / n, CHUNK_BYTES)
                    for n in names
                    if n in COPIED_FILES
                ]
            with tl.span("main", "wait-source-hashes"):
                files_src = records()
            with tl.span("main", "wait-scheme-check"):
                watch.check.agree(ck)
            with tl.span("main", "manifest"):
                watch.check_unchanged()  # every read of the source is done: the bytes converted
                # and hashed are those stamped
                manifest = _manifest(plan, src, files_src, written, copied)
                digest = stage.write_manifest(manifest)
    return _result(out, manifest, digest, tl, plan, used)


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


# --- options ------------------------------------------------------------------------------


def _check_options(
    profile: str, act_dtype: str | None, tp: int, fuse: str, device: str, backend: str
) -> None:
    if profile not in PROFILES:
        raise UsageError(f"--profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if act_dtype is not None and act_dtype not in ACT_DTYPES:
        raise UsageError(f"--act-dtype must be {' or '.join(ACT_DTYPES)}, got {act_dtype!r}")
    if fuse not in FUSIONS:
        raise UsageError(f"--fuse must be one of {', '.join(FUSIONS)}, got {fuse!r}")
    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    check_fusion_tp(fuse, tp)
    check_device_here(device)  # a GPU asked for where there is none: before the source is read
    check_backend_name(backend)


def _act_dtype(ck: Checkpoint, requested: str | None) -> str:
    if requested:
        return requested
    dt = ck.dtype
    if dt in ACT_DTYPES:
        return dt
    raise UnsupportedSchemeError(
        f"{ck.root / CONFIG_NAME}: model dtype {dt!r} is not an activation dtype Marlin supports",
        hint="pass --act-dtype bfloat16 or --act-dtype float16",
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


# --- open, validate, plan -----------------------------------------------------------------


def _open_and_plan(
    src: ResolvedSource,
    check: SchemeCheck,
    *,
    profile: str,
    act_dtype: str | None,
    tp: int,
    fuse: str,
    passthrough: bool,
) -> tuple[Checkpoint, Plan]:
    """Parse every header, find and validate every layer (SPEC §1), plan every output tensor.
    With the scheme check in a child, its error comes first: the same order as inline. The scale
    values are checked later, once torch is imported (:func:`_write_all`)."""
    with check.errors_first():
        ck = open_checkpoint(src.path, scheme=not check.deferred)
        find_layers(ck)
        plan = make_plan(
            ck,
            profile=profile,
            act_dtype=_act_dtype(ck, act_dtype),
            tp=tp,
            fusion=fuse,
            passthrough=passthrough,
        )
    return ck, plan


def validate_values(ck: Checkpoint, plan: Plan) -> None:
    """Scale values of every layer (SPEC §1), read before any heavy work."""
    for module in ck.layers:
        check_scale_values(ck, module, read_scale_array(ck, module), plan.act_dtype)


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
    plan: Plan,
    work: Path,
    options: ConvertOptions,
    check: SchemeCheck,
    progress: Progress | None,
    tl: Timeline,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Stream every output file into ``work``; return ``{file: {size, chunks}}`` and the
    backend's :func:`~mpack.convert.backends.report` (Note [torch off the critical path])."""
    with contextlib.ExitStack() as stack:
        with tl.span("main", "setup"):
            writers = _open_writers(plan, work, stack, direct=direct_writes(options))
            count = _Counter(progress, plan)
            for w in writers.values():
                count.add_bytes(w.position)
        stop = threading.Event()
        with pool("copy", 1) as copier:
            copied = None
            if COMMON_NAME in writers:
                bump = functools.partial(_bump_unless, stop, count.add_bytes)
                copied = copier.submit(
                    copy_tensors, plan.ckpt.read_into, writers[COMMON_NAME], bump, tl
                )
            try:
                backend = options.open_backend(plan, tl)
                stack.callback(backend.close)
                with tl.span("main", "validate-values"), check.errors_first():
                    validate_values(plan.ckpt, plan)
                with tl.span("main", "stream"):
                    _stream_layers(plan, writers, backend, count, tl)
            except BaseException:
                stop.set()  # the copy stops at its next piece
                raise
            if copied is not None:
                copied.result()
        with tl.span("main", "finish"):
            return {name: _finish(w) for name, w in writers.items()}, report(backend)


def _bump_unless(stop: threading.Event, bump: Callable[[int], None], n: int) -> None:
    """``bump(n)``, or raise ``Aborted`` once ``stop`` is set (the copy's way out)."""
    if stop.is_set():
        raise Aborted("convert stopped")
    bump(n)


def _stream_layers(
    plan: Plan, writers: dict[str, HashingWriter], backend: Backend, count: _Counter, tl: Timeline
) -> None:
    """The Marlin layers of every rank through the streamer, on ``backend``."""
    from mpack.convert.stream import Streamer

    Streamer(plan, writers, backend, count.add_bytes, count.unit_done, tl).run()


#: Files of one conversion written O_DIRECT, at most (each holds two chunks of staging memory).
DIRECT_FILES = 2
#: Below this many usable cores a conversion writes O_DIRECT (Note [direct writes]).
DIRECT_BELOW_CORES = 8


def direct_writes(options: ConvertOptions) -> bool:
    """Whether this conversion writes its sidecar O_DIRECT: on fewer than
    :data:`DIRECT_BELOW_CORES` usable cores, unless ``direct-write`` is turned off (Note [direct
    writes] in mpack/iokit.py)."""
    return usable_cores() < DIRECT_BELOW_CORES and not options.turned_off("direct-write")


def _open_writers(
    plan: Plan, work: Path, stack: contextlib.ExitStack, *, direct: bool = False
) -> dict[str, HashingWriter]:
    """A writer per planned file; ``stack`` closes them all, in order. Where ``direct``, the
    pass-through file and the first rank file write O_DIRECT where the file system allows
    (Note [direct writes] in mpack/iokit.py; a multi-target run, whose targets' files are all
    open at once, writes through the page cache)."""
    writers: dict[str, HashingWriter] = {}
    first = sorted(plan.files, key=lambda n: n != COMMON_NAME)[:DIRECT_FILES] if direct else []

    def close_all() -> None:
        for w in writers.values():
            w.close()

    stack.callback(close_all)
    for name, file_map in plan.files.items():
        writers[name] = open_writer(work / name, file_map, direct=name in first)
    return writers


class _Counter:
    """Feeds ``progress``: bytes written (from any thread), layers done."""

    def __init__(self, progress: Progress | None, plan: Plan) -> None:
        self.progress, self.total, self.units = progress, plan.total_bytes, len(plan.units)
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
        model={"architecture": ck.architecture, "config": _model_summary(ck)},
        layers=plan.layers_manifest(),
        files=sorted(records, key=lambda f: f["name"]),
    )


def _model_summary(ck: Checkpoint) -> dict[str, Any]:
    c = ck.text_config
    return {k: c[k] for k in MODEL_CONFIG_KEYS if k in c} | {"dtype": ck.dtype}
