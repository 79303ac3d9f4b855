"""Issue 44: the daemon of one pipeline stage (`mpack serve SC --rank R --pp-rank P --pp-size N`),
on the host backend, as an engine at TP 2 x PP 2 meets it.

Real processes throughout: the (tp, pp) grid of daemons over a converted 5-layer sidecar (vLLM's
split of 5 layers over 2 stages: [3, 2]), and each stage of each rank attached by a process of
its own (``stage_client.py``, which takes its tensors as the vLLM loader does). Together the
stages of a rank hold every tensor of that rank's files exactly once, but for what vLLM itself
builds on more than one stage: with tied embeddings, ``model.embed_tokens.weight`` on the first
and the last stage (vLLM 0.33.0's Llama builds it there for its tied lm_head); nothing else.
A daemon serving another split than the engine's is refused, naming both, under ``attach:
auto`` too; `mpack status --pp-size 2` is ready only while every (rank, stage) is served.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mpack import arch
from mpack.arch import Stage
from mpack.convert import convert
from mpack.errors import StageMismatchError, VerificationError
from mpack.fixtures import make_checkpoint
from mpack.runtime.allocation import plan_rank
from mpack.runtime.loader import load
from mpack.sidecar import COMMON_NAME, rank_file_name, read_file_map
from tests.runtime.rt_helpers import DaemonProc, private_runtime

HERE = Path(__file__).resolve().parent
TP, PP, LAYERS = 2, 2, 5
SPLIT = (3, 2)  # vLLM's split of 5 layers over 2 stages
#: What vLLM 0.33.0's Llama builds on more than one stage, by whether the embeddings are tied:
#: the only tensors two stages may both hold, and they must (first and last stage).
SHARED = {False: set(), True: {"model.embed_tokens.weight"}}


def _sidecar(root: Path, tied: bool) -> Path:
    ck = make_checkpoint(
        root / f"ck-{tied}",
        hidden=128,
        intermediate=256,
        heads=4,
        kv_heads=2,
        vocab=256,
        layers=LAYERS,
        tie_embeddings=tied,
    )
    out = root / f"sc-{tied}"
    convert(ck, out, tp=TP, device="cpu")
    return out


def file_tensors(sidecar: Path, rank: int) -> dict[str, str]:
    """sha256 of every tensor of rank ``rank``'s files (its rank file and common), by name."""
    out = {}
    for name in (rank_file_name(rank, TP), COMMON_NAME):
        data = (sidecar / name).read_bytes()
        for e in read_file_map(sidecar / name).entries:
            out[e.name] = hashlib.sha256(data[e.offset : e.offset + e.nbytes]).hexdigest()
    return out


