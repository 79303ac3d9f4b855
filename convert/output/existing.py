"""What OUT holds already: nothing, this very sidecar (up to date), another sidecar (and how
it differs, for the message), or files that are not a sidecar; and whether a run may write there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpack.convert.output.lock import _DIR_FLAGS, _entries
from mpack.convert.source import ResolvedSource, provenance, record_forms
from mpack.convert.timeline import Timeline
from mpack.errors import InputError, OutputExistsError, arg, shown
from mpack.sidecar import COMMON_NAME, MANIFEST_NAME, load_manifest

#: ``files(forms=None)``: the source's file records (:func:`existing_state`)
SourceRecords = Callable[..., list[dict[str, Any]]]


#: target keys compared, in the order differences are listed (then any others)
TARGET_KEYS = ("tp_size", "profile", "act_dtype", "fusion", "engine_version", "engine", "kernel")
MAX_LISTED_DIFFS = 3


@dataclass
class Existing:
    """What ``-o`` holds already (:func:`existing_state`)."""

    state: str  # absent | empty | same (this sidecar, intact) | other-sidecar | foreign
    loaded: tuple[dict[str, Any], str] | None = None  # its manifest and digest, when readable
    differences: list[str] = field(default_factory=list)  # other-sidecar: how, for people


def existing_state(
    out: Path,
    target: dict[str, Any],
    files: SourceRecords | None,
    common: bool,
    src: ResolvedSource,
) -> Existing:
    """What ``out`` holds: ``absent`` | ``empty`` | ``same`` (this sidecar, intact) |
    ``other-sidecar`` | ``foreign``, with the existing manifest and digest when they could be
    loaded, and for ``other-sidecar`` what differs from the planned one
    (:func:`sidecar_differences`).

    ``files(forms=None)`` gives the source's file records (it may wait for their hashes; ``forms``
    as in :func:`mpack.convert.source.hash_sources`); None: the caller replaces any sidecar
    anyway (``--force``), so an mpack sidecar is reported as ``other-sidecar`` without hashing
    the source (or listing differences). ``src``: the source, whose manifest record is compared.
    """
    if not out.exists():
        return Existing("absent")
    if out.is_dir() and not any(out.iterdir()):
        return Existing("empty")
    if not (out / MANIFEST_NAME).is_file():
        return Existing("foreign")
    try:
        loaded = load_manifest(out)
    except InputError as e:
        return Existing("other-sidecar", None, [f"its {MANIFEST_NAME} cannot be used: {e}"])
    m = loaded[0]
    if files is None:
        return Existing("other-sidecar", loaded)
    has_common = any(f["name"] == COMMON_NAME for f in m["files"])
    recorded = m["source"].get("files")
    now = files()
    if recorded != now and isinstance(recorded, list):
        forms = record_forms(recorded)
        if forms != record_forms(now):
            now = files(forms)  # written by an mpack that recorded other digests
    same = m["target"] == target and has_common == common and recorded == now
    broken = [
        f["name"]
        for f in m["files"]
        if not ((out / f["name"]).is_file() and (out / f["name"]).stat().st_size == f["size"])
    ]
    if same and not broken:
        return Existing("same", loaded)
    diffs = sidecar_differences(m, target, common, provenance(src, now))
    diffs += [f"its {n} is missing or has the wrong size" for n in broken[:MAX_LISTED_DIFFS]]
    return Existing("other-sidecar", loaded, diffs)


def sidecar_differences(
    m: dict[str, Any], target: dict[str, Any], common: bool, source: dict[str, Any]
) -> list[str]:
    """How the sidecar of manifest ``m`` differs from the one planned (``target``, whether it
    has ``common.safetensors``, the planned manifest's ``source``), one ``what old -> new``
    phrase per difference: target keys, pass-through, source repo / path / revision, and which
    source files changed, appeared or went away."""
    diffs = []
    old_t = m.get("target") or {}
    for k in [*TARGET_KEYS, *sorted((set(old_t) | set(target)) - set(TARGET_KEYS))]:
        if old_t.get(k) != target.get(k):
            diffs.append(f"{k} {_short(old_t.get(k))} -> {_short(target.get(k))}")
    had_common = any(f.get("name") == COMMON_NAME for f in m.get("files") or [])
    if had_common != common:
        yes = {True: f"with {COMMON_NAME}", False: f"without {COMMON_NAME}"}
        diffs.append(f"pass-through {yes[had_common]} -> {yes[common]}")
    old_s = m.get("source") if isinstance(m.get("source"), dict) else {}
    if old_s.get("kind") != source.get("kind"):
        diffs.append(f"source {_origin(old_s)} -> {_origin(source)}")
    else:
        for k, n in (("repo", 200), ("path", 4096), ("revision", 12)):
            if old_s.get(k) != source.get(k):
                diffs.append(f"source {k} {_short(old_s.get(k), n)} -> {_short(source.get(k), n)}")
    diffs += _file_differences(old_s.get("files"), source.get("files"))
    return diffs


def _file_differences(old: Any, new: Any) -> list[str]:
    """``source file X changed`` (``added``, ``removed``) for the first few, then a count."""
    if not isinstance(new, list):
        return []
    if not isinstance(old, list):
        return ["source files not recorded -> recorded"]
    a = {r.get("name"): r for r in old if isinstance(r, dict)}
    b = {r["name"]: r for r in new}
    changed = [
        f"source file {_short(n, 200)} {what}"
        for n, what in sorted(
            [(n, "changed") for n in a.keys() & b.keys() if a[n] != b[n]]
            + [(n, "added") for n in b.keys() - a.keys()]
            + [(n, "removed") for n in a.keys() - b.keys()],
            key=lambda x: str(x[0]),
        )
    ]
    if len(changed) > MAX_LISTED_DIFFS:
        more = len(changed) - MAX_LISTED_DIFFS
        changed = changed[:MAX_LISTED_DIFFS] + [f"{more} more source file(s) differ"]
    return changed


def _origin(s: dict[str, Any]) -> str:
    if s.get("kind") == "hub":
        return f"{_short(s.get('repo'), 200)}@{_short(s.get('revision'), 12)}"
    return f"{_short(s.get('kind'))} {_short(s.get('path'), 4096)}"


def _short(v: Any, n: int = 40) -> str:
    """A manifest value for a message: ``none`` for a missing one, cut to ``n`` characters."""
    return "none" if v is None else str(v)[:n]


def _current(
    out: Path,
    target: dict[str, Any],
    common: bool,
    src: ResolvedSource,
    files: SourceRecords | None,
    tl: Timeline,
) -> tuple[dict[str, Any], str] | None:
    """The manifest and digest of ``out`` when it holds this sidecar; None when it may be
    written (absent, empty, or a sidecar to replace: ``files`` None)."""
    if not out.exists():
        return None
    with tl.span("main", "hash-sources"):
        there = existing_state(out, target, files, common=common, src=src)
    if there.state == "same" and there.loaded is not None:  # "same" only with ``files``
        return there.loaded
    if there.state == "foreign":
        raise OutputExistsError(
            f"{out} already holds files that are not an mpack sidecar",
            hint=f"choose another {arg('out')} directory, or remove it yourself (mpack does not "
            "delete what it did not write)",
        )
    if there.state == "other-sidecar" and files is not None:
        how = f" ({', '.join(there.differences)})" if there.differences else ""
        raise OutputExistsError(
            f"{out} already holds a different sidecar{how}",
            hint=f"pass {arg('force', True)} to replace it, or choose another {arg('out')} "
            "directory",
        )
    if there.state == "other-sidecar":  # --force: only a sidecar, nothing else of anyone's
        why = _not_a_sidecar(out)
        if why is not None:
            raise OutputExistsError(f"{out} is not only an mpack sidecar: {why}", hint=keep_hint())
    return None


def keep_hint() -> str:
    """The hint where ``force`` meets more than an mpack sidecar."""
    return (
        f"{arg('force', True)} replaces only an mpack sidecar; move the other files away, or "
        f"choose another {arg('out')} directory (mpack does not delete what it did not write)"
    )


def _not_a_sidecar(d: Path | int) -> str | None:
    """Why the directory ``d`` (a path, or open at a descriptor) is not an mpack sidecar that
    ``--force`` may replace (Note [what the swap replaces] in swap.py); None when it is one."""
    if isinstance(d, Path):
        try:
            fd = os.open(d, _DIR_FLAGS)
        except OSError as e:
            return f"it cannot be opened as a directory ({e.strerror})"
        try:
            return _not_a_sidecar(fd)
        finally:
            os.close(fd)
    files, rest = _entries(d)
    if rest:
        listed = ", ".join(shown(n, 80) for n in rest[:MAX_LISTED_DIFFS])
        more = f" and {len(rest) - MAX_LISTED_DIFFS} more" if len(rest) > MAX_LISTED_DIFFS else ""
        return f"it holds {listed}{more}, which no sidecar has"
    if MANIFEST_NAME not in files:
        return f"it has no {MANIFEST_NAME}"
    return None
