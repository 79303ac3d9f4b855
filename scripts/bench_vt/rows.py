"""The run (``Bench``), its peers and its rows: each ``row_*`` measures one thing in fresh
processes and returns ``report.Row`` s (scripts/bench_vs_tools.py's docstring says how).

Peers are measured once per page-cache state and shared by the rows that need them
(``peer_cp``): every row is against a peer of the same run, on the same disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_rt.procs import BenchError, Child, run_worker, worker
from bench_rt.report import gib
from bench_rt.system import ensure_warm, evict
from benchutil import fresh, run_timed

from .report import Row, secs

SCRIPTS = Path(__file__).resolve().parents[1]
SCRIPT = SCRIPTS / "bench_vs_tools.py"  # this benchmark's workers (bench_vt/workers.py)
RT_SCRIPT = SCRIPTS / "bench_runtime.py"  # bench_runtime's workers: its load_file peer


@dataclass
class Bench:
    """One run: the options, the work directory (``src`` unless --src, ``out``: the sidecar,
    ``cp-dst``), the scratch directory (children's working directory, logs, the socket), their
    environment, what was measured (``peers``, ``rows``) and the lines said along the way (skips,
    warnings)."""

    args: argparse.Namespace
    work: Path
    tmp: Path
    env: dict[str, str]
    peers: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def src(self) -> Path:
        return Path(self.args.src).resolve() if self.args.src else self.work / "src"

    @property
    def out(self) -> Path:
        return self.work / "out"

    def src_files(self) -> list[Path]:
        return sorted(self.src.glob("*.safetensors"))

    def say(self, line: str) -> None:
        """Print a line and keep it for the table's notes (a skip, a warning)."""
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        """Write --json (after every row: what ran survives an interrupted run)."""
        if self.args.json_out:
            doc = {
                "meta": self.meta,
                "peers": self.peers,
                "lines": self.lines,
                "rows": [r.to_json() for r in self.rows],
            }
            Path(self.args.json_out).write_text(json.dumps(doc, indent=2, default=str))

    def worker(self, script: Path, kind: str, args: dict[str, Any]) -> Child:
        return worker(script, kind, args, self.env, self.tmp)

    def run_worker(self, script: Path, kind: str, args: dict[str, Any], key: str) -> Any:
        """One worker in a fresh process, to its ``key`` line; that line's ``key``."""
        return run_worker(script, kind, args, key, 1800, self.env, self.tmp)


# --- page cache, fresh outputs, timed processes --------------------------------------------------


def cache_state(b: Bench, files: list[Path], temp: str) -> dict[str, Any]:
    """Make ``files`` warm (read once unless cached) or cold (``--cold drop``: drop_caches, and
    POSIX_FADV_DONTNEED on the files in any case); what was done."""
    if temp == "warm":
        return {"resident_before": ensure_warm(files)}
    state = evict(files, "drop")
    if "drop_caches" not in b.meta:
        b.meta["drop_caches"] = state["drop_caches"]
        if not state["drop_caches"]:
            b.say(
                "--cold drop: drop_caches not allowed here (needs root and a writable /proc/sys): "
                "cold rows evict only their input files (POSIX_FADV_DONTNEED); libraries stay "
                "cached"
            )
    if not state["cold"]:
        frac = state["resident_after"]
        b.say(
            "WARNING: a cold row's input was not cold: "
            + ("unknown" if frac is None else f"{frac:.0%} still cached")
        )
    return state


def timed_cli(
    b: Bench,
    cmd: list[str],
    files: list[Path],
    temp: str,
    out: Path | None,
    env: dict[str, str] | None = None,
) -> dict:
    """``cmd`` in a fresh process after ``fresh(out)`` and ``cache_state``: wall, peak RSS, and
    for ``--json`` commands (convert) the ``seconds`` of its phases, as ``phases``. ``env``:
    variables set on top of the bench's."""
    if out is not None:
        fresh(out)
    state = cache_state(b, files, temp)
    r = run_timed(cmd, env={**b.env, **(env or {})}, cwd=b.tmp, keep_stdout="--json" in cmd)
    if r.returncode:
        raise BenchError(f"{' '.join(cmd)} exited with {r.returncode}: {r.stderr}")
    got = {"wall": r.wall, "peak_rss": r.peak_rss, "state": state}
    if "--json" in cmd:
        got["phases"] = json.loads(r.stdout).get("seconds", {})
    return got


def peer_cp(b: Bench, temp: str) -> dict[str, Any]:
    """``cp -r SRC DST`` into a fresh DST, then ``sync``, ``--reps`` times (measured once per
    page-cache state, shared by the rows): the best ``cp`` and ``cp + sync`` seconds."""
    key = f"cp-{temp}"
    if key in b.peers:
        return b.peers[key]
    dst, runs = b.work / "cp-dst", []
    for _ in range(b.args.reps):
        r = timed_cli(b, ["cp", "-r", str(b.src), str(dst)], b.src_files(), temp, dst)
        t = time.perf_counter()
        os.sync()
        r["sync"] = time.perf_counter() - t
        runs.append(r)
    fresh(dst)
    p = b.peers[key] = {
        "cp": min(r["wall"] for r in runs),
        "cp_sync": min(r["wall"] + r["sync"] for r in runs),
        "runs": runs,
    }
    print(f"  cp -r ({temp}): {secs(p['cp'])}, with sync {secs(p['cp_sync'])}", flush=True)
    return p


def cp_row(b: Bench, key: str, what: str, runs: list[dict], temp: str) -> Row:
    """A row of CLI runs against ``cp -r`` (and ``cp -r`` + ``sync``) of the same state."""
    p = peer_cp(b, temp)
    best = min(r["wall"] for r in runs)
    rss = max(r["peak_rss"] for r in runs)
    notes = [f"peak RSS {gib(rss)}"] if rss else []
    phases = min(runs, key=lambda r: r["wall"]).get("phases")
    if phases:  # the process's own account of the best run (ConvertResult.seconds)
        notes.append("phases, s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    return Row(
        key,
        what,
        best,
        now=secs(best),
        peer=p["cp"],
        peer2=p["cp_sync"],
        peer_text=f"cp -r {secs(p['cp'])} (+ sync {secs(p['cp_sync'])})",
        notes=notes,
        runs={"runs": runs, "peak_rss": rss},
    )


WARM_UP = r"""
import json, sys, time
t = time.perf_counter()
import torch, compressed_tensors
import mpack.cli, mpack.convert.pipeline, mpack.runtime.client, mpack.runtime.loader, mpack.verify
out = {"import_s": time.perf_counter() - t}
from mpack.convert.scheme_check import SchemeCheck
t = time.perf_counter()
check = SchemeCheck(sys.argv[2], background=True)  # a good verdict is kept (Note [verdict cache])
check.result()
out.update(check_s=time.perf_counter() - t, check_kept=not check.cached)
if sys.argv[1] == "cuda":
    from mpack.convert import cuda_repack
    t = time.perf_counter()
    out.update(kernel=cuda_repack.available(torch.device("cuda", 0)),
               reason=cuda_repack.unavailable_reason(), kernel_s=time.perf_counter() - t)
print(json.dumps(out))
"""


def warm_up(b: Bench, cuda: bool) -> None:
    """One untimed process before the rows: the imports of the CLI and the workers (their
    bytecode is written then, where a fresh install has none), the scheme check of the source
    (its good verdict kept in mpack's cache, Note [verdict cache]) and, with ``cuda``, the fused
    repack kernel built into its cache: no warm row pays a first-run cost. The rows marked
    "no kept verdict" measure a conversion that finds none."""
    r = subprocess.run(
        [sys.executable, "-c", WARM_UP, "cuda" if cuda else "cpu", str(b.src)],
        env=b.env,
        cwd=b.tmp,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise BenchError(f"warm-up failed ({r.returncode}): {r.stderr[-2000:]}")
    w = b.meta["warm_up"] = json.loads(r.stdout)
    print(
        f"warm-up: imports {w['import_s']:.2f} s, scheme check {w['check_s']:.2f} s"
        + (f", repack kernel {w['kernel']} in {w['kernel_s']:.2f} s" if cuda else ""),
        flush=True,
    )
    if cuda and not w["kernel"]:
        b.say(f"the fused repack kernel is not available ({w['reason']}): convert uses torch ops")


# --- convert, verify ------------------------------------------------------------------------------


def convert_cmd(src: Path, out: Path, dev: str, cores: int | None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "mpack",
        "convert",
        str(src),
        "-o",
        str(out),
        "--device",
        dev,
        "--json",
        "--force",
    ]
    return cmd if cores is None else ["taskset", "-c", f"0-{cores - 1}", *cmd]


def row_convert(
    b: Bench, dev: str, cores: int | None, temp: str, kept: bool = True, hub: bool = False
) -> Row:
    """The CLI convert, a fresh output each time, ``--reps`` times; against ``cp -r``. ``kept``
    False: with ``MPACK_NO_VERDICT_CACHE=1``, so the scheme check's child runs (a first
    conversion of these bytes on this machine; Note [verdict cache]). ``hub``: ``mpack convert
    HUB_REPO`` from the bench's HF cache (:func:`hub_cache`), offline: the CI pre-bake job's
    case (the shards' sha256 are their blob names, so nothing hashes the source; Note [source
    digests] in convert/source.py)."""
    peer_cp(b, temp)  # the peer first: a failed copy stops the row before the long part
    env = {"HF_HUB_CACHE": str(hub_cache(b)), "HF_HUB_OFFLINE": "1"} if hub else {}
    if not kept:
        env["MPACK_NO_VERDICT_CACHE"] = "1"
    cmd = convert_cmd(Path(HUB_REPO) if hub else b.src, b.out, dev, cores)
    runs = [timed_cli(b, cmd, b.src_files(), temp, b.out, env) for _ in range(b.args.reps)]
    key = (
        f"convert-{dev}"
        + (f"-{cores}c" if cores else "")
        + ("-cold" if temp == "cold" else "")
        + ("-hub" if hub else "")
        + ("" if kept else "-check")
    )
    how = f"`taskset -c 0-{cores - 1}` " if cores else ""
    what = (
        f"{how}`mpack convert {HUB_REPO + ' ' if hub else ''}--device {dev}`"
        + (" from the HF cache" if hub else "")
        + (", CLI, warm" if temp == "warm" else ", CLI, page cache dropped")
        + ("" if kept else ", no kept verdict (the check's child runs)")
    )
    return cp_row(b, key, what, runs, temp)


def row_convert_rounds(b: Bench, dev: str, cores: int | None, hub: bool = False) -> Row:
    """The CLI convert against ``cp -r && sync`` round by round (scripts/bench_interleaved.py):
    ``--reps`` rounds, each running the peer, the convert as shipped and the convert with
    direct writes off (``MPACK_NO_DIRECT_WRITE=1``: the page-cache writer, the before of Note
    [direct writes]) in a rotated order. The value and the peer are the medians of the walls;
    the notes give each round's ratio, the switch-off figures and each command's CPU seconds.
    On a machine whose disk drifts, a ratio within one round compares like with like."""
    from bench_interleaved import PEER, convert_commands, run_rounds, summarize, switch_var

    var = switch_var("direct-write")
    work = b.tmp / "rounds"
    work.mkdir(exist_ok=True)
    cmds = convert_commands(
        b.src,
        work,
        b.env,
        device=dev,
        cores=cores,
        var=var,
        hub=HUB_REPO if hub else None,
        hf_cache=hub_cache(b) if hub else None,
    )
    rounds = run_rounds(cmds, b.src_files(), b.args.reps, work)
    t = summarize(rounds)
    me, off, peer = t["mpack convert"], t[f"mpack convert, {var}=1"], t[PEER]

    def cpu(r: dict[str, Any]) -> str:
        return f"user {r['user_median']:.2f} s, sys {r['sys_median']:.2f} s"

    key = f"convert-{dev}" + (f"-{cores}c" if cores else "") + ("-hub" if hub else "") + "-rounds"
    how = f"`taskset -c 0-{cores - 1}` " if cores else ""
    source = f"{HUB_REPO} " if hub else ""
    return Row(
        key,
        f"{how}`mpack convert {source}--device {dev}`, CLI, warm, against `cp -r && sync` "
        "round by round",
        me["wall_median"],
        now=f"{secs(me['wall_median'])} median",
        peer=peer["wall_median"],
        peer_text=f"cp -r && sync {secs(peer['wall_median'])} median",
        notes=[
            f"{len(rounds)} rounds; each round's ratio: "
            + ", ".join(f"{x:.2f}" for x in me["ratios"])
            + f" (median {me['ratio_median']:.2f})",
            f"with {var}=1 (the page-cache writer): {secs(off['wall_median'])} median, "
            f"{off['ratio_median']:.2f}x cp -r && sync; CPU medians: this {cpu(me)}; "
            f"{var}=1 {cpu(off)}; cp -r && sync {cpu(peer)}",
        ],
        runs={"rounds": rounds, "table": t},
    )


#: The Hub id the source gets in the bench's own HF cache (``row_convert(..., hub=True)``).
HUB_REPO = "mpack-bench/llama-8b-shaped-fp8"


def hub_cache(b: Bench) -> Path:
    """SRC laid out in an HF cache under the workdir as a finished download of ``HUB_REPO``
    would leave it (made once, no copy of the shards): ``blobs/`` holds the safetensors files
    hard-linked under their sha256 (how the Hub names LFS blobs) and the small files under their
    git blob sha1, ``snapshots/<commit>/`` links to them, ``refs/main`` names the commit, and
    ``trees/<commit>.json`` lists the files. Made again when SRC's files changed (names, sizes,
    mtimes in ``src-stamp.json``). Returns the cache folder (``HF_HUB_CACHE``)."""
    cache = b.work / "hf-cache"
    root = cache / ("models--" + HUB_REPO.replace("/", "--"))
    files = sorted(p for p in b.src.iterdir() if p.is_file())
    stamp = json.dumps([[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    kept = cache / "src-stamp.json"
    if (root / "refs" / "main").is_file() and kept.is_file() and kept.read_text() == stamp:
        return cache
    shutil.rmtree(root, ignore_errors=True)  # made from another SRC: made again
    with ThreadPoolExecutor(len(files)) as pool:  # the shards' sha256 at once: one per file
        digests = list(pool.map(_blob_id, files))
    commit = hashlib.sha1(b"mpack bench " + "".join(d for d, _ in digests).encode()).hexdigest()
    tmp = cache / f".{root.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    snap = tmp / "snapshots" / commit
    for d in (tmp / "blobs", snap, tmp / "refs", tmp / "trees"):
        d.mkdir(parents=True)
    tree = {}
    for f, (blob, sha1) in zip(files, digests, strict=True):
        try:
            os.link(f, tmp / "blobs" / blob)
        except OSError:  # another file system: a copy
            shutil.copyfile(f, tmp / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snap / f.name)
        tree[f.name] = {"size": f.stat().st_size, "blob_id": sha1}
        if blob != sha1:
            tree[f.name].update(lfs_sha256=blob, lfs_size=f.stat().st_size)
    (tmp / "refs" / "main").write_text(commit)
    (tmp / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    tmp.rename(root)
    kept.write_text(stamp)
    return cache


def _blob_id(f: Path) -> tuple[str, str]:
    """(the blob's name in an HF cache, its git blob sha1): the sha256 for a safetensors file
    (an LFS file on the Hub), the git blob sha1 for the others."""
    size = f.stat().st_size
    sha1, sha256 = hashlib.sha1(b"blob %d\0" % size), hashlib.sha256()
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(8 << 20):
            sha1.update(chunk)
            if f.suffix == ".safetensors":
                sha256.update(chunk)
    return (sha256 if f.suffix == ".safetensors" else sha1).hexdigest(), sha1.hexdigest()


def ensure_sidecar(b: Bench, dev: str) -> None:
    """Make ``out`` (untimed) unless a row already did: verify, load and attach read it."""
    if not (b.out / "mpack.json").is_file():
        print(f"  converting {b.src} -> {b.out} ({dev}, untimed)", flush=True)
        timed_cli(b, convert_cmd(b.src, b.out, dev, None), b.src_files(), "warm", b.out)


def sidecar_files(b: Bench) -> list[Path]:
    return sorted(b.out.glob("*.safetensors"))


def row_verify(b: Bench, dev: str) -> Row:
    """``mpack verify OUT --source SRC --json``, warm, ``--reps`` times; against ``cp -r``; its
    phases (``Verification.seconds``) in the notes."""
    ensure_sidecar(b, dev)
    peer_cp(b, "warm")
    cmd = [sys.executable, "-m", "mpack", "verify", str(b.out), "--source", str(b.src), "--json"]
    files = b.src_files() + sidecar_files(b)
    runs = [timed_cli(b, cmd, files, "warm", None) for _ in range(b.args.reps)]
    return cp_row(b, "verify", "`mpack verify OUT --source SRC`", runs, "warm")


def row_rss(b: Bench, dev: str, small: Path) -> Row:
    """Peak RSS of the CLI convert (``dev``, warm) of the full model against a smaller one's."""
    key = f"convert-{dev}"
    big = next((r.runs["peak_rss"] for r in b.rows if r.key == key and r.error is None), None)
    cmd = convert_cmd(b.src, b.out, dev, None)
    if big is None:
        big = timed_cli(b, cmd, b.src_files(), "warm", b.out)["peak_rss"]
    out = b.work / "out-small"
    files = sorted(small.glob("*.safetensors"))
    r = timed_cli(b, convert_cmd(small, out, dev, None), files, "warm", out)
    fresh(out)
    layers = json.loads((small / "config.json").read_text())["num_hidden_layers"]
    return Row(
        "rss",
        f"peak RSS of `mpack convert --device {dev}`, {b.args.layers} vs {layers} layers",
        big,
        unit="GiB",
        now=gib(big),
        peer=r["peak_rss"],
        peer_text=f"{gib(r['peak_rss'])} at {layers} layer(s)",
        runs={"small": r, "big": big},
    )


SCHEME_CHECK = (
    "import sys; from pathlib import Path; from mpack.convert.scheme_check import child_verdict; "
    "v = child_verdict(Path(sys.argv[1])); assert v[0] == 'ok', v"
)


def row_imports(b: Bench) -> Row:
    """What the compressed-tensors check of the source costs, in a fresh process, warm (each
    command run once untimed first): as
    convert's child runs it (the lean import, Note [lean import]) against the full import
    (``MPACK_CT_IMPORT=full``); ``import torch`` alone in the notes."""

    def best(cmd: list[str], env: dict[str, str]) -> float:
        walls = []  # the first run is not timed: it warms the page cache (after the cold rows)
        for _ in range(b.args.reps + 1):
            r = run_timed(cmd, env=env, cwd=b.tmp)
            if r.returncode:
                raise BenchError(f"{' '.join(cmd)} exited with {r.returncode}: {r.stderr}")
            walls.append(r.wall)
        return min(walls[1:])

    check = [sys.executable, "-c", SCHEME_CHECK, str(b.src)]
    lean = best(check, b.env)
    full = best(check, {**b.env, "MPACK_CT_IMPORT": "full"})
    torch_s = best([sys.executable, "-c", "import torch"], b.env)
    return Row(
        "scheme-check",
        "compressed-tensors check of SRC, fresh process (convert's child)",
        lean,
        now=f"{secs(lean)} (lean import)",
        peer=full,
        peer_text=f"full import {secs(full)}",
        runs={"lean": lean, "full": full, "torch": torch_s},
        notes=[f"`import torch` alone: {secs(torch_s)}"],
    )
