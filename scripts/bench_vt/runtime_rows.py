"""The runtime's rows: ``mpack.runtime.load`` against ``safetensors`` ``load_file`` (warm) or a
plain read of the same files (cold); ``attach`` + first touch in fresh client processes; the
first ``attach`` of a process against its second; ``mpack serve`` to READY against ``load`` in a
fresh process. All read rank 0 of the sidecar ``rows.ensure_sidecar`` made: its rank file and
``common.safetensors``.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench_rt.procs import CLIENT_TIMEOUT_S, READY_TIMEOUT_S, BenchError, Child, serve
from bench_rt.system import ensure_warm
from benchutil import read_files, run_timed

from .report import Row, secs
from .rows import RT_SCRIPT, SCRIPT, Bench, cache_state, ensure_sidecar


def rank_files(b: Bench) -> tuple[list[Path], str]:
    """Rank 0's files, and the tensor the clients touch (the first packed weight: int32)."""
    from mpack.runtime.allocation import plan_rank

    plan = plan_rank(b.out, 0)
    t = next((e for e in plan.tensors if e.dtype == "I32"), plan.tensors[0])
    return [r.path for r in plan.regions], t.name


def _peer_runs(b: Bench, dev: str, files: list[Path], probe: str, temp: str) -> list[float]:
    """Warm: ``load_file`` of ``files`` in a fresh process (bench_runtime's ``safetensors``
    worker: after CUDA init; on CPU each tensor cloned, a private copy). Cold: a plain
    sequential read of them here, page cache dropped first (the disk floor)."""
    out = []
    for _ in range(b.args.reps):
        if temp == "warm":
            ensure_warm(files)
            args = {"device": dev, "files": [str(p) for p in files], "probe": probe, "cold": "none"}
            out.append(b.run_worker(RT_SCRIPT, "safetensors", args, "safetensors")["seconds"])
        else:
            cache_state(b, files, temp)
            out.append(read_files(files))
    return out


def row_load(b: Bench, dev: str, convert_dev: str, temp: str) -> Row:
    """``mpack.runtime.load(OUT, rank=0, device=dev)`` in a fresh process per run, timed after
    CUDA init; against ``load_file`` (warm) or the disk read (cold)."""
    ensure_sidecar(b, convert_dev)
    files, probe = rank_files(b)
    runs = []
    for _ in range(b.args.reps):
        state = cache_state(b, files, temp)
        r = b.run_worker(SCRIPT, "load", {"sidecar": str(b.out), "rank": 0, "device": dev}, "load")
        runs.append({**r, "state": state})
    peers = _peer_runs(b, dev, files, probe, temp)
    best, peer = min(r["seconds"] for r in runs), min(peers)
    kind = dev.partition(":")[0]
    r0 = runs[0]
    cuda = f", CUDA init {r0['cuda_s']:.2f} s" if kind == "cuda" else ""
    notes = [
        f"{r0['tensors']} tensors, {r0['bytes'] / 1e9:.2f} GB; before the timed part: "
        f"imports {r0['import_s']:.2f} s{cuda}"
    ]
    label = "`load_file`" if temp == "warm" else "disk read"
    what = f'`mpack.runtime.load(..., device="{dev}")`, ' + (
        "warm" if temp == "warm" else "page cache dropped"
    )
    return Row(
        f"load-{kind}" + ("-cold" if temp == "cold" else ""),
        what,
        best,
        now=secs(best),
        peer=peer,
        peer_text=f"{label} {secs(peer)}",
        notes=notes,
        runs={"runs": runs, "peer_runs": peers},
    )


def rows_attach(b: Bench, dev: str, convert_dev: str) -> list[Row]:
    """One ``mpack serve`` (started with ``mpack.runtime.spawn``); for each ``--clients`` N,
    ``--reps`` rounds of N fresh clients released together: one row per N."""
    ensure_sidecar(b, convert_dev)
    files, name = rank_files(b)
    ensure_warm(files)
    rows = []
    with serve(b.out, 0, dev, b.tmp / "s.sock", b.env, b.tmp) as d:
        print(
            f"  mpack serve READY in {d.ready_s:.1f} s (load_s {d.ready.load_s:.2f} s)", flush=True
        )
        args = {
            "sidecar": str(b.out),
            "rank": 0,
            "device": dev,
            "socket": str(d.socket),
            "tensor": name,
        }
        for n in b.args.clients:
            docs = [x for _ in range(b.args.reps) for x in attach_round(b, n, args)]
            rows.append(attach_row(n, docs, name, dev != "cpu"))
            print(f"  {n} client(s): {rows[-1].now}", flush=True)
    return rows


