"""Opening files that are what they claim, exclusive lock files that cannot be hijacked, and
swapping two names of a directory in one step (:func:`exchange_at`).

Note [trust model for files]: a sidecar is read by long-lived daemons and by every process that
attaches, so a sidecar directory's own files must be *regular files directly inside it*: no
symbolic links (they could point anywhere, e.g. at /etc/shadow, whose bytes would then show up in
an error), no FIFOs or devices (a FIFO blocks a reader forever, /dev/zero never ends), no
directories where a file belongs. :func:`open_regular` enforces that rule with ``O_NOFOLLOW``
and ``O_NONBLOCK`` (so opening a FIFO cannot block), then ``fstat`` on the descriptor itself (so
nothing can be swapped between the check and the read). Source checkpoints may use symlinks
(the Hugging Face cache is made of them): pass ``follow=True``; the file must still be regular.

Lock files (:class:`LockFile`) guard one output or one served socket. They are created and
opened without following symlinks, must be regular files owned by this user with no group or
other permissions, and live in a directory that other users cannot write, unless the directory
is sticky (``/tmp``), where others cannot remove or replace what is ours. The pid written into a
lock file is only ever read back from a file that passed those checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from mpack.errors import (
    ENVIRONMENT_ERRNOS,
    CorruptFileError,
    InputError,
    MpackError,
    SourceNotFoundError,
    environment_failure,
    shown,
)

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """``"a regular file"``, ``"a FIFO"``, ``"a directory"``, ... for an ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


# The ``what``s of a sidecar's (or a checkpoint's) own files: a symlink among them gets the
# sidecar trust-model wording from :func:`os_error`.
_SIDECAR_WHATS = frozenset(
    {"file", "safetensors file", "manifest", "sidecar directory", "directory"}
)


def os_error(e: OSError, path: str | os.PathLike, what: str = "file") -> MpackError:
    """The ``MpackError`` for an ``OSError`` met while opening ``path`` (a ``what``)."""
    if e.errno == errno.ENOENT:
        return SourceNotFoundError(f"{path}: no such {what}")
    if e.errno == errno.ELOOP:
        if what == "lock file":
            return InputError(
                f"{path}: the lock file is a symbolic link (planted by someone?); refusing to "
                "follow it",
                hint=f"remove {path}, or use a directory only you can write",
            )
        if what in _SIDECAR_WHATS:
            return InputError(
                f"{path}: is a symbolic link; a sidecar's files must be regular files inside its "
                "directory (docs/FORMAT.md, trust model)",
                hint="replace the link with the file itself, or regenerate the sidecar",
            )
        return InputError(
            f"{path}: is a symbolic link; a {what} must be a regular file, and links are not "
            "followed"
        )
    if e.errno == errno.ENOTDIR:
        return InputError(
            f"{path}: a part of this path is a file, not a directory",
            hint=f"pass the directory that holds the {what}",
        )
    if e.errno == errno.EISDIR:
        return InputError(f"{path}: is a directory where a {what} belongs")
    if e.errno in ENVIRONMENT_ERRNOS:
        return environment_failure(e if e.filename else OSError(e.errno, e.strerror, str(path)))
    return InputError(f"{path}: cannot open this {what} ({e.strerror or e})")


