"""Benchmark `mpack serve` / `mpack.runtime.attach` against their floors and the usual ways.

    python scripts/bench_runtime.py --sidecar /tmp/mpack-bench/out-cuda --device cuda:0 \\
        [--json runtime.json]
    python scripts/bench_runtime.py --workdir /tmp/brt [--layers 32] [--vocab 128256] ...
    python scripts/bench_runtime.py --workdir /tmp/brt --layers 2 --vocab 32000 --device cpu

Everything is measured in the same run, on the same files (one rank: its rank file and
``common.safetensors``, exactly the bytes ``serve`` loads):

- **floor**: a fresh process reads the files front to back in 16 or 64 MiB pieces (the faster
  warm is used cold) into a ring of 4 pinned buffers, each then copied asynchronously into one
  preallocated device buffer (no hashing, no checks): cold and warm. Also the same reads, no copy
  ("read only": disk or page cache alone, not PCIe). With ``--device cpu`` the floor reads
  straight into a fresh shared anonymous mapping (what the daemon does with its memfd).
- **serve**: ``mpack serve SIDECAR --device D --socket S --json`` in a fresh process: first
  ``--verify always`` (every file hashed and recorded as verified, in the run's own cache), then
  ``--verify auto`` cold (page cache dropped first) and warm (the record trusted: files read,
  not hashed), then ``--verify always`` warm again; ``load_s`` from its READY line (the fill
  only, comparable with the floor), the wall time from ``Popen`` to READY (interpreter, imports,
  CUDA init too), and the ready event's ``startup`` phases (imports, plan, device, lock, alloc,
  fill, seal, listen; bytes hashed and trusted: runtime/daemon.py ``Startup``). With ``--skip
  floor,safetensors,attach,torch_mp`` only this runs (``--cold none``: warm only).
- **safetensors**: ``safetensors.torch.load_file(f, device=D)`` of the same files in a fresh
  process, timed after ``torch.cuda.init()`` and a first allocation, up to a synchronize. (On
  CPU ``load_file`` maps the file lazily, so each tensor is also cloned: a private copy.)
- **attach**: one daemon; N = 1, 2, 4, 8 fresh client processes import torch and mpack and
  initialise CUDA, then are released together and time ``attach(...)`` (building every tensor
  view included); also each client's ``data_ptr()`` of every tensor + synchronize, and a second
  attach in a warm process.
- **memory** (``nvidia-smi memory.used``; on CPU ``Shmem`` + the anonymous memory of the
  processes it started, see host_memory): nothing running; the daemon alone; daemon + 8 idle
  clients (CUDA initialised: their contexts); the same 8 attached. Weights held with 8 clients
  = attached - baseline - 9 contexts (a context measured as (idle - daemon alone) / 8; the
  daemon's counted as one more on CUDA, its own RssAnon on CPU), against the rank's size. Also
  raw (attached - baseline, contexts included) and what attaching added (attached - idle).
- **torch.multiprocessing**: one producer loads the same tensors with ``load_file(f, device=D)``
  and sends the dict to spawned ``torch.multiprocessing`` consumers, pickled by torch's
  reductions (one CUDA IPC handle per tensor, as vLLM's daemon does) over a pipe, as
  ``mp.Queue`` does; consumers time the get (receive + unpickle) up to having every tensor
  (``data_ptr()`` each, then a synchronize); N = 1, 2, 4, 8, and memory with 8.

Targets (ratios measured in this run): cold load <= 1.15 x floor and < safetensors; attach <= 20
ms with 8 clients and faster than torch.mp; 8 clients hold <= 1.05 x one copy. The table of
ratios is printed LAST; ``--json`` writes every number. Cold = ``drop_caches`` (root; the whole
page cache, libraries too: a cold ``serve`` also imports torch from disk, outside ``load_s``) and
``POSIX_FADV_DONTNEED`` on the sidecar's files (any user); mincore then checks that they are out
of the cache, and a run that was not cold is flagged. Every process it starts runs in a session
of its own and is killed (its whole process group) when it ends, fails or is interrupted.

The parts (scripts/bench_rt/): ``procs`` (the child processes; ``mpack serve`` through
``mpack.runtime.spawn``), ``workers`` (the measuring processes, the floor among them),
``system`` (page cache, memory in use), ``sections`` (the run), ``report`` (ratios, the table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_rt import GB  # noqa: E402
from bench_rt.procs import kill_all  # noqa: E402
from bench_rt.report import gib, print_table, probes, summarize  # noqa: E402
from bench_rt.sections import (  # noqa: E402
    Ctx,
    choose_memory_source,
    section_attach,
    section_floor,
    section_safetensors,
    section_serve,
    section_torch_mp,
)
from bench_rt.workers import WORKERS  # noqa: E402
from benchutil import (  # noqa: E402
    LLAMA_8B_LAYERS,
    LLAMA_8B_VOCAB,
    exit_on_signals,
    scratch_dir,
    synth,
    synth_present,
)

# --- setup ---------------------------------------------------------------------------------------


def prepare_sidecar(a: argparse.Namespace, env: dict[str, str], cwd: Path) -> Path:
    if a.sidecar:
        return Path(a.sidecar).resolve()
    work = Path(a.workdir).resolve()
    src, out = work / "src", work / "sidecar"
    have_src = synth_present(src, a.layers, a.vocab)
    if (out / "mpack.json").is_file():
        print(f"reusing {out}", flush=True)
        return out
    if not have_src:
        synth(src, a.layers, a.vocab, env, cwd)
    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mpack.cli",
            "convert",
            str(src),
            "-o",
            str(out),
            "--device",
            a.device,
            "--quiet",
        ],
        check=True,
        env=env,
        cwd=cwd,
    )
    print(f"converted to {out} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def make_ctx(a: argparse.Namespace, tmp: Path, env: dict[str, str]) -> Ctx:
    """The run: the sidecar (made first with ``--workdir``), its rank's regions, the memory
    source."""
    sidecar = prepare_sidecar(a, env, tmp)
    from mpack.errors import MpackError
    from mpack.runtime.allocation import plan_rank

    try:
        plan = plan_rank(sidecar, a.rank)
    except MpackError as e:
        raise SystemExit(f"bench_runtime: {e}") from None
    c = Ctx(
        a,
        sidecar,
        tmp,
        env,
        [(r.path, r.offset, r.size) for r in plan.regions],
        plan.size,
        len(plan.tensors),
        plan.tensors[0].name,
    )
    choose_memory_source(c)
    return c


# --- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--sidecar", help="an existing sidecar (e.g. bench_convert's <workdir>/out-cuda)"
    )
    src.add_argument("--workdir", help="build (or reuse) DIR/src and DIR/sidecar")
    ap.add_argument("--layers", type=int, default=LLAMA_8B_LAYERS, help="with --workdir")
    ap.add_argument("--vocab", type=int, default=LLAMA_8B_VOCAB, help="with --workdir")
    ap.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument(
        "--clients",
        default="1,2,4,8",
        type=lambda s: [int(x) for x in s.split(",")],
        help="client counts (memory at the largest)",
    )
    ap.add_argument("--warm-reps", type=int, default=2)
    ap.add_argument("--floor-chunks", default="16,64", help="MiB; the best warm one is used cold")
    ap.add_argument(
        "--cold",
        choices=["drop", "fadvise", "none"],
        default="drop",
        help="drop: drop_caches (root) + fadvise the files; fadvise: only the files",
    )
    ap.add_argument(
        "--skip", default="", help="sections to skip: floor,serve,safetensors,attach,torch_mp"
    )
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--_worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--_args", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a._worker and not (a.sidecar or a.workdir):
        ap.error("give --sidecar PATH or --workdir DIR")
    if a.device != "cpu" and not a.device.startswith("cuda"):
        ap.error("--device must be cuda, cuda:N or cpu")
    if a.device == "cuda":
        a.device = "cuda:0"
    return a


def run_sections(c: Ctx, m0: int) -> None:
    """Every section not skipped, in order; a failed one is recorded and the others still run."""
    skip = set(c.args.skip.split(","))
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("floor", lambda: section_floor(c)),
        ("serve", lambda: section_serve(c)),
        ("safetensors", lambda: section_safetensors(c)),
        ("attach", lambda: section_attach(c, m0)),
        ("torch_mp", lambda: section_torch_mp(c, m0)),
    ]
    for name, fn in sections:
        if name in skip:
            continue
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        try:
            c.res[name] = fn()
        except Exception as e:  # a failed section is recorded; the others still run
            c.res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
        c.res[name]["section_s"] = time.perf_counter() - t
        sys.stdout.flush()


def bench(a: argparse.Namespace, tmp: Path, env: dict[str, str]) -> None:
    t_start = time.perf_counter()
    c = make_ctx(a, tmp, env)
    print(
        f"{c.sidecar}: {c.total / GB:.2f} GB in {len(c.regions)} files, {c.tensors} tensors; "
        f"device {a.device}",
        flush=True,
    )
    m0 = c.res["memory_baseline"] = c.mem(0.0)
    run_sections(c, m0)
    c.res["memory_end"] = c.mem()
    c.res["total_s"] = time.perf_counter() - t_start
    print(
        f"== memory at the end {gib(c.res['memory_end'] - m0)} above the start; total "
        f"{c.res['total_s']:.0f} s"
    )
    c.res["probes"] = probes(c)
    rows = c.res["summary"] = summarize(c)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(c.res, indent=2, default=str))
        print(f"wrote {a.json_out}")
    print_table(c, rows)


def main() -> int:
    a = parse_args()
    if a._worker:
        WORKERS[a._worker](json.loads(a._args))
        return 0
    exit_on_signals()  # so that `finally` ends every child
    tmp, env = scratch_dir("brt-")  # short: the socket lives here
    env["MPACK_CACHE_DIR"] = str(tmp / "cache")  # the run's own record of verified files
    try:
        bench(a, tmp, env)
    finally:
        kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
