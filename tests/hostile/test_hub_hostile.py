"""Sidecars and checkpoints named by path or repo id under hostile conditions: a local directory
whose path looks like an HF cache snapshot, and HF caches whose snapshot links point outside
the repo's ``blobs/`` (docs/HUB.md, Note [links of the snapshot] in mpack/hub_sidecar.py).

Real sidecars and checkpoints (mpack.fixtures, the real convert), HF caches laid out as a
finished download (tests/convert/hf_cache.py) and then altered, the CLI in a subprocess with
``HF_HUB_OFFLINE=1`` and a private ``HF_HUB_CACHE``: no test contacts the Hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("huggingface_hub")

from mpack.errors import InputError
from mpack.hub_sidecar import resolve_sidecar
from mpack.sidecar import load_manifest
from mpack.target import dir_name
from tests.convert.helpers import cli, snapshot
from tests.convert.hf_cache import add_repo

COMMIT = hashlib.sha1(b"hostile hub commit").hexdigest()
SECRET = b'{"secret": "another user\'s file"}\n'


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mpack.convert import convert
    from mpack.fixtures import make_checkpoint

    root = tmp_path_factory.mktemp("hubhostile")
    ck = make_checkpoint(root / "ck")
    sc = root / "sc"
    convert(ck, sc, device="cpu")
    multi = root / "multi"
    convert(ck, multi, device="cpu", tp=[1, 2])
    return {"root": root, "ck": ck, "sc": sc, "multi": multi}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Offline, with an empty HF cache of the test's own: a lookup on the Hub fails."""
    (tmp_path / "empty-cache").mkdir()
    (tmp_path / "xdg").mkdir(mode=0o700)
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "empty-cache"),
        "HF_HOME": str(tmp_path / "hf-home"),
        "XDG_RUNTIME_DIR": str(tmp_path / "xdg"),
    }


