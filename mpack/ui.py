"""The one output sink: rich tables and progress for people, one JSON document for CI, or nothing.

Library code never prints; it returns results (or calls a progress callback), and the CLI hands
them to the functions here.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

# markup=False: paths, layer and tensor names are data, printed as they are ("out[/]x" or "[red]"
# in a path must neither crash nor vanish); colour comes only from explicit styles (``_ok``).
console = Console(markup=False)
err_console = Console(stderr=True, markup=False)


def _styled(word: str, style: str, rest: str = "") -> Text:
    """``word`` in ``style``, then ``rest`` as plain text."""
    return Text.assemble((word, style), rest)


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


class _Progress:
    """A rich progress display fed by the pipeline's ``progress(stage, done, total)`` callback.

    Two rows: bytes written (with speed and ETA) and layers done.
    """

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.display = Progress(
            TextColumn("{task.description:8}"), BarColumn(), TextColumn("{task.fields[detail]:>22}"),
            TextColumn("{task.fields[rate]:>12}"), TimeRemainingColumn(), console=err_console,
        )  # fmt: skip
        self._tasks: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self._tasks:
            label = "writing" if stage == "bytes" else "layers"
            self._tasks[stage] = self.display.add_task(label, total=total, detail="", rate="")
        rate = ""
        if stage == "bytes":
            detail = f"{human_bytes(done)} / {human_bytes(total)}"
            rate = f"{human_bytes(int(done / max(time.perf_counter() - self._t0, 1e-6)))}/s"
        else:
            detail = f"{done} / {total}"
        self.display.update(
            self._tasks[stage], completed=done, total=total, detail=detail, rate=rate
        )


@contextlib.contextmanager
def convert_progress(enabled: bool):
    """Yield a progress callback: a live display on a terminal, else ``None``."""
    if not enabled or not err_console.is_terminal:
        yield None
        return
    p = _Progress()
    with p.display:
        yield p


def emit_convert(result: Any, *, as_json: bool, quiet: bool) -> None:
    m = result.manifest
    files = {f["name"]: f["size"] for f in m["files"]}
    if as_json:
        print_json(
            {
                "out": str(result.out),
                "up_to_date": result.up_to_date,
                "manifest_digest": result.digest,
                "target": m["target"],
                "source": {k: v for k, v in m["source"].items() if k != "files"},
                "files": files,
                "bytes": sum(files.values()),
                "seconds": {k: round(v, 4) for k, v in result.seconds.items()},
                "layers": len(m["layers"]),
            }
        )
        return
    if quiet:
        return
    if result.up_to_date:
        console.print(
            _styled(
                "up to date",
                "green",
                f": {result.out} already holds this sidecar (use --force to redo it)",
            )
        )
        return
    t = m["target"]
    console.print(
        _styled(
            "wrote",
            "green",
            f" {result.out}: {len(m['layers'])} layers x {t['tp_size']} rank(s), "
            f"{human_bytes(sum(files.values()))} in {result.seconds.get('total', 0):.2f} s "
            f"({t['profile']}, {t['act_dtype']}, fusion {t['fusion']})",
        )
    )
    console.print(f"manifest digest {result.digest}")


def emit_inspect(sidecar: Any, m: dict[str, Any], digest: str, *, as_json: bool) -> None:
    if as_json:
        print_json({"sidecar": str(sidecar), "manifest_digest": digest, **m})
        return
    t, src = m["target"], m["source"]
    origin = (
        f"{src.get('repo')} @ {src.get('revision')}"
        if src.get("kind") == "hub"
        else src.get("path")
    )
    console.print(
        _styled(
            str(sidecar),
            "bold",
            f"  format {m['format']} v{m['format_version']}, {m.get('created_by', '')}",
        )
    )
    console.print(
        f"target: {t['kernel']} for {t['engine']} {t['engine_version']}, profile {t['profile']}, "
        f"{t['act_dtype']}, tp {t['tp_size']}, fusion {t['fusion']}"
    )
    console.print(f"source: {origin} ({len(src.get('files', []))} files)")
    console.print(f"manifest digest: {digest}")
    ft = Table(title="files")
    for col in ("file", "size", "sha256", "chunk digests"):
        ft.add_column(col)
    for f in m["files"]:
        sha = f["sha256"][:16] + "..." if "sha256" in f else "-"
        n = len(f["chunks"]["sha256"]) if f.get("chunks") else 0
        ft.add_row(
            f["name"],
            human_bytes(f["size"]),
            sha,
            f"{n} x {human_bytes(f['chunks']['bytes'])}" if n else "-",
        )
    console.print(ft)
    lt = Table(title=f"layers (per rank; {t['tp_size']} rank(s))")
    for col in ("layer", "N x K", "padded", "strategy", "parallel", "bias"):
        lt.add_column(col)
    for name, ly in sorted(m["layers"].items(), key=lambda kv: kv[1].get("index", 0)):
        lt.add_row(
            name, f"{ly['n']} x {ly['k']}", f"{ly['np']} x {ly['kp']}",
            ly["strategy"] + (" requant" if ly["requantized"] else ""), ly["parallel"], "yes" if ly["bias"] else "",
        )  # fmt: skip
    console.print(lt)


def emit_verify(report: dict[str, Any], *, as_json: bool) -> None:
    fwd = report.get("forward")
    if as_json:
        print_json({"ok": fwd["ok"] if fwd else True, **report})
        return
    console.print(
        _styled(
            "ok",
            "green",
            f": {report['sidecar']}: {report['files_checked']} files match the manifest "
            f"(digest {report['digest'][:16]}...)",
        )
    )
    if report["source_checked"]:
        console.print(
            _styled(
                "ok",
                "green",
                f": {report['tensors_compared']} tensors re-derived from {report['source']} are "
                f"byte-identical; {report['layers_checked']} layers unpack to the source bytes",
            )
        )
    else:
        console.print("source not checked (no --source, and the manifest records no local path)")
    if fwd:
        t = Table(
            title=f"forward: sidecar vs transformers reference ({fwd['device']}, tp {fwd['tp']})"
        )
        for col in (
            "compute",
            "greedy tokens",
            "max |logit diff|",
            "tolerance",
            "decisive steps agree",
        ):
            t.add_column(col)
        for r in fwd["runs"]:
            same = "identical" if r["tokens_identical"] else "differ"
            t.add_row(r["dtype"], same, f"{r['max_logit_diff']:.3g}", f"{r['tolerance']:.3g}",
                      f"{r['decisive_steps_agree']} ({r['decisive_steps']})")  # fmt: skip
        console.print(t)
        first = fwd["runs"][0]
        console.print(f"greedy next tokens (reference): {[row[:8] for row in first['ref_tokens']]}")
        console.print(
            _styled("ok", "green", ": model outputs match")
            if fwd["ok"]
            else _styled("outputs differ", "red")
        )


# --- mpack serve / mpack status (runtime) ------------------------------------------------------


def emit_ready(info: dict[str, Any]) -> None:
    """The one ``READY key=value ...`` line ``mpack serve`` prints on stdout when it serves."""
    keys = ("socket", "pid", "device", "backend", "bytes", "load_s", "rank", "digest")
    _daemon_line(sys.stdout, "READY " + " ".join(f"{k}={info[k]}" for k in keys if k in info))


def _daemon_line(stream: Any, line: str) -> None:
    """Write and flush one line of the daemon's output; never raises. A write that fails (the
    pipe's reader went away: EPIPE; a full disk) drops the line, and the stream's descriptor is
    pointed at /dev/null: later lines are dropped too, and the flush at interpreter exit cannot
    turn the daemon's clean stop into an error (Python exits 120 when it fails)."""
    import os

    if stream is None:
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(null, stream.fileno())
            os.close(null)


