"""``mpack verify``: its one entry point, :func:`verify`, and its result, :class:`Verification`.

Three checks, each one stricter, and a fourth on request:

1. every file's size and sha256 against the manifest (:func:`mpack.sidecar.check_files`), every
   safetensors header parses, and the tensor names and shapes are exactly the ones the
   manifest's layer table implies;
2. with the source checkpoint (given; else the one the manifest records, if it is here:
   :func:`mpack.verify.rederive.find_source`), every Marlin tensor re-derived and compared byte
   for byte, and the pass-through tensors compared with their source bytes, on the GPU when
   there is one (``rederive_device``). When no source is found, ``source_note`` says why and
   how to get one, and the sidecar passes on its checksums alone, unless ``require_source``
   (``verify --require-source``, for CI) makes that an error;
3. the layout read backwards: each weight, scale and bias unpacks to the source's values;
4. with ``forward``: token ids run through a model built from the sidecar and through
   transformers on the source, greedy tokens and logits compared (:mod:`mpack.verify.forward`).

Checks 2 to 4 run only when the ones before found nothing. With a source, the safetensors files'
digests of check 1 are computed by check 2 from the same reads (Note [one pass over the sidecar]
in :mod:`mpack.verify.compare`): each of their bytes is read once. A digest that differs is then
reported as check 1 reports it, and what check 2 found is dropped, as if it had not run. This
module imports no torch: the re-derivation and the forward check load it when they run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.errors import (
    MAX_LISTED,
    MpackError,
    SourceNotFoundError,
    UsageError,
    VerificationError,
    arg,
    listed,
    shown,
)
from mpack.sidecar import (
    FileMap,
    load_manifest,
    regenerate_hint,
    regenerate_hint_of,
    safetensors_files,
    sidecar_problems,
)

if TYPE_CHECKING:
    from mpack.convert.timeline import Timeline

__all__ = [
    "MAX_LISTED",
    "Progress",
    "Verification",
    "check_arguments",
    "targets_error",
    "verify",
    "verify_targets",
]

#: ``progress(stage, done, total)``, as a conversion's (:data:`mpack.convert.pipeline.Progress`):
#: ``"files"`` (bytes of the checksums of check 1), ``"bytes"`` (bytes of the sidecar compared
#: with the re-derived ones), ``"layers"`` (units re-derived); called from worker threads.
Progress = Callable[[str, int, int], None]


@dataclass
class Verification:
    """What :func:`verify` checked, and every problem it found (none: the sidecar is sound): the
    result of :func:`verify` and of :func:`mpack.convert.verify`, as a ``ConvertResult`` is of a
    conversion. ``digest`` is the manifest digest (``manifest_digest`` in :meth:`report` and
    ``--json``, as everywhere); ``ok`` says whether it passed."""

    sidecar: str
    digest: str  # the manifest digest
    files_checked: int
    source_checked: bool = False
    layers_checked: int = 0  # packed layers re-derived, once per rank
    tensors_compared: int = 0
    source_note: str | None = None  # why the source was not checked, for people
    source: str | None = None  # the source re-derived from, as people name it
    source_path: str | None = None  # its local directory
    rederive_device: str | None = None  # where the re-derivation ran (cpu, cuda:0, ...)
    forward: dict[str, Any] | None = None  # :func:`mpack.verify.forward.forward_check`'s report
    problems: list[str] = field(default_factory=list)  # file and re-derivation mismatches
    hint: str | None = None  # with problems: the command that regenerates the sidecar
    #: seconds per phase (``files``, ``plan``, ``open_gpu`` or ``import_torch`` where the
    #: re-derivation needs them, ``pass``, ...; ``total``), for profiling: not part of
    #: :meth:`report` (two runs' reports are equal), ``--json`` prints it
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No problem, and the model outputs match where they were compared."""
        return not self.problems and (self.forward is None or bool(self.forward["ok"]))

    def report(self) -> dict[str, Any]:
        """The facts ``mpack verify --json`` prints (besides ``ok`` and ``seconds``): ``source``,
        ``source_path`` and ``rederive_device`` when the source was checked, ``forward`` when it
        ran. The manifest digest is ``manifest_digest``, its name in every command's JSON."""
        keys = [
            "sidecar",
            "files_checked",
            "source_checked",
            "layers_checked",
            "tensors_compared",
            "source_note",
        ]
        if self.source_checked:
            keys += ["source", "source_path", "rederive_device"]
        if self.forward is not None:
            keys.append("forward")
        return {"manifest_digest": self.digest} | {k: getattr(self, k) for k in keys}

    def error(self) -> VerificationError | None:
        """The error this result stands for: every problem listed, else model outputs that
        differ; None when :attr:`ok`."""
        if self.problems:
            # each problem quotes its names already (Note [quoting untrusted text]); listed()
            # also escapes and caps a line that did not, whoever wrote it
            return VerificationError(
                f"{self.sidecar}: {len(self.problems)} problem(s):{listed(self.problems)}",
                hint=self.hint,
            )
        if not self.ok:
            return VerificationError(
                f"{self.sidecar}: model outputs from the sidecar differ from the reference "
                "beyond the tolerance",
                hint="see the table above; docs/EQUIVALENCE.md explains the tolerance",
            )
        return None

    def raise_for_failure(self) -> None:
        """Raise :meth:`error`, if there is one."""
        err = self.error()
        if err is not None:
            raise err


