"""The one output sink: rich tables and progress for people, one JSON document for CI, or nothing.

Library code never prints; it returns results (or calls a progress callback), and the CLI hands
them to the functions here.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def print_json(doc: Any) -> None:
    """Exactly one JSON document on stdout (for ``--json``)."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def emit_layout(*, n: int, k: int, np_: int, kp: int, act_dtype: str, as_json: bool) -> None:
    doc = {
        "N": n,
        "K": k,
        "Np": np_,
        "Kp": kp,
        "padded": (np_, kp) != (n, k),
        "weight": {"dtype": "int32", "shape": [kp // 16, 4 * np_], "bytes": kp * np_},
        "weight_scale": {"dtype": act_dtype, "shape": [1, np_], "bytes": 2 * np_},
        "bias": {"dtype": act_dtype, "shape": [np_], "bytes": 2 * np_},
    }
    if as_json:
        print_json(doc)
        return
    t = Table(title=f"Marlin FP8 layout of a [N={n}, K={k}] fp8 layer")
    for col in ("tensor", "dtype", "shape", "bytes"):
        t.add_column(col)
    for name in ("weight", "weight_scale", "bias"):
        d = doc[name]
        t.add_row(name, d["dtype"], str(d["shape"]), human_bytes(d["bytes"]))
    console.print(t)
    pad = f"padded to Np={np_}, Kp={kp}" if doc["padded"] else "no padding needed"
    console.print(f"{pad}; bias only if the checkpoint has one")
