"""Where a sidecar's targets sit in a directory, and how a command takes one of them: the one
owner of "how a target directory is found" (docs/FORMAT.md, "Several targets in one directory").

Note [target layout]: a sidecar is a directory holding ``mpack.json``. ``mpack convert -o OUT``
writes one of two layouts:

* ``OUT`` itself is the sidecar: one target, ``--layout auto`` (the default), where ``OUT`` is
  not already a directory of targets;
* ``OUT/<target>/``, a sidecar per target named by :func:`mpack.target.dir_name`: several
  targets; or ``--layout targets``, whatever the count (a CI job that publishes ``OUT`` keeps
  the same paths, ``OUT/tp1-w8a16-bfloat16/`` and ``org/repo/tp1-w8a16-bfloat16`` on the Hub,
  when it goes from several targets to one or back); or one target into an ``OUT`` that
  already is a directory of targets (:func:`holds_targets`), so that a run with fewer targets
  moves nothing. Targets a run does not make are left as they are (never deleted).

Every reader takes either layout. :func:`target_dirs` lists the sidecars a directory holds (itself,
or its target folders); :func:`choose` takes the one a :class:`Selection` (``--tp``,
``--profile``, ``--act-dtype``, ``--ep``) names, for what needs exactly one (serve, status,
attach, load), and refuses an empty or ambiguous choice listing the targets and the options that
pick one (exit code 2); :func:`matching` gives every one it names (inspect, verify, push);
:func:`find` takes the folder of an exact target (the vLLM loader's, from the engine's
settings). A target is known by its manifest's ``target``, so a renamed folder is still found;
a folder whose ``mpack.json`` is a symbolic link (an HF-cache snapshot) by its name
(:func:`mpack.target.target_of_name`).

This module is core (docs/ARCHITECTURE.md): it reads manifests through :mod:`mpack.sidecar`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack.errors import UsageError, arg, shown
from mpack.sidecar import MANIFEST_NAME, load_manifest, parse_run_name
from mpack.target import (
    ACT_DTYPES,
    EXPERT_PARALLEL,
    LAYOUTS,
    PROFILES,
    check_layout,
    dir_name,
    target_of_name,
)

#: The most targets a message lists; the rest are counted.
LISTED_TARGETS = 12
#: A target's keys a selection can name, as (manifest key, argument name).
_KEYS = (("tp_size", "tp"), ("profile", "profile"), ("act_dtype", "act_dtype"))


def is_sidecar(d: Path) -> bool:
    """``d`` holds an ``mpack.json`` (whether it is a good one is the reader's to say)."""
    return os.path.lexists(d / MANIFEST_NAME)


def target_names(root: Path) -> list[str]:
    """The names of the folders of ``root`` that hold a sidecar, sorted (none when ``root`` is
    itself a sidecar, or no directory); hidden entries (a run's work directories) left out.
    Reads no manifest, so it never fails on one."""
    if is_sidecar(root):
        return []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [
        n for n in names if not n.startswith(".") and (root / n).is_dir() and is_sidecar(root / n)
    ]


def holds_targets(root: Path) -> bool:
    """``root`` is a directory of targets (Note [target layout]): no ``mpack.json`` of its own,
    and a folder holding one, or nothing but what an interrupted ``mpack convert`` of targets
    left in it (lock files and work directories: Note [run names] in mpack/sidecar.py)."""
    if is_sidecar(root) or not root.is_dir():
        return False
    if target_names(root):
        return True
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return bool(names) and all(parse_run_name(n) is not None for n in names)


def uses_target_dirs(out: Path, *, count: int, layout: str) -> bool:
    """Whether a conversion of ``count`` targets (``layout``: :data:`LAYOUTS`) writes
    ``out/<target>/`` (True) or the sidecar at ``out`` itself (Note [target layout])."""
    check_layout(layout)
    return layout == "targets" or count > 1 or holds_targets(out)


@dataclass(frozen=True)
class Selection:
    """Which targets of a directory a command means: each field None for any (``--tp``,
    ``--profile``, ``--act-dtype``, ``--ep``). Falsy when nothing is named.

    Raises:
        UsageError: a TP below 1, or a profile or activation dtype that does not exist.
    """

    tp: int | None = None
    profile: str | None = None
    act_dtype: str | None = None
    ep: bool | None = None

    def __post_init__(self) -> None:
        if self.tp is not None and self.tp < 1:
            raise UsageError(f"{arg('tp', self.tp)}: a TP size is 1 or more")
        for name, value, choices in (
            ("profile", self.profile, PROFILES),
            ("act_dtype", self.act_dtype, ACT_DTYPES),
        ):
            if value is not None and value not in choices:
                raise UsageError(
                    f"{arg(name, value)}: not one of {', '.join(choices)}",
                    hint=f"e.g. {arg(name, next(iter(choices)))}",
                )

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.tp, self.profile, self.act_dtype, self.ep))

    def matches(self, target: Mapping[str, Any]) -> bool:
        """``target`` (a manifest's) is one this selection names."""
        return all(
            getattr(self, a) is None or target.get(k) == getattr(self, a) for k, a in _KEYS
        ) and (self.ep is None or bool(target.get(EXPERT_PARALLEL)) == self.ep)

    def words(self) -> str:
        """The selection as the caller gave it (``--tp 2 --profile w8a16``, or ``tp=2, ...``)."""
        given = [(a, getattr(self, a)) for _, a in _KEYS] + [("ep", self.ep)]
        return " ".join(arg(a, v) for a, v in given if v is not None)

    def exact(self) -> dict[str, Any] | None:
        """The target it names when it names one whole (TP, profile and activation dtype; no
        expert parallelism unless ``ep``; vLLM's fusion), as :func:`mpack.target.dir_name`
        takes it; else None."""
        if self.tp is None or self.profile is None or self.act_dtype is None:
            return None
        t: dict[str, Any] = {
            "tp_size": self.tp,
            "profile": self.profile,
            "act_dtype": self.act_dtype,
            "fusion": "vllm",
        }
        if self.ep:
            t[EXPERT_PARALLEL] = True
        return t


