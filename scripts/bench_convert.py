"""Benchmark `mpack convert` on a Llama-3.1-8B-shaped FP8 checkpoint against the I/O floor.

The floor is measured in the same run, on the same disk: reading every source file with plain
sequential I/O, and writing as many bytes as the sidecar has (fsynced), with the page cache
dropped (cold, when this process may write /proc/sys/vm/drop_caches) and warm. A conversion
that overlaps its streams well costs about max(read, write), not their sum.

    python scripts/bench_convert.py [--workdir DIR] [--layers 32] [--json out.json] [--plot out.png]

Prints the table of ratios last. Each convert runs in its own process (peak RSS from /proc).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchutil import drop_caches, proc_status_bytes, read_files, write_bytes  # noqa: E402
from synth_checkpoint import LLAMA_8B, write_checkpoint  # noqa: E402


def peak_rss_run(src: Path, out: Path, device: str) -> tuple[dict, int]:
    """One `mpack convert` in a fresh process: its --json summary (+ wall) and peak RSS (bytes)."""
    cmd = [
        sys.executable,
        "-m",
        "mpack.cli",
        "convert",
        str(src),
        "-o",
        str(out),
        "--device",
        device,
        "--json",
        "--force",
    ]
    return _run(cmd)


def _run(cmd: list[str]) -> tuple[dict, int]:
    """Run ``cmd``, which prints one JSON document; return it and the peak RSS. A document
    without its own ``wall`` (the CLI's) gets the process's wall time.

    The peak is read from /proc/<pid>/status while it runs (wait4's ru_maxrss would include the
    forked parent's pages).
    """
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while p.poll() is None:
        peak = max(peak, proc_status_bytes(p.pid, ("VmHWM:",)))
        time.sleep(0.02)
    wall = time.perf_counter() - t
    stdout, stderr = p.communicate()
    if p.returncode:
        raise SystemExit(f"convert failed ({p.returncode}): {stderr[-2000:]}")
    doc = json.loads(stdout)
    doc.setdefault("wall", wall)
    return doc, peak


LIBRARY_RUN = r"""
import json, sys, time
import torch, compressed_tensors  # a long-lived caller (a service, a notebook) has these loaded
from mpack.convert import cuda_repack
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
src, out, device = sys.argv[1:4]
dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else device)
if dev.type == "cuda":  # CUDA context and the repack kernel ready, as in a warm service
    torch.empty(1, device=dev)
    cuda_repack.available(dev)
t = time.perf_counter()
r = run_convert(src, out, ConvertOptions(device=device, force=True))
wall = time.perf_counter() - t
print(json.dumps({"wall": wall, "seconds": r.seconds, "bytes": r.bytes_written,
                  "timeline": r.timeline}))
"""


def library_run(src: Path, out: Path, device: str) -> tuple[dict, int]:
    """``run_convert`` timed inside a process that already imported torch and compressed-tensors."""
    return _run([sys.executable, "-c", LIBRARY_RUN, str(src), str(out), device])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/mpack-bench")
    ap.add_argument("--layers", type=int, default=LLAMA_8B["layers"])
    ap.add_argument(
        "--small-layers", type=int, default=8, help="second model size, for the RSS check (0: skip)"
    )
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--kinds", default="cli,library", help="fresh CLI processes, library calls")
    ap.add_argument(
        "--library-temps", default="cold,warm", help="page-cache states of the library runs"
    )
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot")
    ap.add_argument("--replot", metavar="JSON", help="only redraw --plot and the table from JSON")
    a = ap.parse_args()
    if a.replot:
        res = json.loads(Path(a.replot).read_text())
        if a.plot:
            plot(res, a.plot)
        print_table(res)
        return
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"llama8b-fp8-{a.layers}l"
    if not (src / "config.json").is_file():
        t = time.perf_counter()
        write_checkpoint(src, layers=a.layers)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", flush=True)
    files = sorted(src.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in files)

    res: dict = {"source_bytes": src_bytes, "layers": a.layers, "runs": {}}
    can_drop = drop_caches()
    res["cold_cache"] = can_drop
    res["floor"] = {
        "read_cold": read_files(files) if can_drop else None,
        "read_warm": read_files(files),
    }
    res["imports"] = import_times()
    devices = [d for d in a.devices.split(",") if d]
    for dev in devices:
        for kind in a.kinds.split(","):
            temps = ("cold", "warm") if kind == "cli" else tuple(a.library_temps.split(","))
            for temp in temps if can_drop else ("warm",):
                if temp == "cold":
                    drop_caches()
                else:
                    read_files(files)  # warm the page cache
                run = peak_rss_run if kind == "cli" else library_run
                out = work / f"out-{dev}"
                shutil.rmtree(out, ignore_errors=True)  # a fresh output, as the floor's write
                doc, rss = run(src, out, dev)
                name = f"{dev}-{kind}-{temp}"
                res["runs"][name] = {
                    "wall": doc["wall"],
                    "seconds": doc["seconds"],
                    "peak_rss": rss,
                    "bytes": doc["bytes"],
                }
                if "timeline" in doc:
                    res["runs"][name]["timeline"] = doc["timeline"]
                print(f"{name}: {doc['wall']:.2f} s, peak RSS {rss / 2**30:.2f} GiB", flush=True)
                if a.json_out:  # what has run so far survives an interrupted benchmark
                    Path(a.json_out).write_text(json.dumps(res, indent=2))
    out_bytes = next(iter(res["runs"].values()))["bytes"]
    res["floor"]["write"] = write_bytes(work / "floor-write.bin", out_bytes)
    res["floor"]["write_behind"] = write_bytes(work / "floor-write.bin", out_bytes, behind=True)
    res["sidecar_bytes"] = out_bytes
    for k in ("cold", "warm"):
        r = res["floor"].get(f"read_{k}")
        if r is not None:
            res["floor"][f"floor_{k}"] = max(r, res["floor"]["write"])
            res["floor"][f"sum_{k}"] = r + res["floor"]["write"]
            res["floor"][f"tight_{k}"] = max(r, res["floor"]["write_behind"])

    if a.small_layers:  # peak RSS against model size: the same convert on a smaller model
        small = work / f"llama8b-fp8-{a.small_layers}l"
        if not (small / "config.json").is_file():
            write_checkpoint(small, layers=a.small_layers)
        _, rss_small = peak_rss_run(small, work / "out-small", devices[0])
        res["rss_small_model"] = {
            "layers": a.small_layers,
            "peak_rss": rss_small,
            "device": devices[0],
        }

    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=2))
    if a.plot:
        plot(res, a.plot)
    print_table(res)


def import_times() -> dict[str, float]:
    """Seconds a fresh interpreter takes to import torch, then compressed-tensors (warm files)."""
    code = (
        "import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        "import compressed_tensors; t2 = time.perf_counter(); print(t1 - t, t2 - t1)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)  # warm the files
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    torch_s, ct_s = (float(x) for x in out.stdout.split())
    return {"torch": torch_s, "compressed_tensors": ct_s}


def run_floors(res: dict, name: str) -> tuple[float, float]:
    """(plain, tight) floor for run ``name``: its own ``floor`` when it carries one (a result
    assembled from several benchmark runs), else the file's; cold runs against the cold floor."""
    f = res["runs"][name].get("floor") or res["floor"]
    temp = name.rsplit("-", 1)[1]
    floor = f.get(f"floor_{temp}") or f["floor_warm"]
    return floor, f.get(f"tight_{temp}") or f.get("tight_warm") or floor  # older files: no tight


def print_table(res: dict) -> None:
    f = res["floor"]
    gb = res["source_bytes"] / 1e9
    print(
        f"\nsource {gb:.2f} GB, sidecar {res['sidecar_bytes'] / 1e9:.2f} GB, {res['layers']} layers"
    )
    print(
        f"floor: read cold {f.get('read_cold') or float('nan'):.2f} s, "
        f"read warm {f['read_warm']:.2f} s, write {f['write']:.2f} s, "
        f"write with write-behind {f.get('write_behind', float('nan')):.2f} s"
    )
    imp = res["imports"]
    print(
        f"imports in a fresh interpreter: torch {imp['torch']:.2f} s, "
        f"compressed-tensors {imp['compressed_tensors']:.2f} s"
    )
    print(
        "wall: the whole process (cli) or the run_convert call (library); total: run_convert's own"
    )
    print("x floor: against max(read, plain write); x tight: against max(read, write-behind write)")
    print(
        f"{'run':<18}{'wall s':>8}{'x floor':>8}{'x tight':>8}{'total':>7}{'valid.':>7}{'read':>6}"
        f"{'xform':>6}{'write':>6}{'finish':>7}{'ct wait':>8}{'RSS GiB':>8}"
    )
    for name, r in res["runs"].items():
        floor, tight = run_floors(res, name)
        s = r["seconds"]
        print(
            f"{name:<18}{r['wall']:>8.2f}{r['wall'] / floor:>8.2f}"
            f"{r['wall'] / tight:>8.2f}{s['total']:>7.2f}"
            f"{s.get('validate', 0):>7.2f}{s.get('read_busy', 0):>6.2f}"
            f"{s.get('transform_busy', 0):>6.2f}"
            f"{s.get('write_busy', 0):>6.2f}{s.get('finish', 0):>7.2f}"
            f"{s.get('wait_scheme_check', 0):>8.2f}"
            f"{r['peak_rss'] / 2**30:>8.2f}"
        )
    small = res.get("rss_small_model") or {}
    dev = small.get("device", "")  # the same device's CLI runs, the small model's peer
    big = max(
        (
            r["peak_rss"]
            for n, r in res["runs"].items()
            if n.startswith(f"{dev}-cli-") or (not dev and "-cli-" in n)
        ),
        default=0,
    )
    if big and small:
        print(
            f"peak RSS ({dev or 'cli'} cli): {res['layers']} layers {big / 2**30:.2f} GiB "
            f"vs {small['layers']} layers {small['peak_rss'] / 2**30:.2f} GiB "
            f"(ratio {big / small['peak_rss']:.2f})"
        )
    print("targets: convert <= 1.2 x floor on GPU, <= 1.5 x on CPU; RSS independent of model size")


def plot(res: dict, path: str) -> None:
    """Top: one bar per run (start-up, validate, stream, finish) against the floor. Bottom: the
    timeline of the fastest library run, one row per stage, waits drawn pale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["runs"])
    traced = [n for n in names if res["runs"][n].get("timeline")]
    rows = 2 if traced else 1
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(9, 0.5 * len(names) + 2 + 3.2 * (rows - 1)),
        gridspec_kw={"height_ratios": [len(names) + 2, 6][:rows]},
    )
    ax = axes[0] if rows > 1 else axes
    colors = {
        "start-up (imports, CUDA)": "tab:gray",
        "validate + plan": "tab:purple",
        "stream (read/transform/write)": "tab:blue",
        "finish (fsync tail)": "tab:green",
        "wait for the scheme check": "tab:red",
    }
    for i, n in enumerate(names):
        r = res["runs"][n]
        s = r["seconds"]
        parts = {
            "start-up (imports, CUDA)": r["wall"] - s["total"] if "-cli-" in n else 0.0,
            "validate + plan": s.get("validate", 0.0),
            "finish (fsync tail)": s.get("finish", 0.0),
            "wait for the scheme check": s.get("wait_scheme_check", 0.0),
        }
        parts["stream (read/transform/write)"] = max(
            0.0, s["total"] - sum(list(parts.values())[1:])
        )
        left = 0.0
        for label in colors:
            ax.barh(
                i, parts[label], left=left, color=colors[label], label=label if i == 0 else None
            )
            left += parts[label]
    for i, n in enumerate(names):  # each run against the floors of its own page-cache state
        floor, tight = run_floors(res, n)
        ax.plot(
            [floor] * 2,
            [i - 0.45, i + 0.45],
            color="red",
            lw=2,
            label="I/O floor: max(read, plain write)" if i == 0 else None,
        )
        ax.plot(
            [tight] * 2,
            [i - 0.45, i + 0.45],
            color="black",
            lw=2,
            label="tight floor: max(read, write-behind write)" if i == 0 else None,
        )
    gb = res["source_bytes"] / 1e9
    finish_axes(ax, names, "seconds", f"mpack convert, Llama-3.1-8B-shaped FP8 ({gb:.1f} GB)")
    if traced:
        best = min(traced, key=lambda n: res["runs"][n]["wall"])
        plot_timeline(axes[1], res["runs"][best]["timeline"], run_floors(res, best), best)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


LANES = {
    "main": "tab:purple",
    "read": "tab:olive",
    "transform": "tab:blue",
    "write": "tab:green",
    "copy": "tab:cyan",
    "hash-src": "tab:orange",
}


def plot_timeline(ax, spans: list, floors: tuple[float, float], name: str) -> None:
    """One row per lane; a span named ``wait*`` is drawn pale (that stage was blocked)."""
    lanes = [lane for lane in LANES if any(s[0] == lane for s in spans)]
    for row, lane in enumerate(lanes):
        for _, what, a, b in (s for s in spans if s[0] == lane):
            waiting = what.startswith("wait")
            ax.broken_barh(
                [(a, max(b - a, 1e-3))],
                (row - 0.35, 0.7),
                color=LANES[lane],
                alpha=0.25 if waiting else 0.9,
                linewidth=0,
            )
            if lane == "main" and b - a > 0.25:
                ax.text((a + b) / 2, row, what, ha="center", va="center", fontsize=6)
    ax.axvline(floors[0], color="red", ls=":", label="I/O floor")
    ax.axvline(floors[1], color="black", ls=":", label="tight floor")
    finish_axes(
        ax, lanes, "seconds from the start of run_convert", f"timeline of {name} (pale: waiting)"
    )


def finish_axes(ax, rows: list[str], xlabel: str, title: str) -> None:
    """One labelled row per bar, top to bottom; axis labels, title, legend."""
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")


if __name__ == "__main__":
    main()
