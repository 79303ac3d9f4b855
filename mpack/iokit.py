"""The I/O engine under convert, the loader and the benchmarks: pools, reads, digests, writes,
rings.

Nothing here knows the sidecar format (:mod:`mpack.sidecar` does); this module knows how to move
and hash bytes fast:

* thread pools: the one place that creates them (Note [thread pools]);
* reads: :func:`read_full`, :func:`pread_pieces` (large reads split over the shared pread pool),
  :func:`prefetch` (the kernel reads ahead while the process starts);
* chunk digests (Note [chunk digests]): of a file on disk (:func:`chunk_digests`,
  :func:`hash_range`, :func:`sha256_file`) and of bytes passing through memory in order
  (:class:`ChunkDigester`);
* writes: :class:`FileWriter` (hashes behind itself, starts the disk writeback early: Note
  [write-behind]), :func:`copy_file`, :func:`copy_tensors`;
* the pinned ring between files and a GPU (:class:`PinnedRing`, Note [pinned rings]).

torch and numpy are imported only by the ring, when one is made.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from mpack.errors import CorruptFileError
from mpack.fsutil import open_regular, open_regular_file

if TYPE_CHECKING:
    import torch

#: Read size of one sha256 stream over a file (whole-file digests, ranges read back).
READ_BYTES = 8 * 1024 * 1024
#: Piece size of a copy through one reused buffer (:func:`copy_file`, :func:`copy_tensors`).
COPY_BYTES = 16 * 1024 * 1024
#: A large read is split into preads of this size that run at once (:func:`pread_pieces`).
PREAD_PIECE = 16 * 1024 * 1024
#: A ring that waits this long for a free piece reports a stall instead of hanging.
STALL_S = 300.0

# --- thread pools --------------------------------------------------------------------------
#
# Note [thread pools]: every thread pool mpack runs is made here, named ``mpack-<name>``.
# :func:`pool` makes one for one job, used in a ``with`` block so that its threads end with the
# job; its size is the caller's (each is tuned for its stage: ``host_repack.block_workers``,
# ``source.hash_workers``, ``loader.HASH_WORKERS``). :func:`shared_pool` returns one of two
# process-wide pools, made on first use and kept for the life of the process, so that many files
# or reads at once share their threads instead of multiplying them:
#
# * ``bg``: the chunk hashing and write-behind requests of every :class:`FileWriter`;
# * ``pread``: the pieces of large checkpoint reads (:func:`pread_pieces`).


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's cpuset),
    not the machine's count. Every thread count in mpack is derived from it."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


_CORES = usable_cores()
#: Threads of each process-wide pool.
SHARED_WORKERS = {"bg": min(16, _CORES), "pread": 4}
#: Threads :func:`chunk_digests` hashes one file's chunks on, unless told otherwise.
DIGEST_WORKERS = min(16, _CORES)

_shared: dict[str, ThreadPoolExecutor] = {}
_shared_lock = threading.Lock()


def pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A new pool of ``workers`` threads named ``mpack-<name>_<i>`` for one job; shut it down
    (a ``with`` block) when the job is done."""
    return ThreadPoolExecutor(workers, thread_name_prefix=f"mpack-{name}")


def shared_pool(name: str) -> ThreadPoolExecutor:
    """The process-wide pool ``name`` (``bg`` or ``pread``), made on first use."""
    with _shared_lock:
        p = _shared.get(name)
        if p is None:
            p = _shared[name] = pool(name, SHARED_WORKERS[name])
        return p


# --- reads ---------------------------------------------------------------------------------