class Grid:
    """One daemon per (rank, stage) of ``sidecar``, in a private runtime directory."""

    def __init__(self, root: Path, sidecar: Path) -> None:
        self.root, self.sidecar = root, sidecar
        self.env = private_runtime(root)
        self.daemons: dict[tuple[int, int], DaemonProc] = {}
        self.others: list[DaemonProc] = []

    def start(self, rank: int, pp_rank: int, *extra: str) -> DaemonProc:
        args = ("--rank", str(rank), "--pp-rank", str(pp_rank), "--pp-size", str(PP), *extra)
        d = DaemonProc(self.sidecar, "cpu", self.env, self.root, *args)
        self.daemons[rank, pp_rank] = d
        return d

    def start_all(self) -> None:
        for r in range(TP):
            for p in range(PP):
                self.start(r, p)
        for d in self.daemons.values():
            d.wait_ready()

    def whole(self, rank: int) -> DaemonProc:
        d = DaemonProc(self.sidecar, "cpu", self.env, self.root, "--rank", str(rank))
        self.others.append(d)
        d.wait_ready()
        return d

    def close(self) -> None:
        for d in [*self.daemons.values(), *self.others]:
            d.stop()
            d.close()

    def clients(self, asks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each of ``asks`` (``rank``, and ``pp_rank`` and ``split``, ``attach``, ``socket``,
        ``env``) in a process of its own, all at once; their JSON documents, in order."""
        procs = []
        for ask in asks:
            cmd = [sys.executable, str(HERE / "stage_client.py"), str(self.sidecar)]
            cmd += ["--rank", str(ask["rank"]), "--attach", ask.get("attach", "require")]
            if "pp_rank" in ask:
                cmd += ["--pp-rank", str(ask["pp_rank"]), "--split", ask["split"]]
            if "socket" in ask:
                cmd += ["--socket", str(ask["socket"])]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**self.env, **ask.get("env", {})},
                    cwd=self.root,
                )
            )
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            lines = stdout.strip().splitlines()
            assert lines, f"stage client printed nothing: {stderr}"
            out.append(json.loads(lines[-1]))
        return out

    def status(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mpack.cli", "status", str(self.sidecar), *args],
            capture_output=True,
            text=True,
            env={**self.env, "COLUMNS": "250", **(env or {})},
            cwd=self.root,
            timeout=120,
        )


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def grid(request, tmp_path_factory):
    tied = request.param
    root = tmp_path_factory.mktemp(f"pp-grid-{tied}")
    g = Grid(root, _sidecar(root, tied))
    g.tied = tied
    try:
        g.start_all()
        yield g
    finally:
        g.close()


def stage_asks(**kw: Any) -> list[dict[str, Any]]:
    split = ",".join(map(str, SPLIT))
    return [{"rank": r, "pp_rank": p, "split": split, **kw} for r in range(TP) for p in range(PP)]


def test_each_daemon_holds_its_stage_and_the_stages_cover_the_model_once(grid: Grid) -> None:
    results = grid.clients(stage_asks())
    by = {(a["rank"], a["pp_rank"]): res for a, res in zip(stage_asks(), results, strict=True)}
    for (r, p), res in by.items():
        assert res["ok"], res
        d = grid.daemons[r, p]
        # attached to the daemon of its own stage, zero-copy, which holds that stage only
        assert res["daemon_pid"] == d.pid and res["backend"] == "host"
        assert res["stage"] == [p, list(SPLIT)]
        assert (d.ready.pp_rank, d.ready.pp_size) == (p, PP)
        assert d.ready.bytes == res["nbytes"] == plan_rank(grid.sidecar, r, Stage(p, SPLIT)).size
        assert d.ready.bytes < plan_rank(grid.sidecar, r).size
    for r in range(TP):
        want = file_tensors(grid.sidecar, r)
        held = collections.Counter()
        for p in range(PP):
            got = by[r, p]["tensors"]
            assert {n: want.get(n) for n in got} == got, f"rank {r} stage {p}: other bytes"
            held.update(list(got))
            span = arch.pp_layers(LAYERS, p, PP)
            layers = {arch.decoder_index(n) for n in got} - {None}
            assert layers == set(span), (r, p, sorted(layers))
            assert ("model.norm.weight" in got) == (p == PP - 1)
            assert ("lm_head.weight" in got) == (p == PP - 1 and not grid.tied)
            assert ("model.embed_tokens.weight" in got) == (p == 0 or grid.tied)
        assert set(held) == set(want), sorted(set(want) ^ set(held))  # every tensor
        twice = {n for n, k in held.items() if k > 1}
        assert twice == SHARED[grid.tied], sorted(twice)
        assert all(held[n] == PP for n in twice)  # on the first stage and the last
        # a stage's allocation holds its tensors, not the others': the two stages' memory
        # is about the rank's (its files less their headers, plus alignment)
        total = sum(by[r, p]["nbytes"] for p in range(PP))
        shared = sum(
            e.nbytes for e in read_file_map(grid.sidecar / COMMON_NAME).entries if e.name in twice
        )
        files = sum((grid.sidecar / n).stat().st_size for n in (rank_file_name(r, TP), COMMON_NAME))
        assert files - 64 * 1024 < total - shared <= files, (total, shared, files)


@pytest.mark.parametrize(
    ("split", "pp_rank"),
    [("2,3", 0), ("2,2,1", 1)],  # the same size, another partition; another size
    ids=["partition", "size"],
)
@pytest.mark.parametrize("attach", ["require", "auto"])
def test_a_daemon_of_another_split_is_refused_naming_both(
    grid: Grid, split: str, pp_rank: int, attach: str
) -> None:
    """The engine's stage ``pp_rank`` of ``split`` meets the daemon of stage ``pp_rank`` of
    [3, 2]; `attach: auto` does not load privately beside it."""
    engine = Stage(pp_rank, tuple(int(n) for n in split.split(",")))
    served = Stage(pp_rank, SPLIT)
    [res] = grid.clients([{"rank": 1, "pp_rank": pp_rank, "split": split, "attach": attach}])
    assert not res["ok"] and res["type"] == StageMismatchError.__name__, res
    assert res["exit_code"] == 2
    assert f"serves pipeline {served}" in res["message"], res["message"]
    assert f"this engine runs {engine}" in res["message"], res["message"]
    assert f"--pp-rank {pp_rank} --pp-size {engine.size}" in res["hint"]


def test_a_stage_daemon_is_refused_for_the_whole_rank(grid: Grid) -> None:
    d = grid.daemons[0, 1]
    [res] = grid.clients([{"rank": 0, "socket": d.ready.socket}])
    assert not res["ok"] and res["type"] == StageMismatchError.__name__, res
    assert f"serves pipeline {Stage(1, SPLIT)} only, not the whole rank" in res["message"]


def test_a_whole_rank_daemon_serves_any_stage(tmp_path: Path, grid: Grid) -> None:
    """No stage daemon in this runtime directory: the stage attaches to its rank's daemon."""
    other = Grid(tmp_path, grid.sidecar)
    try:
        d = other.whole(0)
        split = ",".join(map(str, SPLIT))
        [res] = other.clients([{"rank": 0, "pp_rank": 1, "split": split}])
        assert res["ok"], res
        assert res["daemon_pid"] == d.pid and res["stage"] is None
        assert set(res["tensors"]) == set(file_tensors(grid.sidecar, 0))
        r = other.status("--pp-size", str(PP))  # each stage served by the whole rank's daemon
        assert r.returncode == 2 and "no daemon serves rank 1 stage 0 of 2" in r.stderr
        assert "rank 0 stage" not in r.stderr.split("; served:")[0], r.stderr
        r = other.status("--rank", "0", "--pp-size", str(PP))
        assert r.returncode == 0, r.stderr
    finally:
        other.close()


def test_status_reports_each_tp_pp_rank_and_is_not_ready_with_one_stage_down(
    grid: Grid,
) -> None:
    r = grid.status("--pp-size", str(PP), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True
    got = {
        (d["rank"], d["pp_rank"], d["pp_size"], tuple(d["layers"]), d["pid"])
        for d in doc["daemons"]
    }
    want = set()
    for (rank, p), d in grid.daemons.items():
        span = arch.pp_layers(LAYERS, p, PP)
        want.add((rank, p, PP, (span.start, span.stop), d.pid))
    assert got == want
    r = grid.status()  # every rank is served, stage by stage
    assert r.returncode == 0, r.stderr
    assert "0/2 (layers 0..2)" in r.stdout and "1/2 (layers 3..4)" in r.stdout, r.stdout
    assert grid.status("--pp-size", "3").returncode == 2  # another split is not this grid

    down = grid.daemons[1, 1]
    down.stop()
    try:
        r = grid.status("--pp-size", str(PP))
        assert r.returncode == 2, r.stdout
        assert f"no daemon serves rank 1 {Stage(1, SPLIT)}" in r.stderr, r.stderr
        served = r.stderr.split("; served:")[1]
        for rank, p in [(0, 0), (0, 1), (1, 0)]:
            assert f"rank {rank} {Stage(p, SPLIT)} by pid {grid.daemons[rank, p].pid}" in served
        assert f"mpack serve {grid.sidecar} --rank 1 --pp-rank 1 --pp-size 2" in r.stderr
        r = grid.status()  # rank 1 is only half served: not ready either
        assert r.returncode == 2, r.stdout
        assert "no daemon serves rank 1 (of ranks 0..1)" in r.stderr, r.stderr
        for args, rc in [
            (["--rank", "0", "--pp-size", "2"], 0),
            (["--rank", "1", "--pp-rank", "0", "--pp-size", "2"], 0),
            (["--rank", "1", "--pp-rank", "1", "--pp-size", "2"], 2),
            (["--pp-rank", "1", "--pp-size", "2"], 2),
            (["--pp-rank", "0", "--pp-size", "2", "--device", "cpu", "--device", "cpu"], 0),
        ]:
            assert grid.status(*args).returncode == rc, args
        r = grid.status("--rank", "1", "--pp-rank", "0", "--pp-size", "2", "--json")
        daemons = json.loads(r.stdout)["daemons"]
        assert [(d["rank"], d["pp_rank"]) for d in daemons] == [(1, 0)]
    finally:
        grid.start(1, 1).wait_ready()
    assert grid.status("--pp-size", str(PP)).returncode == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--pp-rank", "0"], "--pp-rank 0 without --pp-size"),
        (["--pp-size", "2"], "--pp-size 2 without --pp-rank: a daemon serves one stage"),
        (["--pp-rank", "2", "--pp-size", "2"], "--pp-rank 2 is out of range"),
        (["--pp-rank", "0", "--pp-size", "0"], "--pp-size must be >= 1"),
    ],
)
def test_serve_refuses_a_stage_that_names_none(tmp_path: Path, args, says) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", str(tmp_path), *args],
        capture_output=True,
        text=True,
        env={**private_runtime(tmp_path)},
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_serve_reads_the_partition_variable_as_vllm_does(grid: Grid, tmp_path: Path) -> None:
    """``VLLM_PP_LAYER_PARTITION=1,4``: stage 0 holds layer 0 only; an empty value is unset."""
    other = Grid(tmp_path, grid.sidecar)
    other.env[arch.PP_PARTITION_ENV] = "1,4"
    try:
        d = other.start(0, 0)
        d.wait_ready()
        assert d.ready.bytes == plan_rank(grid.sidecar, 0, Stage(0, (1, 4))).size
        [res] = other.clients([{"rank": 0, "pp_rank": 0, "split": "1,4"}])
        assert res["ok"] and {arch.decoder_index(n) for n in res["tensors"]} - {None} == {0}
        r = other.status("--pp-size", "2", "--rank", "0", "--pp-rank", "0")
        assert r.returncode == 0, r.stderr  # status reads the variable too
        r = other.status(
            "--rank", "0", "--pp-rank", "0", "--pp-size", "2", env={arch.PP_PARTITION_ENV: ""}
        )
        assert r.returncode == 2 and "split [3, 2]" in r.stderr, r.stderr
        assert "split [1, 4]" in r.stderr.split("; served:")[1]
    finally:
        other.close()


