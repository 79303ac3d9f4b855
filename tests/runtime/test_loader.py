"""The verified fill and ``load()`` (a private copy): bytes, checksums, layout checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mpack.errors import (
    CorruptFileError,
    FormatVersionError,
    InputError,
    UsageError,
    VerificationError,
)
from mpack.runtime import load
from mpack.runtime.allocation import REGION_ALIGN, plan_rank
from mpack.runtime.loader import HostDest, fill
from mpack.sidecar import (
    FileMap,
    HashingWriter,
    TensorSpec,
    new_manifest,
    rank_file_name,
    target_of,
    write_manifest,
)
from mpack.target import packed_specs
from tests.conftest import flip_byte
from tests.runtime.sidecar_factory import expected_tensors, make_sidecar


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("sc") / "s", tp=2, layers=2)


def _check_equal(w, sidecar: Path, rank: int) -> None:
    want = expected_tensors(sidecar, rank)
    assert sorted(w) == sorted(want)
    for name, data in want.items():
        assert _bytes(w[name]) == data, name


@pytest.mark.parametrize("rank", [0, 1])
def test_load_gives_every_tensor_of_the_rank_plus_common(sidecar, rank):
    with load(sidecar, rank=rank) as w:
        _check_equal(w, sidecar, rank)
        assert w.backend == "private" and w.rank == rank and w.device == "cpu"
        assert w.manifest["target"]["tp_size"] == 2
        qkv = w["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.dtype == torch.int32 and qkv.shape == (256 // 16, 4 * 3 * 256 // 2)
        assert w["model.layers.0.self_attn.qkv_proj.weight_scale"].dtype == torch.bfloat16
        assert w["model.odd.weight"].shape == (37,)
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w["model.norm.weight"]


def test_plan_places_whole_files_aligned(sidecar):
    plan = plan_rank(sidecar, 1)
    assert [r.name for r in plan.regions] == [rank_file_name(1, 2), "common.safetensors"]
    assert plan.regions[0].offset == 0 and plan.regions[1].offset % REGION_ALIGN == 0
    assert plan.size == plan.regions[1].offset + plan.regions[1].size


@pytest.mark.parametrize(("chunk", "depth"), [(4096, 2), (1000, 3), (1 << 24, 4)])
def test_fill_with_any_chunking_gives_the_file_bytes(sidecar, chunk, depth):
    plan = plan_rank(sidecar, 0)
    buf = bytearray(plan.size)
    stats = fill(plan, HostDest(memoryview(buf)), chunk=chunk, depth=depth)
    assert stats.bytes == plan.size
    for r in plan.regions:
        assert buf[r.offset : r.offset + r.size] == r.path.read_bytes()


def test_a_flipped_byte_is_refused(tmp_path):
    sc = make_sidecar(tmp_path / "s", seed=3)
    f = sc / rank_file_name(0, 1)
    flip_byte(f, f.stat().st_size - 100, 0x80)
    with pytest.raises(VerificationError, match="does not match the manifest") as e:
        load(sc)
    assert "mpack convert" in e.value.hint


def test_a_header_changed_while_loading_is_refused(tmp_path):
    sc = make_sidecar(tmp_path / "s", seed=4)
    plan = plan_rank(sc, 0)
    f = plan.regions[0].path
    data = bytearray(f.read_bytes())
    i = data.index(b'"format":"pt"')
    data[i + 10 : i + 12] = b"PT"  # same length, still valid: only the head comparison sees it
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="header changed while loading"):
        fill(plan, HostDest(memoryview(bytearray(plan.size))))


def test_unknown_format_version_and_bad_rank(tmp_path):
    sc = make_sidecar(tmp_path / "s", seed=5)
    with pytest.raises(UsageError, match="tp_size=1"):
        load(sc, rank=1)
    m = json.loads((sc / "mpack.json").read_text())
    m["format_version"] = 99
    (sc / "mpack.json").write_text(json.dumps(m))
    with pytest.raises(FormatVersionError, match="format version 99"):
        load(sc)


def test_a_sidecar_without_common_serves_the_rank_file_only(tmp_path):
    sc = make_sidecar(tmp_path / "s", common=False)
    with load(sc) as w:
        _check_equal(w, sc, 0)
        assert "model.embed_tokens.weight" not in w


def _one_file_sidecar(path: Path, specs: list[TensorSpec]) -> Path:
    """A sidecar with one small Marlin layer (zero-filled; a manifest lists at least one) whose
    common.safetensors holds ``specs``, zero-filled (a rank file may hold only what the
    manifest's layers imply)."""
    path.mkdir()
    layers = {"l": {"n": 64, "k": 128, "np": 64, "kp": 128, "bias": False}}
    rank = [
        TensorSpec(n, dt, shape) for n, dt, shape in packed_specs("l", 64, 128, "bfloat16", False)
    ]
    files = []
    for name, file_specs in ((rank_file_name(0, 1), rank), ("common.safetensors", specs)):
        file_map = FileMap.plan(file_specs)
        w = HashingWriter(path / name, file_map)
        for e in file_map.entries:
            w.write_at(e.offset, bytes(e.nbytes))
        size, digest = w.finish()
        files.append({"name": name, "size": size, "sha256": digest})
    write_manifest(
        path,
        new_manifest(
            target=target_of(profile="w8a16", act_dtype="bfloat16", tp=1, fusion="vllm"),
            source={},
            model={},
            layers=layers,
            files=files,
        ),
    )
    return path


def test_an_unaligned_tail_tensor_is_served_as_a_copy(tmp_path):
    specs = [
        TensorSpec("a", "U8", (3,)),
        TensorSpec("b", "F32", (2,)),
        TensorSpec("c", "U8", (64,)),
    ]
    sc = _one_file_sidecar(tmp_path / "s", specs)
    with load(sc) as w:
        assert w["b"].dtype == torch.float32 and w["b"].tolist() == [0.0, 0.0]
        assert w["b"].untyped_storage().data_ptr() != w["c"].untyped_storage().data_ptr()
        assert w["a"].untyped_storage().data_ptr() == w["c"].untyped_storage().data_ptr()


def test_a_file_listed_but_missing_is_reported(tmp_path):
    sc = make_sidecar(tmp_path / "s", seed=6)
    os.unlink(sc / "common.safetensors")
    with pytest.raises(InputError, match="common.safetensors"):
        load(sc)


@pytest.mark.gpu
def test_load_to_cuda_gives_the_same_bytes(sidecar):
    with load(sidecar, rank=1, device="cuda:0") as w:
        assert w["model.norm.weight"].device.type == "cuda"
        _check_equal(w, sidecar, 1)


# --- per-chunk digests (Note [chunk digests]) ------------------------------------------------


def _with_chunks(src: Path, dst: Path, chunk: int) -> dict:
    """A copy of a sidecar whose manifest lists ``chunk``-byte digests for its safetensors files."""
    import shutil

    from mpack.iokit import chunk_digests
    from mpack.sidecar import MANIFEST_NAME

    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST_NAME).read_text())
    for f in m["files"]:
        if f["name"].endswith(".safetensors"):
            f["chunks"] = {"bytes": chunk, "sha256": chunk_digests(dst / f["name"], chunk)}
    write_manifest(dst, m)
    return m