# Note [prefetch]: a command's first seconds go to importing torch (more of them with a cold page
# cache), before it reads a byte of its input. `mpack convert` asks the kernel to start reading the
# source shards first thing (POSIX_FADV_WILLNEED): the disk works through them while the interpreter
# imports, and the stream then finds them in the page cache. The kernel only queues reads, so the
# request itself is cheap and a warm file costs nothing; it runs on a daemon thread all the same. At
# most ``budget`` bytes are asked for (a quarter of the memory available, by default): more would
# evict the first files before they are read. The disk then works through the shards in order, so on
# a cold disk every page fault of a library loaded meanwhile waits behind gigabytes of queued reads
# (`open_gpu` takes several times longer cold than warm). `convert --device cuda` therefore asks for
# the shared objects the driver path maps first (``cudadrv.library_files``: cuda-bindings' driver
# and NVRTC modules, libcuda, libnvrtc): a few hundred MB read whole and in order, little next to
# the shards. Figures: docs/BENCHMARKS.md, sections 2, 6.2 and 9.


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def prefetch(paths: list[Path], budget: int | None = None) -> threading.Thread | None:
    """Start the kernel reading ``paths`` into the page cache, in order, up to ``budget`` bytes
    (default: a quarter of the available memory), on a daemon thread (Note [prefetch]). A hint:
    files that cannot be opened are skipped, and nothing is raised. None where the platform has
    no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return None
    if budget is None:
        avail = _mem_available()
        budget = avail // 4 if avail else 1 << 30

    def run() -> None:
        left = budget
        for p in paths:
            if left <= 0:
                return
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, min(size, left), os.POSIX_FADV_WILLNEED)
                left -= size
            except OSError:
                pass
            finally:
                os.close(fd)

    t = threading.Thread(target=run, name="mpack-prefetch", daemon=True)
    t.start()
    return t


def read_full(f: BinaryIO, view: memoryview) -> int:
    """``readinto`` until ``view`` is full or the file ends; the number of bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from byte ``offset`` of ``fd``; the number of bytes read (fewer only where
    the file ends)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def pread_pieces(fd: int, pieces: list[tuple[memoryview, int]]) -> int | None:
    """Fill every ``(buffer, file offset)`` from ``fd``: None, or the file offset at which the
    file ended before the first buffer it left short.

    Buffers are split into ``PREAD_PIECE`` preads that run at once on the shared ``pread`` pool
    (page-cache copies on several cores, a deeper disk queue); a single pread runs here. The
    split happens here only, so callers never nest pool work.
    """
    jobs = []
    for buf, offset in pieces:
        view = memoryview(buf).cast("B")
        jobs += [(view[a : a + PREAD_PIECE], offset + a) for a in range(0, len(view), PREAD_PIECE)]
    if len(jobs) <= 1:
        done = [pread_full(fd, *j) for j in jobs]
    else:
        done = [f.result() for f in [shared_pool("pread").submit(pread_full, fd, *j) for j in jobs]]
    for (view, offset), got in zip(jobs, done, strict=True):
        if got < len(view):
            return offset + got
    return None


# --- chunk digests -------------------------------------------------------------------------
#
# Note [chunk digests]: one sha256 stream runs slower than an NVMe disk reads (figures:
# docs/BENCHMARKS.md, sections 2, 3 and 9), so a loader that checks only the whole-file sha256 is
# hash-bound, and so is a writer that computes one. The manifest therefore lists the sha256 of every
# ``chunk``-byte piece of a file (the last may be shorter; an empty file has one, of no bytes),
# which the writer computes and a loader checks on many threads as the bytes stream. Since format
# version 2 the safetensors files carry only these; the small copied files also keep a whole-file
# sha256 (docs/FORMAT.md).


class HashCancelled(Exception):
    """A hash stopped early because its ``stop`` event was set (the run it served failed)."""


