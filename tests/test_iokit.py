"""mpack/iokit.py: the chunk digester, parallel preads, the pinned ring's hand-outs, pools.

Everything here runs on the CPU; the ring's CUDA copies are exercised by the GPU tests of
convert (test_stream.py) and the loader (test_loader.py).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

from mpack import iokit


def _want(data: bytes, chunk: int) -> list[str]:
    return [hashlib.sha256(data[a:b]).hexdigest() for a, b in iokit.chunk_spans(len(data), chunk)]


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4567])
def test_chunk_digester_gives_the_chunk_digests(size: int, known: bool, threads: bool) -> None:
    """Any piece sizes, with and without executors, size known or not: the digests of the
    bytes' 1000-byte chunks (one, of no bytes, for an empty file)."""
    data = random.Random(size).randbytes(size)
    rng = random.Random(1)
    with iokit.pool("t-chunk", 3) as p, iokit.pool("t-ordered", 1) as o:
        execs = {"pool": p, "ordered": o} if threads else {}
        d = iokit.ChunkDigester(1000, size if known else None, **execs)
        while d.pos < size:
            n = d.next_piece(rng.randint(1, 700))
            d.add(memoryview(data)[d.pos : d.pos + n])
        assert d.digests() == _want(data, 1000)


def test_chunk_digester_refuses_a_piece_across_a_boundary() -> None:
    d = iokit.ChunkDigester(100)
    d.add(b"x" * 60)
    with pytest.raises(ValueError, match="crosses a chunk boundary"):
        d.add(b"x" * 41)


def test_chunk_digests_and_ranges_agree(tmp_path: Path) -> None:
    data = random.Random(7).randbytes(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert iokit.chunk_digests(path, 3000, workers=2) == _want(data, 3000)
    assert iokit.hash_range(path, 100, 5000) == hashlib.sha256(data[100:5000]).hexdigest()
    assert iokit.sha256_file(path, chunk=999) == hashlib.sha256(data).hexdigest()
    stop = threading.Event()
    stop.set()
    with pytest.raises(iokit.HashCancelled):
        iokit.sha256_file(path, chunk=999, stop=stop)


def test_pread_pieces_fills_every_buffer_and_finds_the_end(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(iokit, "PREAD_PIECE", 1000)  # many preads on the shared pool
    data = random.Random(3).randbytes(7000)
    path = tmp_path / "f"
    path.write_bytes(data)
    bufs = [bytearray(2500), bytearray(3100)]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert (
            iokit.pread_pieces(fd, [(memoryview(bufs[0]), 100), (memoryview(bufs[1]), 3900)])
            is None
        )
        assert bufs[0] == data[100:2600] and bufs[1] == data[3900:7000]
        # 3200 bytes from 3900 pass the end: the file ends at byte 7000
        assert iokit.pread_pieces(fd, [(memoryview(bytearray(3200)), 3900)]) == 7000
    finally:
        os.close(fd)


def test_ring_hands_out_pieces_in_order_and_stops() -> None:
    pytest.importorskip("torch")
    abort = threading.Event()
    ring = iokit.PinnedRing(2, 64, pin=False, abort=abort, name="test", stall_s=0.3)
    a, b = ring.acquire(), ring.acquire()
    assert a is not b and len(a.view) == 64 and ring[2] is a
    with pytest.raises(RuntimeError, match="test stalled: no staging buffer freed"):
        ring.acquire()
    ring.release(b)
    assert ring.acquire() is b
    abort.set()
    with pytest.raises(iokit.Aborted):
        ring.acquire()
    ring.close()


def test_shared_pools_are_made_once() -> None:
    assert iokit.shared_pool("bg") is iokit.shared_pool("bg")
    assert iokit.shared_pool("pread")._max_workers == iokit.SHARED_WORKERS["pread"]


# --- cores and prefetch ----------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_usable_cores_follows_the_affinity() -> None:
    """Under `taskset -c 0` mpack sizes its pools for one core, not for the machine."""
    import subprocess
    import sys

    code = (
        "import os; os.sched_setaffinity(0, {0}); from mpack import iokit; "
        "print(iokit.usable_cores(), iokit.DIGEST_WORKERS)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"]
    assert iokit.usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_prefetch_asks_for_the_files_in_order_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WILLNEED for each file in order until the budget is spent; a missing file is skipped."""
    sizes = {"a": 3000, "b": 5000, "c": 7000}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((os.fstat(fd).st_size, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    paths = [tmp_path / "a", tmp_path / "missing", tmp_path / "b", tmp_path / "c"]
    t = iokit.prefetch(paths, budget=6000)
    assert t is not None
    t.join(10)
    assert not t.is_alive()
    assert asked == [(3000, 3000), (5000, 3000)]  # c is past the budget
