"""The work directory a run fills, and its swap into place at OUT (:func:`staged_sidecar`).

Note [atomic output]: nothing named OUT exists until the final rename; a killed run leaves only
a work directory ``.mpack-<key>.tmp-<rand>`` behind (no manifest at OUT), which the next run
removes. ``<key>``: 12 hex digits of the sha256 of OUT's name, so every hidden name has a fixed
length (an OUT name of 255 bytes still fits) and belongs to one OUT.

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
import errno
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack.convert.output.existing import SourceRecords, _current, _not_a_sidecar, keep_hint
from mpack.convert.output.lock import (
    _DIR_FLAGS,
    OutputParent,
    _names,
    _rmdir_if,
    _sweep,
    _try_lock,
    _unlink_sidecar_files,
    _work_path,
)
from mpack.convert.source import ResolvedSource
from mpack.convert.timeline import Timeline
from mpack.errors import (
    ENVIRONMENT_ERRNOS,
    BusyError,
    EnvironmentFailure,
    MpackError,
    OutputExistsError,
    UsageError,
    arg,
    environment_failure,
)
from mpack.fsutil import exchange_at, kind_of
from mpack.sidecar import fsync_dir, write_manifest


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
    :func:`output_lock` holds it (Note [held parent] in lock.py); None: opened here.

    Raises:
        OutputExistsError: ``out`` holds files that are not an mpack sidecar, or (without
            ``force``) a different sidecar; or such a thing appeared at ``out`` during the run.
        BusyError: another run owns a live work directory of ``out`` (Note [output lock] in
            lock.py).
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


def _move_hint() -> str:
    return (
        f"move it away and run again, or choose another {arg('out')} directory (mpack does not "
        "delete what it did not write)"
    )


class _WorkDir:
    """The hidden directory a run writes its sidecar into: made, locked and removed through the
    held parent (Note [output lock], Note [held parent] in lock.py); ``placed`` once it is OUT."""

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
            if exchange_at(p.fd, self.name, out.name, self._not_swapped):
                self.placed = True
                why = _changed(p.fd, aside, old)
                if why is not None:
                    exchange_at(p.fd, self.name, out.name, self._not_swapped)  # put it back
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
                f"{arg('out', str(out))} became a mount point during the run; a finished sidecar "
                "cannot be renamed onto it, and it was left as it was",
                hint=f"use a subdirectory of it, e.g. {arg('out', str(out / 'sidecar'))}",
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
        hint = keep_hint() if why else _move_hint()
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
    return (
        f"a directory: {why}"
        if why
        else f"an mpack sidecar; pass {arg('force', True)} to replace it"
    )
