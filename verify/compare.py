"""One sidecar file read once: its chunk digests and the bytes a conversion would write, together.

:class:`SidecarComparer` stands where :class:`mpack.sidecar.HashingWriter` stands in a
conversion (the writer of :class:`mpack.convert.stream.Streamer` and of
:func:`mpack.iokit.copy_tensors`), so that ``mpack verify --source`` runs the same read ->
transform -> write machinery as ``mpack convert``; but where the writer writes and hashes, it
reads the sidecar's bytes at the same range, hashes them, and compares them with the bytes it was
given.

Note [one pass over the sidecar]: verification used to read every sidecar byte twice (the chunk
digests, then each tensor again for the comparison) and to re-derive on one CPU thread. Here each
byte is read once, into a reused buffer, and serves both: its chunk digest (whole chunks hashed on
a pool of threads, Note [chunk digests] in mpack/iokit.py) and the byte compare with the
re-derived bytes. Bytes no write covers (the header and its padding, a tensor the source does not
derive) are read and hashed as the reads pass them, so the digests cover the whole file whatever
the writes are. Writes come in the planned file order; a sidecar laid out in another order is
still compared (a range already passed is read a second time, not hashed again).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np

from mpack.errors import CorruptFileError
from mpack.fsutil import open_regular
from mpack.iokit import ChunkDigester, pread_pieces
from mpack.sidecar import FileMap, TensorEntry, digest_problems

__all__ = ["READ_BYTES", "SidecarComparer", "same_bytes"]

#: The most bytes one read of the sidecar holds: a whole chunk of the usual 64 MiB, so that its
#: digest can be computed on any thread of the pool (a longer chunk is hashed in order).
READ_BYTES = 64 * 1024 * 1024
#: Read buffers per file: the piece being compared, and those still hashing on the pool.
BUFFERS = 4


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two uint8 arrays of one length hold the same bytes (compared 8 bytes at a time)."""
    n = len(a) - len(a) % 8
    return bool(
        np.array_equal(a[:n].view(np.uint64), b[:n].view(np.uint64))
        and np.array_equal(a[n:], b[n:])
    )


def _as_u8(data: Any) -> np.ndarray:
    """A uint8 view of bytes-like ``data`` (a numpy array or a memoryview), no copy."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


class _Buffer:
    """A reused read buffer, and the digest that may still read it."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.busy: Future[Any] | None = None

    def ready(self) -> np.ndarray:
        if self.busy is not None:
            self.busy.result()
            self.busy = None
        return self.array


