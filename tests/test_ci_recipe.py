"""The CI recipe cannot rot: examples/github-actions/prebake.yml's mpack steps, run here.

The workflow installs mpack, restores two caches and hands each matrix entry to
examples/ci/prebake.sh, the one recipe other CI systems run too (docs/CI.md). This file reads
the workflow and checks its shape (CPU torch first, both caches, matrix values only through
``env``, the token only where the push is), then runs the steps that call the script as a runner
would: the same ``run:`` text through ``bash -e``, in a workspace whose ``mpack/`` is this
checkout (the checkout step's path), with the step's ``env`` and its expressions filled in from
the matrix entry. Each model id is served offline from an HF cache laid out as a finished
download of a tiny checkpoint, at the path the workflow caches; the push is the workflow's
default, a dry run. No test contacts the Hub (``HF_HUB_OFFLINE=1``, and an endpoint where
nothing listens).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

yaml = pytest.importorskip("yaml")

WORKFLOW = REPO / "examples" / "github-actions" / "prebake.yml"
SCRIPT = REPO / "examples" / "ci" / "prebake.sh"
COMMIT = "c1a0b2e3" * 5  # the commit the cached Hub repos are "downloaded" at
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
SHA = re.compile(r"[^@\s]+@[0-9a-f]{40}")


def load() -> dict[str, Any]:
    wf = yaml.safe_load(WORKFLOW.read_text())
    wf["on"] = wf.pop(True, wf.get("on"))  # YAML 1.1 reads the key `on` as True
    return wf


def the_job(wf: dict[str, Any]) -> dict[str, Any]:
    (job,) = wf["jobs"].values()
    return job


def script_steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in job["steps"] if "prebake.sh" in s.get("run", "")]


def matrix() -> list[dict[str, Any]]:
    return the_job(load())["strategy"]["matrix"]["include"]


# --- the workflow's shape ----------------------------------------------------------------------


def test_the_workflow_is_the_recipe() -> None:
    wf = load()
    job = the_job(wf)
    assert "workflow_dispatch" in wf["on"]
    assert wf["permissions"] == {} and job["permissions"] == {"contents": "read"}
    steps = job["steps"]
    for s in steps:
        if "uses" in s:
            assert SHA.fullmatch(s["uses"]), f"{s['uses']}: pin actions by commit"
        # matrix values and secrets reach a shell only through env (no template injection)
        assert "${{" not in s.get("run", ""), s["run"]
    runs = [s.get("run", "") for s in steps]
    # every mpack command is in the script: the workflow has no recipe of its own
    assert not [r for r in runs if re.search(r"\bmpack (convert|verify|push)\b", r)]
    assert [s["run"].split() for s in script_steps(job)] == [
        ["bash", "mpack/examples/ci/prebake.sh", "build"],
        ["bash", "mpack/examples/ci/prebake.sh", "push"],
    ]
    # mpack's tree is checked out at mpack/, the path the run steps name
    (checkout,) = [s for s in steps if s.get("uses", "").startswith("actions/checkout@")]
    assert checkout["with"]["path"] == "mpack"
    assert checkout["with"]["persist-credentials"] is False
    # CPU torch first, then mpack, before anything runs mpack
    (install,) = [r for r in runs if "pip install" in r]
    assert install.index("scripts/install_torch.sh") < install.index("pip install")
    assert runs.index(install) < runs.index(script_steps(job)[0]["run"])
    # the two caches, restored before the conversion
    cached = [s["with"]["path"] for s in steps if s.get("uses", "").startswith("actions/cache@")]
    assert cached == ["~/.cache/huggingface/hub", "~/.cache/mpack"]
    # only the push step sees the token
    holders = [s.get("name") for s in steps if "secrets." in json.dumps(s)]
    assert holders == ["push"]
    assert len(matrix()) >= 2 and len({e["model"] for e in matrix()}) == len(matrix())


def step_env(step: dict[str, Any], entry: dict[str, Any], inputs: dict[str, str]) -> dict[str, str]:
    """A step's env as the runner gives it: every expression filled in, or the test fails."""

    def value(m: re.Match[str]) -> str:
        expr = m[1]
        if expr.startswith("matrix."):
            return str(entry[expr.removeprefix("matrix.")])
        if expr.startswith("inputs."):
            return inputs[expr.removeprefix("inputs.")]
        if expr.startswith("secrets."):
            return ""  # no token here: nothing may reach the Hub
        raise AssertionError(f"{step.get('name')}: an expression the test cannot fill: {expr}")

    return {k: EXPR.sub(value, str(v)) for k, v in step.get("env", {}).items()}


