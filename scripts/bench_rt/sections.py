"""The benchmark's run (``Ctx``) and its sections, each a ``section_*(c)`` that returns its
results and prints what it measured: floor, serve, safetensors, attach, torch_mp
(scripts/bench_runtime.py's docstring says what each measures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchutil import proc_status_bytes

from mpack.runtime.spawn import DaemonHandle

from . import GB, MiB
from .procs import CLIENT_TIMEOUT_S, Child, own_groups, run_worker, serve, worker
from .report import gbps, gib, meta
from .system import OWN_MEMORY, ensure_warm, evict, host_memory, mem_summary
from .workers import DEPTH

SCRIPT = Path(__file__).resolve().parents[1] / "bench_runtime.py"  # the workers' entry point


@dataclass
class Ctx:
    """One run: the options, the sidecar and the rank's bytes (``regions``: file, offset in the
    allocation, size), the scratch directory and the children's environment, the results."""

    args: argparse.Namespace
    sidecar: Path
    tmp: Path
    env: dict[str, str]
    regions: list[tuple[Path, int, int]]
    total: int
    tensors: int
    probe: str
    meminfo: Child | None = None
    smi_id: str | None = None
    res: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def cuda(self) -> bool:
        return self.args.device != "cpu"

    @property
    def files(self) -> list[Path]:
        return [r[0] for r in self.regions]

    @property
    def socket(self) -> Path:
        return self.tmp / "s.sock"

    def worker(self, kind: str, args: dict[str, Any]) -> Child:
        return worker(SCRIPT, kind, args, self.env, self.tmp)

    def run_worker(self, kind: str, args: dict[str, Any], key: str, timeout: float) -> Any:
        return run_worker(SCRIPT, kind, args, key, timeout, self.env, self.tmp)

    def serve(self, *args: str) -> contextlib.AbstractContextManager[DaemonHandle]:
        """``mpack serve ... *args`` in a fresh process, READY, stopped when the block ends
        (``procs.serve``)."""
        return serve(
            self.sidecar, self.args.rank, self.device, self.socket, self.env, self.tmp, args
        )

    # --- memory ------------------------------------------------------------------------------

    def mem_sample(self) -> int:
        if not self.cuda:
            return host_memory(own_groups())
        if self.meminfo is None:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=memory.used",
                    "--format=csv,noheader,nounits",
                    "-i",
                    str(self.smi_id),
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            return int(out.split()[0]) * MiB
        self.meminfo.send("q")
        return int(self.meminfo.read_json("used")["used"])

    def mem(self, settle: float = 1.0) -> int:
        """Memory in use once things settled: the median of 3 samples."""
        time.sleep(settle)
        samples = []
        for _ in range(3):
            samples.append(self.mem_sample())
            time.sleep(0.15)
        return int(statistics.median(samples))