class SidecarComparer:
    """The sidecar file ``path`` against the bytes written to it, as planned by ``planned``.

    Args:
        planned: the file map a conversion from the source writes (``Plan.files[name]``);
            writes come at its offsets, in its order. ``.file_map`` is this, for the writer's
            callers.
        found: the file's map as read from its header (:func:`mpack.sidecar.read_file_map`).
            A planned tensor is compared with the tensor of ``found`` that has its name, dtype
            and shape; one without such a partner is in :attr:`unmatched`.
        record: the file's manifest ``files`` entry; its size was checked already.
        pool, ordered: executors for the chunk digests (:class:`mpack.iokit.ChunkDigester`).

    :meth:`write_at` compares; :meth:`finish` reads the rest of the file and returns how its
    digests differ from the manifest (:func:`mpack.sidecar.digest_problems`). :attr:`differs`
    names the tensors whose bytes differ, in the order found.
    """

    def __init__(
        self,
        path: Path,
        planned: FileMap,
        found: FileMap,
        record: Mapping[str, Any],
        *,
        pool: Executor,
        ordered: Executor,
    ) -> None:
        self.path, self.file_map, self.record = path, planned, record
        self.size = int(record["size"])
        ch = record.get("chunks")
        chunk = ch["bytes"] if ch else max(self.size, 1)  # no chunks: one whole-file sha256
        self._digester = ChunkDigester(chunk, self.size, pool=pool, ordered=ordered)
        by_name = {e.name: e for e in found.entries}
        self._target: dict[str, TensorEntry] = {}
        self.unmatched: list[str] = []  # planned tensors the file lacks, or holds otherwise
        for e in planned.entries:
            f = by_name.get(e.name)
            if f is not None and (f.dtype, f.shape) == (e.dtype, e.shape):
                self._target[e.name] = f
            else:
                self.unmatched.append(e.name)
        self.unplanned = [e.name for e in found.entries if e.name not in self._target]
        self.differs: dict[str, None] = {}  # an ordered set
        self._starts = [e.offset for e in planned.entries]
        self._bufs = [_Buffer(min(READ_BYTES, max(self.size, 1))) for _ in range(BUFFERS)]
        self._next = 0  # the buffer the next read goes into
        self._pos = 0  # bytes [0, pos) of the file are read and hashed
        self._held: tuple[int, np.ndarray] | None = None  # the last piece read: (start, bytes)
        self._fd = open_regular(path)  # follow=False, as every read of a sidecar file
        try:
            self._advance(found.data_start)  # the header, padding included: hashed, not compared
        except BaseException:
            self.close()
            raise

    # --- reads ------------------------------------------------------------------------------

    def _read_piece(self) -> tuple[int, np.ndarray]:
        """Read and hash the next piece of the file (up to the end of its chunk)."""
        n = self._digester.next_piece(READ_BYTES)
        buf = self._bufs[self._next % BUFFERS]
        self._next += 1
        piece = buf.ready()[:n]
        start = self._pos
        short = pread_pieces(self._fd, [(memoryview(piece), start)])
        if short is not None:
            raise CorruptFileError(f"{self.path}: file shrank while verifying (at byte {short})")
        buf.busy = self._digester.add(memoryview(piece))
        self._pos += n
        self._held = (start, piece)
        return self._held

    def _advance(self, end: int, on_piece: Callable[[int, np.ndarray], None] | None = None) -> None:
        """Read and hash the file up to byte ``end``, calling ``on_piece`` on every piece."""
        while self._pos < end:
            start, piece = self._read_piece()
            if on_piece is not None:
                on_piece(start, piece)

    # --- the writer's interface -------------------------------------------------------------

    def write_at(self, offset: int, data: Any) -> None:
        """Compare ``data``, the bytes a conversion writes at ``offset`` of the planned file map,
        with the sidecar's bytes of the same tensor. ``data`` is not kept."""
        e = self.file_map.entries[bisect.bisect_right(self._starts, offset) - 1]
        target = self._target.get(e.name)
        want = _as_u8(data)
        if target is None or not len(want):
            return
        a = target.offset + offset - e.offset  # the sidecar's bytes [a, b)
        b = a + len(want)
        held = self._held[0] if self._held is not None else self._pos
        if a < held:  # a range already passed (another order of tensors): read again, not hashed
            self._compare_again(e.name, a, want)
            return

        def compare(start: int, piece: np.ndarray) -> None:
            lo, hi = max(a, start), min(b, start + len(piece))
            if lo < hi and not same_bytes(piece[lo - start : hi - start], want[lo - a : hi - a]):
                self.differs[e.name] = None

        if self._held is not None:
            compare(*self._held)
        self._advance(b, compare)

    def _compare_again(self, name: str, a: int, want: np.ndarray) -> None:
        got = np.empty(len(want), dtype=np.uint8)
        short = pread_pieces(self._fd, [(memoryview(got), a)])
        if short is not None:
            raise CorruptFileError(f"{self.path}: file shrank while verifying (at byte {short})")
        if not same_bytes(got, want):
            self.differs[name] = None

    def finish(self) -> list[str]:
        """Read and hash the rest of the file; how its digests differ from the manifest's."""
        self._advance(self.size)
        got = self._digester.digests()
        self.close()
        return digest_problems(self.record, got)

    def close(self) -> None:
        for buf in self._bufs:
            if buf.busy is not None:
                buf.busy.cancel()
                try:
                    buf.ready()  # a digest already running still reads its buffer
                except Exception:
                    buf.busy = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
