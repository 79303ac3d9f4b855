"""`mpack status SIDECAR` as a readiness probe per rank (Note [ready] in runtime/client.py):
every rank of a TP-2 sidecar, or one with `--rank R`; and `engine_version` in `--json`.

Real daemons of a real TP-2 sidecar, and the real command line, as a probe runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpack import target
from tests.runtime.rt_helpers import DaemonProc, child_env
from tests.runtime.sidecar_factory import make_sidecar


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("status-ranks")
    xdg = root / "xdg"
    xdg.mkdir(mode=0o700)
    sc = make_sidecar(root / "sc", tp=2, layers=2, hidden=256, inter=512)
    env = child_env(xdg)
    daemons: list[DaemonProc] = []
    yield root, env, sc, daemons
    for d in daemons:
        d.stop()
        d.close()


def status(world, *args: str) -> subprocess.CompletedProcess:
    root, env, sc, _ = world
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", "status", *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "250"},
        cwd=root,
        timeout=120,
    )


def serve(world, rank: int) -> DaemonProc:
    root, env, sc, daemons = world
    d = DaemonProc(sc, "cpu", env, root, "--rank", str(rank))
    daemons.append(d)
    d.wait_ready()
    return d


def test_one_rank_of_two_is_not_ready_and_rank_asks_for_one(world):
    sc = str(world[2])
    r = status(world, sc)
    assert r.returncode == 2 and "no daemon serves rank 0, rank 1 (of ranks 0..1)" in r.stderr
    d0 = serve(world, 0)

    r = status(world, sc)  # the engine's probe: every rank
    assert r.returncode == 2, r.stdout
    assert "not ready: no daemon serves rank 1 (of ranks 0..1)" in r.stderr, r.stderr
    assert f"served: rank 0 by pid {d0.pid}" in r.stderr
    assert f"mpack serve {sc} --rank 1 --device cpu" in r.stderr  # the hint

    r = status(world, sc, "--rank", "0")  # rank 0's own probe
    assert r.returncode == 0, r.stderr
    r = status(world, sc, "--rank", "0", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    docs = json.loads(r.stdout)["daemons"]
    assert [(doc["rank"], doc["pid"]) for doc in docs] == [(0, d0.pid)]

    r = status(world, sc, "--rank", "1")
    assert r.returncode == 2 and "no daemon serves rank 1 (of ranks 0..1)" in r.stderr
    assert "rank 0," not in r.stderr.split("served:")[0]  # names only the rank asked for

    d1 = serve(world, 1)
    for args in ([], ["--rank", "1"], ["--device", "cpu"], ["--device", "cpu", "--device", "cpu"]):
        r = status(world, sc, *args)
        assert r.returncode == 0, (args, r.stderr)
    r = status(world, sc, "--json")
    docs = json.loads(r.stdout)["daemons"]
    assert sorted((doc["rank"], doc["pid"]) for doc in docs) == [(0, d0.pid), (1, d1.pid)]
    r = status(world, sc, "--rank", "1", "--json")
    assert [doc["pid"] for doc in json.loads(r.stdout)["daemons"]] == [d1.pid]


def test_status_json_names_the_engine_version(world):
    sc = str(world[2])
    if not world[3]:
        serve(world, 0)
    r = status(world, "--json")
    assert r.returncode == 0, r.stderr
    docs = [doc for doc in json.loads(r.stdout)["daemons"] if doc.get("state") == "serving"]
    assert docs and all(doc["engine_version"] == target.ENGINE_VERSION for doc in docs), docs
    assert all(doc["engine"] == target.ENGINE for doc in docs)
    r = status(world, sc, "--rank", "0", "--json")
    assert json.loads(r.stdout)["daemons"][0]["engine_version"] == target.ENGINE_VERSION


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rank", "2"], "rank 2 is out of range: this sidecar has tp_size=2"),
        (["--rank", "-1"], "--rank must be >= 0, got -1"),
        (["--rank", "x"], "Invalid value for '--rank'"),
        (["--rank", "0", "--device", "cpu", "--device", "cpu"], "2 --device values for --rank 0"),
    ],
)
def test_bad_rank_exits_2(world, args, says):
    r = status(world, str(world[2]), *args)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_rank_needs_a_sidecar(world):
    r = status(world, "--rank", "0")
    assert r.returncode == 2 and "--rank 0 needs a SIDECAR" in r.stderr, r.stderr