def emit_event(event: dict[str, Any]) -> None:
    """One log line on stderr per daemon event (attach, detach, refusals, bad requests)."""
    rest = " ".join(f"{k}={v}" for k, v in event.items() if k != "event")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    _daemon_line(sys.stderr, f"{stamp} mpack serve: {event.get('event')} {rest}".rstrip())


def _uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def emit_status(docs: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        print_json(docs)
        return
    live = [d for d in docs if d.get("state") == "serving"]
    stale = [d for d in docs if d.get("state") != "serving"]
    if not live:
        console.print("no mpack daemon is serving")
    else:
        t = Table(title="mpack daemons")
        t.add_column("sidecar", overflow="fold")
        for col in ("rank", "device", "memory", "clients (pid)", "uptime", "daemon pid"):
            t.add_column(col)
        for d in live:
            pids = ", ".join(str(c["pid"]) for c in d["clients"]) or "-"
            dev = d["device_label"] + (
                f" ({d['device'][5:]})" if d["device"].startswith("cuda:") else ""
            )
            t.add_row(
                d["sidecar"], f"{d['rank']}/{d['tp_size']}", dev, human_bytes(d["bytes"]),
                f"{len(d['clients'])}: {pids}", _uptime(d["uptime_s"]), str(d["pid"]),
            )  # fmt: skip
        console.print(t)
    for d in stale:
        console.print(f"stale socket (its daemon died): {d['socket']}")
