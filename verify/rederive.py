"""A sidecar against its source checkpoint: every tensor re-derived, and the layout read backwards.

Given the source checkpoint (a directory or Hub repo id passed in; else the local path the
manifest records, or the Hub repo and commit it records, found in the local Hugging Face cache
without any network call; :func:`find_source`), :func:`rederive`

* checks the source files against the digests the manifest records;
* re-derives every Marlin tensor from the checkpoint (the transform a conversion runs, on the
  path it would take: Note [verify without torch]) and compares it byte for byte, and compares
  the pass-through tensors with their source bytes;
* reads the layout backwards: unpacking each weight gives back the fused checkpoint bytes (for
  ``w8a8-marlin`` tensor layers, the requantized bytes), and unpacking each scale (and bias)
  gives back the checkpoint's values cast to the activation dtype;
* checks the chunk digests of the files it compares, from the same reads (Note [one pass over
  the sidecar] in :mod:`mpack.verify.compare`).

Note [verify as a conversion]: re-deriving is a conversion whose writer compares instead of
writing, so it runs convert's own machinery (:class:`mpack.convert.stream.Streamer`: read,
transform and write on their own threads, on the backend a conversion would open:
:func:`mpack.convert.backends.open_backend`) with
:class:`mpack.verify.compare.SidecarComparer` as the writer,
and the pass-through tensors through :func:`mpack.iokit.copy_tensors` on another thread. As in a
conversion, the source files are hashed on a thread from the start (which also warms the page cache
for the reads), the plan comes from the shard headers, and compressed-tensors' parse of the config
runs in a forked child whose verdict is awaited at the end (Note [scheme check in a child] in
:mod:`mpack.convert.scheme_check`). The layout is read backwards on the re-derived tensors, where
the transform left them, by the backend's own ``read_back`` (the host and driver backends in host
memory, the torch backend on its device): the comparison proves them equal to the sidecar's, so
this is the check of the sidecar's own bytes. A layer whose bytes differ is read back from the
sidecar afterwards to say which of its tensors does not unpack.

Note [verify many targets]: ``mpack verify OUT`` of a directory of targets (Note [target layout]
in mpack/target_dirs.py) re-derives them all from one read of the source, as the conversion made
them (Note [many targets] in mpack/convert/pipeline.py): :func:`rederive_many` plans every target
from one parse of the headers and one scheme check, hashes the source files once, streams each
unit once through every target's backend into every target's comparers (a
:class:`~mpack.convert.stream.Sink` each), and copies the pass-through tensors once into every
``common.safetensors`` comparer. Targets that recorded other source files, another fusion, or
pass-through where the others have none, are another group, and another read
(:func:`group_key`); the targets of one ``mpack convert`` run are one group.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from mpack import iokit
from mpack.cache import recalled_source_dir
from mpack.convert.backends import Backend, open_backend
from mpack.convert.checkpoint import Checkpoint
from mpack.convert.options import TargetSpec
from mpack.convert.plan import OutLayer, Plan, Stack, open_and_plan
from mpack.convert.scheme_check import SchemeCheck
from mpack.convert.source import (
    ResolvedSource,
    cached_source,
    hashing,
    record_forms,
    resolve_source,
)
from mpack.convert.stream import Sink, Streamer
from mpack.convert.timeline import Timeline
from mpack.errors import CorruptFileError, SourceNotFoundError, arg, listed, shown
from mpack.fsutil import open_regular_file
from mpack.iokit import copy_tensors, pread_pieces
from mpack.sidecar import COMMON_NAME, FileMap, rank_file_name, torch_dtype
from mpack.target import EXPERT_PARALLEL, dir_name
from mpack.verify.compare import SidecarComparer

if TYPE_CHECKING:  # the torch backend imports it on use (Note [verify without torch])
    import torch

__all__ = ["Rederived", "find_source", "group_key", "rederive", "rederive_many"]


def find_source(
    source: str | None,
    revision: str | None,
    m: dict[str, Any],
    *,
    sidecar: Path | None = None,
) -> tuple[ResolvedSource | None, str | None]:
    """The source to re-derive from, or None and why not (for people).

    Args:
        source: a directory as it is, or a Hub repo id at ``revision``, else at the commit the
            manifest records (for a Hub-sourced sidecar), else at ``main``. None: the source the
            manifest records, if it is here (:func:`_recorded_source`).
        sidecar: the sidecar's directory: where mpack's cache says the local source of this
            very sidecar is, when the manifest records its name only (Note [source path] in
            :mod:`mpack.cache`).

    Raises:
        SourceNotFoundError, UsageError: ``source`` cannot be resolved.
    """
    if source is None:
        return _recorded_source(m, sidecar)
    rec = m["source"]
    hub_rev = rec.get("revision") if rec.get("kind") == "hub" else None
    local = Path(source).expanduser().exists()
    return resolve_source(source, revision or (None if local else hub_rev)), None


def _recorded_source(
    m: dict[str, Any], sidecar: Path | None = None
) -> tuple[ResolvedSource | None, str | None]:
    """The source the manifest records, if it is here: a local directory that still exists (an
    absolute ``source.path``, or where convert kept the directory of that record: Note [source
    path] in :mod:`mpack.cache`), or a Hub repo at its recorded commit in the local HF cache (never
    downloaded: verify makes no network call without a given source). Else None, and why, for
    people."""
    rec = m["source"]
    kind, path = rec.get("kind"), rec.get("path")
    if kind == "local" and isinstance(path, str) and not Path(path).is_absolute():
        kept = recalled_source_dir(rec, Path(sidecar or ".").resolve())
        if kept is None:
            return None, (
                f"the manifest records the source directory's name ({shown(path, 4096)}), not "
                "where it is, and it was not converted here; only the files were checked. Pass "
                f"{arg('source', 'DIR')} to re-derive every tensor"
            )
        path = str(kept)
    repo, rev = rec.get("repo"), rec.get("revision")
    if kind == "hub" and isinstance(repo, str) and isinstance(rev, str) and repo and rev:
        try:
            return cached_source(repo, rev), None
        except SourceNotFoundError as e:
            return None, (
                f"{e.message} (looked offline); only the files were checked. To re-derive "
                f"every tensor, download it (hf download {repo} --revision {rev}) or pass "
                f"{arg('source', 'DIR')}"
            )
    if kind == "local" and isinstance(path, str) and path:
        if Path(path).is_dir():
            return resolve_source(path), None
        return None, (
            f"the recorded source directory {path} is not there; only the files were checked. "
            f"Pass {arg('source', 'DIR')} (or a Hub repo id) to re-derive every tensor"
        )
    return None, (
        "the manifest records no source mpack can find; only the files were checked. Pass "
        f"{arg('source', 'DIR')} (or a Hub repo id) to re-derive every tensor"
    )


@dataclass
class Rederived:
    """What :func:`rederive` found.

    ``file_problems``: the compared files' digests that differ from the manifest (the wording
    of :func:`mpack.sidecar.check_files`); when there are any, the rest is left empty: a file
    that fails its digests is reported as such, as without a source. ``source_problems``: the
    source files that differ from those the manifest records (then the source is another
    checkpoint, whatever the tensors say). ``problems``: every tensor that differs.
    ``layers``: packed layers re-derived, once per rank; ``tensors``: tensors compared;
    ``device``: where the transform ran.
    """

    file_problems: list[str] = field(default_factory=list)
    source_problems: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    layers: int = 0
    tensors: int = 0
    device: str = "cpu"


def rederive(
    sidecar: Path,
    m: dict[str, Any],
    file_maps: dict[str, FileMap],
    src: ResolvedSource,
    device: str = "auto",
    tl: Timeline | None = None,
    backend: str = "auto",
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> Rederived:
    """Re-derive every tensor of ``sidecar`` from ``src`` on ``device`` and compare, checking the
    digests of the files read on the way (Note [verify as a conversion]).

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:i`` (``--rederive-device``, its name
            checked by the caller): where the transform runs, chosen as a conversion chooses
            (Note [verify without torch]).
        layouts: the sidecar's :func:`mpack.sidecar.safetensors_files` by name, as read; their
            sizes and kinds are checked, their digests not yet.
        tl: gets a ``main`` span for each phase (``plan``, ``pass``, ``wait-source-hashes``,
            ``wait-scheme-check``, ``tensor-problems``).
        backend: ``auto`` or the backend to re-derive on (:data:`mpack.convert.backends.BACKENDS`).
        progress: ``(stage, done, total)`` as the pass goes, as a conversion's: ``"bytes"`` of
            the sidecar compared, ``"layers"`` (units) re-derived.

    The one-sidecar case of :func:`rederive_many`, which runs the phases.

    Raises:
        SourceNotFoundError: the source lacks a file the manifest records (checked first).
        MpackError: the source cannot be opened or planned, or its config is refused (the
            errors a conversion of it raises).
    """
    return rederive_many([(sidecar, m, file_maps)], src, device, tl, backend, progress=progress)[0]


def group_key(m: dict[str, Any], file_maps: dict[str, FileMap]) -> tuple[str, ...]:
    """What sidecars re-derived from one read must share (Note [verify many targets]): the
    source files recorded, the fusion, and whether they have ``common.safetensors``."""
    import json

    files = json.dumps(m["source"].get("files", []), sort_keys=True)
    return (files, str(m["target"].get("fusion")), str(COMMON_NAME in file_maps))


def rederive_many(
    sidecars: list[tuple[Path, dict[str, Any], dict[str, FileMap]]],
    src: ResolvedSource,
    device: str = "auto",
    tl: Timeline | None = None,
    backend: str = "auto",
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[Rederived]:
    """:func:`rederive` of each ``(sidecar, manifest, file maps)`` of ``sidecars``, all from one
    read of ``src`` (Note [verify many targets]); they must share :func:`group_key`. Arguments,
    result (per sidecar, in order) and errors as :func:`rederive`'s; ``progress`` counts the
    bytes of every sidecar.

    Long on purpose: the phases of a re-derivation (plan, open, the pass, the source's digests,
    the scheme verdict, the tensors) in the order they run, each a call, with their spans.
    """
    tl = tl or Timeline()
    _, m0, maps0 = sidecars[0]
    if any(group_key(m, fm) != group_key(m0, maps0) for _, m, fm in sidecars):
        raise ValueError("rederive_many: sidecars of different groups (group_key)")
    recorded = m0["source"].get("files", [])  # hashed in the forms the manifest records
    names, forms = sorted(f["name"] for f in recorded), record_forms(recorded)
    _check_source_files(src, names, sidecars[0][0])
    check = SchemeCheck(src.path)  # forked before any thread of this run starts
    try:
        with tl.span("main", "plan"):
            targets = [m["target"] for _, m, _ in sidecars]
            ck, plans = _plans(src, check, targets, COMMON_NAME in maps0)
        with hashing(src, names, forms=forms) as hashed, contextlib.ExitStack() as on:
            opened: list[Backend] = []
            backends: list[Backend] = []  # each plan's: one opened once for every plan it takes
            for plan in plans:  # the hashing runs meanwhile
                be = open_backend(
                    device,
                    plan,
                    backend=backend,
                    option="--rederive-device",
                    tl=tl,
                    spans=("open-gpu", "import-torch"),
                    opened=opened,
                )
                if all(be is not o for o in opened):
                    opened.append(be)
                    on.callback(be.close)
                backends.append(be)
            cmps = [
                on.enter_context(_Comparers(sc, m, fm, plan))
                for (sc, m, fm), plan in zip(sidecars, plans, strict=True)
            ]
            # the pass: read once, re-derive for every target, compare and digest both sides
            with tl.span("main", "pass"):
                checkers = _run(plans, [c.files for c in cmps], backends, _Counter(progress, plans))
                file_problems = [c.finish(m) for c, (_, m, _) in zip(cmps, sidecars, strict=True)]
            if all(file_problems):
                return [
                    Rederived(file_problems=fp, device=b.where)
                    for fp, b in zip(file_problems, backends, strict=True)
                ]
            with tl.span("main", "wait-source-hashes"):
                source_problems = _source_problems(m0, hashed.result())
        with tl.span("main", "wait-scheme-check"):
            check.agree(ck)  # its verdict; the same layers as the headers
        out = []
        with tl.span("main", "tensor-problems"):
            for i, ((sc, _, fm), plan) in enumerate(zip(sidecars, plans, strict=True)):
                where = backends[i].where
                if file_problems[i]:
                    out.append(Rederived(file_problems=file_problems[i], device=where))
                    continue
                problems = _tensor_problems(sc, plan, cmps[i].files, checkers[i], fm)
                compared = sum(
                    len(ly.file_specs(plan.act_dtype)) for unit in plan.units for ly in unit
                )
                if COMMON_NAME in cmps[i].files:
                    common = cmps[i].files[COMMON_NAME]
                    compared += len(common.file_map.entries) - len(common.unmatched)
                layers = len(plan.units) * plan.tp
                out.append(Rederived([], source_problems, problems, layers, compared, where))
    finally:
        check.cancel()
    return out


def _check_source_files(src: ResolvedSource, names: list[str], sidecar: Path) -> None:
    """Refuse, before any work, a source that lacks a file the manifest records (``names``): it
    is not the checkpoint the sidecar was made from, or not all of it. The error's ``file`` is
    the first missing one."""
    missing = [n for n in names if not (src.path / n).is_file()]
    if not missing:
        return
    given = shown(src.display, 4096)
    if len(missing) == 1:
        what = f"no {shown(missing[0])}, a file"
    else:
        what = f"{len(missing)} of the files"
    err = SourceNotFoundError(
        f"{given}: {what} the sidecar {sidecar} was made from (its mpack.json records "
        f"{len(names)} source files)"
        + (f"; missing:{listed([shown(n) for n in missing])}" if len(missing) > 1 else ""),
        hint=f"pass as {arg('source')} the checkpoint directory (or Hub repo id) that the "
        "sidecar was converted from, with all of its files",
    )
    err.file = str(src.path / missing[0])  # type: ignore[attr-defined]
    raise err


# Note [verify without torch]: verify re-derives on the backend a conversion would open for
# this ``device`` (Note [choosing a backend] in :mod:`mpack.convert.backends`): the host backend
# (numpy, the native repack) or the driver backend (the kernel through cuda-bindings) where it
# takes the plan, and then torch is never imported for a good sidecar (reading a differing layer
# back, a failure's diagnosis, still uses it). Elsewhere (a requantizing plan, no native repack)
# the torch backend runs. Each backend reads the layout backwards itself (``read_back``).


def _plans(
    src: ResolvedSource, check: SchemeCheck, targets: list[dict[str, Any]], passthrough: bool
) -> tuple[Checkpoint, list[Plan]]:
    """A plan per target (of one fusion), from one parse of the shard headers, as a conversion
    to those targets makes them (:func:`mpack.convert.plan.open_and_plan`, the conversion's
    own); two sidecars of one target share its plan."""
    specs = [
        TargetSpec(t["tp_size"], t["profile"], t["act_dtype"], bool(t.get(EXPERT_PARALLEL)))
        for t in targets
    ]
    fuse = targets[0]["fusion"]
    ck, plans, _ = open_and_plan(src.path, check, specs, fuse=fuse, passthrough=passthrough)
    by_name = {dir_name(p.target): p for p in plans}
    return ck, [by_name[dir_name(t)] for t in targets]


def _source_problems(m: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """The source's files against the digests the manifest records of them."""
    recorded = {f["name"]: f for f in m["source"].get("files", [])}
    # what the manifest records is compared: an older one has no probes (mpack/binding.py)
    return [
        f"source {rec['name']}: differs from the file the sidecar was made from"
        for rec in records
        if {k: rec.get(k) for k in recorded[rec["name"]]} != recorded[rec["name"]]
    ]


