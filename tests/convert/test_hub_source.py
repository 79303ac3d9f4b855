"""`mpack convert org/name`: a Hub repo resolved through huggingface_hub's real cache, offline.

No network: a Hugging Face cache is built on disk in the layout huggingface_hub 2.x reads
(``models--org--name/{blobs,refs,snapshots,trees}``; see ``_snapshot_download.py`` and
``_tree_cache.py``) and the CLI runs with ``HF_HUB_CACHE`` pointing at it and
``HF_HUB_OFFLINE=1``, so ``snapshot_download`` resolves refs and snapshots exactly as it does
for a model downloaded earlier.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("huggingface_hub")

from mpack.fixtures import make_checkpoint
from tests.convert.helpers import CliPool, assert_refused, cli, explain, manifest, tmp_dirs
from tests.convert.hf_cache import add_repo

REPO = "org/tiny"
PARTIAL = "org/partial"  # its tree listing names a shard its snapshot lacks
COMMIT = hashlib.sha1(b"mpack test commit").hexdigest()
TAG = "v1.0"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A sharded checkpoint, its bytes, and an HF cache holding it as org/tiny (and org/partial)."""
    root = tmp_path_factory.mktemp("hub")
    src = make_checkpoint(root / "src", max_shard_size="300KB")
    files = {p.name: p.read_bytes() for p in sorted(src.iterdir())}
    assert sum(n.endswith(".safetensors") for n in files) >= 2 and "config.json" in files
    cache = root / "cache"
    add_repo(cache, REPO, files, COMMIT, ["main", TAG])
    shard = sorted(n for n in files if n.endswith(".safetensors"))[-1]
    add_repo(cache, PARTIAL, files, COMMIT, ["main"], missing=(shard,))
    env = {"HF_HUB_CACHE": str(cache), "HF_HOME": str(root / "hf-home")}
    return {"root": root, "src": src, "files": files, "env": env, "missing": shard}


#: run name -> convert arguments (``--json`` is added unless the run is ``--quiet``)
RUNS: dict[str, tuple[str, ...]] = {
    "main": (REPO,),
    "commit": (REPO, "--revision", COMMIT),
    "tag": (REPO, "--revision", TAG),
    "unknown-revision": (REPO, "--revision", "v9"),
    "not-cached": ("org/absent",),
    "incomplete": (PARTIAL,),
    # with a commit and a cached tree listing, snapshot_download takes its "download" path
    "quiet": (REPO, "--revision", COMMIT, "--quiet"),
}


def _options(args: tuple[str, ...]) -> tuple[str, ...]:
    """A run's convert arguments: CPU, and --json unless it is a --quiet run."""
    return (*args, "--device", "cpu", *(() if "--quiet" in args else ("--json",)))


@pytest.fixture(scope="module")
def runs(hub: dict[str, Any]) -> Any:
    """Start every conversion at once; then `verify --source` on the main one."""
    pool = CliPool()
    outs = {name: hub["root"] / f"out-{name}" for name in RUNS}
    try:
        started = {
            name: pool.submit("convert", *_options(args), "-o", outs[name], env=hub["env"])
            for name, args in RUNS.items()
        }

        def verify_main() -> Any:
            started["main"].result()
            return cli("verify", outs["main"], "--source", REPO, "--json", env=hub["env"])

        started["verify"] = pool.then(verify_main)
        yield {"out": outs, **started}
    finally:
        pool.close()


def _converted(runs: Any, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The --json summary and the manifest of a conversion that must have worked."""
    r = runs[name].result()
    assert r.returncode == 0, explain(r)
    assert tmp_dirs(runs["out"][name]) == []
    return json.loads(r.stdout), manifest(runs["out"][name])


def test_hub_source_is_pinned_to_the_cached_commit(runs, hub) -> None:
    doc, m = _converted(runs, "main")
    want = {"kind": "hub", "repo": REPO, "revision": COMMIT}
    assert {k: doc["source"].get(k) for k in want} == want
    assert {k: m["source"].get(k) for k in want} == want
    assert m["source"].get("requested_revision") is None
    assert "path" not in m["source"]  # provenance is the repo and commit, not a cache path


def test_hub_source_files_recorded_with_real_sizes_and_hashes(runs, hub) -> None:
    _, m = _converted(runs, "main")
    recorded = {f["name"]: f for f in m["source"]["files"]}
    # every file of the repo the conversion reads: shards, index, config, generation config
    assert set(recorded) == set(hub["files"])
    for name, data in hub["files"].items():
        assert recorded[name]["size"] == len(data), name
        assert recorded[name]["sha256"] == hashlib.sha256(data).hexdigest(), name
    # the copied config is the repo's, byte for byte
    assert (runs["out"]["main"] / "config.json").read_bytes() == hub["files"]["config.json"]


@pytest.mark.parametrize("name, requested", [("commit", COMMIT), ("tag", TAG)])
def test_revision_resolves_offline(runs, name: str, requested: str) -> None:
    doc, m = _converted(runs, name)
    assert m["source"]["revision"] == COMMIT
    assert m["source"]["requested_revision"] == requested
    assert doc["source"]["revision"] == COMMIT
    # the same sidecar as the one resolved through refs/main
    _, main = _converted(runs, "main")
    assert m["files"] == main["files"]


def test_unknown_revision_is_refused(runs) -> None:
    assert_refused(
        runs["unknown-revision"].result(),
        runs["out"]["unknown-revision"],
        f"{REPO}@v9: not in the local Hugging Face cache",
        "HF_HUB_OFFLINE",
    )


def test_repo_not_in_cache_is_refused(runs) -> None:
    assert_refused(
        runs["not-cached"].result(),
        runs["out"]["not-cached"],
        "org/absent: not in the local Hugging Face cache",
        "HF_HUB_OFFLINE",
    )


def test_incomplete_snapshot_is_refused_naming_the_missing_file(runs, hub) -> None:
    """The cached tree listing names a shard that the snapshot lacks (interrupted download).

    huggingface_hub raises IncompleteSnapshotError (a LocalEntryNotFoundError) listing the
    missing files; the message must say which file is missing, not that the repo is not cached.
    """
    assert_refused(
        runs["incomplete"].result(), runs["out"]["incomplete"], f"{PARTIAL}", hub["missing"]
    )


def test_verify_against_the_hub_source_offline(runs) -> None:
    r = runs["verify"].result()
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["source_checked"] is True
    assert doc["source"] == f"{REPO}@{COMMIT[:12]}"
    assert doc["tensors_compared"] > 0


def test_quiet_prints_nothing(runs) -> None:
    """``--quiet``: "Print nothing but errors" — huggingface_hub's progress bars included."""
    r = runs["quiet"].result()
    assert r.returncode == 0, explain(r)
    assert (runs["out"]["quiet"] / "mpack.json").is_file()
    assert r.stdout == ""
    assert r.stderr == ""
