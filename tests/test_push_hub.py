"""``mpack push`` against a local stand-in of the Hub's HTTP API (tests/hub_server.py): the real
``huggingface_hub.HfApi`` over real sockets, ``HF_ENDPOINT`` pointing at 127.0.0.1. What the
stand-in holds after a push is what the repo would hold; it also counts every LFS upload, so
that the bytes several targets share are seen to go up once (Note [shared uploads] in
mpack/hub.py). Xet transfers are off (``HF_HUB_DISABLE_XET=1``): the stand-in speaks LFS only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpack.convert import convert
from mpack.fixtures import make_checkpoint
from mpack.hub import CARD_NAME, plan_push, push
from tests.hub_server import LocalHub

REPO = "my-org/tiny-marlin"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("hub")
    src = make_checkpoint(
        root / "src", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, vocab=128
    )
    multi = root / "multi"
    convert(src, multi, tp=[1, 2], device="cpu")
    return SimpleNamespace(src=src, multi=multi, single=multi / "tp2-w8a16-bfloat16")


@pytest.fixture
def hub():
    with LocalHub() as h:
        yield h


def _env(hub: LocalHub, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "hf_local_test_token",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_XET": "1",
    }


def _push(hub: LocalHub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack", "push", *args],
        capture_output=True,
        text=True,
        env=_env(hub, tmp_path),
        timeout=300,
    )


@pytest.fixture
def in_process_hub(hub, monkeypatch):
    """``hub`` for a push in this process: huggingface_hub read HF_HUB_DISABLE_XET when it was
    imported, so its constant is set here."""
    from huggingface_hub import HfApi, constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    return hub, HfApi(endpoint=hub.url, token="hf_local_test_token")


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# --- the push, end to end -------------------------------------------------------------------


def test_the_repo_holds_exactly_the_plan(converted, hub, tmp_path) -> None:
    r = _push(hub, tmp_path, str(converted.multi), REPO, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    plan = plan_push(converted.multi, REPO)
    files = hub.state.repos[REPO]["main"]
    assert sorted(files) == sorted([".gitattributes", *(u.path_in_repo for u in plan.uploads)])
    for u in plan.uploads:
        want = plan.card.encode() if u.local is None else u.local.read_bytes()
        assert files[u.path_in_repo] == want, u.path_in_repo
    assert hub.state.validated_cards == [plan.card]  # the Hub checked the card's metadata
    (commit,) = hub.state.commits
    assert commit.summary == doc["commit_message"] == plan.commit_message
    assert (
        commit.summary
        == "mpack push: tp1-w8a16-bfloat16, tp2-w8a16-bfloat16 from local directory src"
    )
    assert not commit.create_pr and doc["pr_url"] is None
    assert doc["commit"] and doc["url"].startswith(f"{hub.url}/{REPO}/commit/")


def test_the_pass_through_file_is_uploaded_once(converted, hub, tmp_path) -> None:
    """Both targets' common.safetensors are the same bytes (their header names no target), and
    the stand-in receives them once: each LFS object exactly once, for all the paths it has."""
    common = [
        converted.multi / t / "common.safetensors"
        for t in ("tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16")
    ]
    assert common[0].read_bytes() == common[1].read_bytes()
    plan = plan_push(converted.multi, REPO)
    shared = {u.path_in_repo: u.same_as for u in plan.uploads if u.same_as}
    assert (
        shared["tp2-w8a16-bfloat16/common.safetensors"] == "tp1-w8a16-bfloat16/common.safetensors"
    )
    r = _push(hub, tmp_path, str(converted.multi), REPO, "--json")
    assert r.returncode == 0, r.stderr
    lfs_paths = [p for p, b in hub.state.repos[REPO]["main"].items() if p.endswith(".safetensors")]
    assert len(lfs_paths) == 5  # two rank files of tp2, one of tp1, a common per target
    assert hub.state.uploads[_sha256(common[0])] == 1
    assert set(hub.state.uploads.values()) == {1}
    assert hub.state.bytes_received == sum(len(b) for b in hub.state.lfs.values())
    assert json.loads(r.stdout)["unique_bytes"] < json.loads(r.stdout)["bytes"]


def test_without_sharing_each_copy_goes_up(converted, in_process_hub) -> None:
    """The control: the same push with every upload on its own sends the shared bytes once per
    path, as the LFS batch API asks for an object not stored yet. This is what Note [shared
    uploads] saves, and what the test above would see without it."""
    hub, api = in_process_hub
    plan = plan_push(converted.multi, REPO)
    alone = dataclasses.replace(
        plan, uploads=[dataclasses.replace(u, same_as=None) for u in plan.uploads]
    )
    push(alone, api=api)
    common = converted.multi / "tp1-w8a16-bfloat16" / "common.safetensors"
    assert hub.state.uploads[_sha256(common)] == 2


def test_commit_message_and_pull_request(converted, hub, tmp_path) -> None:
    assert _push(hub, tmp_path, str(converted.single), REPO).returncode == 0
    before = dict(hub.state.repos[REPO]["main"])
    r = _push(
        hub,
        tmp_path,
        str(converted.multi),
        REPO,
        "--json",
        "--commit-message",
        "Marlin weights for TP 1 and 2",
        "--create-pr",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    commit = hub.state.commits[-1]
    assert commit.summary == "Marlin weights for TP 1 and 2" and commit.create_pr
    assert doc["pr_url"] == f"{hub.url}/{REPO}/discussions/1"
    # the branch is as the first push left it; the pull request holds the new files, and its
    # commit deletes what the branch has and this push does not send
    assert hub.state.repos[REPO]["main"] == before
    pr = hub.state.repos[REPO]["refs/pr/1"]
    assert "tp1-w8a16-bfloat16/rank-00-of-01.safetensors" in pr
    assert "rank-00-of-02.safetensors" not in pr and "rank-00-of-02.safetensors" in doc["deleted"]


# --- progress -------------------------------------------------------------------------------


def test_progress_is_shown_and_silenced(converted, hub, tmp_path) -> None:
    r = _push(hub, tmp_path, str(converted.multi), REPO)
    assert r.returncode == 0, r.stderr
    # stderr is a pipe here: mpack's check as log lines, then huggingface_hub's upload bars
    assert "push: checking" in r.stderr and "(100%)" in r.stderr
    assert "rank-00-of-02.safetensors" in r.stderr and "%|" in r.stderr
    assert "pushed: commit" in r.stdout

    r = _push(hub, tmp_path, str(converted.multi), REPO, "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""

    r = _push(hub, tmp_path, str(converted.multi), REPO, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and json.loads(r.stdout)["ok"] is True


def test_card_of_the_push_is_the_repos_readme(converted, hub, tmp_path) -> None:
    r = _push(hub, tmp_path, str(converted.single), REPO, "--base-model", "org/src-FP8", "--json")
    assert r.returncode == 0, r.stderr
    readme = hub.state.repos[REPO]["main"][CARD_NAME].decode()
    assert readme == json.loads(r.stdout)["card"]
    assert "base_model: org/src-FP8" in readme and "base_model_relation: quantized" in readme