# --- the pass ---------------------------------------------------------------------------------


class _Comparers:
    """A :class:`SidecarComparer` for every planned file, on digest threads of their own."""

    def __init__(
        self, sidecar: Path, m: dict[str, Any], file_maps: dict[str, FileMap], plan: Plan
    ) -> None:
        self.sidecar, self.m, self.file_maps, self.plan = sidecar, m, file_maps, plan
        self.files: dict[str, SidecarComparer] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Comparers:
        records = {f["name"]: f for f in self.m["files"]}
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(iokit.pool("verify-digest", iokit.DIGEST_WORKERS))
            ordered = stack.enter_context(iokit.pool("verify-digest-ordered", 1))
            for name, planned in self.plan.files.items():
                c = SidecarComparer(
                    self.sidecar / name,
                    planned,
                    self.file_maps[name],
                    records[name],
                    pool=pool,
                    ordered=ordered,
                )
                self.files[name] = c
                stack.callback(c.close)
            self._stack = stack.pop_all()
        return self

    def finish(self, m: dict[str, Any]) -> list[str]:
        """Every file's digest problems, in the manifest's order."""
        got = {name: c.finish() for name, c in self.files.items()}
        return [p for f in m["files"] for p in got.get(f["name"], [])]

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def _run(
    plans: list[Plan],
    files: list[dict[str, SidecarComparer]],
    backends: list[Backend],
    count: _Counter,
) -> list[_Checker]:
    """Stream every unit, read once, through each target's backend into its ``files``, and the
    pass-through tensors (read once) into every ``common.safetensors`` comparer meanwhile; a
    checker per target holds its layout-backwards checks. ``count`` is told of every byte
    compared and unit done."""
    checkers = [_Checker(b) for b in backends]
    sinks = [
        Sink(plan, fs, b, transform=c)  # type: ignore[arg-type]
        for plan, fs, b, c in zip(plans, files, backends, checkers, strict=True)
    ]
    streamer = Streamer(sinks, count.add_bytes, count.unit_done)
    with iokit.pool("copy", 1) as copier:
        copied = None
        into = [
            (fs[COMMON_NAME], fs[COMMON_NAME].file_map.entries) for fs in files if COMMON_NAME in fs
        ]
        if into:
            copied = copier.submit(
                copy_tensors, plans[0].ckpt.read_into, into, count.add_bytes, Timeline()
            )
        try:
            streamer.run()
        except BaseException:
            if copied is not None:
                copied.cancel()
            raise
        if copied is not None:
            copied.result()
    for c in checkers:
        c.settle()
    return checkers