def attach_round(b: Bench, n: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """``n`` fresh ``attach`` clients released together (``barrier_round``)."""
    return barrier_round([b.worker(SCRIPT, "attach", args) for _ in range(n)], "attach_ms")


def barrier_round(kids: list[Child], key: str) -> list[dict[str, Any]]:
    """Fresh clients (workers that say ``ready``, then wait for ``go``); once every one is
    ready (the barrier), ``go`` to all; the line holding ``key`` of each, merged with its ready
    line and ``start_s``: from starting the process to its ready line. Every client is ended
    (stdin closed) before this returns."""
    try:
        ready = []
        for k in kids:
            t, line = k.read_line(CLIENT_TIMEOUT_S, lambda s: s.startswith("{"))
            doc = json.loads(line)
            if "ready" not in doc:
                raise BenchError(f"{k.name}: {doc}\n{k.tail()}")
            ready.append({**doc, "start_s": t - k.t0})
        for k in kids:
            k.send("go")
        return [{**r, **k.read_json(key)} for r, k in zip(ready, kids, strict=True)]
    finally:
        for k in kids:  # EOF on stdin: it closes its mapping and exits
            k.end(None, 60)


def _mm(docs: list[dict[str, Any]], key: str, fmt: str = ".1f") -> str:
    xs = [d[key] for d in docs]
    return f"max {max(xs):{fmt}} / median {statistics.median(xs):{fmt}}"


def steps_note(steps: list[dict[str, float]], what: str, digits: int) -> str:
    """ "where WHAT time goes": each step's median milliseconds over the clients (a client's
    ``{step: ms}``, bench_vt/workers.py ``_time_phases``); the rest of an attach is checks and
    building the result."""
    keys = dict.fromkeys(k for got in steps for k in got)  # in the order the steps ran
    parts = ", ".join(
        f"{k.lstrip('_')} {statistics.median(got.get(k, 0.0) for got in steps):.{digits}f}"
        for k in keys
    )
    return f"where {what} time goes, median ms: {parts}"


def attach_row(n: int, docs: list[dict[str, Any]], name: str, cuda: bool) -> Row:
    """attach + first touch (Note [first touch] in bench_vt/workers.py): max and median over
    every client of every round; attach only, first touch only and start-up in the notes."""
    tot = [d["total_ms"] for d in docs]
    at = "alone" if n == 1 else f"{n} at once"
    init = f", CUDA init {_mm(docs, 'cuda_s', fmt='.2f')} s" if cuda else ""
    notes = [
        f"attach only {_mm(docs, 'attach_ms')} ms, first touch only {_mm(docs, 'touch_ms')} ms "
        f"({name}, {docs[0]['tensors']} tensors, {len(docs)} client(s) in all)",
        f"start-up before the barrier (not in the times): process start to ready "
        f"{_mm(docs, 'start_s', fmt='.2f')} s, of which import torch + mpack "
        f"{_mm(docs, 'import_s', fmt='.2f')} s{init}",
    ]
    if docs[0].get("phases_ms"):
        notes.append(steps_note([d["phases_ms"] for d in docs], "attach's", 1))
    if len({d["seen"] for d in docs}) > 1:
        notes.append(
            f"WARNING: the clients read different values: {sorted({d['seen'] for d in docs})}"
        )
    return Row(
        f"attach-{n}",
        f"`attach` + first touch, fresh process, {at}",
        max(tot),
        unit="ms",
        now=f"{max(tot):.1f} ms max, {statistics.median(tot):.1f} median",
        notes=notes,
        runs={"clients": docs},
    )


# --- the first attach of a process ---------------------------------------------------------------


def first_attach_runs(
    start: Callable[[dict[str, Any]], Child], args: dict[str, Any], n: int, reps: int
) -> list[dict[str, Any]]:
    """``reps`` rounds each way, alternating: ``n`` fresh ``first-attach`` workers (``start``
    makes one from its arguments: ``args`` plus ``warm``) released together; every client's
    figures (bench_vt/workers.py ``w_first_attach``), ``warm`` among them."""
    docs = []
    for _ in range(reps):
        for warm in (False, True):
            kids = [start({**args, "warm": warm}) for _ in range(n)]
            docs += barrier_round(kids, "first_ms")
    return docs


def first_attach_rows(n: int, dev: str, docs: list[dict[str, Any]]) -> list[Row]:
    """Two rows for ``n`` clients at once, after ``warm`` and without: the first ``attach`` of
    each process (max and median over every client of every round) against the second of the
    same processes (the peer); the start-up before the barrier in the notes. The targets are on
    the first attach itself (report.TARGETS ``first-attach-*``)."""
    kind = dev.partition(":")[0]
    at = "alone" if n == 1 else f"{n} at once"
    rows = []
    for warm in (True, False):
        mine = [d for d in docs if d["warm"] == warm]
        first, second = [d["first_ms"] for d in mine], [d["second_ms"] for d in mine]
        init = f", CUDA init {_mm(mine, 'cuda_s', fmt='.2f')} s" if kind == "cuda" else ""
        how = f", `warm` {_mm(mine, 'warm_s', fmt='.3f')} s" if warm else ""
        notes = [
            f"{mine[0]['tensors']} tensors, {len(mine)} client(s) in all; start-up before the "
            f"barrier (not in the times): process start to ready {_mm(mine, 'start_s', '.2f')} "
            f"s, of which import torch + mpack.runtime {_mm(mine, 'import_s', '.2f')} s{how}"
            f"{init}"
        ]
        for which in ("first", "second"):
            got = [d[f"{which}_steps_ms"] for d in mine if f"{which}_steps_ms" in d]
            if got:
                notes.append(steps_note(got, f"the {which} attach's", 2))
        if not all(d["same"] for d in mine):
            notes.append("WARNING: a second attach did not see the first one's sidecar")
        rows.append(
            Row(
                f"first-attach-{kind}-{n}" + ("" if warm else "-nowarm"),
                f"first `attach`, fresh process, {at}, "
                + ("after `warm`" if warm else "no `warm`"),
                max(first),
                unit="ms",
                now=f"{max(first):.1f} ms max, {statistics.median(first):.1f} median",
                peer=max(second),
                peer_text=f"second `attach` {max(second):.1f} ms max, "
                f"{statistics.median(second):.1f} median",
                notes=notes,
                runs={"clients": mine},
            )
        )
    return rows


def rows_first_attach(b: Bench, dev: str, convert_dev: str) -> list[Row]:
    """One ``mpack serve OUT --device dev`` on its default socket (``mpack.runtime.spawn``);
    for each ``--clients`` N, ``first_attach_runs``: two rows per N."""
    ensure_sidecar(b, convert_dev)
    ensure_warm(rank_files(b)[0])
    pyc = getattr(importlib.util.find_spec("mpack.runtime.client"), "cached", None)
    if b.env.get("PYTHONDONTWRITEBYTECODE") and pyc and not Path(pyc).exists():
        b.say(
            "PYTHONDONTWRITEBYTECODE is set and mpack has no bytecode cache: a first attach "
            "without `warm` also compiles the modules it imports"
        )
    rows = []
    with serve(b.out, 0, dev, None, b.env, b.tmp) as d:  # None: the default socket
        print(f"  mpack serve READY in {d.ready_s:.1f} s", flush=True)
        args = {"sidecar": str(b.out), "rank": 0, "device": dev, "socket": None}
        for n in b.args.clients:
            docs = first_attach_runs(
                partial(b.worker, SCRIPT, "first-attach"), args, n, b.args.reps
            )
            rows += first_attach_rows(n, dev, docs)
            print(f"  {n} client(s): {rows[-2].now} after warm, {rows[-1].now} without", flush=True)
    return rows


# --- serve to READY ------------------------------------------------------------------------------

#: The serve row's peer: the same rank loaded privately (``mpack.runtime.load``) by a fresh
#: process; the parent times it from starting the process to this script's line.
LOAD_PEER = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from mpack.runtime import load
t1 = time.perf_counter()
w = load(sys.argv[1], rank=0, device=sys.argv[2])
if sys.argv[2] != "cpu":
    torch.cuda.synchronize(sys.argv[2])
out = {"import_s": t1 - t0, "load_s": time.perf_counter() - t1, "tensors": len(w)}
print(json.dumps(out), flush=True)
"""


def serve_run(b: Bench, dev: str, files: list[Path]) -> dict[str, Any]:
    """``mpack serve OUT --device dev`` (default socket) from a warm page cache to READY, then
    stopped: ``ready_s`` (process start to READY, ``spawn``'s own count) and the READY line's
    fields."""
    state = cache_state(b, files, "warm")
    with serve(b.out, 0, dev, None, b.env, b.tmp) as d:
        r = d.ready
        assert r is not None and d.ready_s is not None
        return {
            "ready_s": d.ready_s,
            "load_s": r.load_s,
            "backend": r.backend,
            "bytes": r.bytes,
            "state": state,
        }


def load_peer_run(b: Bench, dev: str, files: list[Path]) -> dict[str, Any]:
    """``LOAD_PEER`` from a warm page cache: ``wall`` (process start to its line) and its own
    ``import_s`` and ``load_s``."""
    cache_state(b, files, "warm")
    k = Child("load-peer", [sys.executable, "-c", LOAD_PEER, str(b.out), dev], b.env, b.tmp)
    try:
        t, line = k.read_line(READY_TIMEOUT_S, lambda s: s.startswith("{"))
        return {**json.loads(line), "wall": t - k.t0}
    finally:
        k.end(None, 60)


def bare_start(b: Bench) -> float:
    """``python -c "import mpack"``, start to exit: the interpreter's own share."""
    r = run_timed([sys.executable, "-c", "import mpack"], env=b.env, cwd=b.tmp)
    if r.returncode:
        raise BenchError(f"python -c 'import mpack' exited with {r.returncode}: {r.stderr}")
    return r.wall


def row_serve(b: Bench, dev: str, convert_dev: str) -> Row:
    """``mpack serve`` to READY against ``mpack.runtime.load`` of the same rank in a fresh
    process (``LOAD_PEER``), each run once untimed, then ``--reps`` times alternating; the
    floor (bare interpreter start + the daemon's own ``load_s``) in the notes."""
    ensure_sidecar(b, convert_dev)
    files = rank_files(b)[0]
    untimed = {  # what each start reads is in the page cache after these
        "serve": serve_run(b, dev, files),
        "peer": load_peer_run(b, dev, files),
        "bare": bare_start(b),
    }
    runs, peers, bare = [], [], []
    for _ in range(b.args.reps):
        runs.append(serve_run(b, dev, files))
        peers.append(load_peer_run(b, dev, files))
        bare.append(bare_start(b))
    best = min(runs, key=lambda r: r["ready_s"])
    peer = min(peers, key=lambda r: r["wall"])
    floor = min(bare) + best["load_s"]
    notes = [
        f"the daemon's fill (READY's load_s) {secs(best['load_s'])}, {best['backend']} backend, "
        f"{best['bytes'] / 1e9:.2f} GB; floor: `python -c 'import mpack'` {secs(min(bare))} + "
        f"that fill = {secs(floor)}, so {secs(best['ready_s'] - floor)} of READY is the "
        "daemon's imports, device start-up, export and listen",
        f"the peer's own account: import torch + mpack.runtime {secs(peer['import_s'])}, "
        f"`load` {secs(peer['load_s'])} ({peer['tensors']} tensors)",
    ]
    return Row(
        f"serve-{dev.partition(':')[0]}",
        f"`mpack serve OUT --device {dev}` to READY, process start included, warm",
        best["ready_s"],
        now=secs(best["ready_s"]),
        peer=peer["wall"],
        peer_text=f"`load` in a fresh process {secs(peer['wall'])}",
        notes=notes,
        runs={"runs": runs, "peer_runs": peers, "bare_runs": bare, "untimed": untimed},
    )
