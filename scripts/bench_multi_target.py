"""Many targets from one read, timed: one target, four targets, and ``cp -r && sync``, in one run.

    python scripts/bench_multi_target.py [--src CKPT | --workdir DIR --layers 32] [--device auto]
                                         [--repeat 1] [--json OUT.json]

Without ``--src``, an 8B-shaped checkpoint (scripts/synth_checkpoint.py, ``--layers`` of its 32
decoder layers) is made in ``--workdir`` (kept there for the next run). Every row is a whole
process timed by the wall clock, with its peak RSS, into a fresh output directory on the same
file system as the source, warm (the source is read once before the first row):

- ``convert 1 target``: ``mpack convert SRC -o OUT --tp 1``;
- ``convert 4 targets (tp 1,2,4,8)``: ``--tp 1,2,4,8``, one profile;
- ``convert 4 targets (tp 1,2 x 2 profiles)``: ``--tp 1,2 --profile w8a16,w8a8-marlin`` (the
  w8a8-marlin targets of this per-tensor checkpoint are requantized: the torch path);
- ``cp -r && sync``: ``cp -r SRC DST`` then ``sync``, the floor of writing the bytes once.

The goal (issue 25): four targets in at most 1.5x the time of one, on the H200 host. The table
gives each row's median over ``--repeat`` runs and its ratio to the single target and to the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import (  # noqa: E402
    LLAMA_8B_LAYERS,
    LLAMA_8B_VOCAB,
    exit_on_signals,
    read_files,
    run_timed,
    scratch_dir,
    synth,
    synth_present,
)

ROWS = {
    "convert 1 target": ["--tp", "1"],
    "convert 4 targets (tp 1,2,4,8)": ["--tp", "1,2,4,8"],
    "convert 4 targets (tp 1,2 x 2 profiles)": ["--tp", "1,2", "--profile", "w8a16,w8a8-marlin"],
}
COPY = "cp -r && sync"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, help="an existing checkpoint (else one is made)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/mpack-bench-multi"))
    p.add_argument("--layers", type=int, default=LLAMA_8B_LAYERS)
    p.add_argument("--vocab", type=int, default=LLAMA_8B_VOCAB)
    p.add_argument("--device", default="auto", help="convert's --device (default auto)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each row (median reported)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args()


def source_files(src: Path) -> list[Path]:
    return sorted(p for p in src.iterdir() if p.is_file())


def time_row(name: str, src: Path, out: Path, device: str, env: dict[str, str], cwd: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    if name == COPY:
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(out)], check=True)
        subprocess.run(["sync"], check=True)
        return {"wall": time.perf_counter() - t, "peak_rss": None}
    cmd = [
        sys.executable,
        "-m",
        "mpack",
        "convert",
        str(src),
        "-o",
        str(out),
        "--device",
        device,
        "--json",
        *ROWS[name],
    ]
    r = run_timed(cmd, env=env, cwd=cwd, keep_stdout=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr}")
    doc = json.loads(r.stdout)
    targets = doc.get("targets", [doc])
    return {
        "wall": r.wall,
        "peak_rss": r.peak_rss,
        "targets": len(targets),
        "bytes": sum(t["bytes"] for t in targets),
    }


def main() -> int:
    exit_on_signals()
    args = parse_args()
    tmp, env = scratch_dir("mpack-bench-multi-")
    try:
        src = args.src
        if src is None:
            args.workdir.mkdir(parents=True, exist_ok=True)
            src = args.workdir / f"llama8b-{args.layers}l"
            if not synth_present(src, args.layers, args.vocab):
                synth(src, args.layers, args.vocab, env, tmp, quiet=True)
        src = src.resolve()
        src_bytes = sum(p.stat().st_size for p in source_files(src))
        print(
            f"source {src}: {src_bytes / 2**30:.2f} GiB; warming: "
            f"{read_files(source_files(src)):.1f} s",
            flush=True,
        )
        outs = src.parent / f".bench-multi-out-{os.getpid()}"
        results: dict[str, list[dict]] = {}
        try:
            for _ in range(args.repeat):
                for name in [*ROWS, COPY]:
                    got = time_row(name, src, outs, args.device, env, tmp)
                    results.setdefault(name, []).append(got)
                    print(f"  {name}: {got['wall']:.2f} s", flush=True)
        finally:
            shutil.rmtree(outs, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(r["wall"] for r in v) for k, v in results.items()}
    one, cp = med["convert 1 target"], med[COPY]
    print("\n| row | s | x 1 target | x cp -r && sync | peak RSS |\n|---|---:|---:|---:|---:|")
    for k, v in results.items():
        rss = max((r["peak_rss"] or 0) for r in v)
        rss_s = f"{rss / 2**30:.2f} GiB" if rss else "-"
        print(f"| {k} | {med[k]:.2f} | {med[k] / one:.2f} | {med[k] / cp:.2f} | {rss_s} |")
    doc = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "source": {"path": str(src), "bytes": src_bytes, "layers": args.layers},
        "device": args.device,
        "repeat": args.repeat,
        "rows": results,
        "median_s": med,
        "ratio_to_one_target": {k: v / one for k, v in med.items()},
        "ratio_to_copy": {k: v / cp for k, v in med.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
