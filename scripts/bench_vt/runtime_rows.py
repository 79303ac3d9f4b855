"""The runtime's rows: ``mpack.runtime.load`` against ``safetensors`` ``load_file`` (warm) or a
plain read of the same files (cold), and ``attach`` + first touch in fresh client processes.
Both read rank 0 of the sidecar ``rows.ensure_sidecar`` made: its rank file and
``common.safetensors``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench_rt.procs import CLIENT_TIMEOUT_S, BenchError, serve
from bench_rt.system import ensure_warm
from benchutil import read_files

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
    """``n`` fresh clients; once every one is ready (the barrier), ``go`` to all; their times,
    each with ``start_s``: from starting the process to its ready line."""
    kids = [b.worker(SCRIPT, "attach", args) for _ in range(n)]
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
        return [{**r, **k.read_json("attach_ms")} for r, k in zip(ready, kids, strict=True)]
    finally:
        for k in kids:  # EOF on stdin: it closes its mapping and exits
            k.end(None, 60)


def _mm(docs: list[dict[str, Any]], key: str, fmt: str = ".1f") -> str:
    xs = [d[key] for d in docs]
    return f"max {max(xs):{fmt}} / median {statistics.median(xs):{fmt}}"


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
    steps = docs[0].get("phases_ms") or {}
    if steps:  # medians over the clients; the rest is checks and building the result
        med = {k: statistics.median(d["phases_ms"].get(k, 0.0) for d in docs) for k in steps}
        parts = ", ".join(f"{k.lstrip('_')} {v:.1f}" for k, v in med.items())
        notes.append(f"where attach's time goes, median ms: {parts}")
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
