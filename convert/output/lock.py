"""Who writes OUT: its parent directory held open, its lock, the hidden names of a run's
directories, and what dead runs left there.

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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mpack.errors import BusyError, EnvironmentFailure, SourceNotFoundError, arg, shown
from mpack.fsutil import LockFile, LockHeld, os_error
from mpack.sidecar import (
    COMMON_NAME,
    COPIED_FILES,
    MANIFEST_NAME,
    RUN_LOCK,
    RUN_OLD,
    RUN_WORK,
    parse_run_name,
    run_key,
    run_name,
)


def lock_path(out: Path) -> Path:
    """The lock file of a run writing ``out`` (Note [output lock]; its name: Note [run names] in
    mpack/sidecar.py)."""
    return out.parent / run_name(out.name, RUN_LOCK)


def _work_path(out: Path, kind: str) -> Path:
    """A new work (``tmp``) or old-sidecar (``old``) directory name for ``out``."""
    return out.parent / run_name(out.name, kind, uuid.uuid4().hex[:8])


def _work_names(out: Path, names: list[str]) -> list[str]:
    """Those of ``names`` that name a work or old-sidecar directory of ``out``, new and old
    naming, sorted."""
    ours = {(run_key(out.name), RUN_WORK), (run_key(out.name), RUN_OLD)}
    return sorted(n for n in names if parse_run_name(n) in ours)


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
            f"{self.out.parent}: the directory of {arg('out')} was moved or removed during the "
            f"run; nothing was written to {self.out}",
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
        hint=f"write the output to a directory on an ordinary file system ({arg('out')})",
    )


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()
