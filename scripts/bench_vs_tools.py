"""Benchmark mpack against the plain tools it replaces, every row beside its peer of the same run.

    python scripts/bench_vs_tools.py --workdir /tmp/mpack-bench-vs [--json out.json] [--md FILE]
    python scripts/bench_vs_tools.py --workdir /tmp/bvt --layers 2 --devices cpu --cores 2

Issue 15 ("Faster than a plain copy"). ``--workdir DIR``: DIR/src is the Llama-3.1-8B-shaped FP8
checkpoint (made by scripts/synth_checkpoint.py when missing; ``--layers`` for a smaller one;
``--src`` names another, e.g. bench_convert's), DIR/out the sidecar the rows write and read,
DIR/cp-dst the copy. Each CLI row is a whole process timed by the wall clock, with its peak RSS
(VmHWM, sampled); before each, its output is removed and every dirty page written back
(``sync``), and its inputs are made warm (read once unless cached) or cold (``--cold drop``:
drop_caches, root only, and POSIX_FADV_DONTNEED on the inputs). Before the rows, one untimed
process imports what the CLI and the workers import and, with cuda, builds the fused repack
kernel into its cache: no warm row pays a first-run cost. Rows (``--only`` takes these names):

- **convert**: ``python -m mpack convert SRC -o OUT --device D --quiet --force`` for each of
  ``--devices``, warm; on CPU once per ``--cores`` N under ``taskset -c 0-(N-1)`` (counts above
  this machine's are skipped; if all are, it runs once on every core). Peer: ``cp -r SRC DST``
  into a fresh DST, and the same copy followed by ``sync`` (``cp`` does not fsync; convert
  fsyncs every file it writes).
  The warm-up keeps the scheme check's verdict on SRC (Note [verdict cache]), as any earlier
  conversion of the same bytes on the machine would; one more row, on CPU with the fewest
  ``--cores``, runs with ``MPACK_NO_VERDICT_CACHE=1``: the first conversion of a checkpoint
  (the check's child imports compressed-tensors and torch).
- **convert-hub**: the CPU row with the fewest ``--cores``, with and without the kept verdict,
  converting ``mpack-bench/llama-8b-shaped-fp8`` from an HF cache under the workdir (SRC's
  files hard-linked as a finished download leaves them, ``HF_HUB_OFFLINE=1``): the CI pre-bake
  job's case, where the shards' sha256 are their blob names and nothing hashes the source.
- **convert-rounds**: issue 28's measure on a machine whose disk drifts: per convert row (and
  the convert-hub case on the fewest ``--cores``), ``--reps`` rounds each running ``cp -r SRC
  DST && sync``, the convert as shipped and the convert with ``MPACK_NO_DIRECT_WRITE=1`` (the
  page-cache writer: Note [direct writes]) in a rotated order (scripts/bench_interleaved.py);
  medians against the median of the peer, each round's own ratio in the notes.
- **convert-cold**: the same for the first of ``--devices``, page cache dropped, with the kept
  verdict and without it; peer: ``cp -r`` after the same drop.
- **verify**: ``python -m mpack verify OUT --source SRC --json``, warm; peer: ``cp -r``.
- **load** / **load-cold**: ``mpack.runtime.load(OUT, rank=0, device=D)`` in a fresh process per
  run, timed after the imports and CUDA init (D: cuda:0 when cuda is among ``--devices``, else
  cpu). Peer warm: ``safetensors.torch.load_file`` of the same files (the rank file and
  common.safetensors) in a fresh process, also after CUDA init (scripts/bench_runtime.py's
  worker); cold: a plain sequential read of them here after the same drop (the disk floor).
- **attach**: one ``mpack serve OUT --device D`` started with ``mpack.runtime.spawn``; for each
  ``--clients`` N, fresh processes that import torch and mpack and initialise CUDA (timed apart),
  wait at a barrier, then time ``attach(...)`` + the first touch of one tensor (``data_ptr()`` and
  its first element read back; Note [first touch] in bench_vt/workers.py): max and median; attach
  only and first touch only in the notes.
- **first-attach**: issue 28's first ``attach()`` of a process. One ``mpack serve OUT --device D``
  on its default socket; for each ``--clients`` N, ``--reps`` rounds each way of N fresh
  processes that import torch and ``mpack.runtime``, call ``mpack.runtime.warm(D)`` (as the
  vLLM plugin does at registration) or not, initialise CUDA, wait at a barrier, then time their
  first ``attach(...)`` and a second one. Two rows per N, after ``warm`` and without: the first
  attach, max and median over the N processes of every round; peer: the second attach of the
  same processes (what any later attach costs: the first pays imports and first calls, Note
  [warm attach]); the targets are on the first attach itself, ``warm`` or not (cuda:0: 10 ms
  alone, 15 ms each at 8; host: 5 ms alone). scripts/bench_first_attach.py runs the same
  clients against any sidecar.
- **serve**: ``mpack serve OUT --device D`` (``mpack.runtime.spawn``, default socket) from
  the start of the process to its READY line, as ``spawn`` counts it (``ready_s``), page cache
  warm; ``--reps`` runs after an untimed one. Peer: the same rank loaded privately,
  ``mpack.runtime.load(OUT, rank=0, device=D)`` in a fresh process, timed the same way from its
  start to the line it prints once loaded (and synchronised on CUDA): what each engine process
  would do without the daemon, with its own interpreter, imports and device start-up, for the
  same verified bytes. The notes give the floor, ``python -c "import mpack"`` plus the daemon's
  own fill (READY's ``load_s``), and what READY spends above it. Target (cuda:0): 2.5 s.
- **rss**: peak RSS of the convert CLI of the full model against one of ``--rss-layers`` layers.
- **imports**: the compressed-tensors check of SRC in a fresh process, as convert's child runs
  it (lean import) against the full import, and ``import torch`` alone: what each choice costs.

``--reps`` runs of each (the best is the row's figure; all are in ``--json``). The table, printed
last: what | now | peer | ratio | target | met? | before (issue 15's figures, on the H200).
``--md FILE`` appends it, with the machine and this command line, under "bench_vs_tools runs".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_rt.procs import kill_all  # noqa: E402
from bench_vt.report import Row, append_markdown, machine, markdown, print_table  # noqa: E402
from bench_vt.rows import (  # noqa: E402
    Bench,
    row_convert,
    row_convert_rounds,
    row_imports,
    row_rss,
    row_verify,
    warm_up,
)
from bench_vt.runtime_rows import row_load, row_serve, rows_attach, rows_first_attach  # noqa: E402
from bench_vt.workers import WORKERS  # noqa: E402
from benchutil import (  # noqa: E402
    LLAMA_8B_LAYERS,
    LLAMA_8B_VOCAB,
    exit_on_signals,
    scratch_dir,
    synth,
    synth_present,
)

GROUPS = (
    "convert",
    "convert-hub",
    "convert-rounds",
    "load",
    "attach",
    "first-attach",
    "serve",
    "convert-cold",
    "load-cold",
    "verify",
    "rss",
    "imports",
)
Step = tuple[str, str, Callable[[], "Row | list[Row]"]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workdir", default="/tmp/mpack-bench-vs")
    ap.add_argument("--src", help="an existing checkpoint instead of DIR/src (its layers, vocab)")
    ap.add_argument("--layers", type=int, default=LLAMA_8B_LAYERS)
    ap.add_argument("--vocab", type=int, default=LLAMA_8B_VOCAB)
    ap.add_argument("--devices", default="cuda,cpu", help="convert devices: cuda, cpu")
    ap.add_argument("--cores", default="16,4", help="CPU counts of the CPU convert rows (taskset)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cold", choices=["drop", "none"], default="drop")
    ap.add_argument(
        "--clients", default="1,8", help="client counts of the attach and first-attach rows"
    )
    ap.add_argument("--rss-layers", type=int, default=4, help="the smaller model (0: no rss row)")
    ap.add_argument("--only", help="rows, comma-separated: " + ",".join(GROUPS))
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--md", help="append the table (Markdown) to this file")
    ap.add_argument("--_worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--_args", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        return a
    a.devices = [d for d in a.devices.split(",") if d]
    a.cores = [int(x) for x in a.cores.split(",") if x]
    a.clients = [int(x) for x in a.clients.split(",") if x]
    a.only = set(a.only.split(",")) if a.only else set(GROUPS)
    if bad := set(a.devices) - {"cuda", "cpu"}:
        ap.error(f"--devices: {','.join(sorted(bad))}: each must be cuda or cpu")
    if bad := a.only - set(GROUPS):
        ap.error(f"--only: {','.join(sorted(bad))}: choose among {','.join(GROUPS)}")
    if a.reps < 1 or min(a.cores, default=1) < 1 or min(a.clients, default=1) < 1:
        ap.error("--reps, --cores and --clients must be positive")
    return a


# --- setup ---------------------------------------------------------------------------------------


def ensure_checkpoint(b: Bench, path: Path, layers: int) -> None:
    """``path`` as scripts/synth_checkpoint.py makes it with ``layers`` (made when missing)."""
    if not synth_present(path, layers, b.args.vocab):
        synth(path, layers, b.args.vocab, b.env, b.tmp, quiet=True)


def usable_devices(b: Bench) -> list[str]:
    """``--devices`` less cuda when torch sees no GPU (said, not an error)."""
    devices = list(b.args.devices)
    if "cuda" in devices and not b.meta["machine"]["cuda"]:
        b.say("cuda rows skipped: torch sees no CUDA device on this machine")
        devices.remove("cuda")
    if not devices:
        raise SystemExit("bench_vs_tools: no device left to run on (--devices)")
    return devices


def cpu_counts(b: Bench) -> list[int]:
    """``--cores`` this machine has (the others skipped, said); none without taskset."""
    have = os.cpu_count() or 1
    if shutil.which("taskset") is None:
        b.say("CPU convert rows skipped: taskset is not installed")
        return []
    for n in (n for n in b.args.cores if n > have):
        b.say(f"`mpack convert --device cpu` at {n} cores skipped: this machine has {have}")
    ok = [n for n in b.args.cores if n <= have]
    if not ok and b.args.cores:
        b.say(f"`mpack convert --device cpu` measured on all {have} cores instead")
    return ok or [have]


def steps(b: Bench, devices: list[str]) -> list[Step]:
    """Every row in the order it runs, as (group, what, measure): warm rows first, then the
    cold ones, verify (the longest), rss."""
    rt = "cuda:0" if "cuda" in devices else "cpu"
    first = devices[0]
    out: list[Step] = []
    for dev in devices if "convert" in b.args.only else []:
        for n in [None] if dev == "cuda" else cpu_counts(b):
            out.append(
                ("convert", f"convert {dev} {n or ''}", partial(row_convert, b, dev, n, "warm"))
            )
    if "cpu" in devices:  # the CI-runner case, converting these bytes for the first time
        n = min(cpu_counts(b))
        out.append(
            (
                "convert",
                f"convert cpu {n} no kept verdict",
                partial(row_convert, b, "cpu", n, "warm", False),
            )
        )
        out += [
            (
                "convert-hub",
                f"convert cpu {n} from the HF cache" + (" no kept verdict" if not k else ""),
                partial(row_convert, b, "cpu", n, "warm", k, True),
            )
            for k in (True, False)
        ]
    for dev in devices if "convert-rounds" in b.args.only else []:
        for n in [None] if dev == "cuda" else cpu_counts(b):
            name = f"convert {dev} {n or ''} against cp -r && sync, round by round"
            out.append(("convert-rounds", name, partial(row_convert_rounds, b, dev, n)))
    if "cpu" in devices:  # the CI pre-bake job's case: the source from the HF cache
        n = min(cpu_counts(b))
        name = f"convert cpu {n} from the HF cache against cp -r && sync, round by round"
        out.append(("convert-rounds", name, partial(row_convert_rounds, b, "cpu", n, True)))
    out += [
        ("load", f"load {rt}", partial(row_load, b, rt, first, "warm")),
        ("attach", f"attach {rt}", partial(rows_attach, b, rt, first)),
        ("first-attach", f"first attach {rt}", partial(rows_first_attach, b, rt, first)),
        ("serve", f"serve {rt} to READY", partial(row_serve, b, rt, first)),
        ("convert-cold", f"convert {first} cold", partial(row_convert, b, first, None, "cold")),
        (
            "convert-cold",
            f"convert {first} cold no kept verdict",
            partial(row_convert, b, first, None, "cold", False),
        ),
        ("load-cold", f"load {rt} cold", partial(row_load, b, rt, first, "cold")),
        ("verify", "verify", partial(row_verify, b, first)),
        ("imports", "imports", partial(row_imports, b)),
    ]
    small, layers = b.work / f"src-{b.args.rss_layers}l", b.args.rss_layers
    if 0 < layers < b.args.layers:
        out.append(("rss", "rss", partial(_rss, b, first, small, layers)))
    elif "rss" in b.args.only:
        b.say(f"rss row skipped: --rss-layers {layers} is not between 0 and --layers")
    return out


def _rss(b: Bench, dev: str, small: Path, layers: int) -> Row:
    ensure_checkpoint(b, small, layers)
    return row_rss(b, dev, small)


# --- the run -------------------------------------------------------------------------------------


def setup(b: Bench) -> list[Step]:
    """The machine, the checkpoint, the warm-up, the rows to run (``--only``; the cold ones
    unless --cold none)."""
    b.work.mkdir(parents=True, exist_ok=True)
    args = {**vars(b.args), "only": sorted(b.args.only)}
    b.meta.update(
        command=shlex.join([Path(sys.executable).name, *sys.argv]),
        args=args,
        layers=b.args.layers,
        machine=machine(b.env, b.tmp),
    )
    if b.args.src:  # its own dimensions, for the rss row's smaller model
        cfg = b.src / "config.json"
        if not cfg.is_file():
            raise SystemExit(f"bench_vs_tools: --src {b.src}: no config.json there")
        c = json.loads(cfg.read_text())
        b.args.layers, b.args.vocab = c["num_hidden_layers"], c["vocab_size"]
    ensure_checkpoint(b, b.src, b.args.layers)
    b.meta["source_bytes"] = sum(p.stat().st_size for p in b.src_files())
    devices = usable_devices(b)
    warm_up(b, "cuda" in devices)
    todo = [s for s in steps(b, devices) if s[0] in b.args.only]
    if b.args.cold == "none" and any(s[0].endswith("-cold") for s in todo):
        b.say("cold rows skipped (--cold none)")
        todo = [s for s in todo if not s[0].endswith("-cold")]
    return todo


def run(b: Bench, todo: list[Step]) -> None:
    """Each step in order; a failed one is a FAILED row and the others still run."""
    for group, what, measure in todo:
        print(f"== {what}", flush=True)
        try:
            got = measure()
            b.rows += got if isinstance(got, list) else [got]
        except Exception as e:  # recorded; the next rows still run
            b.rows.append(Row(group, what, error=f"{type(e).__name__}: {e}"))
            print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
        if (b.out / "mpack.json").is_file():
            b.meta["sidecar_bytes"] = sum(p.stat().st_size for p in b.out.glob("*.safetensors"))
        b.save()


def finish(b: Bench) -> None:
    """The JSON, the table (last), and the Markdown record."""
    b.save()
    print_table(b.rows, b.lines)
    if b.args.md:
        append_markdown(Path(b.args.md), markdown(b.rows, b.lines, b.meta))
        print(f"appended to {b.args.md}")


def main() -> int:
    a = parse_args()
    if a._worker:
        WORKERS[a._worker](json.loads(a._args))
        return 0
    exit_on_signals()
    tmp, env = scratch_dir("bvt-")
    b = Bench(a, Path(a.workdir).resolve(), tmp, env)
    try:
        todo = setup(b)
        try:
            run(b, todo)
        except BaseException:
            b.lines.append("interrupted: the table holds the rows that finished")
            raise
        finally:
            kill_all()
            finish(b)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if any(r.error for r in b.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