def _sha256_hex(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(
    path: str | os.PathLike, chunk: int = READ_BYTES, stop: threading.Event | None = None
) -> str:
    """Hex sha256 of a regular file, read in large sequential chunks; ``stop`` aborts it between
    chunks."""
    h = hashlib.sha256()
    with open_regular_file(path, follow=True, buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            if stop is not None and stop.is_set():
                raise HashCancelled(str(path))
            h.update(view[:n])
    return h.hexdigest()


_hash_buffers = threading.local()


def _hash_buffer() -> memoryview:
    """This thread's ``READ_BYTES`` buffer for hashing reads, made once: a fresh ``bytes`` per
    read would fault in new memory for every byte hashed (9 GB of an 8B sidecar's digests)."""
    view = getattr(_hash_buffers, "view", None)
    if view is None:
        view = _hash_buffers.view = memoryview(bytearray(READ_BYTES))
    return view


def hash_fd_range(fd: int, path: Path, a: int, b: int) -> str:
    """sha256 of bytes ``[a, b)`` of the open file ``fd`` (``path`` names it in errors)."""
    h, buf = hashlib.sha256(), _hash_buffer()
    pos = a
    while pos < b:
        n = pread_full(fd, buf[: min(READ_BYTES, b - pos)], pos)
        if not n:
            raise CorruptFileError(f"{path}: file shrank while hashing")
        h.update(buf[:n])
        pos += n
    return h.hexdigest()


def hash_range(path: Path, a: int, b: int) -> str:
    """sha256 of bytes ``[a, b)`` of the regular file ``path`` (read back from the page cache)."""
    fd = open_regular(path, follow=True)
    try:
        return hash_fd_range(fd, path, a, b)
    finally:
        os.close(fd)


def chunk_spans(size: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every ``chunk``-byte piece of ``size`` bytes (one empty span for 0)."""
    return [(a, min(a + chunk, size)) for a in range(0, max(size, 1), chunk)]


def fd_chunk_digests(
    fd: int, path: Path, chunk: int, size: int, workers: int | None = None
) -> list[str]:
    """:func:`chunk_digests` of the first ``size`` bytes of the open file ``fd``."""
    with pool("digest", workers or DIGEST_WORKERS) as p:
        return list(p.map(lambda s: hash_fd_range(fd, path, *s), chunk_spans(size, chunk)))


def chunk_digests(path: str | os.PathLike, chunk: int, workers: int | None = None) -> list[str]:
    """sha256 of every ``chunk``-byte piece of a regular file, hashed on ``workers`` threads at
    once (Note [chunk digests])."""
    fd = open_regular(path, follow=True)
    try:
        return fd_chunk_digests(fd, Path(path), chunk, os.fstat(fd).st_size, workers)
    finally:
        os.close(fd)


class ChunkDigester:
    """The chunk digests of one file whose bytes pass through memory in order.

    The bytes come to :meth:`add` in pieces of at most :meth:`next_piece` bytes, so that no piece
    crosses a chunk boundary. With executors, a piece that is a whole chunk is hashed on
    ``pool`` (many chunks at once) and the pieces of a longer chunk in order on ``ordered`` (one
    thread): :meth:`add` returns the future that still reads the piece, and its buffer may be
    reused once that is done. Without executors every piece is hashed before :meth:`add`
    returns. ``size`` is the file's size when known (its last, shorter chunk is then whole
    too); None: the file ends where the pieces do.
    """

    def __init__(
        self,
        chunk: int,
        size: int | None = None,
        *,
        pool: Executor | None = None,
        ordered: Executor | None = None,
    ) -> None:
        if (pool is None) != (ordered is None):
            raise ValueError("ChunkDigester takes both executors or neither")
        self.chunk, self.size, self.pos = chunk, size, 0
        self._pool, self._ordered = pool, ordered
        self._h: Any = None  # the open chunk's hash while it spans several pieces
        self._out: list[Future[str] | str] = []

    def _left(self) -> int:
        """Bytes from here to the end of the chunk (or of the file, where its size is known)."""
        left = self.chunk - self.pos % self.chunk
        return left if self.size is None else min(left, self.size - self.pos)

    def next_piece(self, limit: int) -> int:
        """The most bytes the next piece may hold: ``limit``, up to the end of the chunk."""
        return min(limit, self._left())

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args) if self._ordered is None else self._ordered.submit(fn, *args)

    def add(self, view: Any) -> Future[Any] | None:
        """Hash the next ``len(view)`` bytes; the future that still reads ``view``, if any."""
        n, in_chunk, left = len(view), self.pos % self.chunk, self._left()
        if n > left:
            raise ValueError(f"a piece of {n} bytes at {self.pos} crosses a chunk boundary")
        self.pos += n
        if in_chunk == 0 and n == left and self._pool is not None:  # a whole chunk: any thread
            fut = self._pool.submit(_sha256_hex, view)
            self._out.append(fut)
            return fut
        if in_chunk == 0:
            self._h = hashlib.sha256()
        fut = self._run(self._h.update, view)  # pieces of one chunk: in order
        if n == left:
            self._out.append(self._run(self._h.hexdigest))
            self._h = None
        return fut

    def digests(self) -> list[str]:
        """Every chunk's hex sha256, in order, once all are computed (an open last chunk ends
        here; no bytes at all: the one digest of no bytes)."""
        if self._h is not None:
            self._out.append(self._run(self._h.hexdigest))
            self._h = None
        got = [d if isinstance(d, str) else d.result() for d in self._out]
        return got or [_sha256_hex(b"")]


# --- writes --------------------------------------------------------------------------------
#
# Note [write-behind]: Linux starts writing dirty pages back only past dirty_background_ratio
# (10 % of memory by default: ~13 GB on a 128 GB host), so a 9 GB sidecar would sit in the page
# cache until the final fsync and then be flushed in one serial wait as long as the disk write
# itself. sync_file_range(SYNC_FILE_RANGE_WRITE) starts writeback of a range without waiting for
# it, so the disk writes while the pipeline still reads and transforms; fsync at the end waits
# only for the tail. Where the call does not exist (not Linux), writes fall back to plain
# page-cache writes and the final fsync.


def _load_sync_file_range() -> Any:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk, without
    waiting (Note [write-behind]); a no-op where sync_file_range does not exist."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An ``OSError`` without a file name raised inside (a ``write`` or ``fsync`` that failed:
    disk full) gets ``path``, so that its message names the file."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


class FileWriter:
    """Writes a new file of ``size`` bytes front to back, hashing every byte as it goes.

    Writes must come in file order; each one's bytes may be reused as soon as :meth:`write_at`
    returns. Two kinds of work overlap the caller's next write, on the shared ``bg`` pool (both
    release the GIL):

    - the chunk digests (Note [chunk digests]): each ``chunk_bytes`` piece is read back from
      the page cache and hashed as soon as the writer has passed its end;
    - write-behind (Note [write-behind]): every ``FLUSH_BYTES`` written, the kernel is asked to
      start writing that range to disk, so the final fsync finds little left to do.

    ``finish()`` checks that all ``size`` bytes were written, fsyncs, and returns
    ``(size, sha256)``; ``chunks`` then holds the chunk digests (``chunk_bytes=None``: none).
    The whole-file sha256 is computed in :meth:`write_at` itself; ``whole_file=False`` skips
    it, and ``finish`` returns None for it: one sha256 stream is slower than the disk, and the
    chunk digests alone cover every byte.
    """

    FLUSH_BYTES = 32 * 1024 * 1024

    def __init__(
        self, path: str | os.PathLike, size: int, chunk_bytes: int | None, whole_file: bool = True
    ) -> None:
        self.path = Path(path)
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.chunks: list[str] = []
        self._f: BinaryIO = open(self.path, "wb", buffering=0)  # noqa: SIM115 - closed in finish()
        self._h = hashlib.sha256() if whole_file else None
        self._pos = 0
        self._flushed = 0
        self._chunk_futs: list[Future[str]] = []
        self._flushes: list[Future[None]] = []

    def _write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        done = 0
        with naming(self.path):
            while done < len(mv):
                done += self._f.write(mv[done:])
        if self._h is not None:
            self._h.update(mv)
        self._pos += len(mv)
        if self._pos - self._flushed >= self.FLUSH_BYTES:
            self._flush_behind()
        if self.chunk_bytes:
            while (len(self._chunk_futs) + 1) * self.chunk_bytes <= self._pos:
                self._submit_chunk(len(self._chunk_futs))

    def _flush_behind(self) -> None:
        start, self._flushed = self._flushed, self._pos
        if _sync_file_range is not None:
            fut = shared_pool("bg").submit(
                start_writeback, self._f.fileno(), start, self._pos - start
            )
            self._flushes = [f for f in self._flushes if not f.done()] + [fut]

    def _submit_chunk(self, i: int) -> None:
        assert self.chunk_bytes
        a = i * self.chunk_bytes
        b = min(a + self.chunk_bytes, self._pos)
        self._chunk_futs.append(shared_pool("bg").submit(hash_range, self.path, a, b))

    @property
    def position(self) -> int:
        return self._pos

    def write_at(self, offset: int, data: Any) -> None:
        """Append ``data`` (bytes-like, e.g. a numpy array) at ``offset``, which must be the end.
        ``data`` may be reused as soon as this returns."""
        if offset != self._pos:
            raise AssertionError(
                f"{self.path.name}: write at {offset}, but the file is at {self._pos}"
            )
        self._write(data)

    def fence(self) -> threading.Event:
        """An event set once every buffer passed to :meth:`write_at` so far is no longer read:
        always already set, since :meth:`write_at` hashes and writes before it returns."""
        ev = threading.Event()
        ev.set()
        return ev

    def finish(self) -> tuple[int, str | None]:
        if self._pos != self.size:
            raise AssertionError(f"{self.path.name}: wrote {self._pos} of {self.size} bytes")
        if self.chunk_bytes and (
            not self._chunk_futs or len(self._chunk_futs) * self.chunk_bytes < self._pos
        ):
            self._submit_chunk(len(self._chunk_futs))  # the last, shorter chunk (or an empty file)
        for fut in self._flushes:
            fut.result()
        with naming(self.path):
            os.fsync(self._f.fileno())
        self._f.close()
        self.chunks = [f.result() for f in self._chunk_futs]
        return self._pos, self._h.hexdigest() if self._h is not None else None

    def close(self) -> None:
        for fut in self._chunk_futs + self._flushes:
            fut.cancel()
        if not self._f.closed:
            self._f.close()


# --- direct writes -------------------------------------------------------------------------
#
# Note [direct writes]: on a machine of few cores the page cache is not free. On the 2-core
# runner, writing 3 GB through it cost about 2 CPU-seconds of kernel time (the copy into the
# cache, then the writeback), where O_DIRECT writes of the same bytes cost 0.13, and the chunk
# digests then read every byte back. So on fewer than ``DIRECT_BELOW_CORES`` (8) usable cores
# (convert/pipeline.py) the pass-through file (``common.safetensors``: embeddings, norms and
# lm_head, most of a small model's bytes) and the first rank file are written by
# :class:`DirectWriter`: bytes go into a page-aligned staging piece of one chunk (the
# pass-through copy reads the source straight into it; the rank file's writer copies each
# transformed piece in), the chunk's digest is computed from the piece, and the disk takes the
# piece by DMA. The data is on the disk when each write returns, so the final fsync has nothing
# left to wait for. On more cores the CPU is not what a conversion waits for, and the page cache
# wins: it takes the writes at memory speed while the disk catches up (behind, Note
# [write-behind]), where each direct write waits for the disk (on the H200's disk, the 8B
# checkpoint converted 0.35-0.5 s faster through the page cache on 8 and 16 cores, and 0.45-0.6
# s slower on 4). Figures: docs/BENCHMARKS.md, section 12.
# Pieces are whole chunks at chunk offsets (a chunk is a multiple of the block size), so every
# write but the last is aligned; the last is padded to a block and the file then truncated to
# its size. A file system that refuses O_DIRECT at open (tmpfs on older kernels, some network
# file systems) gets the page-cache writer (:class:`FileWriter`); one that takes the flag but
# refuses a write has the flag turned off for that file and the write redone. The costs: two
# chunks of staging memory per file (so at most ``DIRECT_FILES`` files of a conversion: a
# tensor-parallel plan's other rank files, and every file of a multi-target run, go through the
# page cache), and the files are not in the page cache after a conversion (a ``serve`` right
# after reads them from the disk). ``MPACK_NO_DIRECT_WRITE=1`` turns it off (``direct-write``
# in :data:`mpack.convert.backends.SWITCHES`); the bytes are the same either way.

#: What O_DIRECT writes are aligned to: a multiple of every logical block size in use.
BLOCK = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``; where O_DIRECT refuses a write (EINVAL: a file system
    that takes the flag at open but not this write, or a short write that left the rest
    unaligned), the flag is turned off for ``fd`` and the write redone through the page cache."""
    import fcntl

    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if e.errno != errno.EINVAL or not flags & os.O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            continue
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n}")
        done += n


