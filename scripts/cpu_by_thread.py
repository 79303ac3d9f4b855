"""Where an mpack command's CPU time goes, thread by thread.

    python scripts/cpu_by_thread.py [--json F] [--label L] -- convert SRC -o OUT --device cpu

Runs mpack's CLI in this process with a sampler thread beside it: every ``--every`` seconds it
reads each live Python thread's CPU time (user and system, ``/proc/self/task/<tid>/stat``) and
keeps the last value per thread. At the end it prints CPU-seconds per group of threads (the pool
a thread belongs to: mpack names its pools' threads ``mpack-<pool>_<i>``; ``MainThread`` is the
transform stage and the main flow), the process total (``getrusage``), what the sampler did not
see (threads that ended between two samples, the interpreter's start), and the children's (the
forked scheme check). This is the profile behind docs/BENCHMARKS.md's "what bounds the 4-core
row": it says which stage burns the CPU that a 4-core machine runs out of. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu(tid: int) -> float | None:
    """User + system seconds of thread ``tid`` of this process (None once it is gone)."""
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15)


def _group(name: str) -> str:
    """``mpack-repack_3`` -> ``repack``; other names as they are."""
    if name.startswith("mpack-"):
        return name[len("mpack-") :].rsplit("_", 1)[0]
    return name


class Sampler:
    def __init__(self, every: float) -> None:
        self.every = every
        self.last: dict[tuple[int, str], float] = {}  # (tid, name) -> CPU seconds
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id is None or t is self._t:
                continue
            cpu = _thread_cpu(t.native_id)
            if cpu is not None:
                self.last[(t.native_id, t.name)] = cpu

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample()
        self._stop.set()
        self._t.join()

    def groups(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, name), cpu in self.last.items():
            out[_group(name)] = out.get(_group(name), 0.0) + cpu
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="append the result as one JSON line to this file")
    ap.add_argument("--label", default="", help="a name for this run in the output")
    ap.add_argument("--every", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then mpack's CLI arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args:
        ap.error("give mpack's arguments after --")

    from mpack.cli import main as mpack_main

    t0 = time.perf_counter()
    code = 0
    with Sampler(a.every) as s:
        sys.argv = ["mpack", *args]
        try:
            mpack_main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    wall = time.perf_counter() - t0
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    groups = s.groups()
    total = me.ru_utime + me.ru_stime
    result = {
        "label": a.label,
        "args": args,
        "exit": code,
        "wall_s": round(wall, 3),
        "cores": len(os.sched_getaffinity(0)),
        "process_cpu_s": {"user": round(me.ru_utime, 2), "system": round(me.ru_stime, 2)},
        "children_cpu_s": {"user": round(kids.ru_utime, 2), "system": round(kids.ru_stime, 2)},
        "threads_cpu_s": {k: round(v, 2) for k, v in groups.items()},
        "unseen_cpu_s": round(total - sum(groups.values()), 2),
    }
    print(
        f"{a.label or ' '.join(args)}: exit {code}, wall {wall:.2f} s on {result['cores']} cores",
        file=sys.stderr,
    )
    print(
        f"  process CPU {total:.2f} s (user {me.ru_utime:.2f}, system {me.ru_stime:.2f}); "
        f"children {kids.ru_utime + kids.ru_stime:.2f} s",
        file=sys.stderr,
    )
    for name, cpu in groups.items():
        print(f"  {name:24} {cpu:7.2f} s", file=sys.stderr)
    print(f"  {'(unseen)':24} {result['unseen_cpu_s']:7.2f} s", file=sys.stderr)
    if a.json:
        with a.json.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
