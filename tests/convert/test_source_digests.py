"""Source provenance (FORMAT.md `source.files`, Note [source digests]): large local files are
recorded by chunk digests hashed in parallel, small ones by their sha256; verify and the
up-to-date check accept either form, including manifests that recorded whole-file sha256s."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from mpack.convert import source as source_mod
from mpack.convert import verify as run_verify
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.convert.source import ResolvedSource, hash_sources
from mpack.errors import OutputExistsError, VerificationError
from mpack.fixtures import make_checkpoint
from mpack.iokit import HashCancelled
from mpack.sidecar import load_manifest, read_file_map, write_manifest
from tests.conftest import flip_byte

CHUNK = 4096  # small enough that every shard of a tiny checkpoint spans many chunks


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(source_mod, "CHUNK_BYTES", CHUNK)
    return CHUNK


@pytest.fixture
def converted(tmp_path: Path, small_chunks: int) -> tuple[Path, Path]:
    src = make_checkpoint(tmp_path / "ckpt", layers=1, vocab=300)
    out = tmp_path / "side"
    run_convert(src, out, ConvertOptions(device="cpu"))
    return Path(src), out


def as_whole_file_records(out: Path, src: Path) -> None:
    """Rewrite the manifest as an mpack that recorded every source file's sha256 would have."""
    m, _ = load_manifest(out)
    for rec in m["source"]["files"]:
        rec.pop("chunks", None)
        rec["sha256"] = hashlib.sha256((src / rec["name"]).read_bytes()).hexdigest()
    write_manifest(out, m)


def test_large_files_recorded_by_chunks_small_by_sha256(converted) -> None:
    src, out = converted
    m, _ = load_manifest(out)
    kinds = set()
    for rec in m["source"]["files"]:
        data = (src / rec["name"]).read_bytes()
        assert rec["size"] == len(data)
        if rec["name"].endswith(".safetensors"):  # and its probe (tests/test_binding.py)
            rec = {k: v for k, v in rec.items() if k != "probe"}
        if len(data) <= CHUNK:
            kinds.add("sha256")
            assert set(rec) == {"name", "size", "sha256"}
            assert rec["sha256"] == hashlib.sha256(data).hexdigest()
        else:
            kinds.add("chunks")
            assert set(rec) == {"name", "size", "chunks"}
            want = [
                hashlib.sha256(data[a : a + CHUNK]).hexdigest() for a in range(0, len(data), CHUNK)
            ]
            assert rec["chunks"] == {"bytes": CHUNK, "sha256": want}
    assert kinds == {"sha256", "chunks"}  # the tiny checkpoint has both sizes of file


def test_verify_source_checks_chunks_and_reports_a_changed_shard(converted) -> None:
    src, out = converted
    assert run_verify(out, source=src).source_checked
    shard = next(src.glob("*.safetensors"))
    file_map = read_file_map(shard)
    flip_byte(shard, file_map.entries[-1].offset, mask=0x01)  # the last tensor: not re-derived
    with pytest.raises(VerificationError, match=rf"source {shard.name}: differs"):
        run_verify(out, source=src)


def test_verify_and_up_to_date_accept_whole_file_records(converted) -> None:
    src, out = converted
    as_whole_file_records(out, src)
    m, _ = load_manifest(out)
    assert all("chunks" not in r for r in m["source"]["files"])
    assert run_verify(out, source=src).source_checked
    again = run_convert(src, out, ConvertOptions(device="cpu"))
    assert again.up_to_date  # same source, recorded the older way: nothing to redo
    assert json.loads((out / "mpack.json").read_text()) == m


def test_changed_source_is_not_up_to_date_in_either_form(converted) -> None:
    src, out = converted
    as_whole_file_records(out, src)
    shard = next(src.glob("*.safetensors"))
    flip_byte(shard, read_file_map(shard).entries[-1].offset, mask=0x01)
    with pytest.raises(OutputExistsError, match="different sidecar"):
        run_convert(src, out, ConvertOptions(device="cpu"))


def test_hash_sources_stops_when_asked(tmp_path: Path, small_chunks: int) -> None:
    src = make_checkpoint(tmp_path / "ckpt", layers=1, vocab=300)
    names = sorted(p.name for p in Path(src).iterdir())
    stop = threading.Event()
    stop.set()
    with pytest.raises(HashCancelled):
        hash_sources(ResolvedSource(path=Path(src), kind="local"), names, stop=stop)