def test_the_step_env_is_filled_from_the_matrix() -> None:
    job = the_job(load())
    build, push = script_steps(job)
    entry = matrix()[0]
    env = step_env(build, entry, {"dry_run": "true"})
    assert (env["MODEL"], env["TP"], env["PROFILE"]) == (
        entry["model"],
        entry["tp"],
        entry["profile"],
    )
    assert step_env(push, entry, {"dry_run": "true"})["PUSH_DRY_RUN"] == "true"
    with pytest.raises(AssertionError, match="cannot fill: github.token"):
        step_env({"name": "x", "env": {"T": "${{ github.token }}"}}, entry, {})


# --- running it ---------------------------------------------------------------------------------


def workspace(root: Path) -> tuple[Path, dict[str, str]]:
    """A runner's workspace with mpack's tree at mpack/, a fresh HOME, and mpack on PATH."""
    ws, home = root / "ws", root / "home"
    ws.mkdir()
    home.mkdir(mode=0o700)
    (ws / "mpack").symlink_to(REPO, target_is_directory=True)
    bindir = Path(sys.executable).parent
    assert (bindir / "mpack").is_file(), f"no mpack script beside {sys.executable}"
    skip = ("HF_", "HUGGING_FACE_", "MPACK_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env.update(
        PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        HOME=str(home),  # the caches at the workflow's paths: ~/.cache/huggingface, ~/.cache/mpack
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_ENDPOINT="http://127.0.0.1:9",  # nothing listens there: a request fails at once
        OMP_NUM_THREADS="1",
    )
    return ws, env


def run_step(
    ws: Path, env: dict[str, str], step: dict[str, Any], extra: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``run:`` as the runner runs it: a script file through bash -e, in the workspace."""
    script = ws.parent / "step.sh"
    script.write_text(step["run"])
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-e", str(script)],
        cwd=ws,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, bytes]]:
    """The files of a tiny checkpoint of a model id's scheme (``...-FP8-dynamic``: per-channel
    weight scales, else per-tensor), made once per scheme."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from mpack.fixtures import make_checkpoint

    made: dict[str, dict[str, bytes]] = {}

    def files(model: str) -> dict[str, bytes]:
        scheme = "FP8_DYNAMIC" if model.lower().endswith("-dynamic") else "FP8"
        if scheme not in made:
            ck = make_checkpoint(tmp_path_factory.mktemp("ci-ckpt") / scheme, scheme=scheme)
            made[scheme] = {p.name: p.read_bytes() for p in sorted(ck.iterdir())}
        return made[scheme]

    return files


def serve_offline(home: Path, entry: dict[str, Any], files: dict[str, bytes]) -> str:
    """The matrix entry's model in the HF cache the workflow restores; returns its commit."""
    from tests.convert.hf_cache import add_repo

    rev = str(entry.get("revision") or "main")
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else COMMIT
    refs = [] if rev == commit else [rev]
    add_repo(home / ".cache" / "huggingface" / "hub", entry["model"], files, commit, refs)
    return commit


def targets_of(entry: dict[str, Any]) -> set[str]:
    """The folders the matrix entry's --tp and --profile make (the fixture is bfloat16)."""
    return {
        f"tp{tp}-{profile}-bfloat16"
        for tp in str(entry["tp"]).split(",")
        for profile in str(entry["profile"]).split(",")
    }