def verify(
    sidecar: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    revision: str | None = None,
    forward: bool = False,
    device: str | None = None,
    rederive_device: str = "auto",
    require_source: bool = False,
    rederive_backend: str = "auto",
    progress: Progress | None = None,
) -> Verification:
    """Verify ``sidecar``: checksums, re-derivation from its source, and optionally the model
    outputs (see the module docstring).

    Args:
        source: the checkpoint to re-derive from, a directory or a Hub repo id; default: the one
            the manifest records, if it is here (never downloaded).
        revision: with a Hub repo id as ``source``, the commit, branch or tag; default: the
            commit the manifest records (for a Hub-sourced sidecar), else ``main``.
        forward: also compare the model outputs (needs the source checkpoint).
        device: where the forward check runs: ``cpu`` (the default), ``cuda`` or ``cuda:N``;
            given without ``forward``, refused (it would do nothing; the re-derivation's is
            ``rederive_device``).
        rederive_device: where the re-derivation (checks 2 and 3) transforms the source:
            ``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; the
            result is the same on each.
        require_source: fail when the source is not found (given or recorded), instead of
            passing on the checksums alone (``--require-source``, for CI).
        rederive_backend: ``auto`` (as a conversion picks) or the backend to re-derive on
            (:data:`mpack.convert.backends.BACKENDS`); the result is the same on each.
        progress: called as the work goes (:data:`Progress`), as a conversion's progress is.

    Returns:
        A :class:`Verification`; its ``problems`` list every mismatch found (call
        :meth:`Verification.raise_for_failure` to turn them into a ``VerificationError``).

    Raises:
        MpackError: no readable manifest; a given source that cannot be resolved, that lacks a
            file the manifest records (``SourceNotFoundError``), or that ``mpack convert`` would
            refuse; a ``rederive_device`` that is not here; ``device`` without ``forward``
            (``UsageError``); with ``forward``, a device that is not here (before any other
            work) or no source found (``UsageError``).
        SourceNotFoundError: with ``require_source``, no source found (the files are sound;
            damaged files are returned as problems, as without it).
    """
    return verify_targets(
        [sidecar],
        source=source,
        revision=revision,
        forward=forward,
        device=device,
        rederive_device=rederive_device,
        require_source=require_source,
        rederive_backend=rederive_backend,
        progress=progress,
    )[0]


def verify_targets(
    sidecars: Sequence[str | os.PathLike],
    *,
    source: str | os.PathLike | None = None,
    revision: str | None = None,
    forward: bool = False,
    device: str | None = None,
    rederive_device: str = "auto",
    require_source: bool = False,
    rederive_backend: str = "auto",
    progress: Progress | None = None,
) -> list[Verification]:
    """:func:`verify` of each of ``sidecars`` (the targets of a directory of sidecars: Note
    [target layout] in mpack/target_dirs.py), reading the source once for all of them (Note
    [verify many targets] in :mod:`mpack.verify.rederive`); a :class:`Verification` each, in
    order. Arguments and errors as :func:`verify`'s; ``progress`` counts every target's bytes;
    each result's ``seconds`` are the run's, shared.
    """
    check_arguments(source, revision, forward, device)
    forward_device = (device or "cpu") if forward else None
    _check_devices(forward_device, rederive_device)
    from mpack.convert.timeline import Timeline

    tl = Timeline()
    items = []
    with tl.span("main", "files"):
        for sidecar in sidecars:
            path = Path(sidecar)
            m, digest = load_manifest(path)
            problems, file_maps = _check_files(path, m, streamed=True)
            result = Verification(str(path), digest, len(m["files"]), problems=problems)
            items.append(_Item(result, path, m, file_maps))
    src = None if source is None else str(source)
    _check_sources(items, src, revision, rederive_device, tl, rederive_backend, progress)
    for it in items:
        _conclude(it.result, it.path, it.m, require_source, forward_device, tl)
    seconds = {what.replace("-", "_"): b - a for _, what, a, b in tl.spans()}
    seconds["total"] = tl.elapsed()
    for it in items:
        it.result.seconds = dict(seconds)
    return [it.result for it in items]


