"""The output directory of ``convert``: where it is, who writes it, what it holds, and the swap.

A run checks ``-o`` before any work (:func:`output_path`, :func:`check_apart`), holds OUT's
parent directory open and its lock (:func:`output_lock`) from before it reads the source until
OUT is in place, and writes the sidecar through :func:`staged_sidecar`: OUT found up to date
(:func:`existing_state`), or a hidden work directory filled and swapped into place at the end
(:meth:`_WorkDir.swap_into_place`).

Note [atomic output]: nothing named OUT exists until the final rename; a killed run leaves only
a work directory ``.mpack-<key>.tmp-<rand>`` behind (no manifest at OUT), which the next run
removes. ``<key>``: 12 hex digits of the sha256 of OUT's name, so every hidden name has a fixed
length (an OUT name of 255 bytes still fits) and belongs to one OUT.

Note [output lock]: a run holds two ``flock``s. The first is on ``.mpack-<key>.lock`` in OUT's
parent (:class:`mpack.fsutil.LockFile`), from before it reads the source until OUT is in place:
a second run for the same OUT stops at once with ``BusyError``. The second is on its work
directory itself, from ``mkdir`` until the directory is swapped in or removed. The kernel drops
both when their holder dies, whatever its pid namespace, and pids play no part in either.
The lock file alone would do where nobody else can remove it: a parent only we (and root) can
write, or a sticky one (``/tmp``). In a parent others can write (``mkdir -m 777 P``), another
user can delete the lock file under a live run, and a second run then takes a new one. The
work directory's lock still holds there, as it goes with the directory, not with a name:

- a work or old directory of OUT (those named the old way, ``.<OUT>.mpack-tmp-<pid>-<rand>``
  and ``.<OUT>.mpack-old-<pid>-<rand>``, too) is removed only once its lock is ours, so it
  belongs to no live run; one whose lock is held means another run is writing OUT: ``BusyError``;
- a run makes and locks its work directory first, and looks for another live one after: of
  two runs that both got past the lock file, at least one sees the other and stops.

Removing a dead run's directory unlinks only the regular files a sidecar has (its names, not
its contents: :func:`_sidecar_name`) and then the directory if that left it empty; anything else
found there was not written by mpack, and stays. Where a file system cannot ``flock`` a
directory (NFS takes only shared locks on a descriptor opened for reading), the lock file
decides alone, as before.

Note [held parent]: OUT's parent directory is opened once, before the lock, and every name the
run makes there (the lock, the work directory, the swap) is made, renamed and removed through
that descriptor. A parent renamed or removed during the run (``mv P P2``) then fails the run
with ``EnvironmentFailure`` and still leaves nothing behind: the work directory and the lock are
removed from where the parent is now, not from where its old path points. A work directory that
another user renamed within the parent fails the run the same way, and is found by its inode and
removed under its new name.

Note [what the swap replaces]: the final step may replace only what the rules allow at OUT:
nothing, an empty directory, or (``--force``) an mpack sidecar, a directory whose entries are
all regular files with a sidecar's names, ``mpack.json`` among them. Whatever else appeared at
OUT during the run (``mkdir OUT; echo data > OUT/precious.txt``, a file, a link) stays, and the
run fails naming it. The swap is race-free without trusting an earlier look at OUT:

- a plain ``rename(work, OUT)`` replaces nothing or an empty directory and fails on anything
  else, in one step: the kernel checks emptiness, so a file created a moment before is never
  lost. Without ``--force`` that is the whole swap;
- with ``--force`` and a non-empty directory at OUT, that directory is opened and locked, its
  entries checked, and then the two are exchanged in one step (``renameat2(RENAME_EXCHANGE)``,
  so OUT never goes missing). What was swapped out is checked again through the descriptor
  (the same directory as the one opened, and still only a sidecar): if anything changed
  meanwhile, it is exchanged back (OUT held the new sidecar for that moment), and the run
  fails. Only then are its sidecar files unlinked, by name, through the descriptor. A file
  that lands in it after that last check keeps the directory from being removed, under its
  hidden name, where no later run deletes it either. Where the file system cannot exchange,
  OUT is renamed aside first and checked there (OUT is then missing for a moment).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpack.convert.source import ResolvedSource, provenance, record_forms
from mpack.convert.timeline import Timeline
from mpack.errors import (
    ENVIRONMENT_ERRNOS,
    BusyError,
    EnvironmentFailure,
    InputError,
    MpackError,
    OutputExistsError,
    SourceNotFoundError,
    UsageError,
    environment_failure,
    shown,
)
from mpack.fsutil import LockFile, LockHeld, kind_of, os_error
from mpack.sidecar import (
    COMMON_NAME,
    COPIED_FILES,
    MANIFEST_NAME,
    MAX_TP,
    fsync_dir,
    load_manifest,
    rank_file_name,
    write_manifest,
)

#: ``files(forms=None)``: the source's file records (:func:`existing_state`)
SourceRecords = Callable[..., list[dict[str, Any]]]


# --- where OUT is -----------------------------------------------------------------------------


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
        raise UsageError("-o is empty", hint="name a new directory, e.g. -o ./sidecar")
    try:
        expanded = Path(raw).expanduser()
    except RuntimeError:  # ~user of no such user, or ~ without HOME: pathlib gives up
        raise _no_home(raw) from None
    p = Path(os.path.realpath(expanded))
    _check_lengths(raw, p)  # before the first stat, which would fail with ENAMETOOLONG
    if p.is_symlink():
        raise UsageError(f"-o {raw}: a symbolic link that does not resolve (a loop?)")
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except FileNotFoundError:  # the current directory was removed: -o is absolute, or fails later
        cwd = None
    if cwd is not None and (p == cwd or p in cwd.parents):
        what = "is the current directory" if p == cwd else "contains the current directory"
        raise UsageError(
            f"-o {raw} ({p}) {what}; the sidecar would replace it",
            hint="name a new directory, e.g. -o ./sidecar",
        )
    if is_mount_point(p):
        raise UsageError(
            f"-o {raw} ({p}) is a mount point, which a finished sidecar cannot be renamed onto",
            hint=f"use a subdirectory of it, e.g. -o {p / 'sidecar'}",
        )
    return p


def _no_home(raw: str) -> UsageError:
    first = raw.split("/", 1)[0]
    who = f"no user {shown(first[1:])}" if len(first) > 1 else "no home directory (HOME unset)"
    return UsageError(
        f"-o {shown(raw)}: {shown(first)} names a home directory, but there is {who} here",
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
                f"-o {shown(raw, 60)}: the name {shown(part, 40)} is {n} bytes long, more than the "
                f"{name_max} a file name may have here",
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
            f"-o {shown(raw, 60)}: a path of {len(os.fsencode(p))} bytes, too long for the "
            f"sidecar's files in it (a path may have at most {path_max - 1} bytes here)",
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


def check_apart(out: Path, source: Path) -> None:
    """Refuse an output inside the source, or a source inside the output (both resolved)."""
    src = Path(os.path.realpath(source))
    if out == src or src in out.parents:
        raise UsageError(
            f"-o {out} lies inside the source checkpoint {src}; choose another output directory"
        )
    if out in src.parents:
        raise UsageError(
            f"the source checkpoint {src} lies inside -o {out}, which the sidecar would replace",
            hint="choose an output directory outside the checkpoint",
        )


# --- the lock, the held parent, and what dead runs left ---------------------------------------


def _key(out: Path) -> str:
    """12 hex digits naming ``out``'s lock and work directories (Note [atomic output])."""
    return hashlib.sha256(os.fsencode(out.name)).hexdigest()[:12]


def lock_path(out: Path) -> Path:
    """The lock file of a run writing ``out`` (Note [output lock])."""
    return out.parent / f".mpack-{_key(out)}.lock"


def _work_path(out: Path, kind: str) -> Path:
    """A new work (``tmp``) or old-sidecar (``old``) directory name for ``out``."""
    return out.parent / f".mpack-{_key(out)}.{kind}-{uuid.uuid4().hex[:8]}"


def _work_names(out: Path, names: list[str]) -> list[str]:
    """Those of ``names`` that name a work or old-sidecar directory of ``out``, new and old
    naming, sorted."""
    ours = re.compile(
        rf"\.mpack-{_key(out)}\.(tmp|old)-[0-9a-f]{{8}}"  # this mpack's names
        rf"|\.{re.escape(out.name)}\.mpack-(tmp|old)-\d+-[0-9a-f]{{8}}"  # older mpacks'
    )
    return sorted(n for n in names if ours.fullmatch(n))


def work_dirs(out: Path) -> list[Path]:
    """Work and old-sidecar directories of runs for ``out``, new and old naming, sorted."""
    if not out.parent.is_dir():
        return []
    return [out.parent / n for n in _work_names(out, os.listdir(out.parent))]


#: A directory, opened for its descriptor: never through a symbolic link, never blocking.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class OutputParent:
    """OUT's parent directory, held open for the run (Note [held parent]): ``fd`` is where the
    run makes, swaps and removes its names."""

    out: Path
    fd: int

    def in_place(self) -> bool:
        """The parent's path still names the directory held open."""
        try:
            return _same(os.stat(self.out.parent), os.fstat(self.fd))
        except OSError:
            return False

    def moved(self) -> EnvironmentFailure:
        return EnvironmentFailure(
            f"{self.out.parent}: the directory of -o was moved or removed during the run; "
            f"nothing was written to {self.out}",
            hint="leave the output's directory in place while mpack convert runs",
        )


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _names(dir_fd: int, name: str, fd: int) -> bool:
    """``name`` in the directory open at ``dir_fd`` is the file open at ``fd``."""
    try:
        return _same(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), os.fstat(fd))
    except OSError:
        return False


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[OutputParent]:
    """Hold ``out``'s parent directory open and its lock (Note [output lock], Note [held
    parent]), creating ``out``'s parent directories as needed; those it created are removed
    again if they are empty at the end (a refused run leaves nothing). Where this process cannot
    write ``out``'s parent (a read-only mount of sidecars), no lock is taken: the run can then
    only find ``out`` up to date, or fail when it writes. Work and old directories of dead runs
    are removed (Note [output lock]).

    Raises:
        BusyError: another run holds the lock, or owns a live work directory of ``out``.
        InputError, EnvironmentFailure: the parent cannot be created or opened, or the lock file
            is not one we can trust (:class:`mpack.fsutil.LockFile`).
    """
    with contextlib.ExitStack() as stack:
        made = _make_dirs(out.parent)
        stack.callback(_remove_empty, made)
        try:
            fd = os.open(out.parent, _DIR_FLAGS & ~os.O_NOFOLLOW)  # resolved by output_path
        except OSError as e:
            raise os_error(e, out.parent, "directory") from None
        stack.callback(os.close, fd)
        parent = OutputParent(out, fd)
        if not os.access(out.parent, os.W_OK):
            yield parent
            return
        try:
            lock = stack.enter_context(LockFile(lock_path(out)))
        except LockHeld as e:
            raise BusyError(
                f"another mpack convert (pid {e.pid}) is writing {out}",
                hint="wait for it to finish, or stop it",
            ) from None
        except SourceNotFoundError:
            if not out.parent.is_dir():  # removed meanwhile: the message is right
                raise
            raise _takes_no_files(lock_path(out)) from None
        stack.callback(_unlink_lock, parent, lock)  # before LockFile's own, which goes by path
        _sweep(parent)
        yield parent


def _unlink_lock(parent: OutputParent, lock: LockFile) -> None:
    """Remove our lock file through the held parent, wherever the parent is now."""
    with contextlib.suppress(OSError):
        if _names(parent.fd, lock.path.name, lock.fd):
            os.unlink(lock.path.name, dir_fd=parent.fd)


def _sweep(parent: OutputParent, keep: str | None = None) -> None:
    """Remove the work and old directories of ``parent.out`` that dead runs left (but ``keep``,
    ours), as Note [output lock] says: only once their lock is ours, and only their sidecar
    files.

    Raises:
        BusyError: one of them is locked: a live run is writing the same OUT.
    """
    for name in _work_names(parent.out, os.listdir(parent.fd)):
        if name == keep:
            continue
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent.fd)
        except OSError:  # gone meanwhile, or not a directory: nothing mpack left there
            continue
        try:
            if not _try_lock(fd):
                raise BusyError(
                    f"another mpack convert is writing {parent.out} (its work directory "
                    f"{shown(name)} is in use)",
                    hint="wait for it to finish, or stop it",
                )
            _unlink_sidecar_files(fd)
            _rmdir_if(parent.fd, name, fd)
        finally:
            os.close(fd)


def _try_lock(fd: int) -> bool:
    """``flock`` the directory open at ``fd`` for this process: False when another holds it;
    True too where the file system cannot lock a directory (Note [output lock])."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            return True
        raise
    return True


_RANK_FILE = re.compile(r"rank-\d{2,}-of-\d{2,}\.safetensors")


def _sidecar_name(name: str) -> bool:
    """``name`` is the name of a file a sidecar (or a run's work directory) holds."""
    return name in (MANIFEST_NAME, COMMON_NAME, *COPIED_FILES) or bool(_RANK_FILE.fullmatch(name))


def _entries(fd: int) -> tuple[list[str], list[str]]:
    """The entries of the directory open at ``fd``: ``(sidecar files, the rest)``, sorted. A
    sidecar file is a regular file with a sidecar's name (:func:`_sidecar_name`)."""
    files, rest = [], []
    for name in sorted(os.listdir(fd)):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        ours = stat.S_ISREG(st.st_mode) and _sidecar_name(name)
        (files if ours else rest).append(name)
    return files, rest


def _unlink_sidecar_files(fd: int) -> None:
    """Unlink the sidecar files in the directory open at ``fd``; leave everything else."""
    for name in _entries(fd)[0]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)