@pytest.mark.slow
@pytest.mark.parametrize("entry", matrix(), ids=[e["model"] for e in matrix()])
def test_the_workflow_steps_run(
    tmp_path: Path, entry: dict[str, Any], checkpoint_files: Callable[[str], dict[str, bytes]]
) -> None:
    ws, env = workspace(tmp_path)
    home = Path(env["HOME"])
    commit = serve_offline(home, entry, checkpoint_files(entry["model"]))
    # mpack's cache as a restore may leave it: group-writable, which mpack would not use
    cache = home / ".cache" / "mpack"
    cache.mkdir(parents=True)
    cache.chmod(0o775)
    inputs = {"dry_run": "true"}  # workflow_dispatch's default
    build, push = script_steps(the_job(load()))

    r = run_step(ws, env, build, step_env(build, entry, inputs))
    assert r.returncode == 0, f"build exits {r.returncode}\n{r.stdout}\n{r.stderr}"
    convert = json.loads((ws / "reports" / "convert.json").read_text())
    names = {t["name"] for t in convert["targets"]}
    assert names == targets_of(entry) and convert["skipped"] == [] and convert["kept"] == []
    verified = json.loads((ws / "reports" / "verify.json").read_text())  # every target, one run
    assert verified["ok"] and {v["name"] for v in verified["targets"]} == names
    for t, v in zip(convert["targets"], verified["targets"], strict=True):
        assert Path(t["out"]) == (ws / "out" / t["name"]).resolve()
        assert t["source"]["repo"] == entry["model"] and t["source"]["revision"] == commit
        assert v["ok"] and v["source_checked"] and v["tensors_compared"] > 0, v
    # the restored cache was made usable, and the scheme's verdict kept in it for the next run
    assert not cache.stat().st_mode & 0o022
    assert any((cache / "verdicts").iterdir())

    r = run_step(ws, env, push, step_env(push, entry, inputs))
    assert r.returncode == 0, f"push exits {r.returncode}\n{r.stdout}\n{r.stderr}"
    report = json.loads((ws / "reports" / "push.json").read_text())
    assert report["dry_run"] is True and report["repo_id"] == entry["repo"]
    assert {t["folder"] for t in report["targets"]} == names
    sent = {f["path"] for f in report["files"]}
    for name in names:
        local = {f"{name}/{p.name}" for p in (ws / "out" / name).iterdir()}
        assert local <= sent and f"{name}/mpack.json" in local
    assert "README.md" in sent and "would send" in r.stdout

    # with the input off it is a real push, which goes nowhere here: the Hub is offline (exit 3)
    r = run_step(ws, env, push, step_env(push, entry, {"dry_run": "false"}))
    assert r.returncode == 3, f"push exits {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "would send" not in r.stdout


@pytest.mark.slow
def test_a_target_left_from_another_run_stops_the_build(
    tmp_path: Path, checkpoint_files: Callable[[str], dict[str, bytes]]
) -> None:
    """A self-hosted runner keeps OUT: a target no longer asked for must not be pushed."""
    ws, env = workspace(tmp_path)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    for name, data in checkpoint_files("org/model").items():
        (ck / name).write_bytes(data)
    run = [str(SCRIPT), "build"]
    first = {"MODEL": str(ck), "TP": "1,2", "PROFILE": "w8a16"}
    r = subprocess.run(run, cwd=ws, env={**env, **first}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (ws / "out").iterdir()} >= {"tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"}
    (ws / "reports" / "verify.json").unlink()
    second = {**first, "TP": "1", "PROFILE": "w8a16,w8a8-marlin"}
    r = subprocess.run(run, cwd=ws, env={**env, **second}, capture_output=True, text=True)
    assert r.returncode != 0
    assert "holds targets this run did not make: tp2-w8a16-bfloat16" in r.stderr
    # stopped before verifying anything
    assert not (ws / "reports" / "verify.json").exists()


def test_the_script_needs_a_model(tmp_path: Path) -> None:
    ws, env = workspace(tmp_path)
    r = subprocess.run([str(SCRIPT), "build"], cwd=ws, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "set MODEL" in r.stderr
    r = subprocess.run([str(SCRIPT), "bake"], cwd=ws, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr
