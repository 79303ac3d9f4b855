"""Output atomicity and idempotence of `mpack convert`, and what `mpack verify` catches.

Real checkpoints, real ``python -m mpack.cli`` subprocesses (one of them SIGKILLed mid-write),
real files corrupted byte by byte.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from mpack.convert.output import lock_path, work_dirs
from mpack.fixtures import make_checkpoint
from tests.conftest import flip_byte
from tests.convert.helpers import (
    CliPool,
    assert_refused,
    cli,
    cli_popen,
    explain,
    manifest,
    selected_params,
    sha256,
    snapshot,
    tensor_range,
)

TP = ("--tp", "2", "--device", "cpu")  # the options of the shared sidecar
#: every file of the shared sidecar's manifest (checked below, so the parametrization is complete)
SIDECAR_FILES = [
    "common.safetensors",
    "config.json",
    "generation_config.json",
    "rank-00-of-02.safetensors",
    "rank-01-of-02.safetensors",
]
#: large enough that writing takes a while (~130 MB of fp8 weights), small enough to stay quick
BIG = dict(hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=4, vocab=2048)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def sidecar(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good TP-2 sidecar of ``ckpt``; tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("sidecar") / "tp2"
    r = cli("convert", ckpt, "-o", out, *TP)
    assert r.returncode == 0, explain(r)
    return out


def copy_sidecar(sidecar: Path, dst: Path) -> Path:
    """A private copy of the shared sidecar (new files, same bytes)."""
    return Path(shutil.copytree(sidecar, dst))


def stats(directory: Path) -> dict[str, tuple[int, int]]:
    """File name -> (inode, mtime_ns) of every file in ``directory``."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


def patch_manifest_sha(sidecar: Path, name: str) -> None:
    """Make mpack.json's digests (and size) of ``name`` match the file as it is now."""
    from mpack.iokit import chunk_digests
    from mpack.sidecar import write_manifest

    m = manifest(sidecar)
    (entry,) = [f for f in m["files"] if f["name"] == name]
    entry.update(size=(sidecar / name).stat().st_size)
    if "sha256" in entry:
        entry.update(sha256=sha256(sidecar / name))
    entry["chunks"]["sha256"] = chunk_digests(sidecar / name, entry["chunks"]["bytes"])
    write_manifest(sidecar, m)


# --- a killed run ---------------------------------------------------------------------------


def _data_started(rank_file: Path) -> bool:
    """True once ``rank_file`` holds tensor bytes beyond its safetensors header."""
    try:
        size = rank_file.stat().st_size
        if size < 8:
            return False
        with open(rank_file, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
        return size > 8 + hlen
    except (FileNotFoundError, struct.error):
        return False


@pytest.mark.slow
def test_sigkill_mid_write_leaves_no_output_and_next_run_recovers(tmp_path: Path) -> None:
    big = make_checkpoint(tmp_path / "big", **BIG)
    out = tmp_path / "out"
    proc = cli_popen("convert", big, "-o", out, "--device", "cpu")
    caught: Path | None = None
    deadline = time.monotonic() + 120
    try:
        while caught is None and proc.poll() is None and time.monotonic() < deadline:
            for d in work_dirs(out):
                if _data_started(d / "rank-00-of-01.safetensors"):
                    caught = d
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert caught is not None, (
        f"the conversion ended (exit {proc.returncode}) before it was caught mid-write; "
        "make BIG larger"
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"not killed: exit {proc.returncode}; make BIG larger"
    )
    # nothing named OUT, only the killed run's hidden work dir, without a manifest, and its lock
    # file (the lock itself went with the process)
    assert not out.exists()
    assert work_dirs(out) == [caught]
    assert caught.name.startswith(".mpack-") and ".tmp-" in caught.name
    assert not (caught / "mpack.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["big", caught.name, lock_path(out).name]
    )

    # the next run takes the lock and removes the dead run's work dir
    r = cli("convert", big, "-o", out, "--device", "cpu", "--json")
    assert r.returncode == 0, explain(r)
    assert json.loads(r.stdout)["up_to_date"] is False
    assert not caught.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "out"]
    r = cli("verify", out)
    assert r.returncode == 0, explain(r)


# --- re-runs --------------------------------------------------------------------------------


def test_rerun_is_up_to_date_and_force_rewrites_identical_bytes(
    ckpt: Path, sidecar: Path, tmp_path: Path
) -> None:
    out = copy_sidecar(sidecar, tmp_path / "out")
    before = stats(out)

    r = cli("convert", ckpt, "-o", out, *TP, "--json")
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert doc["up_to_date"] is True
    assert doc["manifest_digest"] == sha256(out / "mpack.json")
    assert stats(out) == before, "an up-to-date run touched the files"

    r = cli("convert", ckpt, "-o", out, *TP, "--json", "--force")
    assert r.returncode == 0, explain(r)
    assert json.loads(r.stdout)["up_to_date"] is False
    after = stats(out)
    assert after.keys() == before.keys()
    assert all(after[n][0] != before[n][0] for n in before), "--force did not rewrite every file"
    # deterministic: the same bytes as the first conversion, file by file
    assert {n: sha256(out / n) for n in after} == {n: sha256(sidecar / n) for n in after}
    assert manifest(out)["files"] == manifest(sidecar)["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work or old dirs left


@pytest.mark.parametrize(
    "args, target",
    [
        (("--tp", "1", "--device", "cpu"), {"tp_size": 1, "profile": "w8a16"}),
        ((*TP, "--profile", "w8a8-marlin"), {"tp_size": 2, "profile": "w8a8-marlin"}),
    ],
    ids=["other-tp", "other-profile"],
)
def test_other_sidecar_needs_force(
    ckpt: Path, sidecar: Path, tmp_path: Path, args: tuple[str, ...], target: dict[str, Any]
) -> None:
    out = copy_sidecar(sidecar, tmp_path / "out")
    before = snapshot(out)
    r = cli("convert", ckpt, "-o", out, *args)
    assert_refused(r, out, f"{out} already holds a different sidecar", "--force", exists=True)
    assert snapshot(out) == before

    r = cli("convert", ckpt, "-o", out, *args, "--force")
    assert r.returncode == 0, explain(r)
    m = manifest(out)
    assert {k: m["target"][k] for k in target} == target
    tp = target["tp_size"]
    assert {p.name for p in out.glob("rank-*")} == {
        f"rank-{i:02d}-of-{tp:02d}.safetensors" for i in range(tp)
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old one is gone


def test_rerun_asking_for_pass_through_is_not_up_to_date(ckpt: Path, tmp_path: Path) -> None:
    """A sidecar written with --no-passthrough lacks common.safetensors: a run that asks for it
    must not answer "up to date" (it is a different sidecar, like another --tp)."""
    out = tmp_path / "out"
    r = cli("convert", ckpt, "-o", out, *TP, "--no-passthrough")
    assert r.returncode == 0, explain(r)
    assert not (out / "common.safetensors").exists()

    before = snapshot(out)
    r = cli("convert", ckpt, "-o", out, *TP, "--json")
    assert_refused(r, out, "already holds a different sidecar", "--force", exists=True)
    assert snapshot(out) == before


# --- verify ---------------------------------------------------------------------------------

RENAMED = ("model.layers.0.self_attn.o_proj.weight", "model.layers.9.self_attn.o_proj.weight")
FLIPPED_TENSORS = {
    "rank-weight": ("rank-01-of-02.safetensors", "model.layers.1.mlp.gate_up_proj.weight"),
    "pass-through": ("common.safetensors", "model.embed_tokens.weight"),
}


def _flip_file(sc: Path, name: str) -> None:
    """Flip the middle byte of sidecar file ``name`` (mpack.json left as it was)."""
    flip_byte(sc / name, (sc / name).stat().st_size // 2)


def _rename_tensor(sc: Path, name: str) -> None:
    """Rename a tensor in rank 0's header (same length), then re-sign the file in mpack.json."""
    path = sc / "rank-00-of-02.safetensors"
    old, new = (f'"{n}"'.encode() for n in RENAMED)
    assert len(old) == len(new)
    raw = path.read_bytes()
    assert raw.count(old) == 1
    path.write_bytes(raw.replace(old, new))
    patch_manifest_sha(sc, path.name)


def _flip_tensor(sc: Path, key: str) -> None:
    """Flip one byte in the middle of a tensor, then re-sign the file in mpack.json."""
    fname, tensor = FLIPPED_TENSORS[key]
    a, b = tensor_range(sc / fname, tensor)
    flip_byte(sc / fname, (a + b) // 2)
    patch_manifest_sha(sc, fname)


#: damage kind -> (prepare(sidecar, arg), arg)
VERIFY_CASES: dict[str, tuple[Any, str]] = {
    **{f"flip-{n}": (_flip_file, n) for n in SIDECAR_FILES},
    "renamed-tensor": (_rename_tensor, ""),
    **{f"flip-{k}-tensor": (_flip_tensor, k) for k in FLIPPED_TENSORS},
    "good": (None, ""),
}


@pytest.fixture(scope="module")
def verify_runs(request, sidecar: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Damage a copy of the sidecar per selected case and start `mpack verify --json` on it."""
    pool = CliPool()
    try:
        runs = {}
        for case in selected_params(request, "case"):
            sc = copy_sidecar(sidecar, tmp_path_factory.mktemp(case) / "sc")
            prepare, arg = VERIFY_CASES[case]
            if prepare:
                prepare(sc, arg)
            runs[case] = pool.submit("verify", sc, "--json")
        yield runs
    finally:
        pool.close()


def test_manifest_lists_every_sidecar_file(sidecar: Path) -> None:
    names = [f["name"] for f in manifest(sidecar)["files"]]
    assert names == SIDECAR_FILES
    assert {p.name for p in sidecar.iterdir()} == {*SIDECAR_FILES, "mpack.json"}


def _assert_verify_fails(r: Any, *expect: str) -> None:
    """Exit 2, no traceback, every ``expect`` in the message, and (``--json``) stdout holding
    only the JSON error document, which says the same."""
    assert r.returncode == 2, explain(r)
    assert "Traceback" not in r.stderr
    for s in expect:
        assert s in r.stderr, f"{s!r} not in:\n{r.stderr}"
    if "--json" in r.args:
        doc = json.loads(r.stdout)
        assert doc["ok"] is False and doc["error"]["exit_code"] == 2
        assert doc["error"]["code"] == "VerificationError" or doc["error"]["message"] in r.stderr
    else:
        assert r.stdout == ""


@pytest.mark.parametrize("case", [f"flip-{n}" for n in SIDECAR_FILES])
def test_verify_catches_a_flipped_byte_in_any_file(case: str, verify_runs) -> None:
    name = case.removeprefix("flip-")
    _assert_verify_fails(verify_runs[case].result(), f"{name}: sha256 ", "manifest says")


@pytest.mark.parametrize("case", ["renamed-tensor"])
def test_verify_catches_a_renamed_tensor_with_valid_checksums(case: str, verify_runs) -> None:
    old, new = RENAMED
    _assert_verify_fails(
        verify_runs[case].result(),
        f"rank-00-of-02.safetensors: tensor {old} is missing",
        f"rank-00-of-02.safetensors: unexpected tensor {new}",
    )


@pytest.mark.parametrize("case", [f"flip-{k}-tensor" for k in FLIPPED_TENSORS])
def test_verify_re_derives_tensors_from_the_source(case: str, verify_runs) -> None:
    """Checksums re-signed, so only the comparison with the source checkpoint can tell."""
    fname, tensor = FLIPPED_TENSORS[case.removeprefix("flip-").removesuffix("-tensor")]
    r = verify_runs[case].result()
    if fname == "common.safetensors":
        _assert_verify_fails(r, f"{fname}: {tensor} differs from the source bytes")
    else:
        _assert_verify_fails(
            r,
            f"{fname}: {tensor} differs from the tensor re-derived from the source",
            f"{fname}: {tensor.removesuffix('.weight')}.weight does not unpack to the checkpoint",
        )


@pytest.mark.parametrize("case", ["good"])
def test_verify_json_on_a_good_sidecar(case: str, verify_runs, ckpt: Path) -> None:
    r = verify_runs[case].result()
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["source_checked"] is True
    assert doc["source"] == str(ckpt.resolve())
    assert doc["files_checked"] == len(SIDECAR_FILES)
    assert doc["layers_checked"] == 8 * 2  # 2 layers x 4 fused linears, on 2 ranks
    assert doc["tensors_compared"] > doc["layers_checked"]