def targets_error(root: str | os.PathLike, results: list[Verification]) -> VerificationError | None:
    """The error of :func:`verify_targets`'s ``results`` (the targets of the directory
    ``root``): each failed target's :meth:`Verification.error`, one after another, and their
    hints; None when every one is :attr:`~Verification.ok`."""
    errors = [e for e in (r.error() for r in results) if e is not None]
    if not errors:
        return None
    hints = list(dict.fromkeys(e.hint for e in errors if e.hint))
    return VerificationError(
        f"{root}: {len(errors)} of {len(results)} target(s) failed:\n"
        + "\n".join(e.message for e in errors),
        hint="; ".join(hints) or None,
    )


@dataclass
class _Item:
    """One sidecar being verified: its result so far, path, manifest and file maps."""

    result: Verification
    path: Path
    m: dict[str, Any]
    file_maps: dict[str, FileMap]


def check_arguments(
    source: str | os.PathLike | None, revision: str | None, forward: bool, device: str | None
) -> None:
    """Refuse arguments that contradict each other, before any work, with the fix (in the
    caller's words: Note [API wording] in mpack/errors.py)."""
    if revision is not None and source is None:
        raise UsageError(
            f"{arg('revision', revision)} applies to a given source; pass {arg('source')} too"
        )
    if device is not None and not forward:
        raise UsageError(
            f"{arg('device', device)} is where the forward check runs, and without "
            f"{arg('forward', True)} there is none: it would be ignored",
            hint=f"add {arg('forward', True)} to compare the model outputs on {device}, or use "
            f"{arg('rederive_device', device)} to re-derive the tensors there",
        )


def _check_devices(forward_device: str | None, rederive_device: str) -> None:
    """Refuse, before any work, a device that is not here (a typo, or a GPU where there is
    none): the forward check's (None: no forward check), then the re-derivation's."""
    if forward_device is not None:
        from mpack.runtime.protocol import checked_device

        checked_device(forward_device)  # fails now, not after the re-derivation
    from mpack.convert.backends import check_device_here

    check_device_here(rederive_device, "rederive_device")


def _conclude(
    result: Verification,
    path: Path,
    m: dict[str, Any],
    require_source: bool,
    forward_device: str | None,
    tl: Timeline,
) -> None:
    """After checks 1 to 3: a sidecar with problems gets its hint; else one whose source was not
    checked fails ``require_source``; else check 4 runs on ``forward_device`` (None: not asked
    for)."""
    if result.problems:
        result.hint = result.hint or regenerate_hint_of(m, path)
    elif require_source and not result.source_checked:
        required = arg("require_source", True)
        raise SourceNotFoundError(
            f"{path}: {required}: source not checked: {result.source_note}",
            hint=f"pass {arg('source', 'DIR')} (the checkpoint directory or Hub repo id it was "
            f"converted from), or leave out {required} to accept the checksums alone",
        )
    elif forward_device is not None:
        _check_forward(result, path, forward_device, tl)


def _check_forward(result: Verification, path: Path, device: str, tl: Timeline) -> None:
    """Check 4, the model outputs on ``device``, into ``result.forward``; it needs the source
    that checks 2 and 3 found."""
    if not result.source_checked:
        raise UsageError(
            f"{arg('forward', True)} needs the source checkpoint: pass {arg('source', 'DIR')}"
        )
    from mpack.verify.forward import forward_check

    with tl.span("main", "forward"):
        result.forward = forward_check(path, result.source_path, device=device)


def _check_files(
    sidecar: Path, m: dict[str, Any], *, streamed: bool = False, progress: Progress | None = None
) -> tuple[list[str], dict[str, FileMap]]:
    """Checks 1 (:func:`mpack.sidecar.sidecar_problems`). ``streamed``: leave the digests of the
    safetensors files to the re-derivation (:func:`mpack.verify.rederive.rederive`), which reads
    them anyway. ``progress`` gets ``("files", bytes checked, bytes to check)`` after each file
    (not when ``streamed``: the files hashed here are then the small ones)."""
    names = safetensors_files(m) if streamed else ()
    counted = None
    if progress is not None and not streamed:
        total, done = sum(f["size"] for f in m["files"]), [0]

        def counted(n: int) -> None:
            done[0] += n
            progress("files", done[0], total)

    return sidecar_problems(sidecar, m, hashed_elsewhere=names, progress=counted)