class DirectWriter:
    """Writes a new file of ``size`` bytes front to back with O_DIRECT, computing its
    ``chunk_bytes`` digests from the staging pieces (Note [direct writes]).

    The bytes go into ``depth`` page-aligned pieces of one chunk each: either filled in place
    (:meth:`space`, then :meth:`advance`: a read lands where the disk will take it from) or
    copied in by :meth:`write_at`. A full piece is hashed and written on the shared ``bg`` pool
    while the next fills. ``finish()`` checks that all ``size`` bytes came, waits for the
    writes, fsyncs and returns ``(size, None)``; ``chunks`` then holds the digests. The
    interface is :class:`FileWriter`'s (no whole-file sha256).

    Raises ``OSError`` (EINVAL, or EOPNOTSUPP) from the constructor where the file system
    refuses O_DIRECT: use :class:`FileWriter` there.
    """

    def __init__(
        self, path: str | os.PathLike, size: int, chunk_bytes: int, *, depth: int = 2
    ) -> None:
        import mmap

        if chunk_bytes <= 0 or chunk_bytes % BLOCK or depth < 1:
            raise ValueError(f"DirectWriter: chunk_bytes {chunk_bytes}, depth {depth}")
        self.path, self.size, self.chunk_bytes = Path(path), size, chunk_bytes
        self.chunks: list[str] = []
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT
        self._fd = os.open(self.path, flags, 0o666)
        self._maps = [mmap.mmap(-1, chunk_bytes) for _ in range(depth)]  # page-aligned
        self._views = [memoryview(m) for m in self._maps]
        self._busy: list[list[Future[Any]]] = [[] for _ in range(depth)]
        self._k = 0  # the chunk being filled, in piece k % depth
        self._fill = 0  # bytes of it so far
        self._pos = 0
        self._digests: list[Future[str]] = []

    @property
    def position(self) -> int:
        return self._pos

    def _piece(self) -> memoryview:
        """The piece chunk ``k`` fills, once the hash and write of the chunk it held are done."""
        i = self._k % len(self._views)
        if self._fill == 0 and self._busy[i]:
            done, self._busy[i] = self._busy[i], []
            with naming(self.path):
                for fut in done:
                    fut.result()
        return self._views[i]

    def _end(self) -> int:
        """Bytes the chunk being filled holds: a whole chunk, or what is left of the file."""
        return min(self.chunk_bytes, self.size - self._k * self.chunk_bytes)

    def space(self) -> memoryview:
        """Where the next bytes go: the rest of the chunk being filled (empty once ``size``
        bytes came). Fill a prefix of it, then :meth:`advance` by that many bytes."""
        if self._fill >= self._end():
            return memoryview(b"")
        return self._piece()[self._fill : self._end()]

    def advance(self, n: int) -> None:
        """``n`` more bytes are in place at the start of :meth:`space`."""
        if n < 0 or self._fill + n > self._end():
            raise AssertionError(f"{self.path.name}: {n} bytes past the space given")
        self._fill += n
        self._pos += n
        if self._fill == self.chunk_bytes:
            self._submit()

    def write_at(self, offset: int, data: Any) -> None:
        """Append ``data`` at ``offset``, which must be the end (copied: it may be reused)."""
        if offset != self._pos:
            raise AssertionError(
                f"{self.path.name}: write at {offset}, but the file is at {self._pos}"
            )
        mv = memoryview(data).cast("B")
        while len(mv):
            room = self.space()
            if not len(room):
                raise AssertionError(f"{self.path.name}: write past its {self.size} bytes")
            n = min(len(room), len(mv))
            room[:n] = mv[:n]
            mv = mv[n:]
            self.advance(n)

    def fence(self) -> threading.Event:
        """Set: :meth:`write_at` copies what it is given before it returns."""
        ev = threading.Event()
        ev.set()
        return ev

    def _submit(self) -> None:
        """Hash and write the chunk being filled (its last block padded), on the ``bg`` pool."""
        i, n = self._k % len(self._views), self._fill
        piece, offset = self._views[i], self._k * self.chunk_bytes
        bg = shared_pool("bg")
        digest = bg.submit(_sha256_hex, piece[:n])
        self._digests.append(digest)
        self._busy[i] = [digest]
        if n:
            write = bg.submit(_pwrite_all, self._fd, piece[: _round_up(n, BLOCK)], offset)
            self._busy[i].append(write)
        self._k += 1
        self._fill = 0

    def finish(self) -> tuple[int, None]:
        if self._pos != self.size:
            raise AssertionError(f"{self.path.name}: wrote {self._pos} of {self.size} bytes")
        if self._fill or not self._digests:
            self._submit()  # the last, shorter chunk (or the one digest of an empty file)
        with naming(self.path):  # earlier writes were waited for when their piece came back
            for fut in (f for futs in self._busy for f in futs):
                fut.result()
            if self.size % BLOCK:
                os.ftruncate(self._fd, self.size)  # the last write's padding
            os.fsync(self._fd)
        self.chunks = [d.result() for d in self._digests]
        self.close()
        return self._pos, None

    def close(self) -> None:
        """Wait for the pieces' hashes and writes (they read the staging memory), then close
        the file and free the pieces. Errors were the caller's to see in :meth:`finish`."""
        for futs in self._busy:
            for fut in futs:
                with contextlib.suppress(BaseException):
                    fut.result()
        self._busy = [[] for _ in self._busy]
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for v in self._views:
            v.release()
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still held: freed with it
                m.close()
        self._views, self._maps = [], []


