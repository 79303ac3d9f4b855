"""Note [a sidecar is bound to its checkpoint] (mpack/binding.py): the probe ``convert`` records
per shard, and the check ``load`` / ``attach`` run when they are given the checkpoint. (The vLLM
loader's own use of it: tests/vllm/test_vllm_loader.py, ``other-checkpoint``.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpack.runtime as rt
from mpack.binding import PROBE_BYTES, SourceMismatchError, probe, probe_spans
from mpack.convert import convert
from mpack.fixtures import make_checkpoint
from mpack.sidecar import load_manifest, read_file_map, write_manifest
from tests.conftest import flip_byte


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoint A, its sidecar, and checkpoint B: A's config and shapes, other weights."""
    root = tmp_path_factory.mktemp("binding")
    a = make_checkpoint(root / "a", layers=1, max_shard_size="200KB")
    b = make_checkpoint(root / "b", layers=1, max_shard_size="200KB", seed=1)
    convert(a, root / "sc", device="cpu")
    return {"a": Path(a), "b": Path(b), "sc": root / "sc", "root": root}


def shards(ck: Path) -> list[Path]:
    return sorted(ck.glob("*.safetensors"))


def test_the_spans_cover_small_tensors_and_both_ends_of_large_ones() -> None:
    assert probe_spans(100, 0) == []
    assert probe_spans(100, 2 * PROBE_BYTES) == [(100, 100 + 2 * PROBE_BYTES)]
    n = 10 * PROBE_BYTES
    assert probe_spans(0, n) == [(0, PROBE_BYTES), (n - PROBE_BYTES, n)]


def test_convert_records_a_probe_of_every_shard(pair: dict[str, Path]) -> None:
    m, _ = load_manifest(pair["sc"])
    recorded = {f["name"]: f for f in m["source"]["files"]}
    assert len(shards(pair["a"])) > 1
    for p in shards(pair["a"]):
        assert recorded[p.name]["probe"] == probe(p)
    assert all("probe" not in f for n, f in recorded.items() if not n.endswith(".safetensors"))


def test_the_probe_sees_a_tensors_first_and_last_bytes_and_the_header(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ck", layers=1)
    shard = shards(ck)[0]
    big = max(read_file_map(shard).entries, key=lambda e: e.nbytes)
    assert big.nbytes > 2 * PROBE_BYTES
    before = probe(shard)
    in_header = shard.read_bytes()[: big.offset].index(b'"pt"') + 2  # "pt" -> "pu": still valid
    for offset in (big.offset, big.offset + big.nbytes - 1, in_header):  # head, tail, header
        flip_byte(shard, offset, 0x01)
        assert probe(shard) != before, offset
        flip_byte(shard, offset, 0x01)
    assert probe(shard) == before


def test_load_with_its_own_checkpoint(pair: dict[str, Path]) -> None:
    w = rt.load(pair["sc"], checkpoint=pair["a"])
    assert len(w) > 0
    w.close()


def test_load_refuses_another_checkpoint_naming_the_shard(pair: dict[str, Path]) -> None:
    with pytest.raises(SourceMismatchError) as e:
        rt.load(pair["sc"], checkpoint=pair["b"])
    assert "another checkpoint" in str(e.value) and "other weights" in str(e.value)
    assert shards(pair["b"])[0].name in str(e.value)
    assert "checkpoint=" in e.value.hint


def test_attach_refuses_another_checkpoint_before_looking_for_a_daemon(
    pair: dict[str, Path],
) -> None:
    with pytest.raises(SourceMismatchError):
        rt.attach(pair["sc"], checkpoint=pair["b"], timeout=0.1)


@pytest.mark.parametrize("change", ["extra-shard", "missing-shard", "size", "tail-byte"])
def test_the_check_names_what_differs(pair: dict[str, Path], tmp_path: Path, change: str) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(pair["a"], ck)
    first = shards(ck)[0]
    if change == "extra-shard":
        (ck / "model.safetensors.index.json").unlink()
        shutil.copy(first, ck / "extra.safetensors")
        want = "extra.safetensors"
    elif change == "missing-shard":
        first.unlink()
        want = f"{first.name} is missing"
    elif change == "size":
        with open(first, "ab") as f:
            f.write(b"\0")
        want = "bytes"
    else:
        flip_byte(first, first.stat().st_size - 1, 0x01)
        want = "other weights"
    with pytest.raises(SourceMismatchError, match=want):
        rt.load(pair["sc"], checkpoint=ck)


def test_an_older_sidecar_without_probes_is_refused_with_the_way_out(
    pair: dict[str, Path], tmp_path: Path
) -> None:
    old = tmp_path / "old"
    shutil.copytree(pair["sc"], old)
    m, _ = load_manifest(old)
    for f in m["source"]["files"]:
        f.pop("probe", None)
    write_manifest(old, m)
    with pytest.raises(SourceMismatchError, match="records no probe") as e:
        rt.load(old, checkpoint=pair["a"])
    assert "regenerate" in e.value.hint
    rt.load(old).close()  # without a checkpoint named, nothing is compared


def test_a_malformed_probe_is_a_corrupt_manifest(pair: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(pair["sc"], bad)
    m = json.loads((bad / "mpack.json").read_text())
    next(f for f in m["source"]["files"] if "probe" in f)["probe"] = "not a digest"
    (bad / "mpack.json").write_text(json.dumps(m))
    p = subprocess.run(
        [sys.executable, "-m", "mpack", "inspect", str(bad)], capture_output=True, text=True
    )
    assert p.returncode == 2 and "probe" in p.stderr, p.stderr


def test_a_repo_id_not_in_the_cache_cannot_be_checked(
    pair: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceMismatchError, match="local HF cache"):
        rt.load(pair["sc"], checkpoint="some-org/not-here")
