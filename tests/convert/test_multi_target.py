"""Many targets from one read (Note [many targets] in convert/pipeline.py): every sidecar byte for
byte the one a single-target run writes, the source read once, invalid targets refused up
front, and locking, up-to-date checks and atomicity per target."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from mpack.convert import convert
from mpack.convert.checkpoint import Checkpoint
from mpack.convert.options import ConvertOptions
from mpack.convert.output import work_dirs
from mpack.convert.pipeline import ConvertResult, MultiConvertResult, run_convert
from mpack.fixtures import make_checkpoint
from mpack.hub import plan_push, push_sidecar
from mpack.sidecar import COMMON_NAME
from tests.convert.helpers import cli, cli_popen, explain, same_bytes, tensors
from tests.convert.test_convert import check_sidecar_rules

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "cases"
BIG = dict(hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=4, vocab=2048)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi-ckpts")
    return {
        # per-tensor scales: w8a8-marlin requantizes (the torch path), w8a16 takes the host path
        "llama": make_checkpoint(root / "llama", arch="llama", scheme="FP8"),
        # a BF16 bias, cast to float16 for one target and kept for the other
        "qwen2": make_checkpoint(
            root / "qwen2", arch="qwen2", scheme="FP8", hidden=256, heads=4, kv_heads=2
        ),
    }


def same_files(a: Path, b: Path) -> None:
    """``a`` and ``b`` hold the same files with the same bytes, manifest included."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), f"{a.name}/{n} differs"


# --- the bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["host", "torch"])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_each_target_is_the_single_target_sidecar(ckpts, tmp_path, path, model):
    out = tmp_path / "multi"
    r = convert(
        ckpts[model],
        out,
        tp=[1, 2],
        profile=["w8a16", "w8a8-marlin"],
        act_dtype=["bfloat16", "float16"],
        device="cpu",
        backend="auto" if path == "host" else path,
    )
    assert isinstance(r, MultiConvertResult) and r.out == out and r.skipped == []
    for x in r.results:  # the host backend refuses requantization: torch takes those targets
        requant = x.manifest["target"]["profile"] == "w8a8-marlin"
        assert x.backend["name"] == ("torch" if path == "torch" or requant else "host")
    names = [x.out.name for x in r.results]
    assert sorted(names) == sorted(p.name for p in out.iterdir())
    assert len(names) == 8 and "tp2-w8a8-marlin-float16" in names
    for x in r.results:
        t = x.manifest["target"]
        single = run_convert(
            ckpts[model],
            tmp_path / f"single-{x.out.name}",
            ConvertOptions(
                tp=t["tp_size"], profile=t["profile"], act_dtype=t["act_dtype"], device="cpu"
            ),
        )
        same_files(single.out, x.out)
        assert x.digest == single.digest and x.bytes_written == single.bytes_written


@pytest.mark.parametrize("path", ["host", "torch"])
def test_one_run_matches_both_golden_profiles(tmp_path, path):
    """tiny-llama-tensor-w8a16-bf16-tp1 and -w8a8marlin-bf16-tp1 share their input."""
    cases = [
        GOLDEN / "tiny-llama-tensor-w8a16-bf16-tp1",
        GOLDEN / "tiny-llama-tensor-w8a8marlin-bf16-tp1",
    ]
    inputs = [(c / "input" / "model.safetensors").read_bytes() for c in cases]
    assert inputs[0] == inputs[1]
    out = tmp_path / "out"
    backend = [] if path == "host" else ["--backend", path]  # host: auto (torch requantizes)
    r = cli(
        "convert",
        cases[0] / "input",
        "-o",
        out,
        "--profile",
        "w8a16,w8a8-marlin",
        "--act-dtype",
        "bfloat16",
        "--device",
        "cpu",
        *backend,
    )
    assert r.returncode == 0, explain(r)
    for case_dir in cases:
        case = json.loads((case_dir / "case.json").read_text())
        got_dir = out / f"tp{case['tp']}-{case['profile']}-{case['act_dtype']}"
        for name in case["expected_files"]:
            got, exp = tensors(got_dir / name), tensors(case_dir / "expected" / name)
            assert got.keys() == exp.keys(), name
            for k in exp:
                assert same_bytes(got[k], exp[k]), f"{case_dir.name} {name}: {k}"
        check_sidecar_rules(got_dir, profile=case["profile"], act_dtype=case["act_dtype"], tp=1)