def test_a_private_stage_load_holds_its_stage_verified(grid: Grid, tmp_path: Path) -> None:
    """``load(stage=...)`` (the loader's private path at PP > 1) gives the daemon's tensors,
    and its bytes are checked against the manifest's digests: a byte changed in the other
    stage's part of the same chunk is found, as in a whole load."""
    import shutil

    want = file_tensors(grid.sidecar, 0)
    for p in range(PP):
        w = load(grid.sidecar, rank=0, stage=Stage(p, SPLIT))
        assert w.stage == Stage(p, SPLIT)
        for n in w:
            data = w[n].reshape(-1).view(__import__("torch").uint8).numpy()
            assert hashlib.sha256(data).hexdigest() == want[n], n
    bad = tmp_path / "bad"
    shutil.copytree(grid.sidecar, bad)
    f = bad / rank_file_name(0, TP)
    last = max(read_file_map(f).entries, key=lambda e: e.offset)  # in stage 1's layers
    assert arch.decoder_index(last.name) == LAYERS - 1
    with open(f, "r+b") as fh:
        fh.seek(last.offset)
        byte = fh.read(1)
        fh.seek(last.offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(VerificationError, match="does not match the manifest"):
        load(bad, rank=0, stage=Stage(0, SPLIT))
    assert os.path.getsize(f) == (grid.sidecar / f.name).stat().st_size