def copy_file(a: Path, b: Path, chunk_bytes: int) -> dict[str, Any]:
    """Copy ``a`` to ``b`` (fsynced), hashing the bytes on the way: its ``files`` record
    (docs/FORMAT.md) with the whole-file sha256 and the ``chunk_bytes`` digests, from one read
    in ``COPY_BYTES`` pieces."""
    whole, digester = hashlib.sha256(), ChunkDigester(chunk_bytes)
    with open(a, "rb", buffering=0) as fa, open(b, "wb") as fb:
        while data := fa.read(digester.next_piece(COPY_BYTES)):
            with naming(b):
                fb.write(data)
            whole.update(data)
            digester.add(data)
        with naming(b):
            fb.flush()
            os.fsync(fb.fileno())
    return {
        "name": b.name,
        "size": digester.pos,
        "sha256": whole.hexdigest(),
        "chunks": {"bytes": chunk_bytes, "sha256": digester.digests()},
    }


def copy_tensors(
    read_into: Callable[[str, memoryview, int], None],
    into: Sequence[tuple[FileWriter | DirectWriter, Sequence[Any]]],
    bump: Callable[[int], None],
    tl: Any,
) -> None:
    """Copy the same tensors byte for byte into one file or several, in file order: each piece
    is read once and written to every file. ``into``: ``(writer, entries)`` per file, the
    entries (each with ``name``, ``offset`` and ``nbytes``: a file map's) naming the same
    tensors in the same order, each at its own file's offset (their headers differ).

    The read goes into one reused buffer of ``COPY_BYTES``, or, where the first writer is a
    :class:`DirectWriter`, straight into its staging piece (:meth:`DirectWriter.space`: for
    that file the bytes are copied once, by the read); the other files take the piece by
    ``write_at`` before the direct writer moves on.

    ``read_into(name, buffer, skip)`` fills a buffer with tensor ``name``'s bytes from ``skip``
    on (``Checkpoint.read_into``); ``bump(n)`` follows every piece written to each file; ``tl``
    (a ``Timeline``) gets a ``copy`` span for each read and each write (for a direct writer,
    the wait for a free piece too).
    """
    first, firsts = into[0]
    others = into[1:]
    if isinstance(first, DirectWriter):
        room, put = first.space, lambda _at, view: first.advance(len(view))
    else:
        buf = memoryview(bytearray(COPY_BYTES))
        room, put = (lambda: buf), first.write_at
    for i, entry in enumerate(firsts):
        at = [entries[i].offset for _, entries in others]
        pos = 0
        while pos < entry.nbytes:
            t = time.perf_counter()
            view = room()[: entry.nbytes - pos]
            if not len(view):
                raise AssertionError(f"{first.path.name}: no room left for {entry.name}")
            t = tl.add("copy", first.path.name, t, time.perf_counter())
            read_into(entry.name, view, pos)
            t = tl.add("copy", "read", t, time.perf_counter())
            for (w, _), off in zip(others, at, strict=True):
                w.write_at(off + pos, view)
                t = tl.add("copy", w.path.name, t, time.perf_counter())
                bump(len(view))
            put(entry.offset + pos, view)
            tl.add("copy", first.path.name, t, time.perf_counter())
            pos += len(view)
            bump(len(view))