def test_the_source_is_read_once(ckpts, tmp_path, monkeypatch):
    read: dict[str, int] = {}
    real = Checkpoint.read_parts  # every read of tensor bytes goes through it

    def counting(self, parts):
        for name, buf, _ in parts:
            read[name] = read.get(name, 0) + memoryview(buf).nbytes
        return real(self, parts)

    monkeypatch.setattr(Checkpoint, "read_parts", counting)
    r = convert(
        ckpts["llama"], tmp_path / "out", tp=[1, 2], profile=["w8a16", "w8a8-marlin"], device="cpu"
    )
    assert len(r.results) == 4
    ck = r.results[0].manifest
    from mpack.convert.checkpoint import open_checkpoint

    src = open_checkpoint(ckpts["llama"])
    weights = [
        n
        for n in src.tensors
        if n.endswith(".weight")
        and n.rpartition(".")[0]
        in {s["module"] for ly in ck["layers"].values() for s in ly["shards"]}
    ]
    common = [e.name for e in tensors_in(r.results[0].out / COMMON_NAME)]
    assert weights and common
    for n in weights + common:
        assert read.get(n) == src.tensors[n].nbytes, f"{n}: {read.get(n)} bytes read"


def tensors_in(path: Path):
    from mpack.sidecar import read_file_map

    return read_file_map(path).entries


# --- invalid targets ----------------------------------------------------------------------


def test_an_invalid_target_refuses_the_whole_run(ckpts, tmp_path):
    out = tmp_path / "out"  # llama fixture: 4 heads, so --tp 3 cannot be
    r = cli("convert", ckpts["llama"], "-o", out, "--tp", "1,3", "--device", "cpu")
    assert r.returncode == 2, explain(r)
    assert "tp3-w8a16-bfloat16" in r.stderr and "does not divide" in r.stderr
    assert "--skip-invalid" in r.stderr
    assert not out.exists()  # refused before anything was written


def test_skip_invalid_converts_the_others_and_reports(ckpts, tmp_path):
    out = tmp_path / "out"
    r = cli(
        "convert",
        ckpts["llama"],
        "-o",
        out,
        "--tp",
        "1,3",
        "--device",
        "cpu",
        "--json",
        "--skip-invalid",
    )
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert [t["name"] for t in doc["targets"]] == ["tp1-w8a16-bfloat16"]
    assert [s["name"] for s in doc["skipped"]] == ["tp3-w8a16-bfloat16"]
    assert "does not divide" in doc["skipped"][0]["reason"]
    assert sorted(p.name for p in out.iterdir()) == ["tp1-w8a16-bfloat16"]
    # nothing valid at all: refused even so
    r = cli(
        "convert",
        ckpts["llama"],
        "-o",
        tmp_path / "none",
        "--tp",
        "3,5",
        "--device",
        "cpu",
        "--skip-invalid",
    )
    assert r.returncode == 2, explain(r)
    assert "tp3-w8a16-bfloat16" in r.stderr and "tp5-w8a16-bfloat16" in r.stderr


def test_misspelt_values_are_usage_errors(ckpts, tmp_path):
    for args in (["--tp", "1,x"], ["--tp", "1,,2"], ["--profile", "w8a16,w9"]):
        r = cli("convert", ckpts["llama"], "-o", tmp_path / "o", *args, "--skip-invalid")
        assert r.returncode == 2, explain(r)
        assert not (tmp_path / "o").exists()


def test_a_single_sidecar_is_no_directory_of_targets(ckpts, tmp_path):
    one = convert(ckpts["llama"], tmp_path / "one", tp=[2], device="cpu")
    assert isinstance(one, ConvertResult) and (tmp_path / "one" / "mpack.json").is_file()
    r = cli("convert", ckpts["llama"], "-o", tmp_path / "one", "--tp", "1,2", "--device", "cpu")
    assert r.returncode == 2, explain(r)
    assert "is a sidecar" in r.stderr


# --- per target: up to date, --force, --json ----------------------------------------------


