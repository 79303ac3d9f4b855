"""``--load-format mpack`` with the sidecar named by Hub repo id, offline, through vLLM's classes.

An HF cache laid out as a finished download (tests/convert/hf_cache.py) holds a real TP 2
sidecar as ``org/tiny-marlin`` (refs ``main`` and ``v1``) and, in ``mpack push``'s multi-target
layout, as folder ``tp2-w8a16-bfloat16`` of ``org/multi-marlin`` (the model's config at the
root). The TP 2 workers of test_vllm_loader.py run with ``HF_HUB_CACHE`` on it and
``HF_HUB_OFFLINE=1``, and every load by repo id must give the model the local-path load gives:

* ``{"sidecar": "org/tiny-marlin@v1"}`` beside the original checkpoint;
* ``vllm serve org/tiny-marlin --load-format mpack`` (the model argument is the repo; under
  HF_HUB_OFFLINE vLLM passes the loader the cached snapshot, which the loader maps back to the
  repo and commit);
* ``vllm serve org/multi-marlin --load-format mpack``: the loader picks the folder of the
  engine's TP size, profile and dtype.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.convert.hf_cache import add_repo
from tests.vllm.test_vllm_loader import (
    CASES,
    CKPTS,
    assert_same_tensors,
    assert_views,
    ok,
    run_cli,
    run_workers,
)

CASE = CASES[1]  # llama-tensor, w8a16, bfloat16, TP 2
COMMIT = hashlib.sha1(b"vllm hub commit").hexdigest()
TARGET = f"tp{CASE.tp}-{CASE.profile}-{CASE.dtype}"
LOADS = ("local", "hub-extra", "hub-model", "hub-multi")


def _files(d: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def hub_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.fail(f"{sys.executable} has no vLLM: run these tests with .venv-vllm (make test)")
    work = tmp_path_factory.mktemp("vllm-hub")
    ck, sc = work / "ck", work / "sc"
    run_cli(["mpack.fixtures", str(ck), *CKPTS[CASE.ckpt]], work)
    run_cli(
        [
            "mpack",
            "convert",
            str(ck),
            "-o",
            str(sc),
            "--quiet",
            "--tp",
            str(CASE.tp),
            "--profile",
            CASE.profile,
            "--act-dtype",
            CASE.dtype,
        ],
        work,
    )
    cache = work / "hf-cache"
    add_repo(cache, "org/tiny-marlin", _files(sc), COMMIT, ["main", "v1"])
    multi = {"config.json": (sc / "config.json").read_bytes(), **_files(sc, f"{TARGET}/")}
    add_repo(cache, "org/multi-marlin", multi, COMMIT, ["main"])
    runtime = work / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
    }

    base = {"profile": CASE.profile, "dtype": CASE.dtype, "sidecar": str(sc)}
    never = {"attach": "never"}
    loads = [
        {**base, "id": "default", "model": str(ck), "sidecar": None},
        {
            **base,
            "id": "local",
            "model": str(ck),
            "load_format": "mpack",
            "extra": {**never, "sidecar": str(sc)},
        },
        {
            **base,
            "id": "hub-extra",
            "model": str(ck),
            "load_format": "mpack",
            "extra": {**never, "sidecar": "org/tiny-marlin@v1"},
        },
        {
            **base,
            "id": "hub-model",
            "model": "org/tiny-marlin",
            "load_format": "mpack",
            "extra": never,
        },
        {
            **base,
            "id": "hub-multi",
            "model": "org/multi-marlin",
            "load_format": "mpack",
            "extra": never,
        },
    ]
    t0 = time.monotonic()
    results = run_workers({CASE.tp: loads}, env, work)
    print(f"\nvLLM hub loads: {time.monotonic() - t0:.1f} s")
    return {"results": results[CASE.tp], "sc": sc, "cache": cache}


@pytest.mark.slow
@pytest.mark.parametrize("load", LOADS)
def test_load_by_repo_id_equals_local_path(hub_world: dict[str, Any], load: str) -> None:
    for rank in range(CASE.tp):
        res = hub_world["results"][rank]
        default = ok(res["default"])["tensors"]
        local = ok(res["local"])["tensors"]
        got = ok(res[load])
        assert_same_tensors(got["tensors"], local, f"{load} rank {rank} vs local path")
        assert_same_tensors(got["tensors"], default, f"{load} rank {rank} vs default loader")
        assert_views(got, hub_world["sc"], rank, "private", f"{load} rank {rank}")


@pytest.mark.slow
def test_views_hold_the_files_of_the_ranks(hub_world: dict[str, Any]) -> None:
    """Each repo's view holds regular files (hard links, not the snapshot's symlinks), and only
    those of the manifest."""
    want = set(os.listdir(hub_world["sc"]))
    for repo, sub in (("tiny-marlin", ""), ("multi-marlin", TARGET)):
        view = hub_world["cache"] / f"models--org--{repo}" / "mpack" / COMMIT / sub
        got = {p.name for p in view.iterdir()}
        assert got == want, (repo, sorted(got ^ want))
        assert not any(p.is_symlink() for p in view.iterdir()), repo
