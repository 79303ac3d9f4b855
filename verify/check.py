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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.errors import (
    MAX_LISTED,
    MpackError,
    SourceNotFoundError,
    UsageError,
    VerificationError,
    listed,
)
from mpack.sidecar import (
    FileMap,
    load_manifest,
    regenerate_hint_of,
    safetensors_files,
    sidecar_problems,
)

if TYPE_CHECKING:
    from mpack.convert.timeline import Timeline

__all__ = ["MAX_LISTED", "Verification", "verify"]


@dataclass
class Verification:
    """What :func:`verify` checked, and every problem it found (none: the sidecar is sound)."""

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
        """The facts ``mpack verify --json`` prints (besides ``ok``): ``source``,
        ``source_path`` and ``rederive_device`` when the source was checked, ``forward`` when it
        ran."""
        keys = [
            "sidecar",
            "digest",
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
        return {k: getattr(self, k) for k in keys}

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
    device: str = "cpu",
    rederive_device: str = "auto",
    require_source: bool = False,
    rederive_backend: str = "auto",
) -> Verification:
    """Verify ``sidecar``: checksums, re-derivation from its source, and optionally the model
    outputs (see the module docstring).

    Args:
        source: the checkpoint to re-derive from, a directory or a Hub repo id; default: the one
            the manifest records, if it is here (never downloaded).
        revision: with a Hub repo id as ``source``, the commit, branch or tag; default: the
            commit the manifest records (for a Hub-sourced sidecar), else ``main``.
        forward: also compare the model outputs (needs the source checkpoint).
        device: where the forward check runs: ``cpu``, ``cuda`` or ``cuda:N``.
        rederive_device: where the re-derivation (checks 2 and 3) transforms the source:
            ``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; the
            result is the same on each.
        require_source: fail when the source is not found (given or recorded), instead of
            passing on the checksums alone (``--require-source``, for CI).
        rederive_backend: ``auto`` (as a conversion picks) or the backend to re-derive on
            (:data:`mpack.convert.backends.BACKENDS`); the result is the same on each.

    Returns:
        A :class:`Verification`; its ``problems`` list every mismatch found (call
        :meth:`Verification.raise_for_failure` to turn them into a ``VerificationError``).

    Raises:
        MpackError: no readable manifest; a given source that cannot be resolved, or that
            ``mpack convert`` would refuse; a ``rederive_device`` that is not here; with
            ``forward``, a device that is not here (before any other work) or no source found
            (``UsageError``).
        SourceNotFoundError: with ``require_source``, no source found (the files are sound;
            damaged files are returned as problems, as without it).
    """
    if revision is not None and source is None:
        raise UsageError(f"revision {revision} applies to a given source; pass source too")
    _check_devices(device if forward else None, rederive_device)
    from mpack.convert.timeline import Timeline

    tl = Timeline()
    path = Path(sidecar)
    with tl.span("main", "files"):
        m, digest = load_manifest(path)
        problems, file_maps = _check_files(path, m, streamed=True)
    result = Verification(str(path), digest, len(m["files"]), problems=problems)
    src = None if source is None else str(source)
    _check_source(result, path, m, file_maps, src, revision, rederive_device, tl, rederive_backend)
    _conclude(result, path, m, require_source, device if forward else None, tl)
    result.seconds = {what.replace("-", "_"): b - a for _, what, a, b in tl.spans()}
    result.seconds["total"] = tl.elapsed()
    return result


def _check_devices(forward_device: str | None, rederive_device: str) -> None:
    """Refuse, before any work, a device that is not here (a typo, or a GPU where there is
    none): the forward check's (None: no forward check), then the re-derivation's."""
    if forward_device is not None:
        from mpack.runtime.protocol import checked_device

        checked_device(forward_device)  # fails now, not after the re-derivation
    from mpack.convert.backends import check_device_here

    check_device_here(rederive_device, "--rederive-device")


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
        result.hint = regenerate_hint_of(m, path)
    elif require_source and not result.source_checked:
        raise SourceNotFoundError(
            f"{path}: --require-source: source not checked: {result.source_note}",
            hint="pass --source DIR (the checkpoint directory or Hub repo id it was converted "
            "from), or leave out --require-source to accept the checksums alone",
        )
    elif forward_device is not None:
        _check_forward(result, path, forward_device, tl)


def _check_forward(result: Verification, path: Path, device: str, tl: Timeline) -> None:
    """Check 4, the model outputs on ``device``, into ``result.forward``; it needs the source
    that checks 2 and 3 found."""
    if not result.source_checked:
        raise UsageError("--forward needs the source checkpoint: pass --source")
    from mpack.verify.forward import forward_check

    with tl.span("main", "forward"):
        result.forward = forward_check(path, result.source_path, device=device)


def _check_files(
    sidecar: Path, m: dict[str, Any], *, streamed: bool = False
) -> tuple[list[str], dict[str, FileMap]]:
    """Checks 1 (:func:`mpack.sidecar.sidecar_problems`). ``streamed``: leave the digests of the
    safetensors files to the re-derivation (:func:`mpack.verify.rederive.rederive`), which reads
    them anyway."""
    names = safetensors_files(m) if streamed else ()
    return sidecar_problems(sidecar, m, hashed_elsewhere=names)


def _check_source(
    result: Verification,
    sidecar: Path,
    m: dict[str, Any],
    file_maps: dict[str, FileMap],
    source: str | None,
    revision: str | None,
    device: str,
    tl: Timeline,
    backend: str = "auto",
) -> None:
    """Checks 2 and 3, when the source is found and checks 1 found nothing; else checks 1 done
    whole (``result.problems`` from :func:`_check_files` without the safetensors digests)."""
    from mpack.verify.rederive import find_source, rederive

    src, result.source_note = find_source(source, revision, m, sidecar=sidecar)
    if src is None or result.problems:
        result.problems = _check_files(sidecar, m)[0]
        return
    try:
        got = rederive(sidecar, m, file_maps, src, device, tl, backend)
    except MpackError:
        full = _check_files(sidecar, m)[0]
        if full:  # a damaged sidecar is reported as such, whatever its source
            result.problems = full
            return
        raise
    if got.file_problems:
        result.problems = got.file_problems
        return
    result.problems = got.problems
    result.layers_checked, result.tensors_compared = got.layers, got.tensors
    result.source_checked, result.source, result.source_path = True, src.display, str(src.path)
    result.rederive_device = got.device