class _Counter:
    """Feeds ``progress`` (None: nobody listens) as a conversion's counter does: bytes compared,
    from the streamer's and the copier's threads, and units done."""

    def __init__(self, progress: Callable[[str, int, int], None] | None, plans: list[Plan]) -> None:
        self.progress, self.units = progress, len(plans[0].units)
        # the tensors' bytes, which are what is counted (a file's header and padding are not)
        self.total = sum(e.nbytes for p in plans for fm in p.files.values() for e in fm.entries)
        self.done = 0
        self._lock = threading.Lock()

    def add_bytes(self, n: int) -> None:
        if self.progress is not None:
            with self._lock:
                self.done += n
                self.progress("bytes", self.done, self.total)

    def unit_done(self, i: int) -> None:
        if self.progress is not None:
            self.progress("layers", i, self.units)


class _Checker:
    """The backend's transform, followed by the layout read backwards on its results before
    they are handed on (:meth:`mpack.convert.backends.Backend.read_back`; queued where the
    backend answers later, read in :meth:`settle`)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._flags: list[tuple[OutLayer, str, Any]] = []
        self.failed: dict[tuple[int, str], list[str]] = {}  # (rank, layer) -> what

    def __call__(self, layer: OutLayer, src: dict[str, Any], act: str) -> list[Any]:
        outs = self.backend.transform(layer, src, act)
        for what, differs in self.backend.read_back(layer, src, outs, act):
            self._flags.append((layer, what, differs))
        return outs

    def settle(self) -> None:
        """Read every queued comparison (after the backend finished them)."""
        self.backend.settle()
        for layer, what, differs in self._flags:
            if bool(differs):
                self.failed.setdefault((layer.rank, layer.name), []).append(what)
        self._flags = []


# --- what differs, for people -----------------------------------------------------------------


def _tensor_problems(
    sidecar: Path,
    plan: Plan,
    files: dict[str, SidecarComparer],
    checker: _Checker,
    file_maps: dict[str, FileMap],
) -> list[str]:
    """Every tensor that differs, per unit and rank, then the pass-through tensors. A layer
    with a differing tensor is read back from the sidecar to say what does not unpack."""
    problems: list[str] = []
    for fname in (n for n in plan.files if n != COMMON_NAME):
        c = files[fname]
        problems += [
            f"{fname}: tensor {t} is missing (the source derives it)"
            for t in c.unmatched
            if t not in {e.name for e in file_maps[fname].entries}
        ]
        problems += [
            f"{fname}: unexpected tensor {t} (the source does not derive it)" for t in c.unplanned
        ]
    back = _read_back(sidecar, plan, files, file_maps)
    for unit in plan.units:
        for layer in unit:
            fname = rank_file_name(layer.rank, plan.tp)
            c, found = files[fname], {e.name for e in file_maps[fname].entries}
            for spec in layer.file_specs(plan.act_dtype):  # a stacked tensor once
                if spec.name in c.differs or (spec.name in c.unmatched and spec.name in found):
                    problems.append(
                        f"{fname}: {spec.name} differs from the tensor re-derived from the source"
                    )
            whats = checker.failed.get((layer.rank, layer.name), [])
            whats += back.get((layer.rank, layer.name, layer.stack), [])
            problems += [f"{fname}: {w}" for w in dict.fromkeys(whats)]
    if COMMON_NAME in files:
        c = files[COMMON_NAME]
        found = {e.name for e in file_maps[COMMON_NAME].entries}
        if found != {e.name for e in c.file_map.entries}:
            problems.append(
                f"{COMMON_NAME}: tensor names differ from the source's pass-through tensors"
            )
        bad = set(c.differs) | {t for t in c.unmatched if t in found}
        problems += [f"{COMMON_NAME}: {t} differs from the source bytes" for t in sorted(bad)]
    return problems


def _read_back(
    sidecar: Path, plan: Plan, files: dict[str, SidecarComparer], file_maps: dict[str, FileMap]
) -> dict[tuple[int, str, Stack | None], list[str]]:
    """The layout read backwards on the sidecar's own bytes, for the layers whose bytes differ
    from the re-derived ones (on the CPU with torch: a failure's diagnosis, not the fast path)."""
    out: dict[tuple[int, str, Stack | None], list[str]] = {}  # per rank, layer (and expert)
    for unit in plan.units:
        bad = [ly for ly in unit if _differing(ly, plan, files)]
        if not bad:
            continue
        from mpack.convert.backends.torch import backwards, fuse, read_unit

        data = read_unit(plan.ckpt, unit)
        for layer in bad:
            fname = rank_file_name(layer.rank, plan.tp)
            with open_regular_file(sidecar / fname, buffering=0) as f:
                got = [
                    _read(f, file_maps[fname], s.name, layer)
                    for s in layer.tensor_specs(plan.act_dtype)
                ]
            fused = fuse(layer, data)
            out[(layer.rank, layer.name, layer.stack)] = [
                what
                for what, differs in backwards(layer, fused, got, plan.act_dtype, None)
                if differs
            ]
    return out


def _differing(layer: OutLayer, plan: Plan, files: dict[str, SidecarComparer]) -> bool:
    """Some tensor of ``layer`` differs, and every one is in the sidecar as planned."""
    c = files[rank_file_name(layer.rank, plan.tp)]
    names = [s.name for s in layer.tensor_specs(plan.act_dtype)]
    return any(n in c.differs for n in names) and not any(n in c.unmatched for n in names)


def _read(f: BinaryIO, file_map: FileMap, name: str, layer: OutLayer) -> torch.Tensor:
    """``layer``'s part of tensor ``name`` of the sidecar file ``f`` (all of it, or an expert's
    slice of a stacked one), read into a new CPU tensor (a single ``pread`` returns at most
    2 GiB: :func:`mpack.iokit.pread_pieces` reads it whole)."""
    import torch

    e = file_map.entry(name)
    offset, nbytes = layer.slot(e.offset, e.nbytes)
    out = torch.empty(nbytes, dtype=torch.uint8)  # every byte is read below
    short = pread_pieces(f.fileno(), [(memoryview(out.numpy()), offset)])
    if short is not None:
        raise CorruptFileError(f"tensor {name!r} of a sidecar file is truncated at byte {short}")
    shape = e.shape[1:] if layer.stack is not None else e.shape
    return out.view(torch_dtype(e.dtype)).reshape(shape)