@dataclass(frozen=True)
class TargetDir:
    """One sidecar of a directory (:func:`target_dirs`): its ``name`` there (``""`` for the
    directory itself), ``path``, ``target`` (its manifest's; from the folder's name where the
    manifest is a link), and the ``manifest`` and its ``digest`` where they were read."""

    name: str
    path: Path
    target: Mapping[str, Any]
    manifest: Mapping[str, Any] | None = None
    digest: str | None = None

    @property
    def label(self) -> str:
        """The target's name (:func:`mpack.target.dir_name`), whatever the folder is called."""
        return dir_name(self.target) if self.target else (self.name or self.path.name)


def _target_dir(d: Path, name: str) -> TargetDir:
    if os.path.islink(d / MANIFEST_NAME):  # an HF-cache snapshot: the strict reader opens no link
        return TargetDir(name, d, target_of_name(name or d.name) or {})
    m, digest = load_manifest(d)
    return TargetDir(name, d, m["target"], m, digest)


def target_dirs(root: Path) -> list[TargetDir]:
    """The sidecars ``root`` holds: itself when it is one, else each of its folders that is one,
    by name; none when neither (the reader of ``root`` then says what it is).

    Raises:
        MpackError: a manifest that cannot be read (:func:`mpack.sidecar.load_manifest`).
    """
    root = Path(root)
    if is_sidecar(root):
        return [_target_dir(root, "")]
    return [_target_dir(root / n, n) for n in target_names(root)]


def matching(root: Path, select: Selection = Selection()) -> list[TargetDir]:
    """The sidecars of ``root`` (:func:`target_dirs`) that ``select`` names; every one for an
    empty selection; none when ``root`` holds no sidecar (its reader says why).

    Raises:
        UsageError: ``select`` names none of them (they are listed).
    """
    found = target_dirs(root)
    hits = [t for t in found if not t.target or select.matches(t.target)]
    if found and not hits:
        raise _none_named(Path(root), found, select)
    return hits


def choose(root: Path, select: Selection = Selection()) -> Path:
    """The one sidecar of ``root`` that ``select`` names: ``root`` itself when it is a sidecar
    (refused when ``select`` names another target), else its one target folder that ``select``
    names; ``root`` as it is when it holds no sidecar at all (its reader says why).

    Raises:
        UsageError: ``select`` names no target of ``root``, or several (they are listed, with
            the options, or the folder, that take one).
    """
    root = Path(root)
    if not select and is_sidecar(root):  # the common case: the reader reads the manifest itself
        return root
    hits = matching(root, select)
    if not hits:
        return root
    if len(hits) == 1:
        return hits[0].path
    raise _several(root, hits, select)


def find(root: Path, target: Mapping[str, Any]) -> Path | None:
    """The folder of ``root`` holding the sidecar of exactly ``target`` (a manifest's, or the
    engine's settings as one): ``root/<dir_name(target)>``, else a folder whose manifest has
    that target; None when there is none (or ``root`` is itself a sidecar)."""
    root = Path(root)
    if is_sidecar(root):
        return None
    want = dir_name(target)
    if is_sidecar(root / want):
        return root / want
    for n in target_names(root):
        try:
            if _target_dir(root / n, n).label == want:
                return root / n
        except (OSError, ValueError):  # a manifest that cannot be read is no match
            continue
    return None


def listed_names(found: list[TargetDir]) -> str:
    """``a, b, c`` (at most :data:`LISTED_TARGETS`, then how many more)."""
    names = [shown(t.name or t.label) for t in found[:LISTED_TARGETS]]
    more = len(found) - LISTED_TARGETS
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def picking_words(t: TargetDir, among: list[TargetDir]) -> str:
    """The options that take ``t`` out of ``among``: its value of every key in which they
    differ (``--tp 2 --profile w8a16``); empty when only the folder tells them apart."""
    words = []
    for key, a in _KEYS:
        if len({x.target.get(key) for x in among}) > 1:
            words.append(arg(a, t.target.get(key)))
    if len({bool(x.target.get(EXPERT_PARALLEL)) for x in among}) > 1:
        words.append(arg("ep", bool(t.target.get(EXPERT_PARALLEL))))
    return " ".join(words)


def _none_named(root: Path, found: list[TargetDir], select: Selection) -> UsageError:
    if found[0].name == "":  # root is a sidecar of another target
        return UsageError(
            f"{root} is the sidecar of target {found[0].label}; {select.words()} names another",
            hint=f"leave out {select.words()}, or give a directory that holds that target",
        )
    return UsageError(
        f"{root}: no target matches {select.words()}; it holds {listed_names(found)}",
        hint=f"name one of them, e.g. {picking_words(found[0], found) or found[0].path}",
    )


def _several(root: Path, hits: list[TargetDir], select: Selection) -> UsageError:
    which = f" that {select.words()} names" if select else ""
    words = picking_words(hits[0], hits)  # the keys they differ in: none the selection named
    return UsageError(
        f"{root} holds {len(hits)} targets{which} ({listed_names(hits)}); name one",
        hint=(f"add {words}, or " if words else "")
        + f"give its folder: {hits[0].path} (mpack inspect {root} lists them)",
    )


__all__ = [
    "LAYOUTS",
    "Selection",
    "TargetDir",
    "check_layout",
    "choose",
    "find",
    "holds_targets",
    "is_sidecar",
    "matching",
    "target_dirs",
    "target_names",
    "uses_target_dirs",
]