def _rmdir_if(dir_fd: int, name: str, fd: int) -> None:
    """Remove ``name`` (in the directory open at ``dir_fd``) if it is still the directory open
    at ``fd`` and empty; leave it otherwise."""
    if _names(dir_fd, name, fd):
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=dir_fd)


def _make_dirs(d: Path) -> list[Path]:
    """Create ``d`` and its missing parents; return those created, outermost first."""
    missing = []
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    made: list[Path] = []
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            continue  # made by someone else meanwhile
        except OSError as e:
            _remove_empty(made)
            if e.errno == errno.ENOENT and m.parent.is_dir():
                raise _takes_no_files(m) from None
            raise os_error(e, m, "directory") from None
        made.append(m)
    return made


def _takes_no_files(path: Path) -> EnvironmentFailure:
    """Creating ``path`` failed with ENOENT although its directory exists: a file system that
    takes no new entries there (``/proc``, ``/sys``), which is the machine refusing, not a
    missing input (exit code 3)."""
    return EnvironmentFailure(
        f"{path.parent}: this file system takes no new files (creating {path.name} there "
        "failed: no such file or directory)",
        hint="write the output to a directory on an ordinary file system (-o)",
    )


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()


# --- what OUT holds ---------------------------------------------------------------------------


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


# --- the stage --------------------------------------------------------------------------------