def _check_sources(
    items: list[_Item],
    source: str | None,
    revision: str | None,
    device: str,
    tl: Timeline,
    backend: str = "auto",
    progress: Progress | None = None,
) -> None:
    """Checks 2 and 3 of each item, when its source is found and checks 1 found nothing; else
    checks 1 done whole (``problems`` from :func:`_check_files` without the safetensors
    digests). Items of one source and :func:`~mpack.verify.rederive.group_key` are re-derived
    from one read of it (Note [verify many targets]). A source whose files are not those the
    manifest records is reported as that, with a hint about the source (:func:`_other_source`),
    not about the sidecar."""
    from mpack.verify.rederive import find_source, group_key

    groups: dict[tuple[str, ...], tuple[Any, list[_Item]]] = {}
    given: dict[Any, Any] = {}  # a given source, resolved once per revision the targets imply
    for it in items:
        rec = it.m["source"]
        if source is None:
            src, it.result.source_note = find_source(source, revision, it.m, sidecar=it.path)
        else:
            key = rec.get("revision") if rec.get("kind") == "hub" else None
            if key not in given:
                given[key] = find_source(source, revision, it.m, sidecar=it.path)
            src, it.result.source_note = given[key]
        if src is None or it.result.problems:
            it.result.problems = _check_files(it.path, it.m, progress=progress)[0]
            continue
        key = (str(src.path), *group_key(it.m, it.file_maps))
        groups.setdefault(key, (src, []))[1].append(it)
    for src, group in groups.values():
        _rederive_group(group, src, device, tl, backend, progress)


def _rederive_group(
    group: list[_Item],
    src: Any,
    device: str,
    tl: Timeline,
    backend: str,
    progress: Progress | None,
) -> None:
    """Checks 2 and 3 of ``group`` from one read of ``src``. Where the re-derivation fails, a
    damaged sidecar is reported as such, whatever its source, and the others are re-derived
    again without it; a failure with no damaged sidecar is raised."""
    from mpack.verify.rederive import rederive_many

    try:
        sidecars = [(it.path, it.m, it.file_maps) for it in group]
        gots = rederive_many(sidecars, src, device, tl, backend, progress=progress)
    except MpackError:
        damaged = [it for it in group if _damaged(it)]
        if not damaged:
            raise
        rest = [it for it in group if it not in damaged]
        if rest:
            _rederive_group(rest, src, device, tl, backend, progress)
        return
    for it, got in zip(group, gots, strict=True):
        _apply(it.result, it.path, it.m, src, got)


def _damaged(it: _Item) -> bool:
    """Checks 1 done whole find problems in ``it``: they become its result's."""
    full = _check_files(it.path, it.m)[0]
    if full:
        it.result.problems = full
    return bool(full)


def _apply(result: Verification, sidecar: Path, m: dict[str, Any], src: Any, got: Any) -> None:
    """A re-derivation's findings (:class:`mpack.verify.rederive.Rederived`) into ``result``."""
    if got.file_problems:
        result.problems = got.file_problems
        return
    if got.source_problems:
        result.problems, result.hint = _other_source(sidecar, m, src, got)
        return
    result.problems = got.problems
    result.layers_checked, result.tensors_compared = got.layers, got.tensors
    result.source_checked, result.source, result.source_path = True, src.display, str(src.path)
    result.rederive_device = got.device


def _other_source(sidecar: Path, m: dict[str, Any], src: Any, got: Any) -> tuple[list[str], str]:
    """The problems and hint of a source whose files differ from those the manifest records:
    the sidecar was made from another checkpoint (or another version of this one). What the
    tensors then do is beside the point: they are counted, not listed. The hint is about the
    source argument first; converting again is for when this checkpoint is the one wanted."""
    problems = list(got.source_problems)
    if got.problems:
        problems.append(
            f"{len(got.problems)} tensor problem(s) follow from that (not listed): "
            "a sidecar matches only the checkpoint it was made from"
        )
    rec = m["source"]
    recorded = rec.get("repo") if rec.get("kind") == "hub" else rec.get("path")
    made_from = f" ({shown(recorded, 4096)})" if isinstance(recorded, str) and recorded else ""
    if src.kind == "hub" and src.repo:
        again = f"{src.repo} --revision {src.revision}" if src.revision else src.repo
    else:
        again = str(src.path)
    return problems, (
        f"{arg('source', shown(src.display, 4096))} is not the checkpoint {sidecar} was made "
        f"from{made_from}: pass that one as {arg('source')}; or, to make the sidecar from this "
        f"checkpoint instead: {regenerate_hint(shown(again, 4096), sidecar)}"
    )
