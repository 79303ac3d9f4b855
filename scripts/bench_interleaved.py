"""`mpack convert` against `cp -r && sync`, interleaved round by round, with a switch on and off.

    python scripts/bench_interleaved.py SRC [--cores 2] [--rounds 5] [--device cpu]
        [--off direct-write] [--hub REPO --hf-cache DIR] [--before SITE] [--json out.json]

On a machine whose disk and page cache drift from minute to minute (the 2-core development VM:
`cp -r && sync` of the same 3 GB took 1.8 s in one run and 4.7 s in another), a peer measured
once and a command measured later compare two different machines. Here every round runs, in a
rotated order, `cp -r SRC DST && sync`, the CLI convert as shipped, and the CLI convert with
``--off``'s ``MPACK_NO_*`` variable set (the switch off: the before), each into a fresh output
(removed, then `sync`) from a warm source, all under ``taskset`` on ``--cores`` CPUs. The ratio
of each round is taken within the round; the table gives the median of those and of the walls,
with each command's CPU seconds (user, system: the kernel's page-cache work shows there).
``--hub REPO --hf-cache DIR``: the converts read ``REPO`` from that HF cache, offline (the CI
pre-bake job's case: the shards' sha256 are their blob names, so nothing hashes the source;
bench_vs_tools' ``convert-hub`` row makes such a cache of SRC); `cp -r` still copies SRC.
``--before SITE``: one more command in every round, the CLI of an older tree installed with
``pip install --target SITE`` (a refactor's before and after, on the same machine minute by
minute).
Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchutil import exit_on_signals, fresh, read_files, scratch_dir  # noqa: E402


def switch_var(name: str) -> str:
    """The environment variable that turns ``name`` off (mpack.convert.backends.SWITCHES)."""
    from mpack.convert.backends import SWITCHES

    if name not in SWITCHES:
        raise SystemExit(f"--off {name}: not one of {sorted(SWITCHES)}")
    return SWITCHES[name]


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> dict[str, float]:
    """Wall and CPU seconds (user, system) of ``cmd`` and its children; stops on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return {
        "wall": wall,
        "user": after.ru_utime - before.ru_utime,
        "sys": after.ru_stime - before.ru_stime,
    }


#: The peer's name in :func:`convert_commands` (the first command of every round's rotation).
PEER = "cp -r && sync"


def convert_commands(
    src: Path,
    tmp: Path,
    env: dict[str, str],
    *,
    device: str,
    cores: int | None,
    var: str,
    hub: str | None = None,
    hf_cache: Path | None = None,
    before: Path | None = None,
) -> dict[str, tuple[list[str], dict[str, str], Path]]:
    """name -> (command, environment, the output it writes): the peer, the convert as shipped,
    the convert with ``var`` set; under ``taskset -c 0-(cores-1)`` unless ``cores`` is None;
    ``hub``: the converts read that repo from ``hf_cache``, offline; ``before``: also the
    convert of the tree installed there (first on PYTHONPATH)."""
    pin = ["taskset", "-c", f"0-{cores - 1}"] if cores else []
    out, dst = tmp / "out", tmp / "cp-dst"
    convert = [*pin, sys.executable, "-m", "mpack", "convert", hub or str(src), "-o", str(out)]
    convert += ["--device", device, "--force"]
    plain = {k: v for k, v in env.items() if k != var}
    if hub:
        assert hf_cache is not None
        plain.update(HF_HUB_CACHE=str(hf_cache.resolve()), HF_HUB_OFFLINE="1")
    commands = {
        PEER: ([*pin, "sh", "-c", f'cp -r "{src}" "{dst}" && sync'], plain, dst),
        "mpack convert": (convert, plain, out),
        f"mpack convert, {var}=1": (convert, {**plain, var: "1"}, out),
    }
    if before:
        path = ":".join(p for p in (str(before.resolve()), plain.get("PYTHONPATH")) if p)
        commands[f"mpack convert, before ({before.name})"] = (
            convert,
            {**plain, "PYTHONPATH": path},
            out,
        )
    return commands


def run_rounds(
    commands: dict[str, tuple[list[str], dict[str, str], Path]],
    files: list[Path],
    rounds: int,
    cwd: Path,
) -> list[dict[str, dict[str, float]]]:
    """``rounds`` rounds of every command, in an order rotated each round, each into a fresh
    output from a warm source; every command's :func:`timed` figures, per round."""
    names = list(commands)
    got_all = []
    for i in range(rounds):
        got = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            cmd, cmd_env, target = commands[name]
            fresh(target)
            read_files(files)  # warm: the source in the page cache
            got[name] = timed(cmd, cmd_env, cwd)
            fresh(target)
        got_all.append(got)
        print(
            f"round {i + 1}: " + ", ".join(f"{n} {g['wall']:.2f} s" for n, g in got.items()),
            flush=True,
        )
    return got_all


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per command: median and min wall, median user and system CPU seconds, and each round's
    ratio to the peer of the same round (and their median)."""
    table = {}
    for name in rounds[0]:
        walls = [r[name]["wall"] for r in rounds]
        ratios = [r[name]["wall"] / r[PEER]["wall"] for r in rounds]
        table[name] = {
            "wall_median": statistics.median(walls),
            "wall_min": min(walls),
            "user_median": statistics.median(r[name]["user"] for r in rounds),
            "sys_median": statistics.median(r[name]["sys"] for r in rounds),
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
        }
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--cores", type=int, default=2, help="taskset -c 0-(N-1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--off", default="direct-write", help="the switch the 'before' turns off")
    ap.add_argument("--hub", metavar="REPO", help="convert REPO from --hf-cache instead of SRC")
    ap.add_argument("--hf-cache", type=Path, metavar="DIR")
    ap.add_argument("--before", type=Path, metavar="SITE", help="an older tree (pip --target)")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    if (a.hub is None) != (a.hf_cache is None):
        ap.error("--hub and --hf-cache go together")
    exit_on_signals()
    var = switch_var(a.off)
    tmp, env = scratch_dir("bil-")
    src = a.src.resolve()
    files = sorted(src.glob("*.safetensors"))
    commands = convert_commands(
        src,
        tmp,
        env,
        device=a.device,
        cores=a.cores,
        var=var,
        hub=a.hub,
        hf_cache=a.hf_cache,
        before=a.before,
    )
    try:
        rounds = run_rounds(commands, files, a.rounds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\n{a.rounds} rounds, {a.cores} core(s), SRC {src}"
        + (f" (the converts read {a.hub})" if a.hub else "")
        + f" ({sum(f.stat().st_size for f in files) / 1e9:.2f} GB)"
    )
    print(f"{'command':44s} {'wall, median':>13s} {'min':>7s} {'user':>6s} {'sys':>6s}  x peer")
    table = summarize(rounds)
    for name, row in table.items():
        print(
            f"{name:44s} {row['wall_median']:11.2f} s {row['wall_min']:5.2f} s "
            f"{row['user_median']:6.2f} {row['sys_median']:6.2f}  {row['ratio_median']:.2f} x "
            f"(rounds: {', '.join(f'{x:.2f}' for x in row['ratios'])})"
        )
    if a.json_out:
        doc = {"args": {**vars(a), "src": str(src)}, "rounds": rounds, "table": table}
        Path(a.json_out).write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
