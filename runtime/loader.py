"""Fill an allocation from the sidecar files: large sequential reads, hashed as they stream.

Note [the fill pipeline]: each file is read in ``CHUNK``-byte pieces into a ring of ``DEPTH``
slots. A slot is either the destination itself (host memory: read straight into the memfd
mapping or tensor, no staging copy) or a piece of a pinned ring (``mpack.iokit``'s
``PinnedRing``) whose bytes then go to the GPU by an asynchronous copy on a side stream. Each
piece is checked against the manifest's per-chunk digests (Note [chunk digests] in
mpack/iokit.py). A file whose chunks fit in one piece (every file mpack writes) is filled by
``FILL_WORKERS`` threads at once, each reading, copying and hashing whole chunks (Note [parallel
fill]); a longer chunk (a version-1 file, which lists only its whole-file sha256: one chunk) is
read front to back and hashed piece by piece on one thread. ``preadv`` and ``hashlib`` release
the GIL, so disk, hashing and H2D copies overlap. A slot is reused only after its hash and its
copy finished. Every digest must match the manifest, and each file's first bytes must equal the
header that was parsed when planning (so the file map describes exactly the bytes loaded);
otherwise the load fails and nothing is served. The daemon passes a record of the files an
earlier start already hashed (``mpack.cache.VerifiedFiles``): the chunks it vouches for, of a
file whose ``fstat`` identity is the recorded one, are read and checked like the others but not
hashed (Note [verified files] in mpack/cache.py).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol

from mpack import iokit
from mpack.arch import Stage
from mpack.cache import FileIdentity
from mpack.errors import CorruptFileError, VerificationError
from mpack.fsutil import open_regular_file
from mpack.iokit import ChunkDigester, PinnedRing, chunk_spans, pread_full, read_full
from mpack.runtime.allocation import Allocation, Region, plan_rank
from mpack.runtime.protocol import checked_device
from mpack.sidecar import CHUNK_BYTES, chunk_mismatch, regenerate_hint_of

if TYPE_CHECKING:
    import torch

    from mpack.cache import VerifiedFiles
    from mpack.runtime.weights import SharedWeights

CHUNK = CHUNK_BYTES  # read size: one piece per manifest chunk digest
HASH_WORKERS = max(1, min(8, iokit.usable_cores() - 1))
#: Threads of the parallel fill (Note [parallel fill]): each reads a chunk, then hashes it.
FILL_WORKERS = HASH_WORKERS + 1
DEPTH = FILL_WORKERS + 1  # ring slots: every worker busy while the next piece is read


class Destination(Protocol):
    """Where the fill writes. Slot ``i`` of the ring is reused only after ``wait(i)``."""

    def slot(self, i: int, offset: int, n: int) -> memoryview: ...
    def submit(self, i: int, offset: int, n: int) -> None: ...
    def wait(self, i: int) -> None: ...
    def finish(self) -> None: ...


class HostDest:
    """Writable host memory (a memfd mapping or a CPU tensor's buffer): read straight into it."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf.cast("B") if buf.format != "B" else buf

    def slot(self, i: int, offset: int, n: int) -> memoryview:
        return self.buf[offset : offset + n]

    def submit(self, i: int, offset: int, n: int) -> None:
        pass

    def wait(self, i: int) -> None:
        pass

    def finish(self) -> None:
        pass


class CudaDest:
    """A uint8 CUDA tensor, filled through a ring of ``depth`` pinned pieces (Note [pinned
    rings] in mpack/iokit.py) and asynchronous copies on a side stream."""

    def __init__(self, dst: torch.Tensor, *, depth: int = DEPTH, chunk: int = CHUNK) -> None:
        import torch

        self.dst = dst  # uint8 [size] on a CUDA device
        self.stream = torch.cuda.Stream(device=dst.device)
        self.ring = PinnedRing(depth, chunk)

    def slot(self, i: int, offset: int, n: int) -> memoryview:
        return self.ring.slots[i].view[:n]

    def submit(self, i: int, offset: int, n: int) -> None:
        self.ring.slots[i].to_device(self.dst[offset : offset + n], self.stream)

    def wait(self, i: int) -> None:
        self.ring.slots[i].ready()

    def finish(self) -> None:
        self.stream.synchronize()
        self.ring.close()


@dataclass(frozen=True)
class FillStats:
    bytes: int  # the allocation's bytes filled
    seconds: float
    #: File bytes read and hashed against the manifest's chunk digests.
    hashed: int = 0
    #: File bytes read but not hashed: chunks a ``VerifiedFiles`` record vouched for.
    trusted: int = 0


#: Called with the byte count of each piece once it is read, checked and handed to the
#: destination (from the fill's worker threads too): the daemon's load progress.
Progress = Callable[[int], None]


def fill(
    plan: Allocation,
    dest: Destination,
    *,
    chunk: int = CHUNK,
    depth: int = DEPTH,
    progress: Progress | None = None,
    verified: VerifiedFiles | None = None,
) -> FillStats:
    """Copy every region of ``plan`` into ``dest``, verifying each file (Note [the fill pipeline]).

    Every file is checked chunk by chunk against the manifest (``Region.chunk_sha256``; a
    version-1 file without chunk digests is one chunk with its whole-file sha256). A chunk that
    fits in one ``chunk``-byte read is read, handed to ``dest`` and hashed by one of
    ``HASH_WORKERS`` threads, several at once (:func:`_fill_parallel`); a larger one is read in
    order and hashed piece by piece on one thread (:class:`mpack.iokit.ChunkDigester`).
    ``progress(n)``, if given, is called for every ``n`` bytes done, from any of those threads.

    ``verified`` (the daemon's): the chunks it vouches for of a file whose identity is the
    recorded one are not hashed (Note [verified files] in mpack/cache.py; a file of chunks
    longer than ``chunk`` is always hashed); the chunks hashed and found right are recorded
    there, and the record is saved once every file is filled.

    Raises:
        VerificationError: a chunk whose sha256 differs from the manifest.
        CorruptFileError: a file that changed size or header since it was planned, or a file
            whose chunks were not hashed that changed while it loaded.
    """
    t0 = time.perf_counter()
    pending: list[Future | None] = [None] * depth
    scratch = _Scratch(depth)
    k = hashed = trusted = 0
    try:
        with iokit.pool("hash", 1) as ordered, iokit.pool("chunk", FILL_WORKERS) as pool:
            for r in plan.regions:
                with open_regular_file(r.path, buffering=0) as f:  # no symlink, FIFO or device
                    before = os.fstat(f.fileno())
                    since = time.time_ns()
                    skip: frozenset[int] = frozenset()
                    if verified is not None and r.chunk_bytes <= chunk:
                        skip = verified.known(r.name, before, r.chunk_bytes)
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    if r.chunk_bytes <= chunk:
                        done, k = _fill_parallel(
                            r, f.fileno(), dest, pool, pending, k, progress, scratch, skip
                        )
                        got = {c: d for c, d in done.items() if d is not None}
                        unhashed = [c for c, d in done.items() if d is None]
                    else:
                        digester = ChunkDigester(r.chunk_bytes, r.size, pool=pool, ordered=ordered)
                        k = _fill_region(r, f, dest, digester, pending, k, chunk, progress, scratch)
                        got, unhashed = dict(enumerate(digester.digests())), []
                    for i, p in enumerate(pending):  # the file's last pieces
                        if p is not None:
                            p.result()
                            pending[i] = None
                    if os.pread(f.fileno(), 1, r.size):
                        raise CorruptFileError(f"{r.path}: file grew while loading")
                    after = os.fstat(f.fileno())
                _verify(plan, r, got)
                same = FileIdentity.of(after) == FileIdentity.of(before)
                if unhashed and not same:
                    raise CorruptFileError(
                        f"{r.path}: changed while loading (its size, mtime or ctime moved); its "
                        "chunks were trusted from an earlier start's record, not hashed, so "
                        "what was read is not known to be right",
                        hint="start again once nothing writes the sidecar's files",
                    )
                hashed += _span_bytes(r, got)
                trusted += _span_bytes(r, unhashed)
                if verified is not None and same:
                    verified.add(r.name, before, r.chunk_bytes, [*got, *unhashed], since)
        if verified is not None:
            verified.save()
    finally:
        dest.finish()  # also on failure: no copy may still be writing into memory about to go
    return FillStats(plan.size, time.perf_counter() - t0, hashed, trusted)


def _span_bytes(r: Region, chunks: Iterable[int]) -> int:
    """How many bytes of ``r``'s file the chunks ``chunks`` (indices) hold."""
    return sum(min(r.chunk_bytes, r.size - c * r.chunk_bytes) for c in chunks)


def _verify(plan: Allocation, r: Region, got: dict[int, str]) -> None:
    """Raise ``VerificationError`` unless the chunk digests ``got`` of ``r`` (by chunk index:
    every chunk hashed, Note [a stage's allocation]) are the manifest's."""
    idx = sorted(got)
    if not idx:
        return
    want = [r.chunk_sha256[i] if i < len(r.chunk_sha256) else "" for i in idx]
    bad = chunk_mismatch([got[i] for i in idx], want, r.chunk_bytes, r.size)
    if bad:
        first, _, _, nbad = bad
        lo = idx[first] * r.chunk_bytes
        hi = min(lo + r.chunk_bytes, r.size)
        raise VerificationError(
            f"{r.path}: sha256 of bytes {lo}..{hi} does not match the manifest's chunk "
            f"sha256 ({nbad} of {len(got)} chunks differ): the file is damaged or was "
            "modified; refusing to serve it",
            hint=regenerate_hint_of(plan.manifest, plan.sidecar),
        )


def _check_head(r: Region, pos: int, view: memoryview) -> None:
    """The bytes at ``pos`` of ``r`` that overlap its header must be the header as planned."""
    if pos < len(r.head) and view[: len(r.head) - pos] != r.head[pos : pos + len(view)]:
        raise CorruptFileError(f"{r.path}: header changed while loading")


# Note [parallel fill]: one thread reading a file front to back copies page-cache pages into its
# buffer at a few GB/s, and a sha256 stream is slower still: one reader was the warm load's limit,
# slower than safetensors' load_file (figures: docs/BENCHMARKS.md, section 9). When each chunk of
# a file fits in one read (every file mpack writes: its chunks are the read size), the chunks are
# independent jobs: a worker preads one into its ring slot, checks the header bytes, queues the
# slot's copy to the GPU and hashes the slot, while the other workers do the same with the next
# chunks. Cold, several reads in flight also keep the disk's queue deep. Slots are handed out in
# order; a slot is given to the next chunk only after its job and its copy are done, so at most
# ``depth`` pieces are in flight.


def _fill_parallel(
    r: Region,
    fd: int,
    dest: Destination,
    pool: Executor,
    pending: list[Future | None],
    k: int,
    progress: Progress | None = None,
    scratch: _Scratch | None = None,
    skip: frozenset[int] = frozenset(),
) -> tuple[dict[int, str | None], int]:
    """Fill ``r``, one chunk per job on ``pool`` (Note [parallel fill]): every chunk of a whole
    file, the chunks a stage's windows or the header touch otherwise (Note [a stage's
    allocation]); their digests by chunk index (None for a chunk in ``skip``: read, not
    hashed), and the next slot's ``k``."""
    depth = len(pending)
    scratch = scratch or _Scratch(depth)
    jobs: dict[int, Future[str | None]] = {}
    for c, (a, b) in enumerate(chunk_spans(r.size, r.chunk_bytes)):
        if not r.needs(a, b - a):
            continue
        i = k % depth
        if pending[i] is not None:
            pending[i].result()
        dest.wait(i)
        pending[i] = job = pool.submit(
            _fill_chunk, r, fd, dest, i, a, b - a, progress, scratch, c not in skip
        )
        jobs[c] = job
        k += 1
    return {c: j.result() for c, j in jobs.items()}, k


def _fill_chunk(
    r: Region,
    fd: int,
    dest: Destination,
    i: int,
    pos: int,
    n: int,
    progress: Progress | None = None,
    scratch: _Scratch | None = None,
    hashed: bool = True,
) -> str | None:
    """Read bytes ``[pos, pos + n)`` of ``r`` and hand the held ones to ``dest`` (through slot
    ``i``); their sha256 (None unless ``hashed``)."""
    view = _take(r, dest, i, pos, n, lambda v: pread_full(fd, v, pos), scratch)
    digest = hashlib.sha256(view).hexdigest() if hashed else None
    if progress is not None:
        progress(n)
    return digest


class _Scratch:
    """One host buffer per ring slot, for the bytes of a piece that the allocation does not
    hold in full (Note [a stage's allocation]): read and hashed there, the held part copied."""

    def __init__(self, depth: int) -> None:
        self._bufs: list[bytearray | None] = [None] * depth

    def get(self, i: int, n: int) -> memoryview:
        buf = self._bufs[i]
        if buf is None or len(buf) < n:
            buf = self._bufs[i] = bytearray(n)
        return memoryview(buf)[:n]


def _take(
    r: Region,
    dest: Destination,
    i: int,
    pos: int,
    n: int,
    read: Callable[[memoryview], int],
    scratch: _Scratch | None,
) -> memoryview:
    """Read bytes ``[pos, pos + n)`` of ``r`` (``read(view)`` fills ``view`` and returns the
    count) and hand ``dest`` the ones the allocation holds; the bytes read, for the hash. A
    piece inside one window is read straight into ``dest``'s slot ``i``; any other into
    ``scratch``'s, and its held parts copied through slot ``i``."""
    whole = r.window_of(pos, n)
    if whole is not None:
        view = dest.slot(i, whole.alloc(pos), n)
        if read(view) != n:
            raise CorruptFileError(f"{r.path}: file became shorter while loading")
        _check_head(r, pos, view)
        dest.submit(i, whole.alloc(pos), n)
        return view
    assert scratch is not None
    view = scratch.get(i, n)
    if read(view) != n:
        raise CorruptFileError(f"{r.path}: file became shorter while loading")
    _check_head(r, pos, view)
    for lo, hi, at in r.overlaps(pos, n):
        dest.wait(i)  # slot i's previous copy is done
        dest.slot(i, at, hi - lo)[:] = view[lo - pos : hi - pos]
        dest.submit(i, at, hi - lo)
    return view


def _fill_region(
    r: Region,
    f: BinaryIO,
    dest: Destination,
    digester: ChunkDigester,
    pending: list[Future | None],
    k: int,
    chunk: int,
    progress: Progress | None = None,
    scratch: _Scratch | None = None,
) -> int:
    """Read ``r`` from ``f`` in order into ring slots ``k, k + 1, ...`` (mod ``depth``) in pieces
    that never cross a chunk boundary, each handed to ``digester`` (the whole file: its one
    chunk is hashed whole; a stage's region keeps only its windows' bytes); the next slot's
    ``k``."""
    depth = len(pending)
    pos = 0
    while pos < r.size:
        n = digester.next_piece(chunk)
        i = k % depth
        if pending[i] is not None:
            pending[i].result()
        dest.wait(i)
        view = _take(r, dest, i, pos, n, lambda v: read_full(f, v), scratch)
        pending[i] = digester.add(view)  # still reads the slot until it is done
        pos += n
        k += 1
        if progress is not None:
            progress(n)
    return k


def load(
    sidecar: str | os.PathLike, *, rank: int = 0, device: str = "cpu", stage: Stage | None = None
) -> SharedWeights:
    """A private, writable copy of one rank of a sidecar (no daemon), verified while it loads:
    of pipeline ``stage`` only, if given (Note [a stage's allocation] in allocation.py).

    Returns a ``SharedWeights`` whose tensors are views into one uint8 buffer of the rank's
    bytes on ``device`` (``cpu``, ``cuda`` or ``cuda:N``).
    """
    import torch

    from mpack.runtime.weights import SharedWeights

    where = checked_device(device)
    plan = plan_rank(sidecar, rank, stage)
    if where.kind == "cpu":
        buf = torch.empty(plan.size, dtype=torch.uint8)
        fill(plan, HostDest(memoryview(buf.numpy())))
        label = "cpu"
    else:
        label = f"cuda:{where.ordinal}"
        buf = torch.empty(plan.size, dtype=torch.uint8, device=label)
        fill(plan, CudaDest(buf))
    return SharedWeights(
        buf,
        plan.tensors,
        manifest=plan.manifest,
        digest=plan.digest,
        rank=rank,
        device=label,
        backend="private",
        nbytes=plan.size,
        stage=plan.stage,
    )
