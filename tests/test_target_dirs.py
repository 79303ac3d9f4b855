"""A directory of targets (Note [target layout] in mpack/target_dirs.py): one stable layout
(``--layout targets``), runs with fewer targets into the same OUT, and every command taking the
directory: inspect lists, verify checks every target from one read of the source, serve and
status take the one a selection names (or refuse, listing them), push sends folders. Real
checkpoints, real sidecars, real processes; the Hub is a dry run (no socket)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from mpack.convert import convert
from mpack.convert.pipeline import ConvertResult, MultiConvertResult
from mpack.errors import InputError, UsageError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import load_manifest
from mpack.target import dir_name, target_of_name
from mpack.target_dirs import Selection, choose, find, holds_targets, matching, target_dirs
from tests.convert.helpers import cli, explain

TP1, TP2 = "tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("td") / "ck")


@pytest.fixture(scope="module")
def multi(ck: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``OUT`` with TP 1 and TP 2 (read only: tests that change it copy it)."""
    out = tmp_path_factory.mktemp("td-multi") / "out"
    convert(ck, out, tp=[1, 2], device="cpu")
    return out


def stamps(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d``: its inode and mtime (a file moved, rewritten or removed shows)."""
    return {
        str(p.relative_to(d)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def run_json(*args: Any) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    r = cli(*args, "--json")
    return r, json.loads(r.stdout) if r.stdout.strip() else {}


# --- the names ------------------------------------------------------------------------------


def test_a_folder_name_reads_back_as_its_target() -> None:
    for t in (
        {"tp_size": 2, "profile": "w8a16", "act_dtype": "bfloat16", "fusion": "vllm"},
        {"tp_size": 4, "profile": "w8a8-marlin", "act_dtype": "float16", "fusion": "vllm"},
        {"tp_size": 1, "profile": "w8a16", "act_dtype": "float16", "fusion": "none"},
        {
            "tp_size": 8,
            "profile": "w8a16",
            "act_dtype": "bfloat16",
            "fusion": "vllm",
            "expert_parallel": True,
        },
    ):
        assert target_of_name(dir_name(t)) == t
    for other in ("tp0-w8a16-bfloat16", "tp2-w8a16", "out", "tp2-w8a16-bfloat16-x", "tpx-w8a16"):
        assert target_of_name(other) is None, other


# --- convert: the layout ----------------------------------------------------------------------


def test_layout_targets_puts_one_target_in_its_folder(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r, doc = run_json("convert", ck, "-o", out, "--layout", "targets", "--device", "cpu")
    assert r.returncode == 0, explain(r)
    # the shape of several targets, whatever the count: a CI job reads one shape
    assert [t["name"] for t in doc["targets"]] == [TP1] and doc["kept"] == []
    assert (out / TP1 / "mpack.json").is_file() and not (out / "mpack.json").exists()
    assert sorted(p.name for p in out.iterdir()) == [TP1]  # no lock or work directory left
    # byte for byte the sidecar a run at OUT itself writes
    alone = convert(ck, tmp_path / "alone", device="cpu")
    assert isinstance(alone, ConvertResult)
    assert {p.name: p.read_bytes() for p in (out / TP1).iterdir()} == {
        p.name: p.read_bytes() for p in alone.out.iterdir()
    }
    # and the Python API says the same
    again = convert(ck, out, device="cpu", layout="targets")
    assert isinstance(again, MultiConvertResult) and again.up_to_date
    r = cli("convert", ck, "-o", tmp_path / "x", "--layout", "nested")
    assert r.returncode == 2 and "--layout must be one of auto, targets" in r.stderr, explain(r)
    assert not (tmp_path / "x").exists()


def test_fewer_targets_into_the_same_out_keep_their_paths(multi: Path, ck: Path, tmp_path) -> None:
    """From several targets to one: nothing moves, the target asked for is up to date, the other
    is kept (never deleted) and reported."""
    out = tmp_path / "out"
    shutil.copytree(multi, out)
    before = stamps(out)
    r, doc = run_json("convert", ck, "-o", out, "--tp", "1", "--device", "cpu")
    assert r.returncode == 0, explain(r)
    assert [(t["name"], t["up_to_date"]) for t in doc["targets"]] == [(TP1, True)]
    assert doc["kept"] == [TP2]
    assert stamps(out) == before  # nothing moved, rewritten or removed
    r = cli("convert", ck, "-o", out, "--tp", "1", "--device", "cpu")
    assert r.returncode == 0 and f"kept {TP2}" in r.stdout, explain(r)
    # a new single target goes beside them, the others untouched
    r, doc = run_json("convert", ck, "-o", out, "--profile", "w8a8-marlin", "--device", "cpu")
    assert r.returncode == 0, explain(r)
    assert [t["name"] for t in doc["targets"]] == ["tp1-w8a8-marlin-bfloat16"]
    assert sorted(doc["kept"]) == [TP1, TP2]
    assert {k: v for k, v in stamps(out).items() if k in before} == before


def test_an_out_left_by_an_interrupted_run_of_targets_is_a_directory_of_targets(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mpack-0123456789ab.lock").touch()  # what a killed run of targets leaves in OUT
    assert holds_targets(out)
    (out / "notes.txt").touch()  # anything of anyone else's: not mpack's
    assert not holds_targets(out)


def test_targets_into_a_single_sidecar_are_refused_with_the_fix(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(ck, out, device="cpu")
    before = stamps(out)
    for args in (["--layout", "targets"], ["--tp", "1,2"]):
        r = cli("convert", ck, "-o", out, "--device", "cpu", *args)
        assert r.returncode == 2, explain(r)
        assert f"{out} is a sidecar (one target at {out} itself)" in r.stderr
        parked = f"{out}.single"
        assert f"mv {out} {parked} && mkdir {out} && mv {parked} {out / TP1}" in r.stderr
        assert stamps(out) == before and sorted(os.listdir(tmp_path)) == ["out"]
    # the fix, run as the hint says it, works
    subprocess.run(
        f"mv {out} {out}.single && mkdir {out} && mv {out}.single {out / TP1}",
        shell=True,
        check=True,
    )
    r, doc = run_json("convert", ck, "-o", out, "--layout", "targets", "--device", "cpu")
    assert r.returncode == 0 and doc["targets"][0]["up_to_date"], explain(r)


# --- finding and choosing ------------------------------------------------------------------------


def test_choose_takes_one_and_lists_the_others(multi: Path, tmp_path: Path) -> None:
    assert [t.name for t in target_dirs(multi)] == [TP1, TP2]
    assert choose(multi, Selection(tp=2)) == multi / TP2
    assert [t.name for t in matching(multi)] == [TP1, TP2]
    with pytest.raises(UsageError) as e:
        choose(multi)
    assert f"{multi} holds 2 targets ({TP1}, {TP2}); name one" in e.value.message
    assert "tp=1" in e.value.hint and str(multi / TP1) in e.value.hint
    with pytest.raises(UsageError, match=f"no target matches tp=4; it holds {TP1}, {TP2}"):
        choose(multi, Selection(tp=4))
    with pytest.raises(UsageError, match="not one of"):
        Selection(profile="w9")
    # a renamed folder is still found by its manifest's target
    renamed = tmp_path / "renamed"
    shutil.copytree(multi / TP2, renamed / "prod")
    assert find(renamed, load_manifest(multi / TP2)[0]["target"]) == renamed / "prod"
    assert choose(renamed) == renamed / "prod"  # its only target: nothing to choose
    # an old single-target sidecar at OUT is itself, and refuses another target
    assert choose(multi / TP1) == multi / TP1
    with pytest.raises(UsageError, match=f"is the sidecar of target {TP1}; tp=2 names another"):
        choose(multi / TP1, Selection(tp=2))
    # a reader given the directory says what it is, not "convert it"
    with pytest.raises(InputError, match=f"a directory of 2 sidecar target.*{TP1}, {TP2}"):
        load_manifest(multi)


# --- the commands --------------------------------------------------------------------------------


def test_inspect_lists_the_targets_and_shows_one(multi: Path) -> None:
    r, doc = run_json("inspect", multi)
    assert r.returncode == 0, explain(r)
    assert [(t["name"], t["target"]["tp_size"]) for t in doc["targets"]] == [(TP1, 1), (TP2, 2)]
    for t in doc["targets"]:
        assert t["manifest_digest"] == load_manifest(multi / t["name"])[1] and t["bytes"] > 0
    r = cli("inspect", multi)
    assert r.returncode == 0 and TP1 in r.stdout and TP2 in r.stdout, explain(r)
    r, doc = run_json("inspect", multi, "--tp", "2")
    assert r.returncode == 0 and doc["target"]["tp_size"] == 2, explain(r)
    assert doc["sidecar"] == str(multi / TP2)
    r = cli("inspect", multi, "--tp", "4")
    assert r.returncode == 2 and f"it holds {TP1}, {TP2}" in r.stderr, explain(r)
    assert "--tp 1" in r.stderr  # the hint speaks in flags
    r = cli("inspect", multi / TP1)  # one target's folder: the sidecar, as ever
    assert r.returncode == 0 and "tp 1" in r.stdout, explain(r)


def test_verify_checks_every_target_from_one_read(multi: Path, ck: Path, monkeypatch) -> None:
    import mpack.verify.rederive as rederive
    from mpack.convert.checkpoint import Checkpoint
    from mpack.convert.scheme_check import SchemeCheck
    from mpack.verify import verify_targets

    read: dict[str, int] = {}
    real_read = Checkpoint.read_parts  # every read of tensor bytes goes through it

    def counting(self, parts):
        for name, buf, _ in parts:
            read[name] = read.get(name, 0) + memoryview(buf).nbytes
        return real_read(self, parts)

    hashed: list[list[str]] = []
    real_hashing = rederive.hashing

    def hashing(src, names, **kw):
        hashed.append(list(names))
        return real_hashing(src, names, **kw)

    checks = []
    real_init = SchemeCheck.__init__

    def init(self, *a, **kw):
        checks.append(a)
        real_init(self, *a, **kw)

    monkeypatch.setattr(Checkpoint, "read_parts", counting)
    monkeypatch.setattr(rederive, "hashing", hashing)
    monkeypatch.setattr(SchemeCheck, "__init__", init)
    results = verify_targets([multi / TP1, multi / TP2], source=ck, rederive_device="cpu")
    assert [r.ok and r.source_checked for r in results] == [True, True]
    assert results[1].layers_checked == 2 * results[0].layers_checked  # TP 2: each rank
    assert len(hashed) == 1 and len(checks) == 1  # the source hashed, its scheme checked, once
    from mpack.convert.checkpoint import open_checkpoint

    src = open_checkpoint(ck)
    assert read and all(read[n] == src.tensors[n].nbytes for n in read), read  # each byte once
    weights = [n for n in src.tensors if n.endswith(".weight")]  # Marlin and pass-through
    assert weights and all(n in read for n in weights)


def test_verify_of_the_directory_and_a_damaged_target(multi: Path, ck: Path, tmp_path) -> None:
    r, doc = run_json("verify", multi, "--source", ck)
    assert r.returncode == 0, explain(r)
    assert doc["ok"] and [t["name"] for t in doc["targets"]] == [TP1, TP2]
    assert all(t["source_checked"] for t in doc["targets"])
    r, doc = run_json("verify", multi, "--source", ck, "--tp", "2")  # one named: as one sidecar
    assert r.returncode == 0 and doc["sidecar"] == str(multi / TP2), explain(r)
    out = tmp_path / "out"
    shutil.copytree(multi, out)
    rank = out / TP2 / "rank-01-of-02.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF
    rank.write_bytes(bytes(data))
    r = cli("verify", out, "--source", ck)
    assert r.returncode == 2, explain(r)
    assert f"{out}: 1 of 2 target(s) failed" in r.stderr and str(out / TP2) in r.stderr
    assert "rank-01-of-02.safetensors" in r.stderr and f"{out / TP1}:" not in r.stderr


def test_serve_and_status_take_the_target_named(multi: Path, tmp_path: Path) -> None:
    from mpack.runtime.spawn import DaemonHandle

    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    (tmp_path / "xdg").mkdir(mode=0o700)
    for cmd in (["serve", multi, "--device", "cpu"], ["status", multi]):
        r = cli(*cmd, env=env)
        assert r.returncode == 2, explain(r)
        assert f"holds 2 targets ({TP1}, {TP2}); name one" in r.stderr
        assert "hint: add --tp 1, or give its folder" in r.stderr
    r = cli("status", "--tp", "2", env=env)
    assert r.returncode == 2 and "none is given" in r.stderr, explain(r)
    d = DaemonHandle(multi, rank=1, device="cpu", env=env, log_dir=tmp_path, args=["--tp", "2"])
    try:
        ready = d.wait_ready()
        assert ready.digest == load_manifest(multi / TP2)[1]
        r = cli("status", multi, "--tp", "2", "--rank", "1", env=env)
        assert r.returncode == 0, explain(r)
        r = cli("status", multi, "--tp", "2", env=env)  # rank 0 is not served: not ready
        assert r.returncode == 2 and "rank 0" in r.stderr, explain(r)
    finally:
        d.stop(timeout=20)


def test_a_directory_of_one_target_is_served_without_a_selection(ck: Path, tmp_path) -> None:
    import mpack.runtime as rt

    out = tmp_path / "out"
    convert(ck, out, device="cpu", layout="targets")
    with rt.load(out, rank=0) as w, rt.load(out / TP1, rank=0) as same:
        assert set(w) == set(same) and len(w) > 0


def test_push_sends_folders_and_only_the_targets_named(multi: Path) -> None:
    from mpack.hub import plan_push

    assert [t.folder for t in plan_push(multi, "org/m").targets] == [TP1, TP2]
    one = plan_push(multi, "org/m", select=Selection(tp=2))
    assert [t.folder for t in one.targets] == [TP2]  # still in its folder: a stable repo path
    assert {u.path_in_repo.split("/")[0] for u in one.uploads} >= {TP2}
    assert not any(u.path_in_repo.startswith(TP1) for u in one.uploads)
    only = plan_push(multi, "org/m", only=[TP1])  # convert --push: the run's targets
    assert [t.folder for t in only.targets] == [TP1]
    with pytest.raises(UsageError, match="no target matches"):
        plan_push(multi, "org/m", select=Selection(tp=4))
    r, doc = run_json("push", multi, "org/m", "--dry-run", "--tp", "1")
    assert r.returncode == 0, explain(r)
    assert [t["folder"] for t in doc["targets"]] == [TP1]


def test_every_command_takes_the_target_options() -> None:
    for cmd in ("inspect", "verify", "serve", "status", "push"):
        r = cli(cmd, "--help")
        assert r.returncode == 0, explain(r)
        for opt in ("--tp", "--profile", "--act-dtype", "--ep"):
            assert opt in r.stdout, (cmd, opt)
    assert "--layout" in cli("convert", "--help").stdout
