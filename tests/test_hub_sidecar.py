"""Loading a sidecar by Hub repo id (mpack/hub_sidecar.py), offline, from an HF cache on disk.

The cache is laid out as huggingface_hub leaves a finished download (tests/convert/hf_cache.py)
and holds a real TP 2 sidecar as ``org/tiny-marlin`` (refs ``main`` and ``v1``), the same with
rank 1's file absent from the snapshot (``org/partial-marlin``), a multi-target repo in
``mpack push``'s layout (``org/multi-marlin``: one folder per target, the model's config at the
root) and a checkpoint that is no sidecar (``org/tiny-fp8``). In-process resolves patch
huggingface_hub's constants; the CLI runs with ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``. No test
contacts the Hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("huggingface_hub")


from mpack.errors import InputError, SourceNotFoundError, UsageError, exit_code_for
from mpack.hub_sidecar import parse_ref, resolve_sidecar
from mpack.sidecar import load_manifest
from mpack.target import dir_name
from tests.convert.hf_cache import add_repo

REPO, PARTIAL, MULTI, CKPT = (
    "org/tiny-marlin",
    "org/partial-marlin",
    "org/multi-marlin",
    "org/tiny-fp8",
)
COMMIT = hashlib.sha1(b"sidecar commit").hexdigest()
MULTI_COMMIT = hashlib.sha1(b"multi commit").hexdigest()


def _files(d: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mpack.convert import convert
    from mpack.fixtures import make_checkpoint

    root = tmp_path_factory.mktemp("hubsc")
    ck = make_checkpoint(root / "ck")
    sc = root / "sc"
    convert(ck, sc, tp=2)
    sc1 = root / "sc1"
    convert(ck, sc1, tp=1)
    cache = root / "cache"
    add_repo(cache, REPO, _files(sc), COMMIT, ["main", "v1"])
    add_repo(cache, PARTIAL, _files(sc), COMMIT, ["main"], missing=("rank-01-of-02.safetensors",))
    folders = {dir_name(load_manifest(d)[0]["target"]): d for d in (sc, sc1)}
    multi = {"config.json": (sc / "config.json").read_bytes()}
    for name, d in folders.items():
        multi |= _files(d, f"{name}/")
    add_repo(cache, MULTI, multi, MULTI_COMMIT, ["main"])
    add_repo(cache, CKPT, _files(ck), COMMIT, ["main"])
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "XDG_RUNTIME_DIR": str(root / "xdg"),
    }
    (root / "xdg").mkdir(mode=0o700)
    return {"root": root, "cache": cache, "sc": sc, "sc1": sc1, "folders": folders, "env": env}


@pytest.fixture
def offline(hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def cli(hub: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", *args],
        capture_output=True,
        text=True,
        env=hub["env"],
        cwd=hub["root"],
        timeout=300,
    )


def same_bytes(view: Path, sidecar: Path, names: list[str]) -> None:
    for n in names:
        assert (view / n).read_bytes() == (sidecar / n).read_bytes(), n
        assert not (view / n).is_symlink(), n  # Note [a view of the snapshot]


# --- the reference ---------------------------------------------------------------------------


def test_parse_ref() -> None:
    assert str(parse_ref("org/name@v1")) == "org/name@v1"
    r = parse_ref("org/name/tp2-w8a16-bfloat16", "dev")
    assert (r.repo, r.folder, r.revision) == ("org/name", "tp2-w8a16-bfloat16", "dev")
    for not_a_repo in ("./org/name", "/abs/path", "~/x", "bare", "a/b/c/d", "org/na--me", "org/.."):
        assert parse_ref(not_a_repo) is None, not_a_repo
    with pytest.raises(UsageError):
        parse_ref("org/name@v1", "v2")


# --- what a resolve fetches ------------------------------------------------------------------


def test_rank_resolve_fetches_only_that_ranks_files(offline: dict[str, Any]) -> None:
    """org/partial-marlin's snapshot lacks rank 1's file: rank 0 resolves without it; rank 1
    and a full resolve need it and say so."""
    view = resolve_sidecar(PARTIAL, rank=0)
    got = sorted(os.listdir(view))
    assert "rank-01-of-02.safetensors" not in got
    want = [
        "common.safetensors",
        "config.json",
        "generation_config.json",
        "mpack.json",
        "rank-00-of-02.safetensors",
    ]
    assert got == want
    same_bytes(view, offline["sc"], want)
    for kw in ({"rank": 1}, {"fetch": "all"}):
        with pytest.raises(SourceNotFoundError, match="rank-01-of-02") as e:
            resolve_sidecar(PARTIAL, **kw)
        assert exit_code_for(e.value) == 2 and e.value.hint


def test_manifest_resolve_fetches_the_manifest_alone(offline: dict[str, Any]) -> None:
    view = resolve_sidecar(f"{REPO}@v1", fetch="manifest")
    assert os.listdir(view) == ["mpack.json"]
    assert load_manifest(view)[1] == load_manifest(offline["sc"])[1]


def test_revisions(offline: dict[str, Any]) -> None:
    for ref, rev in ((REPO, None), (f"{REPO}@v1", None), (REPO, "main"), (REPO, COMMIT)):
        view = resolve_sidecar(ref, rev, fetch="all")
        assert view.name == COMMIT
        same_bytes(view, offline["sc"], sorted(os.listdir(offline["sc"])))
    with pytest.raises(SourceNotFoundError, match="v9") as e:
        resolve_sidecar(f"{REPO}@v9")
    assert "hf download" in e.value.hint


def test_offline_refuses_an_uncached_repo(offline: dict[str, Any]) -> None:
    with pytest.raises(SourceNotFoundError, match="org/absent.*not in the local") as e:
        resolve_sidecar("org/absent")
    assert exit_code_for(e.value) == 2 and "HF_HUB_OFFLINE" in e.value.hint


def test_not_a_sidecar(offline: dict[str, Any]) -> None:
    with pytest.raises(InputError, match="no mpack.json.*not an mpack sidecar") as e:
        resolve_sidecar(CKPT)
    assert "/<target>" in e.value.hint


def test_local_path_wins(offline: dict[str, Any], tmp_path: Path, monkeypatch) -> None:
    """A directory named like a repo id is the directory; revision with it is refused."""
    local = tmp_path / "org" / "tiny-marlin"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_sidecar(REPO) == Path(REPO)
    with pytest.raises(UsageError, match="local path"):
        resolve_sidecar(REPO, "v1")


def test_multi_target_repo(offline: dict[str, Any]) -> None:
    folders = offline["folders"]
    tp2 = next(n for n in folders if n.startswith("tp2-"))
    with pytest.raises(InputError, match="not an mpack sidecar") as e:
        resolve_sidecar(MULTI)  # no folder, no target to pick one by
    assert f"{MULTI}/<target>" in e.value.hint
    view = resolve_sidecar(f"{MULTI}/{tp2}", rank=1)
    assert view.name == tp2 and "rank-00-of-02.safetensors" not in os.listdir(view)
    same_bytes(view, folders[tp2], ["mpack.json", "rank-01-of-02.safetensors"])
    target = load_manifest(folders[tp2])[0]["target"]
    assert resolve_sidecar(MULTI, fetch="manifest", target=target) == view
    # The snapshot directory itself (what vLLM passes under HF_HUB_OFFLINE=1) resolves the same.
    snap = offline["cache"] / f"models--{MULTI.replace('/', '--')}" / "snapshots" / MULTI_COMMIT
    with pytest.raises(InputError):
        load_manifest(snap / tp2)  # made of symlinks: no sidecar reader opens them
    assert resolve_sidecar(snap, fetch="manifest", target=target) == view
    assert resolve_sidecar(snap / tp2, fetch="manifest") == view


def test_a_selection_names_the_folder_of_a_multi_target_repo(offline: dict[str, Any]) -> None:
    """Note [target layout]: --tp, --profile and --act-dtype together name a repo's folder; fewer
    cannot (the repo's folders are not listed), and a sidecar of another target is refused."""
    from mpack.target_dirs import Selection

    tp2 = next(n for n in offline["folders"] if n.startswith("tp2-"))
    whole = Selection(tp=2, profile="w8a16", act_dtype="bfloat16")
    view = resolve_sidecar(MULTI, fetch="manifest", select=whole)
    assert view.name == tp2 and load_manifest(view)[0]["target"]["tp_size"] == 2
    with pytest.raises(InputError) as e:
        resolve_sidecar(MULTI, fetch="manifest", select=Selection(tp=2))
    hint = e.value.hint or ""
    assert "tp, profile and act_dtype together" in hint and f"{MULTI}/<target>" in hint
    with pytest.raises(UsageError, match="is the sidecar of target tp2-w8a16-bfloat16; tp=1"):
        resolve_sidecar(REPO, fetch="manifest", select=Selection(tp=1))


def test_inspect_a_multi_target_repo_by_selection(hub: dict[str, Any]) -> None:
    p = cli(hub, "inspect", MULTI, "--tp", "1", "--profile", "w8a16", "--act-dtype", "bfloat16")
    assert p.returncode == 0 and "tp 1" in p.stdout, p.stderr
    p = cli(hub, "inspect", MULTI, "--tp", "1")
    assert p.returncode == 2 and "--tp, --profile and --act-dtype together" in p.stderr, p.stderr


# --- the commands and the runtime --------------------------------------------------------------


def test_inspect_and_verify_by_repo_id(hub: dict[str, Any]) -> None:
    digest = load_manifest(hub["sc"])[1]
    p = cli(hub, "inspect", f"{REPO}@v1", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["manifest_digest"] == digest
    p = cli(hub, "verify", REPO, "--json")
    assert p.returncode == 0, p.stderr
    p = cli(hub, "inspect", "org/absent")
    assert p.returncode == 2 and "org/absent" in p.stderr, p.stderr
    p = cli(hub, "inspect", CKPT)
    assert p.returncode == 2 and "not an mpack sidecar" in p.stderr, p.stderr


def test_serve_status_attach_load_by_repo_id(hub: dict[str, Any], monkeypatch) -> None:
    from huggingface_hub import constants

    import mpack.runtime as rt
    from mpack.runtime.spawn import DaemonHandle

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", hub["env"]["XDG_RUNTIME_DIR"])
    monkeypatch.chdir(hub["root"])  # the child's cwd (not the repo root, whose ./mpack shadows)
    # Rank 0 of the repo whose snapshot lacks rank 1's file: serve fetches only its rank's.
    d = DaemonHandle(PARTIAL, rank=0, device="cpu", env=hub["env"], log_dir=hub["root"])
    try:
        ready = d.wait_ready()
        assert ready.digest == load_manifest(hub["sc"])[1]
        p = cli(hub, "status", f"{REPO}@v1", "--json")
        # found by the repo's digest, but rank 1 has no daemon: not ready (Note [ready])
        assert p.returncode == 2, p.stderr
        said = json.loads(p.stdout)["error"]["message"]
        assert "no daemon serves rank 1" in said and f"rank 0 by pid {ready.pid}" in said, said
        local = rt.load(hub["sc"], rank=0)
        with rt.attach(REPO, rank=0, revision="v1") as w, rt.load(f"{REPO}@v1", rank=0) as mine:
            assert set(w) == set(local) == set(mine)
            for name in local:
                assert w[name].equal(local[name]) and mine[name].equal(local[name]), name
        local.close()
    finally:
        d.stop(timeout=20)
