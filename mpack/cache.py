"""mpack's per-user cache: things that cost time to make and are safe to make again.

Three kinds live here, each in its own folder under the cache root, ``$MPACK_CACHE_DIR``
(default ``$XDG_CACHE_HOME/mpack``, else ``~/.cache/mpack``):

- ``kernels``: the NVRTC builds of the fused repack kernel (:mod:`mpack.convert.cuda_repack`);
- ``verdicts``: the good verdicts of compressed-tensors' check of a source's quantization
  config (Note [verdict cache] in :mod:`mpack.convert.scheme_check`);
- ``sources``: where the local source of each sidecar converted here is, by its manifest's
  source record (Note [source path]: the record names the directory only);
- ``verified``: the sidecar files whose chunk digests `mpack serve` already checked, by manifest
  digest and what proves each file unchanged since (Note [verified files]).

Everything here is best effort: an entry is written whole or not at all (a temporary file
renamed into place), a cache that cannot be read or written is skipped (with ``mpack -v``, a
line says why), and removing the folder at any time only costs the time to make its entries
again. Entries are read and written only through :func:`read_entry` and :func:`write_entry`,
which apply Note [cache trust].
"""

# Note [cache trust]: an entry decides things (a kept "ok" verdict lets a checkpoint through
# without compressed-tensors' check; a cubin is loaded and run on the GPU), and its name is
# computable by anyone (the sha256 of public bytes). So an entry counts only if nobody but us
# could have put it there, the rule the runtime directory follows (runtime/protocol.py):
#
# - the root, the kind's folder and the entry are each owned by our effective uid and not
#   writable by group or others;
# - none of them is a symbolic link (each is opened with O_NOFOLLOW, the folders with
#   O_DIRECTORY, the next one relative to the descriptor of the one before, and every check is
#   an fstat of the open descriptor: nothing can be swapped between the check and the use);
# - an entry is a regular file (opened O_NONBLOCK: a FIFO cannot block us) of at most
#   CAPS[kind] bytes, and no more than that is ever read.
#
# Anything else is ignored, never repaired or removed: the verdict is reached by the check
# itself, the kernel is compiled again, and ``mpack -v`` says which part broke the rule. A
# write follows the same rule: a root or folder that is missing is made (mode 0700); one that
# breaks the rule is left alone and nothing is written, so a planted ``verdicts`` symlink can
# never make us write where someone else chose. An entry is replaced only where the name holds
# a regular file of ours. The folders above the root are the user's own choice and are not
# checked (``~/.cache`` is often a symlink to a larger disk).
#
# Entries are not signed. A key kept in the root (an HMAC over each entry) would be readable by
# exactly those the rule already lets write there (our uid and root), and a cache copied or
# restored from elsewhere (a CI cache) brings its key along; kept anywhere else, it would make
# every restored cache useless. So the rule above is the whole of the trust: a cache shared
# with someone you do not trust, even under one uid, must not be shared (docs/RUNTIME.md).

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "CAPS",
    "cache_dir",
    "cache_root",
    "read_entry",
    "VerifiedFiles",
    "recalled_source_dir",
    "remember_source_dir",
    "write_entry",
]

log = logging.getLogger("mpack.cache")

#: The most bytes one entry of each kind may have. A verdict of a 47,000-linear MoE is ~5 MB;
#: the repack kernel's cubin is well under 1 MB.
CAPS: dict[str, int] = {
    "kernels": 16 << 20,
    "verdicts": 64 << 20,
    "sources": 16 << 10,
    "verified": 4 << 20,
}

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Untrusted(Exception):
    """A part of the cache breaks Note [cache trust]; the message says which and how."""


