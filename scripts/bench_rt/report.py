"""What the benchmark reports: the run's metadata, the measured ratios against their targets
(``summarize``), the bytes each method saw (``probes``), and the final table, printed last.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from . import GB

if TYPE_CHECKING:
    from .sections import Ctx


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def gbps(nbytes: int, s: float | None) -> str:
    return f"{nbytes / s / GB:.2f} GB/s" if s else "n/a"


def meta(c: Ctx) -> dict[str, Any]:
    m: dict[str, Any] = {
        "sidecar": str(c.sidecar),
        "device": c.device,
        "rank": c.args.rank,
        "bytes": c.total,
        "tensors": c.tensors,
        "files": {p.name: n for p, _, n in c.regions},
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "cold_method": c.args.cold,
    }
    if c.cuda and c.smi_id is not None:
        with contextlib.suppress(Exception):
            m["gpu"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version",
                    "--format=csv,noheader",
                    "-i",
                    c.smi_id,
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
    return m


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarize(c: Ctx) -> list[dict[str, Any]]:
    """The rows of the final table: each a measured ratio (or ms) against its target."""
    r = c.res
    temp = "cold" if _get(r, "serve", "cold") is not None else "warm"
    if temp == "cold":
        serve, floor = _get(r, "serve", "cold", "load_s"), _get(r, "floor", "copy_cold")
        st = _get(r, "safetensors", "cold", "seconds")
    else:
        serve, floor = _get(r, "serve", "warm_best"), _get(r, "floor", "copy_warm_best")
        st = _get(r, "safetensors", "warm_best")
    top = str(max(c.args.clients))
    att = _get(r, "attach", "rounds", top, "attach_ms", "max")
    att_total = _get(r, "attach", "rounds", top, "total_ms", "max")
    tmp_total = _get(r, "torch_mp", "rounds", top, "total_ms", "max")
    mem = _get(r, "attach", "memory") or {}
    tensors = _get(r, "attach", "rounds", top, "tensors")

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    where = "GPU" if c.cuda else "host"
    weights = mem.get("weights_with_clients")
    rows = [
        {
            "name": f"{temp} load / floor",
            "value": ratio(serve, floor),
            "unit": "x",
            "op": "<=",
            "target": 1.15,
            "from": f"load_s {sec(serve)} s / floor {sec(floor)} s",
        },
        {
            "name": f"{temp} load / safetensors load_file",
            "value": ratio(serve, st),
            "unit": "x",
            "op": "<",
            "target": 1.0,
            "from": f"{sec(serve)} s / {sec(st)} s",
        },
        {
            "name": f"attach ms, max of {top} clients",
            "value": att,
            "unit": "ms",
            "op": "<=",
            "target": 20.0,
            "from": f"{tensors[0] if tensors else '?'} tensors",
        },
        {
            "name": f"attach / torch.mp, max of {top}",
            "value": ratio(att_total, tmp_total),
            "unit": "x",
            "op": "<",
            "target": 1.0,
            "from": f"{ms(att_total)} ms / {ms(tmp_total)} ms (+ data_ptr, sync)",
        },
        {
            "name": f"{where} memory, {top} clients / one copy",
            "value": mem.get("ratio"),
            "unit": "x",
            "op": "<=",
            "target": 1.05,
            "from": "n/a" if weights is None else f"{gib(weights)} / {gib(c.total)}, contexts out",
        },
    ]
    for row in rows:
        v, t = row["value"], row["target"]
        row["pass"] = None if v is None else bool(v <= t if row["op"] == "<=" else v < t)
    return rows


def probes(c: Ctx) -> dict[str, list[int]]:
    """The checksum of the same tensor's first bytes, as each method saw it (all must agree)."""
    r = c.res
    loads = [_get(r, "safetensors", "cold"), *(_get(r, "safetensors", "warm") or [])]
    out = {"load_file": [x["probe"] for x in loads if isinstance(x, dict) and "probe" in x]}
    for name in ("attach", "torch_mp"):
        out[name] = [p for rnd in (_get(r, name, "rounds") or {}).values() for p in rnd["probes"]]
    if _get(r, "torch_mp", "probe") is not None:
        out["torch_mp"].append(r["torch_mp"]["probe"])
    return {k: sorted(set(v)) for k, v in out.items() if v}


def print_table(c: Ctx, rows: list[dict[str, Any]]) -> None:
    r = c.res
    print(
        f"\n{c.sidecar}: rank {c.args.rank}, {c.total / GB:.2f} GB, {c.tensors} tensors, "
        f"device {c.device}" + ("" if c.cuda else " (CPU analogues: the targets are for CUDA)")
    )
    cold = [_get(r, "floor", "copy_cold_state", "cold"), _get(r, "serve", "cold", "state", "cold")]
    if c.args.cold == "none":
        print("cold runs skipped (--cold none): the load ratios are warm")
    elif False in cold:
        print(
            f"WARNING: a cold run was not cold (floor, serve: {cold}); "
            "run as root or --cold fadvise"
        )
    seen = r.get("probes", {})
    if len({v for vs in seen.values() for v in vs}) > 1:
        print(f"WARNING: the methods saw different bytes of {c.probe}: {seen}")
    print(f"{'metric':<40}{'value':>10}{'target':>9}  {'result':<7}from")
    for row in rows:
        v, ok = row["value"], row["pass"]
        val = "n/a" if v is None else (f"{v:.1f} ms" if row["unit"] == "ms" else f"{v:.3f}x")
        res = "n/a" if ok is None else "PASS" if ok else "MISS"
        print(
            f"{row['name']:<40}{val:>10}{row['op'] + ' ' + format(row['target'], 'g'):>9}  "
            f"{res:<7}{row['from']}"
        )