@pytest.fixture
def offline(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The same, for in-process resolves (huggingface_hub read its constants at import)."""
    from huggingface_hub import constants

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return env


def _files(d: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# --- 1: a local directory shaped like a snapshot is used as it is -----------------------------


def test_a_sidecar_at_a_snapshot_shaped_path_is_used_as_it_is(
    made: dict[str, Path], tmp_path: Path, env: dict[str, str], offline: dict[str, str]
) -> None:
    """``/data/models--org--name/snapshots/<commit>/``, outside the HF cache, holding a copied
    sidecar: the directory itself, never a lookup of org/name on the Hub (which fails here)."""
    snap = tmp_path / "data" / "models--org--name" / "snapshots" / COMMIT
    shutil.copytree(made["sc"], snap)
    assert resolve_sidecar(snap) == snap
    assert resolve_sidecar(snap, fetch="all", rank=0) == snap
    digest = load_manifest(made["sc"])[1]
    p = cli("inspect", snap, "--json", env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["manifest_digest"] == digest
    p = cli("verify", snap, "--json", env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is True and doc["manifest_digest"] == digest and doc["sidecar"] == str(snap)
    assert os.listdir(env["HF_HUB_CACHE"]) == []  # nothing looked up, nothing cached


def test_a_directory_of_targets_at_a_snapshot_shaped_path_is_used_as_it_is(
    made: dict[str, Path], tmp_path: Path, offline: dict[str, str]
) -> None:
    """A multi-target output copied to such a path: its target's folder, taken locally (the
    vLLM loader's case: the engine's target, no folder named)."""
    snap = tmp_path / "models--org--multi" / "snapshots" / COMMIT
    shutil.copytree(made["multi"], snap)
    tp2 = next(d for d in snap.iterdir() if d.name.startswith("tp2-"))
    target = load_manifest(tp2)[0]["target"]
    assert resolve_sidecar(snap, target=target) == tp2
    assert resolve_sidecar(tp2) == tp2


# --- 2: snapshot links that point outside the repo's blobs/ -----------------------------------


def _crafted(cache: Path, repo: str, files: dict[str, bytes], name: str, to: Path) -> Path:
    """``repo`` in ``cache`` as huggingface_hub leaves it, but its snapshot's ``name`` a link to
    ``to``; returns the snapshot."""
    snap = add_repo(cache, repo, files, COMMIT, ["main"])
    (snap / name).unlink()
    (snap / name).symlink_to(to)
    return snap


@pytest.mark.parametrize("name", ["config.json", "rank-00-of-01.safetensors", "mpack.json"])
def test_a_sidecar_snapshot_link_outside_the_blobs_is_refused(
    made: dict[str, Path], tmp_path: Path, offline: dict[str, str], name: str
) -> None:
    """By repo id and by the snapshot's path: refused, naming the link and its target; the view
    holds no link to (or copy of) the file."""
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    cache = Path(offline["HF_HUB_CACHE"])
    snap = _crafted(cache, "org/crafted", _files(made["sc"]), name, secret)
    for ref in ("org/crafted", snap):
        with pytest.raises(InputError, match="refusing to follow it") as e:
            resolve_sidecar(ref, fetch="all")
        assert str(snap / name) in e.value.message and str(secret) in e.value.message
        assert "blobs" in e.value.message and e.value.hint
    view = cache / "models--org--crafted" / "mpack" / COMMIT
    held = [p for p in view.rglob("*") if p.is_file()] if view.exists() else []
    assert all(p.read_bytes() != SECRET for p in held)
    assert all(os.stat(p).st_ino != os.stat(secret).st_ino for p in held)


def test_a_link_to_another_repos_blob_is_refused(
    made: dict[str, Path], offline: dict[str, str]
) -> None:
    """Inside the HF cache, but another repo's blob: not this repo's file either."""
    cache = Path(offline["HF_HUB_CACHE"])
    other = add_repo(cache, "org/other", _files(made["sc"]), COMMIT, ["main"])
    theirs = Path(os.path.realpath(other / "config.json"))
    _crafted(cache, "org/crafted", _files(made["sc"]), "config.json", theirs)
    with pytest.raises(InputError, match="not in the repo's blobs folder"):
        resolve_sidecar("org/crafted", fetch="all")
    assert resolve_sidecar("org/other", fetch="all").name == COMMIT  # an honest one still loads


def test_convert_refuses_a_hub_source_linking_outside_the_blobs(
    made: dict[str, Path], tmp_path: Path, env: dict[str, str]
) -> None:
    """`mpack convert org/name` whose snapshot's generation_config.json links to another file:
    before, its bytes were copied into the sidecar. Refused, exit 2, nothing written."""
    secret = tmp_path / "secret.json"
    secret.write_bytes(SECRET)
    cache = Path(env["HF_HUB_CACHE"])
    snap = _crafted(cache, "org/tiny", _files(made["ck"]), "generation_config.json", secret)
    before = snapshot(cache)
    out = tmp_path / "out"
    p = cli("convert", "org/tiny", "-o", out, "--device", "cpu", env=env)
    assert p.returncode == 2, p.stderr
    assert str(snap / "generation_config.json") in p.stderr and str(secret) in p.stderr
    assert "refusing to follow it" in p.stderr
    assert not out.exists() and snapshot(cache) == before
    # the same cache, honest: converts
    add_repo(tmp_path / "honest", "org/tiny", _files(made["ck"]), COMMIT, ["main"])
    honest = {**env, "HF_HUB_CACHE": str(tmp_path / "honest")}
    p = cli("convert", "org/tiny", "-o", out, "--device", "cpu", env=honest)
    assert p.returncode == 0, p.stderr
    assert (out / "mpack.json").is_file()


def test_a_multi_target_sidecar_in_a_snapshot_is_viewed_from_its_own_files(
    made: dict[str, Path], tmp_path: Path, offline: dict[str, str]
) -> None:
    """An honest snapshot in a cache that is not HF_HUB_CACHE (vLLM's --download-dir): its view is
    made from its own links, no Hub; every view file a hard link of the blob."""
    other_cache = tmp_path / "download-dir"
    multi = {"config.json": (made["sc"] / "config.json").read_bytes()}
    for d in made["multi"].iterdir():
        multi |= _files(d, f"{d.name}/")
    snap = add_repo(other_cache, "org/multi", multi, COMMIT, ["main"])
    tp2 = next(d for d in made["multi"].iterdir() if d.name.startswith("tp2-"))
    target = load_manifest(tp2)[0]["target"]
    view = resolve_sidecar(snap, target=target, rank=1)
    assert view == other_cache / "models--org--multi" / "mpack" / COMMIT / dir_name(target)
    assert "rank-00-of-02.safetensors" not in os.listdir(view)
    for n in os.listdir(view):
        assert not (view / n).is_symlink()
        assert os.stat(view / n).st_ino == os.stat(snap / dir_name(target) / n).st_ino
    assert load_manifest(view)[1] == load_manifest(tp2)[1]