def cache_root() -> Path:
    """``$MPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpack``, else ``~/.cache/mpack``.

    Raises:
        RuntimeError: none is set and the home directory is unknown.
    """
    root = os.environ.get("MPACK_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mpack"


def cache_dir(kind: str) -> Path:
    """The folder of one kind of entry: ``<cache root>/<kind>``."""
    return cache_root() / kind


def _kind_word(mode: int) -> str:
    from mpack.fsutil import kind_of

    return kind_of(mode)


def _check_owned(st: os.stat_result, path: Path) -> None:
    """Ours and not writable by group or others (Note [cache trust])."""
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{path} belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(
            f"{path} can be written by group or others (mode {stat.filemode(st.st_mode)})"
        )


def _open_dir(name: str | Path, path: Path, dir_fd: int | None, *, create: bool) -> int:
    """A checked descriptor of the folder ``name`` (relative to ``dir_fd``), made 0700 first
    where it is missing and ``create``. Raises FileNotFoundError (missing), Untrusted, OSError."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        if dir_fd is None:  # the folders above the root are the user's (Note [cache trust])
            Path(name).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        return _open_dir(name, path, dir_fd, create=False)
    except NotADirectoryError:  # O_NOFOLLOW | O_DIRECTORY on a symlink says ENOTDIR too
        try:
            what = _kind_word(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            what = "not a directory"
        raise Untrusted(f"{path} is {what}, not a directory") from None
    try:
        _check_owned(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _kind_fd(kind: str, *, create: bool) -> Iterator[tuple[int, Path]]:
    """The checked descriptor of ``kind``'s folder and its path."""
    if kind not in CAPS:
        raise ValueError(f"no such cache kind: {kind!r}")
    root = cache_root()
    root_fd = _open_dir(root, root, None, create=create)
    try:
        kind_fd = _open_dir(kind, root / kind, root_fd, create=create)
    finally:
        os.close(root_fd)
    try:
        yield kind_fd, root / kind
    finally:
        os.close(kind_fd)


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\0" in name:
        raise ValueError(f"not a cache entry name: {name!r}")


def read_entry(kind: str, name: str, *, then: str = "it is made again") -> bytes | None:
    """The bytes of entry ``name`` of ``kind``, or None where it is missing, cannot be read, or
    breaks Note [cache trust] (then a debug line says why, ending with ``then``: what the
    caller does instead)."""
    _check_name(name)
    cap = CAPS[kind]
    try:
        path = cache_dir(kind) / name
        with _kind_fd(kind, create=False) as (kind_fd, _):
            try:
                fd = os.open(
                    name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=kind_fd
                )
            except OSError as e:
                if e.errno == errno.ELOOP:  # O_NOFOLLOW: the entry is a symlink
                    raise Untrusted(f"{path} is a symbolic link") from None
                raise
            with os.fdopen(fd, "rb", buffering=0) as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise Untrusted(f"{path} is {_kind_word(st.st_mode)}, not a regular file")
                _check_owned(st, path)
                if st.st_size > cap:
                    raise Untrusted(f"{path} has {st.st_size} bytes, more than {cap}")
                data = f.read(cap + 1)
            if len(data) > cap:
                raise Untrusted(f"{path} has more than {cap} bytes")
            return data
    except FileNotFoundError:
        return None
    except (OSError, Untrusted, RuntimeError) as e:
        log.info("cache entry %s/%s ignored: %s; %s", kind, name, e, then)
    return None


def write_entry(kind: str, name: str, data: bytes) -> bool:
    """Write entry ``name`` of ``kind`` whole (a concurrent reader sees all of it or none);
    False where the cache cannot be written or breaks Note [cache trust] (the caller goes on
    without it)."""
    _check_name(name)
    if len(data) > CAPS[kind]:
        return False
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        with _kind_fd(kind, create=True) as (kind_fd, folder):
            try:
                st = os.stat(name, dir_fd=kind_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:  # never replace what we did not write
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise Untrusted(
                        f"{folder / name} is in the way ({_kind_word(st.st_mode)} of uid "
                        f"{st.st_uid})"
                    )
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=kind_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, name, src_dir_fd=kind_fd, dst_dir_fd=kind_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=kind_fd)
                raise
    except (Untrusted, RuntimeError) as e:
        log.info("cache entry %s/%s not written: %s", kind, name, e)
        return False
    except OSError:
        return False
    return True


# --- where a sidecar's local source is ----------------------------------------------------

# Note [source path]: a local source's absolute path (``/home/alice/secret-project/ckpt``) is
# not for a manifest that ``mpack push`` publishes, so by default the manifest's ``source.path``
# is the directory's name only (:func:`mpack.convert.source.provenance`;
# ``MPACK_SOURCE_PATH=full`` records the absolute path, as mpack did before). Where it is stays
# on this machine, in this cache: convert keeps it under the sha256 of the manifest's ``source``
# record (its kind, name and every file's digests: :func:`source_entry_name`), with the sidecar
# made from it; ``mpack verify SIDECAR`` without ``--source`` looks it up there to re-derive from
# it. The entry lists the last ``MAX_SOURCE_PLACES`` (sidecar, source) pairs, newest first: two
# copies of one checkpoint under one name share the record, and each sidecar finds the copy it
# was made from; a sidecar copied elsewhere (or whose other files were changed afterwards) finds
# the newest copy still there. A wrong directory found there is caught as a given ``--source``
# is: its files are hashed and compared with ``source.files``.
#: The (sidecar, source) pairs one ``sources`` entry keeps.
MAX_SOURCE_PLACES = 16


def source_entry_name(record: Mapping[str, Any]) -> str:
    """The ``sources`` entry of a manifest's ``source`` record: the sha256 of its canonical
    JSON (Note [source path])."""
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _source_places(name: str) -> list[tuple[str, str]]:
    data = read_entry("sources", name, then="the source is not looked for")
    try:
        doc = json.loads(data) if data else []
    except ValueError:
        return []
    ok = isinstance(doc, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in doc
    )
    return [(p[0], p[1]) for p in doc] if ok else []


def remember_source_dir(
    record: Mapping[str, Any], sidecar: str | os.PathLike, source: str | os.PathLike
) -> bool:
    """Keep ``source`` as the directory that ``sidecar`` was converted from, under the manifest
    ``source`` record ``record`` (Note [source path]); best effort, False when not kept."""
    name = source_entry_name(record)
    new = (os.fspath(sidecar), os.fspath(source))
    places = [new, *(p for p in _source_places(name) if p != new)][:MAX_SOURCE_PLACES]
    return write_entry("sources", name, json.dumps(places).encode())


def recalled_source_dir(record: Mapping[str, Any], sidecar: str | os.PathLike) -> Path | None:
    """The directory ``sidecar``, whose manifest's ``source`` record is ``record``, was
    converted from on this machine; else the newest one of that record still there; else None
    (Note [source path])."""
    try:
        places = _source_places(source_entry_name(record))
    except (TypeError, ValueError):  # a record JSON cannot hold: never one convert wrote
        return None
    here = os.fspath(sidecar)
    mine = [Path(src) for sc, src in places if sc == here]
    there = [Path(src) for _, src in places if os.path.isdir(src)]
    return (mine or there or [None])[0]


# --- sidecar files already verified ---------------------------------------------------------

# Note [verified files]: `mpack serve` checks every chunk of every file it loads against the
# manifest's sha256 (Note [the fill pipeline] in runtime/loader.py). Hashing is most of a warm
# start's fill (docs/BENCHMARKS.md, section 19), and on a restart it re-proves what the last start
# proved, about bytes nobody touched. So a fill that hashed a file keeps a record of it here,
# under the manifest's digest (the entry's name, and repeated inside it): the file's name in the
# manifest, the chunk size, the chunks hashed, and the file's identity as ``fstat`` saw it before
# the first read and again after the last, unchanged: ``st_dev``, ``st_ino``, ``st_size``,
# ``st_mtime_ns`` and ``st_ctime_ns``. A later fill of the same manifest whose file has that
# identity under that name reads its bytes without hashing them (the header comparison, the size
# and the "grew while loading" checks stay); one whose identity differs in any field, or that
# names another manifest, hashes as the first did. The identity is ``fstat``-ed again after the
# read: a trusted file that changed while it loaded is refused (its bytes were not hashed).
#
# What this trusts (docs/RUNTIME.md, "Verification on a restart"): any write to a file through
# the filesystem (``write``, a writable ``mmap``, ``truncate``, a rename onto it) sets its ctime
# to the current time, and ctime cannot be set by a process, only by setting the system clock
# (root): git's index relies on the same. So a file that changed through the filesystem is
# hashed again. It does not catch what bypasses the filesystem: a disk's or a network
# filesystem's silent corruption, a write to the block device, a filesystem that does not keep
# ctime, or a clock set back to repeat an old ctime. ``mpack serve --verify always`` and
# ``mpack verify`` hash regardless (and ``always`` rewrites the record).
#
# A file whose ctime or mtime is within ``RACY_S`` of the start of its read is not recorded:
# a write in the same clock tick as the recorded ``fstat`` (timestamps move in ticks of a few
# milliseconds; a network filesystem's come from the server's clock) could leave the identity
# unchanged ("racy git"). A freshly written sidecar is hashed at its first two starts.
#
# The record lives in mpack's cache under Note [cache trust]: whoever can write it runs as us
# and could as well edit the sidecar. Two daemons of one manifest writing at once may lose one's
# record (the last rename wins): the loser's files are hashed again on their next start.

#: A file changed this close to the start of its read is not recorded (Note [verified files]).
RACY_S = 1.0
#: File records one ``verified`` entry keeps (newest first): copies of one sidecar at several
#: paths each have their own, as do the files of every rank.
MAX_VERIFIED_FILES = 512
_VERIFIED_VERSION = 1


class FileIdentity(NamedTuple):
    """What proves a file unchanged since it was hashed (Note [verified files])."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class VerifiedFiles:
    """The ``verified`` record of the manifest with sha256 ``digest`` (Note [verified files]).

    :meth:`known` answers which chunks of a file need no hashing now; :meth:`add` records the
    chunks a fill hashed and found right; :meth:`save` writes the record whole. ``trust=False``
    (``--verify always``): nothing recorded earlier is read, so every chunk is hashed, and the
    record is rewritten from what this fill hashed. Best effort: a record that is missing,
    unreadable or breaks Note [cache trust] is an empty one, and one that cannot be written is
    skipped.
    """

    def __init__(self, digest: str, *, trust: bool = True) -> None:
        self.digest, self.trust = digest, trust
        self._files: dict[tuple[str, FileIdentity, int], frozenset[int]] = {}
        self._changed = False
        if trust:
            self._files = self._read()

    def _read(self) -> dict[tuple[str, FileIdentity, int], frozenset[int]]:
        data = read_entry("verified", self.digest, then="every file is hashed")
        if not data:
            return {}
        try:
            doc = json.loads(data)
            if doc.get("version") != _VERIFIED_VERSION or doc.get("manifest") != self.digest:
                return {}  # another manifest's record (or a format of another mpack) proves nothing
            out = {}
            for f in doc["files"]:
                ident = FileIdentity(*(int(f[k]) for k in FileIdentity._fields))
                out[(str(f["name"]), ident, int(f["chunk_bytes"]))] = frozenset(
                    int(c) for c in f["chunks"]
                )
            return out
        except (ValueError, TypeError, KeyError, AttributeError):
            why = "not a record; every file is hashed"
            log.info("cache entry verified/%s ignored: %s", self.digest, why)
            return {}

    def known(self, name: str, st: os.stat_result, chunk_bytes: int) -> frozenset[int]:
        """The chunks of file ``name`` (``st``: its ``fstat`` now) recorded as verified with
        this identity and chunk size; empty for any other identity."""
        return self._files.get((name, FileIdentity.of(st), chunk_bytes), frozenset())

    def add(
        self, name: str, st: os.stat_result, chunk_bytes: int, chunks: Iterable[int], since_ns: int
    ) -> bool:
        """Record ``chunks`` of file ``name`` as verified with identity ``st`` (``fstat``-ed
        before its first read and unchanged after its last), merged with what is recorded for
        that identity; not where the file changed within ``RACY_S`` of ``since_ns`` (the
        ``time.time_ns()`` before the first read). Whether it was recorded."""
        if max(st.st_ctime_ns, st.st_mtime_ns) > since_ns - int(RACY_S * 1e9):
            return False
        key = (name, FileIdentity.of(st), chunk_bytes)
        merged = self._files.pop(key, frozenset()) | frozenset(chunks)
        self._files = {key: merged, **self._files}  # newest first
        self._changed = True
        return True

    def save(self) -> bool:
        """Write the record (if anything was added) whole; False where it was not written."""
        if not self._changed:
            return False
        files = [
            {"name": name, **ident._asdict(), "chunk_bytes": cb, "chunks": sorted(chunks)}
            for (name, ident, cb), chunks in list(self._files.items())[:MAX_VERIFIED_FILES]
        ]
        doc = {"version": _VERIFIED_VERSION, "manifest": self.digest, "files": files}
        data = json.dumps(doc, separators=(",", ":")).encode()
        ok = write_entry("verified", self.digest, data)
        self._changed = not ok
        return ok
