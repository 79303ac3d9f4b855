"""scripts/bench_vs_tools.py's issue-28 rows (``first-attach``, ``serve``) and
scripts/bench_first_attach.py, which shares their clients: run end to end on the host backend
with a one-layer sidecar, and the rule that checks a row against its target."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


@pytest.fixture(scope="module")
def report() -> Any:
    """scripts/bench_vt/report.py (stdlib only), loaded from its file: no folder of the
    checkout goes onto sys.path (tests/__init__.py)."""
    spec = importlib.util.spec_from_file_location("bench_vt_report", SCRIPTS / "bench_vt/report.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses looks its module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_a_target_on_a_ratio_checks_the_ratio_any_other_the_value(report: Any) -> None:
    # serve-cuda: <= 2.5 s on the value, whatever its peer; the ratio is still shown
    fast_vs_faster = report.Row("serve-cuda", "serve", 2.0, peer=0.5)
    assert fast_vs_faster.ratio == 4.0 and fast_vs_faster.met is True
    slow_vs_slower = report.Row("serve-cuda", "serve", 3.0, peer=30.0)
    assert slow_vs_slower.ratio == pytest.approx(0.1) and slow_vs_slower.met is False
    assert slow_vs_slower.cells()[3:6] == ["0.10x", "<= 2.5 s", "NO"]
    # first-attach on cuda:0, 8 at once: 15 ms each, warm or not
    assert report.Row("first-attach-cuda-8-nowarm", "x", 14.9, unit="ms", peer=1.0).met is True
    assert report.Row("first-attach-cuda-8", "x", 15.1, unit="ms", peer=100.0).met is False
    # load-cpu: <= 0.9 x load_file, on the ratio
    assert report.Row("load-cpu", "load", 2.0, peer=2.5).met is True
    assert report.Row("load-cpu", "load", 0.5, peer=0.5).met is False
    # no target: no verdict
    assert report.Row("serve-cpu", "serve", 0.1, peer=1.0).met is None
    assert report.Row("first-attach-cpu-8", "x", 1.0, unit="ms", peer=1.0).met is None


def _tensors(sidecar: Path) -> int:
    from mpack.runtime.allocation import plan_rank

    return len(plan_rank(sidecar, 0).tensors)


def _run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_first_attach_and_serve_rows_end_to_end(
    converted: tuple[Path, Path], tmp_path: Path
) -> None:
    ck, _ = converted
    out = tmp_path / "bvt.json"
    cmd = [
        str(SCRIPTS / "bench_vs_tools.py"),
        *("--workdir", str(tmp_path / "work"), "--src", str(ck), "--devices", "cpu"),
        *("--cores", "1", "--only", "serve,first-attach", "--clients", "1,2", "--reps", "1"),
        *("--json", str(out)),
    ]
    r = _run(cmd)
    doc = json.loads(out.read_text())
    rows = {row["key"]: row for row in doc["rows"]}
    assert list(rows) == [
        "first-attach-cpu-1",
        "first-attach-cpu-1-nowarm",
        "first-attach-cpu-2",
        "first-attach-cpu-2-nowarm",
        "serve-cpu",
    ]
    assert all(row["error"] is None for row in rows.values())
    n = _tensors(tmp_path / "work" / "out")
    for key, row in rows.items():
        assert row["what"] in r.stdout  # the table, printed last
        if key == "serve-cpu":
            continue
        clients = row["runs"]["clients"]
        assert len(clients) == (1 if "-1" in key else 2)
        assert {c["warm"] for c in clients} == {not key.endswith("-nowarm")}
        assert all(c["tensors"] == n and c["same"] for c in clients)
        assert len({c["ready"] for c in clients}) == len(clients)  # one process each
        assert row["value"] == max(c["first_ms"] for c in clients) > 0
        assert row["peer"] == max(c["second_ms"] for c in clients) > 0
        if key.startswith("first-attach-cpu-1"):
            assert row["target"] == [5.0, "ms"] and row["met"] == (row["value"] <= 5.0)
        else:
            assert row["target"] is None and row["met"] is None
    serve = rows["serve-cpu"]["runs"]
    assert len(serve["runs"]) == len(serve["peer_runs"]) == len(serve["bare_runs"]) == 1
    for run in [*serve["runs"], serve["untimed"]["serve"]]:
        assert run["backend"] == "host" and run["ready_s"] > run["load_s"] >= 0
    assert rows["serve-cpu"]["value"] == serve["runs"][0]["ready_s"]
    peer = serve["peer_runs"][0]
    assert peer["tensors"] == n and peer["wall"] > peer["import_s"] + peer["load_s"]
    assert rows["serve-cpu"]["peer"] == peer["wall"]


@pytest.mark.slow
def test_bench_first_attach_uses_the_same_clients(converted: tuple[Path, Path]) -> None:
    _, sidecar = converted
    r = _run([str(SCRIPTS / "bench_first_attach.py"), str(sidecar), "--runs", "1", "--steps"])
    docs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert sorted(d["warm"] for d in docs) == [False, True]  # one round each way
    n = _tensors(sidecar)
    assert all(d["tensors"] == n and d["first_ms"] > 0 and d["second_ms"] > 0 for d in docs)
    for d in docs:  # --steps: each attach's parts, within its own time
        for which in ("first", "second"):
            steps = d[f"{which}_steps_ms"]
            assert set(steps) == {"load_manifest", "_connect", "_request", "_map"}
            assert 0 < sum(steps.values()) <= d[f"{which}_ms"]
    assert "where the first attach's time goes, median ms: " in r.stdout
    assert "first `attach`, fresh process, alone, after `warm`" in r.stdout
    assert "first `attach`, fresh process, alone, no `warm`" in r.stdout


@pytest.mark.slow
def test_convert_rounds_rows_end_to_end(converted: tuple[Path, Path], tmp_path: Path) -> None:
    """``convert-rounds``: every round runs the peer and both converts (the local source and the
    HF-cache one); the value and peer are the medians of the walls, each round's ratio is kept."""
    ck, _ = converted
    out = tmp_path / "bvt.json"
    cmd = [
        str(SCRIPTS / "bench_vs_tools.py"),
        *("--workdir", str(tmp_path / "work"), "--src", str(ck), "--devices", "cpu"),
        *("--cores", "1", "--only", "convert-rounds", "--reps", "2", "--json", str(out)),
    ]
    _run(cmd)
    rows = {row["key"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["convert-cpu-1c-rounds", "convert-cpu-1c-hub-rounds"]
    for row in rows.values():
        assert row["error"] is None
        rounds = row["runs"]["rounds"]
        assert len(rounds) == 2
        names = ["cp -r && sync", "mpack convert", "mpack convert, MPACK_NO_DIRECT_WRITE=1"]
        assert [sorted(r) for r in rounds] == [sorted(names)] * 2
        assert list(rounds[1]) == names[1:] + names[:1]  # the order rotates
        mine = sorted(r["mpack convert"]["wall"] for r in rounds)
        assert row["value"] == pytest.approx(sum(mine) / 2)  # the median of two
        assert row["peer"] == pytest.approx(sum(r["cp -r && sync"]["wall"] for r in rounds) / 2)
        assert row["target"] is None  # the 1.5x target is for 2 cores
    assert (tmp_path / "work" / "hf-cache").is_dir()
