"""What the disk itself does cold: the floor under a cold `mpack convert` (and under `cp -r`).

    python scripts/bench_disk.py SRC [--scratch /tmp/mpack-disk-test.bin]

A cold conversion reads every byte of SRC's shards from the disk and writes as many bytes back,
durably, on the same disk. This measures, each after ``drop_caches`` (root): reading the shards
(one thread; one with POSIX_FADV_SEQUENTIAL; 8 and 16 threads of 16 MiB preads; 8 threads
O_DIRECT), writing as many bytes (16 MiB writes, with and without the write-behind mpack uses,
then fsync), and reading and writing at once (the best a perfect overlap of a conversion's reads
and writes could do). Where reading and writing at once takes as long as the two one after the
other, the disk has one budget for both, and no schedule of a conversion's I/O beats their sum.
Prints one line per case; figures go to docs/BENCHMARKS.md (section 12).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchutil import drop_caches, write_bytes  # noqa: E402

PIECE = 16 << 20


def read_all(
    files: list[Path], threads: int, direct: bool = False, advise: int | None = None
) -> float:
    """Seconds to read every byte of ``files`` in PIECE preads on ``threads`` threads."""
    fds = {}
    for f in files:
        fds[f] = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        if advise is not None:
            os.posix_fadvise(fds[f], 0, 0, advise)
    jobs = [
        (f, a, min(PIECE, f.stat().st_size - a))
        for f in files
        for a in range(0, f.stat().st_size, PIECE)
    ]
    local = threading.local()

    def run(job: tuple[Path, int, int]) -> int:
        f, a, n = job
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
        want = -(-n // 4096) * 4096 if direct else n
        got = 0
        while got < n:
            k = os.preadv(fds[f], [memoryview(buf)[got:want]], a + got)
            if k <= 0:
                break
            got += k
        return got

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, jobs))
    dt = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/mpack-disk-test.bin"))
    a = ap.parse_args()
    files = sorted(a.src.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    print(f"{len(files)} shard(s), {total / 1e9:.2f} GB; scratch {a.scratch}", flush=True)
    if not drop_caches():
        print("drop_caches not allowed here (needs root): the reads are not cold", flush=True)

    def cold(label: str, fn: Callable[[], float]) -> None:
        os.sync()
        drop_caches()
        dt = fn()
        print(f"{label:44s} {dt:6.2f} s  {total / dt / 1e9:5.2f} GB/s", flush=True)
        a.scratch.unlink(missing_ok=True)
        os.sync()

    def both(threads: int, direct: bool) -> float:
        got: dict[str, float] = {}
        writer = threading.Thread(
            target=lambda: got.setdefault("w", write_bytes(a.scratch, total, behind=True))
        )
        t = time.perf_counter()
        writer.start()
        got["r"] = read_all(files, threads, direct)
        writer.join()
        print(f"    (of which the read {got['r']:.2f} s, the write + fsync {got['w']:.2f} s)")
        return time.perf_counter() - t

    cold("read, 1 thread", lambda: read_all(files, 1))
    cold(
        "read, 1 thread, FADV_SEQUENTIAL",
        lambda: read_all(files, 1, advise=os.POSIX_FADV_SEQUENTIAL),
    )
    cold("read, 8 threads", lambda: read_all(files, 8))
    cold("read, 16 threads", lambda: read_all(files, 16))
    cold("read, 8 threads, O_DIRECT", lambda: read_all(files, 8, direct=True))
    cold("write the same size (write-behind), fsync", lambda: write_bytes(a.scratch, total, True))
    cold("write the same size (no write-behind), fsync", lambda: write_bytes(a.scratch, total))
    cold("read (8 threads) and write at once", lambda: both(8, False))
    cold("read (8 threads, O_DIRECT) and write at once", lambda: both(8, True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