# --- the pinned ring ---------------------------------------------------------------
#
# Note [pinned rings]: every buffer on the host side of a GPU copy is a fixed piece of pinned
# memory, reused. Fresh pageable buffers cost a page fault per 4 KiB, and pageable copies go
# through the driver's own bounce buffer at a fraction of the link's speed; a reused pinned
# ring costs neither, and bounds memory whatever the size of what passes through it. A piece is
# reused only after the copies that last used it finished: the ring waits on their CUDA events
# before handing it out again.


class Aborted(Exception):
    """Another stage failed; this one stops (the first error is the one reported)."""


def put_or_abort(q: queue.Queue, item: Any, abort: threading.Event) -> None:
    """``q.put(item)``, raising :class:`Aborted` once ``abort`` is set while ``q`` is full."""
    while True:
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            if abort.is_set():
                raise Aborted from None


def get_or_abort(q: queue.Queue, abort: threading.Event, stall_s: float | None = None) -> Any:
    """``q.get()``, raising :class:`Aborted` once ``abort`` is set while ``q`` is empty, and
    ``queue.Empty`` after ``stall_s`` seconds (None: never)."""
    start = time.monotonic()
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if abort.is_set():
                raise Aborted from None
            if stall_s is not None and time.monotonic() - start > stall_s:
                raise