def test_chunk_digests_match_whole_file_bytes(sidecar, tmp_path):
    import hashlib

    from mpack.iokit import chunk_digests

    path = sidecar / rank_file_name(0, 2)
    data = path.read_bytes()
    want = [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    assert chunk_digests(path, 1000, workers=3) == want


def test_chunked_load_gives_the_bytes_and_catches_a_flip(sidecar, tmp_path):
    chunked = tmp_path / "chunked"
    m = _with_chunks(sidecar, chunked, 4096)
    w = load(chunked, rank=1)
    for name, data in expected_tensors(chunked, 1).items():
        assert _bytes(w[name]) == data, name
    # flip a byte in the third chunk, and make the whole-file sha256 agree, so that only the
    # chunk digests can notice
    import hashlib

    path = chunked / rank_file_name(1, 2)
    raw = bytearray(path.read_bytes())
    raw[2 * 4096 + 100] ^= 0x40
    path.write_bytes(raw)
    for f in m["files"]:
        if f["name"] == path.name:
            f["sha256"] = hashlib.sha256(raw).hexdigest()
    write_manifest(chunked, m)
    with pytest.raises(VerificationError, match=r"bytes 8192\.\.12288 .*chunk sha256"):
        load(chunked, rank=1)


def test_chunks_larger_than_the_read_piece_are_hashed_in_order(sidecar, tmp_path):
    """Chunk digests of 8 KiB read in 1 KiB pieces (a chunk spans several ring slots): the bytes
    load, and a flip in the second chunk is named by that chunk's byte range."""
    chunked = tmp_path / "big-chunks"
    _with_chunks(sidecar, chunked, 8192)
    plan = plan_rank(chunked, 1)
    buf = torch.empty(plan.size, dtype=torch.uint8)
    fill(plan, HostDest(memoryview(buf.numpy())), chunk=1024, depth=3)
    for r in plan.regions:
        assert bytes(buf[r.offset : r.offset + r.size].numpy()) == r.path.read_bytes(), r.name
    flip = chunked / rank_file_name(1, 2)
    flip_byte(flip, 8192 + 3000, 0x01)
    with pytest.raises(VerificationError, match=r"bytes 8192\.\.16384 .*chunk sha256"):
        fill(plan_rank(chunked, 1), HostDest(memoryview(buf.numpy())), chunk=1024, depth=3)