@dataclass
class Stage:
    """A sidecar being made at ``out`` (:func:`staged_sidecar`): ``work`` is the hidden directory
    its files go into; ``current`` (and no ``work``) when ``out`` already holds it."""

    out: Path
    work: Path | None = None
    current: tuple[dict[str, Any], str] | None = None  # up to date: OUT's manifest and digest

    @property
    def up_to_date(self) -> bool:
        return self.work is None

    def write_manifest(self, manifest: Mapping[str, Any]) -> str:
        """Write the manifest, the last file, into the work directory and flush the directory;
        return the manifest digest."""
        assert self.work is not None, "an up-to-date sidecar is not written"
        digest = write_manifest(self.work, manifest)
        fsync_dir(self.work)
        return digest


@contextlib.contextmanager
def staged_sidecar(
    out: Path,
    target: dict[str, Any],
    *,
    common: bool,
    src: ResolvedSource,
    files: SourceRecords,
    force: bool = False,
    timeline: Timeline | None = None,
    parent: OutputParent | None = None,
) -> Iterator[Stage]:
    """Make the sidecar at ``out`` atomically (Note [atomic output]); call with ``out``'s lock held.

    First, what ``out`` holds (:func:`existing_state`, with ``target``, ``common``, ``src`` and
    ``files`` as there): this very sidecar yields a :class:`Stage` that is ``up_to_date`` and
    nothing is written. Otherwise the stage has a new work directory: when the ``with`` block
    ends normally it is swapped into place at ``out`` (Note [what the swap replaces]); when it
    raises, it is removed. ``force``: replace another mpack sidecar at ``out`` (and redo this
    one). ``timeline``: where the time of the source hashing the check waits for
    (``hash-sources``) and of the swap goes. ``parent``: ``out``'s parent as
    :func:`output_lock` holds it (Note [held parent]); None: opened here.

    Raises:
        OutputExistsError: ``out`` holds files that are not an mpack sidecar, or (without
            ``force``) a different sidecar; or such a thing appeared at ``out`` during the run.
        BusyError: another run owns a live work directory of ``out`` (Note [output lock]).
        EnvironmentFailure: ``out``'s parent was moved during the run (Note [held parent]), or
            the machine refused a write (disk full: the message names the file).
    """
    tl = timeline or Timeline()
    current = _current(out, target, common, src, None if force else files, tl)
    if current is not None:
        yield Stage(out, current=current)
        return
    with contextlib.ExitStack() as stack:
        if parent is None:
            parent = OutputParent(out, os.open(out.parent, _DIR_FLAGS & ~os.O_NOFOLLOW))
            stack.callback(os.close, parent.fd)
        work = _WorkDir(parent)
        stack.callback(work.close)
        try:
            yield Stage(out, work.path)
            with tl.span("main", "swap"):
                work.swap_into_place(force)
        except BaseException as e:
            lost = not parent.in_place(), not (work.placed or work.in_place())  # before removal
            work.remove()
            if not isinstance(e, Exception):
                raise
            if lost[0]:  # what failed, failed for that
                raise parent.moved() from e
            if lost[1]:
                raise work.moved() from e
            environmental = isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS
            if environmental and not isinstance(e, MpackError):
                if e.filename is None:  # a write(2) that failed: the work directory at least
                    e.filename = str(work.path)
                raise environment_failure(e, f"writing the sidecar {out}") from e
            raise


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
            hint="choose another -o directory, or remove it yourself (mpack does not "
            "delete what it did not write)",
        )
    if there.state == "other-sidecar" and files is not None:
        how = f" ({', '.join(there.differences)})" if there.differences else ""
        raise OutputExistsError(
            f"{out} already holds a different sidecar{how}",
            hint="pass --force to replace it, or choose another -o directory",
        )
    if there.state == "other-sidecar":  # --force: only a sidecar, nothing else of anyone's
        why = _not_a_sidecar(out)
        if why is not None:
            raise OutputExistsError(f"{out} is not only an mpack sidecar: {why}", hint=_KEEP_HINT)
    return None


_KEEP_HINT = (
    "--force replaces only an mpack sidecar; move the other files away, or choose another -o "
    "directory (mpack does not delete what it did not write)"
)
_MOVE_HINT = (
    "move it away and run again, or choose another -o directory (mpack does not delete what "
    "it did not write)"
)