def _record(stream: Any) -> Any:
    """A CUDA event recorded on ``stream`` now."""
    import torch

    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


class Slot:
    """One piece of a :class:`PinnedRing`: ``buf``, uint8 [piece] host memory; ``view``, the same
    bytes as a memoryview (for ``readinto`` and ``preadv``); ``waits``, the CUDA events of the
    copies that still use it."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.view = memoryview(buf.numpy())
        self.waits: list[Any] = []

    def ready(self) -> Slot:
        """Wait for every copy that still uses the piece; return it."""
        for w in self.waits:
            w.synchronize()
        self.waits = []
        return self

    def to_device(self, dst: torch.Tensor, stream: Any) -> None:
        """Queue on ``stream`` the copy of the piece's first ``dst.numel()`` bytes into ``dst``
        (uint8 on a GPU); the piece is handed out again only once it is done."""
        import torch

        with torch.cuda.stream(stream):
            dst.copy_(self.buf[: dst.numel()], non_blocking=True)
        self.waits.append(_record(stream))

    def from_device(self, src: torch.Tensor, stream: Any) -> Any:
        """Queue on ``stream`` the copy of ``src`` (uint8 on a GPU) into the piece's first bytes;
        returns the CUDA event set once they are there (wait for it before reading them)."""
        import torch

        with torch.cuda.stream(stream):
            self.buf[: src.numel()].copy_(src, non_blocking=True)
        ev = _record(stream)
        self.waits.append(ev)
        return ev


class PinnedRing:
    """``count`` pieces of ``piece`` bytes of pinned host memory, reused (Note [pinned rings]).

    A ring is used one of two ways, not both. Threads that pass pieces to each other take one
    with :meth:`acquire` and give it back with :meth:`release` (convert's read, transform and
    write stages); ``abort`` stops a waiting :meth:`acquire`, and one that waits ``stall_s``
    raises "``name`` stalled". One thread that cycles through the pieces in order takes piece
    ``k % count`` with ``ring[k]`` (the loader's fill, the benchmarks' floor). Either way a piece
    is handed out only after the copies that used it finished. ``pin=False``: pageable memory,
    for a run that copies to no GPU.
    """

    def __init__(
        self,
        count: int,
        piece: int,
        *,
        pin: bool = True,
        abort: threading.Event | None = None,
        name: str = "pinned ring",
        stall_s: float = STALL_S,
    ) -> None:
        import torch

        self.count, self.piece, self.name, self.stall_s = count, piece, name, stall_s
        self.slots = [
            Slot(torch.empty(piece, dtype=torch.uint8, pin_memory=pin)) for _ in range(count)
        ]
        self._free: queue.Queue[Slot] = queue.Queue()
        for s in self.slots:
            self._free.put(s)
        self._abort = abort if abort is not None else threading.Event()

    def __getitem__(self, k: int) -> Slot:
        """Piece ``k % count``, once the copies that used it finished."""
        return self.slots[k % self.count].ready()

    def acquire(self) -> Slot:
        """The next free piece, once the copies that used it finished."""
        try:
            slot = get_or_abort(self._free, self._abort, self.stall_s)
        except queue.Empty:
            raise RuntimeError(
                f"{self.name} stalled: no staging buffer freed in {self.stall_s:.0f} s"
            ) from None
        return slot.ready()

    def release(self, slot: Slot, *waits: Any) -> None:
        """Give ``slot`` back; it is handed out again after its copies and ``waits`` (events)."""
        slot.waits += waits
        self._free.put(slot)

    def close(self) -> None:
        """Release the pieces' memoryviews (the ring is not used afterwards)."""
        for s in self.slots:
            s.view.release()
