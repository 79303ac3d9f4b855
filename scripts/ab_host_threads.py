"""A/B of the host path's repack thread count, per CPU count (Note [host repack]).

    python scripts/ab_host_threads.py SRC OUT --cases 4:2,4:4,16:12,16:16 [--json FILE]

Each case ``C:T`` runs ``mpack convert SRC -o OUT --device cpu --force --json`` in a fresh
process under ``taskset -c 0-(C-1)`` with ``T`` repack threads (the process sets
``host_repack.block_workers`` before the CLI runs), SRC warm, OUT removed and every dirty page
written back first. Prints the wall time, the CPU time of the process and its scheme-check child
(user and system, from ``getrusage``) and the process's own phases of each, in order.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

WRAP = (
    "import sys\n"
    "from mpack.convert import host_repack\n"
    "threads = int(sys.argv.pop(1))\n"
    "host_repack.block_workers = lambda: threads\n"
    "from mpack.cli import main\n"
    "sys.argv[0] = 'mpack'\n"
    "main()\n"
)


def one(src: Path, out: Path, cores: int, threads: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    cmd = ["taskset", "-c", f"0-{cores - 1}", sys.executable, "-c", WRAP, str(threads),
           "convert", str(src), "-o", str(out), "--device", "cpu", "--force", "--json"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"case {cores}:{threads} failed ({r.returncode}): {r.stderr[-2000:]}")
    summary = json.loads(r.stdout)
    return {"cores": cores, "threads": threads, "wall": round(wall, 3),
            "user": round(after.ru_utime - before.ru_utime, 3),
            "sys": round(after.ru_stime - before.ru_stime, 3),
            "seconds": {k: round(v, 3) for k, v in summary.get("seconds", {}).items()}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="4:2,4:4,16:12,16:16")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",") if c]
    have = len(os.sched_getaffinity(0))
    results = []
    for cores, threads in cases:
        if cores > have:
            print(f"{cores}:{threads}: skipped, {have} CPUs here", flush=True)
            continue
        res = one(a.src, a.out, cores, threads)
        s = res["seconds"]
        print(f"{cores} cores, {threads} repack threads: {res['wall']:.2f} s wall, CPU user "
              f"{res['user']:.2f} s + sys {res['sys']:.2f} s; "
              f"transform_busy {s.get('transform_busy', 0):.2f}, write_wait "
              f"{s.get('write_wait', 0):.2f}, wait_scheme_check {s.get('wait_scheme_check', 0):.2f}",
              flush=True)  # fmt: skip
        results.append(res)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
