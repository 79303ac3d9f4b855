"""Where OUT is: ``-o`` made absolute and checked before any work (:func:`output_path`), and
kept apart from the source (:func:`check_apart`); both, for the place of each target's sidecar
(:func:`target_output`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mpack.errors import UsageError, arg, shown
from mpack.sidecar import COMMON_NAME, COPIED_FILES, MANIFEST_NAME, MAX_TP, rank_file_name


# Note [output path]: ``out`` is resolved through symbolic links (``os.path.realpath``) and
# the sidecar is written at the target: ``-o link`` where ``link -> some/dir`` fills
# ``some/dir`` and keeps the link, so the link never turns into a directory and two runs
# through different links to one directory share one lock.
def output_path(out: str | os.PathLike) -> Path:
    """The directory ``-o out`` names, made absolute (symbolic links resolved: Note [output
    path]) and checked before any work.

    Raises:
        UsageError: ``out`` is empty, names the home directory of a user who does not exist
            (``~nosuchuser/x``), holds a name longer than the file system takes or makes a path
            too long for the sidecar's files, is the current directory or one of its ancestors
            (the run would replace it), a mount point, bind mounts included (it cannot be
            renamed into place), or a symbolic link that does not resolve (a loop).
    """
    raw = os.fspath(out)
    if not raw:
        raise UsageError(
            f"{arg('out')} is empty", hint=f"name a new directory, e.g. {arg('out', './sidecar')}"
        )
    try:
        expanded = Path(raw).expanduser()
    except RuntimeError:  # ~user of no such user, or ~ without HOME: pathlib gives up
        raise _no_home(raw) from None
    p = Path(os.path.realpath(expanded))
    _check_lengths(raw, p)  # before the first stat, which would fail with ENAMETOOLONG
    if p.is_symlink():
        raise UsageError(f"{arg('out', raw)}: a symbolic link that does not resolve (a loop?)")
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except FileNotFoundError:  # the current directory was removed: -o is absolute, or fails later
        cwd = None
    if cwd is not None and (p == cwd or p in cwd.parents):
        what = "is the current directory" if p == cwd else "contains the current directory"
        raise UsageError(
            f"{arg('out', raw)} ({p}) {what}; the sidecar would replace it",
            hint=f"name a new directory, e.g. {arg('out', './sidecar')}",
        )
    if is_mount_point(p):
        raise UsageError(
            f"{arg('out', raw)} ({p}) is a mount point, which a finished sidecar cannot be "
            "renamed onto",
            hint=f"use a subdirectory of it, e.g. {arg('out', str(p / 'sidecar'))}",
        )
    return p


def _no_home(raw: str) -> UsageError:
    first = raw.split("/", 1)[0]
    who = f"no user {shown(first[1:])}" if len(first) > 1 else "no home directory (HOME unset)"
    return UsageError(
        f"{arg('out', shown(raw))}: {shown(first)} names a home directory, but there is {who} here",
        hint=f"write the path out in full (./{shown(raw)} names a directory called "
        f"{shown(first)} in the current one)",
    )


#: The longest name of a file in a sidecar or a work directory, and of a work directory.
_LONGEST_FILE = max(
    len(n) for n in (MANIFEST_NAME, COMMON_NAME, *COPIED_FILES, rank_file_name(MAX_TP - 1, MAX_TP))
)
_WORK_NAME = len(".mpack-" + 12 * "0" + ".tmp-" + 8 * "0")


def _check_lengths(raw: str, p: Path) -> None:
    """Refuse an OUT with a name longer than its file system takes (``NAME_MAX``, 255 bytes on
    most), or one whose files, or the work directory's, would have a path longer than
    ``PATH_MAX``: both would fail later as ``ENAMETOOLONG``, after the conversion."""
    base = next(a for a in (p, *p.parents) if os.path.isdir(a))  # "/" at the latest
    name_max = _pathconf(base, "PC_NAME_MAX", 255)
    for part in p.parts[1:]:
        n = len(os.fsencode(part))
        if n > name_max:
            raise UsageError(
                f"{arg('out', shown(raw, 60))}: the name {shown(part, 40)} is {n} bytes long, "
                f"more than the {name_max} a file name may have here",
                hint="choose a shorter name for the output directory",
            )
    path_max = _pathconf(base, "PC_PATH_MAX", 4096)
    longest = (
        len(os.fsencode(p.parent))
        + 1
        + max(len(os.fsencode(p.name)), _WORK_NAME)
        + 1
        + _LONGEST_FILE
    )
    if longest >= path_max:
        raise UsageError(
            f"{arg('out', shown(raw, 60))}: a path of {len(os.fsencode(p))} bytes, too long for "
            f"the sidecar's files in it (a path may have at most {path_max - 1} bytes here)",
            hint="choose a shorter path for the output directory",
        )


def _pathconf(d: Path, name: str, default: int) -> int:
    try:
        got = os.pathconf(d, name)
    except (OSError, ValueError):
        return default
    return got if got > 0 else default


def is_mount_point(p: Path) -> bool:
    """``p`` is a mount point: another file system's root (``os.path.ismount``), or a bind
    mount, of another directory of the same file system too, which only the mount table
    shows (``/proc/self/mountinfo``, where there is one)."""
    return os.path.ismount(p) or os.fsencode(p) in _mount_points()


def _mount_points() -> set[bytes]:
    """Every mount point in this process's mount table, its octal escapes (``\\040`` for a
    space) undone; empty where there is no ``/proc/self/mountinfo``."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:
            points.add(re.sub(rb"\\([0-3][0-7]{2})", lambda m: bytes([int(m[1], 8)]), fields[4]))
    return points


def check_apart(out: Path, source: Path, given: str | os.PathLike | None = None) -> None:
    """Refuse an output inside the source, or a source inside the output (both resolved;
    ``given``: the path as it was named, shown beside ``out`` where the two differ)."""
    src = Path(os.path.realpath(source))
    named = arg("out", str(out)) if given is None or Path(given) == out else f"{given} ({out})"
    if out == src or src in out.parents:
        raise UsageError(
            f"{named} lies inside the source checkpoint {src}; choose another output directory",
            hint="a symbolic link counts where it leads: the sidecar would be written there",
        )
    if out in src.parents:
        raise UsageError(
            f"the source checkpoint {src} lies inside {named}, which the sidecar would replace",
            hint="choose an output directory outside the checkpoint",
        )


def target_output(out: str | os.PathLike, source: Path) -> Path:
    """Where one target's sidecar goes: ``out`` resolved and checked (:func:`output_path`), and
    apart from ``source`` (:func:`check_apart`). The one check of the place of every sidecar a
    run writes: ``-o`` of one target, and each ``OUT/<target>`` of several, which may itself be
    a symbolic link into the source.

    Raises:
        UsageError: as :func:`output_path` and :func:`check_apart`.
    """
    p = output_path(out)
    check_apart(p, source, out)
    return p