def test_up_to_date_and_force_per_target(ckpts, tmp_path):
    out = tmp_path / "out"
    args = ["convert", ckpts["qwen2"], "-o", out, "--device", "cpu", "--json"]
    r = cli(*args, "--tp", "1,2")
    assert r.returncode == 0, explain(r)
    first = json.loads(r.stdout)
    assert first["up_to_date"] is False and len(first["targets"]) == 2
    for t in first["targets"]:
        assert t["out"] == str(out / t["name"]) and t["bytes_written"] > 0
        assert t["up_to_date"] is False and len(t["manifest_digest"]) == 64
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    # again: nothing to do; one more target: only it is written
    r = cli(*args, "--tp", "1,2,4")
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert [(t["name"], t["up_to_date"]) for t in doc["targets"]] == [
        ("tp1-w8a16-bfloat16", True),
        ("tp2-w8a16-bfloat16", True),
        ("tp4-w8a16-bfloat16", False),
    ]
    assert [t["bytes_written"] for t in doc["targets"][:2]] == [0, 0]
    assert all(p.stat().st_mtime_ns == s for p, s in stamps.items())
    digests = {t["name"]: t["manifest_digest"] for t in first["targets"]}
    # --force rewrites every target, with the same bytes
    r = cli(*args, "--tp", "1,2", "--force")
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert all(t["up_to_date"] is False for t in doc["targets"])
    assert {t["name"]: t["manifest_digest"] for t in doc["targets"]} == digests
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no locks or work dirs


def test_single_target_json_keeps_its_shape(ckpts, tmp_path):
    r = cli(
        "convert", ckpts["llama"], "-o", tmp_path / "o", "--tp", "2", "--device", "cpu", "--json"
    )
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert (
        "targets" not in doc and doc["out"] == str(tmp_path / "o") and doc["target"]["tp_size"] == 2
    )


# --- interrupted ----------------------------------------------------------------------------


def _data_started(rank_file: Path) -> bool:
    try:
        with open(rank_file, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
        return rank_file.stat().st_size > 8 + hlen
    except (OSError, struct.error):
        return False


@pytest.mark.slow
def test_sigterm_mid_run_leaves_no_target(tmp_path):
    big = make_checkpoint(tmp_path / "big", **BIG)
    out = tmp_path / "out"
    names = ["tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"]
    proc = cli_popen("convert", big, "-o", out, "--tp", "1,2", "--device", "cpu")
    caught = False
    deadline = time.monotonic() + 120
    try:
        while not caught and proc.poll() is None and time.monotonic() < deadline:
            for d in work_dirs(out / names[1]):
                caught = caught or _data_started(d / "rank-01-of-02.safetensors")
            time.sleep(0.002)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert caught, f"the run ended (exit {proc.returncode}) before it was caught mid-write"
    assert proc.returncode == 128 + signal.SIGTERM
    # no target, finished-looking or not; no work directory or lock left
    assert not out.exists() or list(out.iterdir()) == []
    r = cli("convert", big, "-o", out, "--tp", "1,2", "--device", "cpu")
    assert r.returncode == 0, explain(r)
    for n in names:
        r = cli("verify", out / n)
        assert r.returncode == 0, explain(r)


# --- pushed as one repo ---------------------------------------------------------------------


def test_push_sends_the_directory_as_one_repo(ckpts, tmp_path):
    from tests.test_push import RecordingApi

    out = tmp_path / "out"
    r = convert(ckpts["llama"], out, tp=[1, 2], profile=["w8a16", "w8a8-marlin"], device="cpu")
    plan = plan_push(out, "org/llama-marlin")
    assert [t.folder for t in plan.targets] == sorted(x.out.name for x in r.results)
    api = RecordingApi()
    push_sidecar(out, "org/llama-marlin", api=api)
    ((args, _),) = api.named("create_commit")
    sent = {op.path_in_repo for op in args[1] if hasattr(op, "path_or_fileobj")}
    for x in r.results:
        for f in [*x.manifest["files"], {"name": "mpack.json"}]:
            assert f"{x.out.name}/{f['name']}" in sent


# --- the GPU paths (run by the lead on the device) ------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("driver", ["driver", "torch"])
def test_gpu_targets_are_the_cpu_sidecars(ckpts, tmp_path, driver):
    r = convert(
        ckpts["qwen2"],
        tmp_path / "gpu",
        tp=[1, 2],
        profile=["w8a16", "w8a8-marlin"],
        act_dtype=["bfloat16", "float16"],
        device="cuda",
        backend="auto" if driver == "driver" else "torch",
    )
    for x in r.results:
        t = x.manifest["target"]
        want = "driver" if driver == "driver" and t["profile"] == "w8a16" else "torch"
        assert (x.backend["name"], x.backend["device"]) == (want, "cuda:0")
        single = run_convert(
            ckpts["qwen2"],
            tmp_path / f"cpu-{x.out.name}",
            ConvertOptions(
                tp=t["tp_size"], profile=t["profile"], act_dtype=t["act_dtype"], device="cpu"
            ),
        )
        same_files(single.out, x.out)
