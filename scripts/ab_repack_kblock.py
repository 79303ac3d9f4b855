"""A/B of the CPU repack's k-tiles per pass (``host_repack.K_BLOCK``), one core, 8B shapes.

    python scripts/ab_repack_kblock.py [--json F] [--blocks 0,4,8,16,32] [--reps 3]

For each block size and each Llama-3.1-8B linear shape (qkv, o, gate_up, down), the native
repack of one layer into a used output array, the median of ``--reps`` timings after one warm-up
call, as GB/s of fp8 input. ``0`` is a whole row at a time (Note [host repack]). The results in
docs/BENCHMARKS.md section 6.2 come from this script on the H200 host and the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from mpack import target
from mpack.convert import host_repack

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--blocks", default="0,4,8,16,32", help="k-tiles per pass, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not host_repack.available():
        ap.error("the host repack extension is not built here")
    results: dict[str, dict[str, float]] = {}
    for kb in (int(b) for b in a.blocks.split(",")):
        host_repack.K_BLOCK = kb
        row = {}
        for name, (n, k) in SHAPES.items():
            w = np.full((n, k), 7, np.uint8)
            np_, kp = target.padded_nk(n, k)
            out = np.zeros(target.packed_weight_shape(np_, kp), np.int32)
            rows = host_repack.rows_of(w)
            host_repack.pack_rows(rows, k, np_, kp, None, out)  # warm-up: pages touched
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                host_repack.pack_rows(rows, k, np_, kp, None, out)
                times.append(time.perf_counter() - t)
            row[name] = round(n * k / statistics.median(times) / 1e9, 2)
        results[str(kb)] = row
        print(f"K_BLOCK {kb:3}: " + ", ".join(f"{s} {v} GB/s" for s, v in row.items()), flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
