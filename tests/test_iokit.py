"""mpack/iokit.py: the chunk digester, parallel preads, the staging ring's hand-outs, pools.

Everything here runs on the CPU; the ring's CUDA copies are exercised by the GPU tests of
convert (test_stream.py) and the loader (test_runtime_loader.py).
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
