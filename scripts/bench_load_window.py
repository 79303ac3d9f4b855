"""The window vLLM times as "Model loading took", for ``--load-format mpack``, on the CPU with
vLLM 0.33.0's real classes (Note [the heap frozen for vLLM's collections] in
runtime/vllm/loader.py).

One fresh process per run, doing what vLLM's worker and model runner do around a load, in their
order: the worker's full ``gc.collect()``, its ``get_external_weight_memory`` question, then
``DeviceMemoryProfiler``'s collection, the loader's ``load_model``, and the profiler's two
collections. ``--before`` runs the same with the loader's ``gc.freeze`` calls made no-ops (what
the loader did before the note). Runs alternate, before and now; one JSON line each.

    .venv-vllm/bin/python scripts/bench_load_window.py SIDECAR [--socket SOCK] [--runs 2]

Without ``--socket`` the load is private (``attach: never``); with it, attached to the daemon
``mpack serve SIDECAR --device cpu --socket SOCK`` started beforehand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(sidecar: str, sock: str | None, before: bool) -> dict[str, float]:
    """One load in this process (a fresh one: the heap's size is the point)."""
    import gc

    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    import cpu_standins

    cpu_standins.install()  # before vLLM is imported
    import vllm_worker
    from vllm.utils.network_utils import get_open_port

    from mpack.runtime.vllm import loader, register

    register()
    if before:
        loader.gc = type("NoFreeze", (), {"freeze": staticmethod(lambda: None)})
    extra = {"attach": "require", "socket": sock} if sock else {"attach": "never"}
    load = {"model": sidecar, "profile": "w8a8-marlin", "dtype": "bfloat16",
            "load_format": "mpack", "extra": extra}  # fmt: skip
    cfg = vllm_worker.engine_config(load, 1)
    vllm_worker.join_world(cfg, tp=1, pp=1, rank=0, port=get_open_port())
    gc.collect()  # the worker's, before it asks about external weights
    vllm_worker.external_weight_memory(cfg)
    t0 = time.perf_counter()
    gc.collect()  # DeviceMemoryProfiler.__enter__
    t1 = time.perf_counter()
    model = vllm_worker.build(cfg)
    t2 = time.perf_counter()
    gc.collect()  # DeviceMemoryProfiler.__exit__: current_memory_usage, then its own
    gc.collect()
    t3 = time.perf_counter()
    return {"before": before, "tracked_objects": len(gc.get_objects()),
            "enter_collect_s": round(t1 - t0, 4), "load_model_s": round(t2 - t1, 4),
            "exit_collects_s": round(t3 - t2, 4), "window_s": round(t3 - t0, 4),
            "mpack_phases": getattr(model, "_mpack_load", {}).get("seconds")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sidecar")
    ap.add_argument("--socket", default=None, help="an mpack serve daemon's socket: attach")
    ap.add_argument("--runs", type=int, default=2, help="runs of each, alternating")
    ap.add_argument("--one", choices=("before", "now"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.sidecar, a.socket, a.one == "before")), flush=True)
        return 0
    for _ in range(a.runs):
        for which in ("before", "now"):
            cmd = [sys.executable, __file__, a.sidecar, "--one", which]
            cmd += ["--socket", a.socket] if a.socket else []
            r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return r.returncode
            print(r.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