def _not_a_sidecar(d: Path | int) -> str | None:
    """Why the directory ``d`` (a path, or open at a descriptor) is not an mpack sidecar that
    ``--force`` may replace (Note [what the swap replaces]); None when it is one."""
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


class _WorkDir:
    """The hidden directory a run writes its sidecar into: made, locked and removed through the
    held parent (Note [output lock], Note [held parent]); ``placed`` once it is OUT."""

    def __init__(self, parent: OutputParent) -> None:
        self.parent = parent
        self.name = _work_path(parent.out, "tmp").name
        self.placed = False
        try:
            os.mkdir(self.name, dir_fd=parent.fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None  # the whole path
        try:
            self.fd = os.open(self.name, _DIR_FLAGS, dir_fd=parent.fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.rmdir(self.name, dir_fd=parent.fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        try:
            # locked, and still there: else another run's sweep took it the moment it was made
            if not (_try_lock(self.fd) and self.in_place()):
                raise BusyError(
                    f"another mpack convert is writing {parent.out} (it removed this run's "
                    f"work directory {self.name})",
                    hint="wait for it to finish, or stop it",
                )
            _sweep(parent, keep=self.name)  # made and locked first, then looked: Note [output lock]
        except BaseException:
            self.remove()
            self.close()
            raise

    @property
    def path(self) -> Path:
        return self.parent.out.parent / self.name

    def in_place(self) -> bool:
        """Its name still names it (another user may rename it in a parent they can write)."""
        return _names(self.parent.fd, self.name, self.fd)

    def moved(self) -> EnvironmentFailure:
        return EnvironmentFailure(
            f"{self.path}: this run's work directory was moved or removed during the run; "
            f"nothing was written to {self.parent.out}",
            hint="leave the output's directory alone while mpack convert runs",
        )

    def remove(self) -> None:
        """Remove the work directory and the files this run wrote there, wherever the parent
        is now, under whatever name it has there now; nothing once it is in place."""
        if self.placed:
            return
        _unlink_sidecar_files(self.fd)
        if self.in_place():
            _rmdir_if(self.parent.fd, self.name, self.fd)
            return
        ino = os.fstat(self.fd).st_ino
        with os.scandir(self.parent.fd) as entries:
            names = [e.name for e in entries if e.inode() == ino]
        for name in names:  # renamed within the parent by someone who can write there
            _rmdir_if(self.parent.fd, name, self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # and with it the lock
            self.fd = -1

    # --- the swap (Note [what the swap replaces]) ---

    def swap_into_place(self, force: bool) -> None:
        """Put the work directory at OUT: over nothing or an empty directory, or (``force``) an
        mpack sidecar, in one step; anything else at OUT is left there.

        Raises:
            OutputExistsError: something else appeared at OUT during the run (named).
            UsageError: OUT became a mount point.
            EnvironmentFailure: OUT's parent was moved (Note [held parent]).
        """
        p, out = self.parent, self.parent.out
        if not p.in_place():
            raise p.moved()
        try:
            os.rename(self.name, out.name, src_dir_fd=p.fd, dst_dir_fd=p.fd)
        except OSError as e:
            if not (force and e.errno in (errno.ENOTEMPTY, errno.EEXIST)):
                raise self._not_swapped(e) from None
            self._replace_sidecar()
        self.placed = True
        os.fsync(p.fd)

    def _replace_sidecar(self) -> None:
        """``--force`` and a non-empty directory at OUT: replace it if it is an mpack sidecar,
        checked before and after the exchange through a descriptor; it is then removed."""
        p, out = self.parent, self.parent.out
        try:
            old = os.open(out.name, _DIR_FLAGS, dir_fd=p.fd)
        except OSError as e:  # no longer a directory
            raise self._not_swapped(e) from None
        try:
            if not _try_lock(old):
                raise BusyError(
                    f"another mpack convert is writing {out} (it holds the directory there)",
                    hint="wait for it to finish, or stop it",
                )
            why = _not_a_sidecar(old)
            if why is not None:
                raise self._appeared(why)
            aside = self.name  # where the exchange puts the old OUT
            if _exchange_at(p.fd, self.name, out.name, self._not_swapped):
                self.placed = True
                why = _changed(p.fd, aside, old)
                if why is not None:
                    _exchange_at(p.fd, self.name, out.name, self._not_swapped)  # put it back
                    self.placed = False
                    raise self._appeared(why)
            else:  # no exchange on this file system: rename the old OUT aside first
                aside = _work_path(out, "old").name
                try:
                    os.rename(out.name, aside, src_dir_fd=p.fd, dst_dir_fd=p.fd)
                except OSError as e:
                    raise self._not_swapped(e) from None
                why = _changed(p.fd, aside, old)
                if why is not None:
                    os.rename(aside, out.name, src_dir_fd=p.fd, dst_dir_fd=p.fd)
                    raise self._appeared(why)
                try:
                    os.rename(self.name, out.name, src_dir_fd=p.fd, dst_dir_fd=p.fd)
                except OSError as e:
                    with contextlib.suppress(OSError):  # put the old one back, if OUT is free
                        os.rename(aside, out.name, src_dir_fd=p.fd, dst_dir_fd=p.fd)
                    raise self._not_swapped(e) from None
                self.placed = True
            os.fsync(p.fd)
            _unlink_sidecar_files(old)
            _rmdir_if(p.fd, aside, old)
        finally:
            os.close(old)

    def _not_swapped(self, e: OSError) -> MpackError | OSError:
        """The error for a swap that ``e`` refused: what is at OUT, named."""
        out = self.parent.out
        if e.errno == errno.EBUSY:
            return UsageError(
                f"-o {out} became a mount point during the run; a finished sidecar cannot be "
                "renamed onto it, and it was left as it was",
                hint=f"use a subdirectory of it, e.g. -o {out / 'sidecar'}",
            )
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            return self._appeared(None)
        if e.errno == errno.ENOENT and not self.in_place():
            return self.moved()
        return OSError(e.errno, e.strerror, str(out))

    def _appeared(self, why: str | None) -> OutputExistsError:
        """OUT holds what the swap may not replace (``why``: how it is not a sidecar)."""
        out = self.parent.out
        what = why or _describe(self.parent.fd, out.name)
        hint = _KEEP_HINT if why else _MOVE_HINT
        return OutputExistsError(
            f"{out} changed during the run and now holds what the sidecar may not replace "
            f"({what}); it was left as it was, and the new sidecar was not kept",
            hint=hint,
        )


def _changed(dir_fd: int, name: str, fd: int) -> str | None:
    """Why what the swap put at ``name`` may not be removed: not the directory checked (open at
    ``fd``), or no longer only a sidecar; None when it may."""
    if not _names(dir_fd, name, fd):
        return "another directory took its place during the swap"
    return _not_a_sidecar(fd)


def _describe(dir_fd: int, name: str) -> str:
    """What ``name`` in the directory open at ``dir_fd`` is, for a message."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "something that went away again"
    if not stat.S_ISDIR(st.st_mode):
        return kind_of(st.st_mode)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return "a directory"
    try:
        why = _not_a_sidecar(fd)
    finally:
        os.close(fd)
    return f"a directory: {why}" if why else "an mpack sidecar; pass --force to replace it"


# --- renameat2 --------------------------------------------------------------------------------


_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no such call in this libc (glibc < 2.28, macOS)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange_at(dir_fd: int, a: str, b: str, error: Callable[[OSError], BaseException]) -> bool:
    """Swap ``a`` and ``b`` of the directory open at ``dir_fd`` atomically; False where the
    system or file system cannot. Raises ``error(e)`` for any other failure."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise error(OSError(err, os.strerror(err)))