def smi_id(device: str) -> str | None:
    """The nvidia-smi id of ``cuda:N`` (through CUDA_VISIBLE_DEVICES), None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    n = int(device.partition(":")[2] or 0)
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return vis[n] if n < len(vis) else str(n)


def choose_memory_source(c: Ctx) -> None:
    """How ``c.mem`` samples: host memory on CPU; on CUDA nvidia-smi, else (none, or it fails)
    a ``meminfo`` worker that asks the driver (its own context: a constant). Recorded in meta."""
    if c.cuda:
        c.smi_id = smi_id(c.device)
        if c.smi_id is not None:
            try:
                c.mem_sample()
            except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
                print(f"nvidia-smi -i {c.smi_id} failed ({e}): asking the driver instead")
                c.smi_id = None
        if c.smi_id is None:
            c.meminfo = c.worker("meminfo", {"device": c.device})
            c.meminfo.read_json("ready", CLIENT_TIMEOUT_S)
    c.res["meta"] = meta(c)
    c.res["meta"]["memory_source"] = (
        "Shmem + RssAnon of ours"
        if not c.cuda
        else "nvidia-smi"
        if c.meminfo is None
        else "torch.mem_get_info"
    )


# --- sections ------------------------------------------------------------------------------------


def section_floor(c: Ctx) -> dict[str, Any]:
    chunks = [int(x) for x in c.args.floor_chunks.split(",")]
    f = c.run_worker(
        "floor",
        {
            "device": c.device,
            "regions": [[str(p), o, n] for p, o, n in c.regions],
            "total": c.total,
            "depth": DEPTH,
            "chunks": chunks,
            "reps": c.args.warm_reps,
            "cold": c.args.cold,
        },
        "floor",
        1800,
    )
    f["copy_warm_best"] = min(min(v) for v in f["copy_warm"].values())
    b = c.total
    copy = "file -> pinned -> device" if c.cuda else "file -> shared mapping"
    for k in ("copy_cold", "read_cold"):
        st = f.get(k + "_state")
        if st and not st["cold"]:
            print(f"  WARNING: {k} was not cold: {st}")
    print(
        f"  {copy} ({f['best_chunk_mib']} MiB x {DEPTH}): cold {f.get('copy_cold', 0):.2f} s "
        f"({gbps(b, f.get('copy_cold'))}), warm {f['copy_warm_best']:.2f} s "
        f"({gbps(b, f['copy_warm_best'])})"
    )
    print(
        f"  read only: cold {f.get('read_cold', 0):.2f} s ({gbps(b, f.get('read_cold'))}), warm "
        f"{min(f['read_warm']):.2f} s ({gbps(b, min(f['read_warm']))}); per chunk (warm, s): "
        + ", ".join(f"{k} MiB {min(v):.2f}" for k, v in f["copy_warm"].items())
    )
    print(
        f"  sha256, one thread: {f['sha256_gbps']:.2f} GB/s ({b / GB / f['sha256_gbps']:.2f} s "
        "for these bytes as one stream; serve hashes 64 MiB chunks on several threads)"
    )
    return f


def _cold_and_warm(c: Ctx, one: Callable[[str], dict[str, Any]], key: str) -> dict[str, Any]:
    """``one("cold")`` once (unless ``--cold none``), then ``one("warm")`` ``--warm-reps`` times;
    ``warm_best`` is the smallest ``key`` of the warm runs."""
    out: dict[str, Any] = {"warm": []}
    for temp in (["cold"] if c.args.cold != "none" else []) + ["warm"] * c.args.warm_reps:
        r = one(temp)
        if temp == "cold":
            out["cold"] = r
        else:
            out["warm"].append(r)
    out["warm_best"] = min(r[key] for r in out["warm"]) if out["warm"] else None
    return out


#: The phases of the ready event's ``startup`` field (runtime/daemon.py ``Startup``), in order.
PHASES = ("imports", "plan", "device", "lock", "alloc", "fill", "seal", "listen")


def _startup_of(d: DaemonHandle) -> dict[str, Any] | None:
    """The ``startup`` field of the ready event a ``serve --json`` daemon printed (None from a
    daemon too old to say it)."""
    if d.out_path is None:
        return None
    for line in Path(d.out_path).read_text().splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "ready":
                return doc.get("startup")
    return None


def _phases_line(s: dict[str, Any] | None) -> str:
    if not s:
        return "no startup phases (an older mpack)"
    parts = [f"{p} {s[p + '_s']:.3f}" for p in PHASES if s.get(p + "_s") is not None]
    return (
        ", ".join(parts)
        + f"; hashed {s.get('hashed_bytes', 0) / GB:.2f} GB, trusted "
        + f"{s.get('trusted_bytes', 0) / GB:.2f} GB"
    )


def section_serve(c: Ctx) -> dict[str, Any]:
    """``mpack serve --json`` to READY, the ready event's phases each time. ``--verify always``
    (every file hashed) warm; ``--verify auto`` cold and warm, after a first start recorded the
    files as verified (Note [verified files] in mpack/cache.py: a file changed within a second
    of its read is not recorded, so the files' age is waited out first)."""

    def one(temp: str, verify: str = "auto") -> dict[str, Any]:
        state = (
            evict(c.files, c.args.cold)
            if temp == "cold"
            else {"resident_before": ensure_warm(c.files)}
        )
        with c.serve("--json", "--verify", verify) as d:
            code = d.stop(signal.SIGTERM, 60)
        ready, wall = d.ready, d.ready_s
        startup = _startup_of(d)
        r = {
            "load_s": ready.load_s,
            "wall_s": wall,
            "bytes": ready.bytes,
            "startup_s": wall - ready.load_s,
            "verify": verify,
            "startup": startup,
            "exit": code,
            "state": state,
        }
        print(
            f"  serve ({temp}, --verify {verify}): load_s {r['load_s']:.2f} s "
            f"({gbps(c.total, r['load_s'])}), Popen to READY {r['wall_s']:.2f} s, SIGTERM exit "
            f"{code}\n    {_phases_line(startup)}"
        )
        return r

    newest = max(max(p.stat().st_ctime, p.stat().st_mtime) for p in c.files)
    time.sleep(max(0.0, newest + 1.5 - time.time()))
    first = one("warm", "always")  # hashes every file, and records them
    out = _cold_and_warm(c, one, "load_s")
    out["first"] = first
    hashed = [one("warm", "always") for _ in range(c.args.warm_reps)]
    out["warm_hashed"] = hashed
    out["warm_hashed_best"] = min(r["load_s"] for r in hashed) if hashed else None
    best = min(out["warm"], key=lambda r: r["wall_s"]) if out["warm"] else None
    out["warm_best_ready_s"] = best["wall_s"] if best else None
    out["warm_best_startup"] = best["startup"] if best else None
    return out


def section_safetensors(c: Ctx) -> dict[str, Any]:
    def one(temp: str) -> dict[str, Any]:
        if temp == "warm":
            ensure_warm(c.files)
        args = {
            "device": c.device,
            "files": [str(p) for p in c.files],
            "probe": c.probe,
            "cold": c.args.cold if temp == "cold" else "none",
        }
        r = c.run_worker("safetensors", args, "safetensors", 1800)
        print(
            f"  load_file ({temp}): {r['seconds']:.2f} s ({gbps(r['bytes'], r['seconds'])}), "
            f"{r['tensors']} tensors, safetensors {r['version']}"
        )
        return r

    return _cold_and_warm(c, one, "seconds")


def _clients(c: Ctx, n: int) -> list[Child]:
    args = {
        "device": c.device,
        "sidecar": str(c.sidecar),
        "rank": c.args.rank,
        "socket": str(c.socket),
        "probe": c.probe,
    }
    kids = [c.worker("attach-client", args) for _ in range(n)]
    try:
        for k in kids:
            k.read_json("ready", CLIENT_TIMEOUT_S)
    except BaseException:
        for k in kids:
            k.end(signal.SIGKILL, 10)
        raise
    return kids


def _stats(xs: list[float]) -> dict[str, float]:
    return {"max": max(xs), "median": statistics.median(xs), "min": min(xs)}


def _attach_round(c: Ctx, n: int, mem: dict[str, Any]) -> dict[str, Any]:
    """``n`` fresh clients released together: their attach times (and with ``mem``, the round
    with the most clients: the memory held; with one client, reattach times too)."""
    kids = _clients(c, n)
    try:
        m_idle = c.mem() if mem else None
        for k in kids:  # the barrier: every client is initialised and waits for this
            k.send("attach")
        docs = [k.read_json("attach_ms") for k in kids]
        rnd = {
            "attach_ms": _stats([x["attach_ms"] for x in docs]),
            "total_ms": _stats([x["total_ms"] for x in docs]),
            "tensors": sorted({x["tensors"] for x in docs}),
            "probes": sorted({x["probe"] for x in docs}),
        }
        if m_idle is not None:
            from mpack.runtime.client import status_of

            m_att = c.mem()
            rnd["daemon_clients"] = len(status_of(c.socket)["clients"])
            mem["memory"] = mem_summary(
                mem["m0"], mem["one"], m_idle, m_att, n, c.total, mem["own"]
            )
        if n == 1:
            again = []
            for _ in range(3):
                kids[0].send("attach")
                again.append(kids[0].read_json("attach_ms")["attach_ms"])
            rnd["reattach_ms"] = _stats(again)
        return rnd
    finally:
        for k in kids:  # EOF on stdin: it closes its lease and exits
            k.end(None, 60)


def section_attach(c: Ctx, m0: int) -> dict[str, Any]:
    ensure_warm(c.files)
    out: dict[str, Any] = {"tensors": c.tensors, "rounds": {}}
    with c.serve() as d:
        try:
            out["daemon_bytes"] = d.ready.bytes
            m_one = c.mem()
            own = None if c.cuda else proc_status_bytes(d.pid, OWN_MEMORY)
            for n in c.args.clients:
                mem = {"m0": m0, "one": m_one, "own": own} if n == max(c.args.clients) else {}
                rnd = _attach_round(c, n, mem)
                if "reattach_ms" in rnd:
                    out["reattach_ms"] = rnd.pop("reattach_ms")
                if "memory" in mem:
                    out["memory"] = mem["memory"]
                out["rounds"][str(n)] = rnd
                a = rnd["attach_ms"]
                print(
                    f"  {n} client(s): attach max {a['max']:.1f} ms, median {a['median']:.1f} ms "
                    f"(with data_ptr + sync: max {rnd['total_ms']['max']:.1f} ms), "
                    f"{rnd['tensors']} tensors"
                )
                if len(rnd["probes"]) != 1:
                    print(f"  WARNING: clients saw different bytes: probes {rnd['probes']}")
            _print_attach_totals(out, m0, m_one, c.total)
        finally:
            out["daemon_exit"] = d.stop(signal.SIGTERM, 60)
    return out


def _print_attach_totals(out: dict[str, Any], m0: int, m_one: int, total: int) -> None:
    if "reattach_ms" in out:
        print(f"  attach again in a warm process: median {out['reattach_ms']['median']:.2f} ms")
    if "memory" in out:
        m = out["memory"]
        print(
            f"  memory: baseline {gib(m0)}, daemon alone +{gib(m_one - m0)}, context/client "
            f"{gib(m['context_per_client'])}, {m['clients']} attached add "
            f"{gib(m['attach_added'])}: weights {gib(m['weights_with_clients'])} = "
            f"{m['ratio']:.3f} x one copy ({gib(total)}); raw {m['raw_ratio']:.3f} x"
        )


def section_torch_mp(c: Ctx, m0: int) -> dict[str, Any]:
    ensure_warm(c.files)
    args = {"device": c.device, "files": [str(p) for p in c.files], "probe": c.probe}
    p = c.worker("tmp-producer", args)
    out: dict[str, Any] = {"rounds": {}}
    try:
        out.update(p.read_json("loaded", 1800))
        m_one = c.mem()
        own = None if c.cuda else proc_status_bytes(p.proc.pid, OWN_MEMORY)
        counts = c.args.clients
        for n in counts:
            p.send(f"round {n}")
            p.read_json("ready", CLIENT_TIMEOUT_S)
            m_idle = c.mem() if n == max(counts) else None
            p.send("go")
            doc = p.read_json("results")
            res = doc["results"]
            if m_idle is not None:
                m_att = c.mem()
                out["memory"] = mem_summary(m0, m_one, m_idle, m_att, n, out["bytes"], own)
            p.send("release")
            p.read_json("released")
            rnd = {
                "get_ms": _stats([r["get_ms"] for r in res]),
                "total_ms": _stats([r["total_ms"] for r in res]),
                "probes": sorted({r["probe"] for r in res}),
                "producer_pickle_ms": doc["pickle_ms"],
                "pickle_bytes": doc["pickle_bytes"],
            }
            out["rounds"][str(n)] = rnd
            print(
                f"  {n} consumer(s): get max {rnd['get_ms']['max']:.1f} ms, with data_ptr + sync "
                f"max {rnd['total_ms']['max']:.1f} ms, median {rnd['total_ms']['median']:.1f} ms "
                f"(producer: {doc['pickle_ms']:.1f} ms to pickle each, {doc['pickle_bytes']} B)"
            )
        if "memory" in out:
            m = out["memory"]
            print(
                f"  memory: producer alone +{gib(m_one - m0)}, {m['clients']} consumers add "
                f"{gib(m['attach_added'])}: weights {gib(m['weights_with_clients'])} = "
                f"{m['ratio']:.3f} x one copy ({gib(out['bytes'])}); raw {m['raw_ratio']:.3f} x"
            )
        p.send("quit")
        out["exit"] = p.end(None, 60)
    finally:
        if p in Child.live:
            p.end(signal.SIGKILL, 10)
    return out
