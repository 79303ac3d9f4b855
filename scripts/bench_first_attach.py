"""The first ``attach()`` of a fresh process, with and without ``mpack.runtime.warm`` first.

    python scripts/bench_first_attach.py SIDECAR [--device cpu|cuda:0] [--runs 3]

Starts one ``mpack serve SIDECAR`` (``mpack.runtime.spawn``), then, ``--runs`` times each way,
a fresh process that imports torch and ``mpack.runtime`` and times: ``warm(device)`` (or
nothing), the first ``attach()`` and a second one. The second attach is the peer: what the first
costs beyond it is the one-time work Note [warm attach] is about. Prints one JSON line per run
and a summary; figures go to docs/BENCHMARKS.md, section 10.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
import torch
import mpack.runtime as rt
sidecar, device, how = sys.argv[1:4]
t0 = time.perf_counter()
if how == "warm":
    rt.warm(device)
t1 = time.perf_counter()
first = rt.attach(sidecar, rank=0, device=device)
t2 = time.perf_counter()
second = rt.attach(sidecar, rank=0, device=device)
t3 = time.perf_counter()
print(json.dumps({"how": how, "warm_ms": (t1 - t0) * 1e3, "first_ms": (t2 - t1) * 1e3,
                  "second_ms": (t3 - t2) * 1e3, "tensors": len(first)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sidecar")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    from mpack.runtime.spawn import DaemonHandle

    runs: list[dict] = []
    with DaemonHandle(a.sidecar, device=a.device) as d:
        d.wait_ready()
        for _ in range(a.runs):
            for how in ("cold", "warm"):
                cmd = [sys.executable, "-c", CHILD, a.sidecar, a.device, how]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), flush=True)
    for how in ("cold", "warm"):
        mine = [r for r in runs if r["how"] == how]
        med = {k: round(statistics.median(r[k] for r in mine), 2) for k in mine[0] if "ms" in k}
        print(f"{how}: median {med} over {len(mine)} runs, {mine[0]['tensors']} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