def open_regular(path: str | os.PathLike, *, follow: bool = False, what: str = "file") -> int:
    """A read-only descriptor of ``path``, which must be a regular file (Note [trust model for
    files]); ``follow=False`` also refuses a symbolic link as the last path component.

    Raises:
        SourceNotFoundError: nothing at ``path``.
        InputError: a symlink (``follow=False``), FIFO, device, socket or directory.
        EnvironmentFailure: permission denied and the like.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise os_error(e, path, what) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(
                f"{path}: is {kind_of(st.st_mode)}, not a regular file",
                hint=f"a {what} must be a regular file",
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_file(
    path: str | os.PathLike, *, follow: bool = False, what: str = "file", buffering: int = -1
) -> BinaryIO:
    """:func:`open_regular` as a binary file object."""
    return os.fdopen(open_regular(path, follow=follow, what=what), "rb", buffering=buffering)


def read_capped(
    path: str | os.PathLike, cap: int, *, what: str = "file", follow: bool = False
) -> bytes:
    """The whole of a regular file of at most ``cap`` bytes (never reads more than ``cap + 1``).

    Raises:
        InputError: larger than ``cap``; as :func:`open_regular` otherwise.
    """
    with open_regular_file(path, what=what, follow=follow, buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise InputError(f"{path}: {size} bytes, more than the {cap} a {what} may have")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise InputError(f"{path}: more than the {cap} bytes a {what} may have")
    return data


def parse_json(
    data: bytes | str, path: str | os.PathLike, what: str = "JSON", *, hint: str | None = None
) -> Any:
    """``data``, the bytes of ``path`` (a ``what``), parsed as JSON: the one parse of JSON that
    came from outside (config.json, the shard index, safetensors headers, mpack.json, the
    sidecar's copied config).

    Raises:
        CorruptFileError: not UTF-8 JSON, or nested too deeply for the parser (a ``RecursionError``
            inside ``json``), naming ``path``; with ``hint`` (default: replace the file).
    """
    try:
        return json.loads(data)
    except RecursionError:
        reason = "nested too deeply"
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        reason = str(e)
    raise CorruptFileError(
        f"{path}: malformed {what} ({shown(reason, 300)})",
        hint=hint or "replace the file with a good copy: it must be plain JSON",
    )


# --- lock files --------------------------------------------------------------------------------


def is_private(st: os.stat_result, mode: int | None = None) -> bool:
    """``st`` is owned by our effective uid and has no group or other permission bits (with
    ``mode``: its permission bits are exactly ``mode``)."""
    if st.st_uid != os.geteuid():
        return False
    return st.st_mode & 0o777 == mode if mode is not None else not st.st_mode & 0o077


def check_safe_dir(d: str | os.PathLike, *, purpose: str) -> None:
    """Refuse a directory that users other than us (and root) can write, unless it is sticky.

    Raises:
        InputError: the directory is group- or world-writable without the sticky bit, or owned
            by another user (who could then rename our files away and plant their own).
    """
    st = os.stat(d)
    me = os.geteuid()
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid not in (me, 0) or (writable_by_others and not st.st_mode & stat.S_ISVTX):
        raise InputError(
            f"{d}: other users can write this directory (owner uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}), so they could plant files for {purpose}",
            hint="use a directory only you can write (or a sticky one such as /tmp)",
        )


class LockHeld(Exception):
    """The lock is held by another process; ``pid`` is what it wrote (a file we own)."""

    def __init__(self, pid: str) -> None:
        super().__init__(pid)
        self.pid = pid


class LockFile:
    """An exclusive, non-blocking ``flock`` on ``path``, held until ``__exit__`` (which removes
    the file if it still names the locked inode). The kernel drops the lock when the holder dies,
    however it dies, and in whatever pid namespace it runs: a held lock means a live holder.

    Raises (from ``__enter__``):
        LockHeld: another process holds it.
        InputError: ``path`` is a symlink, not a regular file, not ours, or not mode 0600
            (Note [trust model for files]).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd = -1

    def __enter__(self) -> LockFile:
        while True:
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
            except OSError as e:
                raise os_error(e, self.path, "lock file") from None
            try:
                _check_lock_file(fd, self.path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
                    raise LockHeld(pid if pid.isdigit() else "?") from None
                try:
                    same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return self
            os.close(fd)  # the holder removed it as we opened it: try again

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def _check_lock_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: the lock file is {kind_of(st.st_mode)}; refusing to use it")
    if not is_private(st):
        raise InputError(
            f"{path}: the lock file belongs to uid {st.st_uid} with mode "
            f"{stat.filemode(st.st_mode)}; it must be ours with mode 0600. Refusing to use it",
            hint=f"remove {path} if you trust it, or use another directory",
        )


def lock_held(path: str | os.PathLike) -> bool:
    """Another process holds a ``flock`` on ``path`` (a lock file or a directory, never followed
    through a symbolic link): asked with a shared lock, taken and dropped at once. False where
    ``path`` cannot be opened or the file system takes no locks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and with it the shared lock
    return False


_RENAME_EXCHANGE = 2


@functools.cache
def renameat2() -> Any:
    """libc's ``renameat2``, set up for ``ctypes``; None where this libc has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no such call in this libc (glibc < 2.28, macOS)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange_at(dir_fd: int, a: str, b: str, error: Callable[[OSError], BaseException]) -> bool:
    """Swap ``a`` and ``b`` of the directory open at ``dir_fd`` atomically; False where the
    system or file system cannot. Raises ``error(e)`` for any other failure."""
    fn = renameat2()
    if fn is None:
        return False
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise error(OSError(err, os.strerror(err)))
