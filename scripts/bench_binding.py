"""What the start-time check that a sidecar was made from its checkpoint costs, against a full
digest of the same shards (the peer: what ``mpack verify --source`` must read).

    python scripts/bench_binding.py SRC SIDECAR [--reps 5] [--cold] [--json out.json]

SIDECAR must have been converted from SRC (``mpack convert SRC -o SIDECAR``). Times
``mpack.binding.check_bound`` (Note [a sidecar is bound to its checkpoint]) and a sha256 of
every shard, warm (the shards in the page cache), and with ``--cold`` after dropping the page
cache (root only: ``/proc/sys/vm/drop_caches``). Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def sha256_all(paths: list[Path]) -> None:
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)


def timed(fn, reps: int, cold: bool) -> list[float]:
    out = []
    for _ in range(reps):
        if cold:
            drop_caches()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("sidecar", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    from mpack.binding import check_bound
    from mpack.sidecar import load_manifest, read_file_map

    manifest, _ = load_manifest(a.sidecar)
    shards = sorted(a.src.glob("*.safetensors"))
    tensors = sum(len(read_file_map(p).entries) for p in shards)
    size = sum(p.stat().st_size for p in shards)

    def check() -> None:
        check_bound(manifest, a.src, where=a.sidecar, override="-")

    rows = {}
    for mode in ["warm", *(["cold"] if a.cold else [])]:
        cold = mode == "cold"
        if not cold:
            sha256_all(shards)  # warm the page cache
        rows[f"check_bound, {mode}"] = timed(check, a.reps, cold)
        rows[f"sha256 of every shard, {mode}"] = timed(lambda: sha256_all(shards), 1, cold)
    print(f"SRC {a.src}: {len(shards)} shard(s), {tensors} tensors, {size / 1e9:.2f} GB")
    for name, walls in rows.items():
        print(f"{name:40s} median {statistics.median(walls) * 1e3:9.1f} ms  (runs: {len(walls)})")
    if a.json_out:
        doc = {"src": str(a.src), "shards": len(shards), "tensors": tensors, "bytes": size}
        Path(a.json_out).write_text(json.dumps({**doc, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
