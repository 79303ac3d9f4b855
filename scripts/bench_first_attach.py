"""The first ``attach()`` of a fresh process, with and without ``mpack.runtime.warm`` first.

    python scripts/bench_first_attach.py SIDECAR [--device cpu|cuda:0] [--runs 3] [--clients 1]
        [--steps]

bench_vs_tools' ``first-attach`` row for any sidecar (one with the 8B sidecar's tensor count,
say, without its checkpoint): one ``mpack serve SIDECAR`` (``mpack.runtime.spawn``, default
socket), then ``--runs`` rounds each way of ``--clients`` fresh processes that import torch and
``mpack.runtime``, call ``warm(device)`` or not, initialise CUDA on a GPU, wait at a barrier,
then time the first ``attach()`` and a second one (the peer: what the first costs beyond it is
the one-time work Note [warm attach] is about). The clients are bench_vs_tools' workers
(bench_vt/workers.py ``w_first_attach``), the rows its rows. Prints one JSON line per client,
then the table; figures go to docs/BENCHMARKS.md, section 10. ``--steps``: the notes also say
where each attach's milliseconds go (client steps; on a GPU the VMM import, map and torch view).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_rt.procs import kill_all, serve, worker  # noqa: E402
from bench_vt.report import print_table  # noqa: E402
from bench_vt.rows import SCRIPT  # noqa: E402
from bench_vt.runtime_rows import first_attach_rows, first_attach_runs  # noqa: E402
from benchutil import exit_on_signals, scratch_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sidecar")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3, help="rounds each way")
    ap.add_argument("--clients", type=int, default=1, help="processes released together")
    ap.add_argument(
        "--steps", action="store_true", help="also time attach's steps (in the table's notes)"
    )
    a = ap.parse_args()
    if a.runs < 1 or a.clients < 1:
        ap.error("--runs and --clients must be positive")
    exit_on_signals()
    tmp, env = scratch_dir("bfa-")
    try:
        with serve(Path(a.sidecar).resolve(), 0, a.device, None, env, tmp) as d:
            print(f"mpack serve READY in {d.ready_s:.2f} s", flush=True)
            args = {
                "sidecar": str(Path(a.sidecar).resolve()),
                "rank": 0,
                "device": a.device,
                "steps": a.steps,
            }
            start = partial(worker, SCRIPT, "first-attach", env=env, cwd=tmp)
            docs = first_attach_runs(start, {**args, "socket": None}, a.clients, a.runs)
    finally:
        kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
    for doc in docs:
        print(json.dumps(doc), flush=True)
    print_table(first_attach_rows(a.clients, a.device, docs), [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
