"""mpack/sidecar.py: file layouts, the header reader, manifest bounds and the rank-file contract.

Checked against the stock ``safetensors`` library's own view of the same bytes (names, dtypes,
shapes, data), against real files (the golden cases' inputs and expected outputs, a sidecar
converted here from a real compressed-tensors checkpoint), and, for the manifest, against the
bounds docs/FORMAT.md states. Refusals already covered by tests/hostile/test_sidecar_hostile.py
(FIFOs, symlinks, tp_size range, file sizes, digests, duplicate files, profile, act_dtype, huge
layer dims) are not repeated here.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors import safe_open

from mpack.convert import convert
from mpack.errors import CorruptFileError, FormatVersionError, InputError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import (
    ALIGN,
    DTYPE_SIZES,
    MANIFEST_NAME,
    MAX_DIM,
    MAX_FILE_BYTES,
    MAX_TP,
    FileMap,
    TensorSpec,
    check_manifest,
    expected_rank_tensors,
    load_manifest,
    rank_file_name,
    rank_tensor_problems,
    read_file_map,
    torch_dtype,
)

TP = 2


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real TP-2 float16 sidecar of a Qwen2 checkpoint (q/k/v carry a bias)."""
    root = tmp_path_factory.mktemp("sidecar")
    ck = make_checkpoint(
        root / "ck",
        arch="qwen2",
        hidden=128,
        intermediate=256,
        heads=4,
        kv_heads=2,
        vocab=128,
        dtype="float16",
    )
    convert(ck, root / "sc", tp=TP, act_dtype="float16", device="cpu")
    return root / "sc"


@pytest.fixture
def manifest(sidecar: Path) -> dict[str, Any]:
    """A fresh copy of the real sidecar's manifest for each test to edit."""
    return json.loads((sidecar / MANIFEST_NAME).read_text())


def _stock_view(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """The stock safetensors parser's view of a file: name -> (dtype, shape, data bytes)."""
    return {
        name: (info["dtype"], tuple(info["shape"]), bytes(info["data"]))
        for name, info in safetensors.deserialize(path.read_bytes())
    }


def _write_planned(path: Path, file_map: FileMap, rng: random.Random) -> dict[str, bytes]:
    """Write ``layout`` with random tensor bytes; return name -> the bytes written."""
    data = {e.name: rng.randbytes(e.nbytes) for e in file_map.entries}
    with open(path, "wb") as f:
        f.write(file_map.header)
        for e in file_map.entries:
            assert f.tell() == e.offset
            f.write(data[e.name])
    return data


# --- FileMap.plan against the stock reader -----------------------------------------------


MIXED = [
    TensorSpec("w", "I32", (4, 64)),  # 1024 bytes
    TensorSpec("odd", "BF16", (3,)),  # 6
    TensorSpec("f8", "F8_E4M3", (2, 32)),  # 64
    TensorSpec("s", "F16", (1, 96)),  # 192
    TensorSpec("empty", "F32", (0,)),  # 0: a multiple of 64
    TensorSpec("scalar", "F64", ()),  # 8
    TensorSpec("b", "U8", (5,)),  # 5
]


def test_plan_puts_64_multiples_first_in_the_order_given(tmp_path: Path) -> None:
    file_map = FileMap.plan(MIXED, {"format": "pt", "rank": "0"})
    assert [e.name for e in file_map.entries] == ["w", "f8", "s", "empty", "odd", "scalar", "b"]
    path = tmp_path / "mixed.safetensors"
    written = _write_planned(path, file_map, random.Random(0))
    assert (
        path.stat().st_size
        == file_map.size
        == file_map.data_start + sum(map(len, written.values()))
    )
    assert file_map.data_start % ALIGN == 0
    view = _stock_view(path)
    assert set(view) == {s.name for s in MIXED}
    for s in MIXED:
        assert view[s.name] == (s.dtype, s.shape, written[s.name]), s.name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "rank": "0"}
    raw = path.read_bytes()
    for e in file_map.entries:
        if e.nbytes % ALIGN == 0:
            assert e.offset % ALIGN == 0, e.name
        assert raw[e.offset : e.offset + e.nbytes] == written[e.name]


@pytest.mark.parametrize("seed", range(12))
def test_random_file_maps_are_read_back_by_safetensors_and_read_file_map(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    dtypes = sorted(DTYPE_SIZES)
    specs = [
        TensorSpec(
            f"t{i}.{rng.choice(['weight', 'bias'])}",
            rng.choice(dtypes),
            tuple(rng.randint(0, 40) for _ in range(rng.randint(0, 3))),
        )
        for i in range(rng.randint(0, 12))
    ]
    meta = {"seed": str(seed)} if seed % 2 else None
    file_map = FileMap.plan(specs, meta)
    path = tmp_path / "r.safetensors"
    written = _write_planned(path, file_map, rng)
    view = _stock_view(path)
    assert view == {s.name: (s.dtype, s.shape, written[s.name]) for s in specs}
    assert file_map.data_start % ALIGN == 0
    assert all(e.offset % ALIGN == 0 for e in file_map.entries if e.nbytes % ALIGN == 0)
    again = read_file_map(path)
    assert (again.header, again.entries, again.size) == (
        file_map.header,
        file_map.entries,
        file_map.size,
    )
    assert again.metadata == (meta or {})


def test_plan_refuses_duplicate_names() -> None:
    with pytest.raises(ValueError, match="duplicate tensor names"):
        FileMap.plan([TensorSpec("a", "U8", (64,)), TensorSpec("a", "U8", (3,))])
    file_map = FileMap.plan([TensorSpec("a", "U8", (3,))])
    with pytest.raises(KeyError):
        file_map.entry("b")


def test_dtype_table_agrees_with_torch_and_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "dtypes.safetensors"
    tensors = {name: torch.zeros(2, dtype=torch_dtype(name)) for name in DTYPE_SIZES}
    safetensors.torch.save_file(tensors, str(path))
    view = _stock_view(path)
    for name, size in DTYPE_SIZES.items():
        assert torch_dtype(name).itemsize == size, name
        assert view[name][0] == name and len(view[name][2]) == 2 * size, name
        assert TensorSpec(name, name, (3, 5)).nbytes == 15 * size


# --- read_file_map on real files ----------------------------------------------------------------


def test_read_file_map_agrees_with_safetensors_on_golden_files(golden: Path) -> None:
    files = sorted((golden / "cases").glob("*/input/model.safetensors"))
    files += sorted((golden / "cases").glob("*/expected/*.safetensors"))
    assert len(files) >= 6
    for path in files:
        file_map = read_file_map(path)
        raw = path.read_bytes()
        view = _stock_view(path)
        assert [e.name for e in file_map.entries] != [] and file_map.size == len(raw)
        assert {e.name for e in file_map.entries} == set(view), path
        for e in file_map.entries:
            dtype, shape, data = view[e.name]
            assert (e.dtype, e.shape) == (dtype, shape)
            assert raw[e.offset : e.offset + e.nbytes] == data, (path, e.name)
        with safe_open(str(path), framework="pt") as f:
            assert file_map.metadata == (f.metadata() or {})
        assert file_map.header == raw[: file_map.data_start]


def _raw(header: Any, data: bytes = b"") -> bytes:
    """A safetensors file made by hand: length prefix, JSON ``header``, ``data``."""
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def _u8(a: int, b: int, n: int | None = None) -> dict[str, Any]:
    return {"dtype": "U8", "shape": [b - a if n is None else n], "data_offsets": [a, b]}


BAD_FILES = {
    "shorter-than-8-bytes": (b"\x01\x00\x00", "is too short for a safetensors file"),
    "header-is-a-list": (_raw([1, 2]), "header is not a JSON object"),
    "metadata-is-a-list": (_raw({"__metadata__": ["x"]}), "__metadata__ is not a JSON object"),
    "unknown-dtype": (
        _raw({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 2]}}, b"xx"),
        "malformed header entry",
    ),
    "size-disagrees-with-shape": (_raw({"a": _u8(0, 2, n=3)}, b"xx"), "malformed header entry"),
    "offsets-reversed": (
        _raw({"a": {"dtype": "U8", "shape": [0], "data_offsets": [2, 0]}}, b"xx"),
        "malformed header entry",
    ),
    "no-data-offsets": (
        _raw({"a": {"dtype": "U8", "shape": [2]}}, b"xx"),
        "malformed header entry",
    ),
    "gap": (_raw({"a": _u8(0, 2), "b": _u8(3, 5)}, b"xxxxx"), "'b' starts at byte"),
    "overlap": (_raw({"a": _u8(0, 2), "b": _u8(1, 3)}, b"xxx"), "'b' starts at byte"),
    "not-from-zero": (_raw({"a": _u8(1, 3)}, b"xxx"), "'a' starts at byte"),
    "trailing-bytes": (_raw({"a": _u8(0, 2)}, b"xxx"), "has trailing bytes"),
    "data-past-the-end": (_raw({"a": _u8(0, 4)}, b"xx"), "truncated: tensors end at byte"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_read_file_map_refuses_what_safetensors_refuses(tmp_path: Path, case: str) -> None:
    raw, match = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CorruptFileError, match=match) as e:
        read_file_map(path)
    assert str(path) in str(e.value)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.deserialize(raw)


def test_read_file_map_follow_decides_on_symlinks(tmp_path: Path) -> None:
    real = tmp_path / "real.safetensors"
    file_map = FileMap.plan([TensorSpec("a", "U8", (3,))])
    _write_planned(real, file_map, random.Random(1))
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    assert read_file_map(link).entries == file_map.entries
    with pytest.raises(InputError, match="symbolic link"):
        read_file_map(link, follow=False)


# --- check_manifest: bounds and refusals -------------------------------------------------------


def _parent(m: dict[str, Any], path: str) -> tuple[Any, Any]:
    """The container of ``a.b.c`` in the manifest, and its last key (list indices as numbers)."""
    *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = m
    for k in keys:
        node = node[k]
    return node, last


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets ``a.b.c`` of the manifest to ``value``."""

    def edit(m: dict[str, Any]) -> None:
        node, last = _parent(m, path)
        node[last] = value

    return edit


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    """An edit that removes ``a.b.c`` from the manifest."""

    def edit(m: dict[str, Any]) -> None:
        node, last = _parent(m, path)
        del node[last]

    return edit


def _first_layer(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["layers"][sorted(m["layers"])[0]].__setitem__(key, value)


def _file_named(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["files"].append({"name": name, "size": 1, "sha256": "0" * 64})


def _chunks_only(version: int) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["format_version"] = version
        chunks = {"bytes": 4, "sha256": ["a" * 64] * 3}  # 10 bytes in chunks of 4
        m["files"].append({"name": "extra.bin", "size": 10, "chunks": chunks})

    return edit


REFUSED = {
    "format": (_set("format", "safetensors"), "not an mpack sidecar manifest"),
    "no-layers": (_drop("layers"), "manifest key 'layers' is missing or not a dict"),
    "files-not-a-list": (_set("files", {}), "manifest key 'files' is missing or not a list"),
    "target-lacks-fusion": (_drop("target.fusion"), "manifest target lacks 'fusion'"),
    "kernel": (_set("target.kernel", "marlin-int4"), "target kernel is 'marlin-int4'"),
    "fusion": (_set("target.fusion", "both"), "target fusion is 'both', not one of vllm, none"),
    "engine-not-a-string": (_set("target.engine", 3), "target engine is not a string"),
    "tp-larger-than-the-rank-files": (
        _set("target.tp_size", 3),
        "do not list rank-00-of-03.safetensors, rank-01-of-03.s",
    ),
    "many-missing-rank-files": (_set("target.tp_size", 9), "rank-03-of-09.safetensors ..."),
    "path-in-a-file-name": (_file_named("../escape"), "is not a plain file name"),
    "dot-dot": (_file_named(".."), "is not a plain file name"),
    "empty-file-name": (_file_named(""), "is not a plain file name"),
    "nul-in-a-file-name": (_file_named("a\0b"), "is not a plain file name"),
    "manifest-lists-itself": (_file_named(MANIFEST_NAME), "is not a plain file name"),
    "name-not-a-string": (_file_named(7), "malformed files entry"),  # type: ignore[arg-type]
    "version-1-needs-sha256": (_chunks_only(1), "malformed files entry"),
    "chunk-count": (_set("files.0.chunks", {"bytes": 1, "sha256": ["a" * 64]}), "malformed chunks"),
    "chunk-bytes-zero": (
        _set("files.0.chunks", {"bytes": 0, "sha256": ["a" * 64]}),
        "malformed chunks",
    ),
    "layer-bias-not-bool": (_first_layer("bias", 1), "is malformed"),
    "layer-dim-zero": (_first_layer("n", 0), "is malformed"),
    "layer-dim-bool": (_first_layer("kp", True), "is malformed"),
    "layer-dim-float": (_first_layer("np", 64.0), "is malformed"),
    "layer-dim-above-max": (_first_layer("k", MAX_DIM + 1), "is malformed"),
    "layer-not-a-dict": (lambda m: m["layers"].__setitem__("x", [1]), "layer 'x' is malformed"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_check_manifest_refuses(manifest: dict[str, Any], case: str) -> None:
    edit, match = REFUSED[case]
    edit(manifest)
    with pytest.raises(CorruptFileError, match=match) as e:
        check_manifest(manifest, "/x/sc/mpack.json")
    assert str(e.value).startswith("/x/sc/mpack.json: ")


@pytest.mark.parametrize("m", [[], None, "mpack-sidecar", {"format": "mpack-sidecar "}])
def test_check_manifest_refuses_non_manifests(m: Any) -> None:
    with pytest.raises(CorruptFileError, match="not an mpack sidecar manifest"):
        check_manifest(m, "w")


@pytest.mark.parametrize("version", [0, 3, True, "2", None])
def test_other_format_versions_name_the_regenerate_command(manifest: dict, version: Any) -> None:
    manifest["format_version"] = version
    with pytest.raises(FormatVersionError, match=f"sidecar format version {version!r}") as e:
        check_manifest(manifest, "/x/sc/mpack.json")
    assert "reads versions 1, 2" in str(e.value)
    src = manifest["source"]["path"]
    assert e.value.hint == f"regenerate it: mpack convert {src} -o /x/sc --force"


def test_check_manifest_accepts_the_bounds(manifest: dict[str, Any]) -> None:
    assert check_manifest(manifest, "w") is manifest
    m = copy.deepcopy(manifest)
    chunked = [f for f in m["files"] if "sha256" not in f]
    assert chunked, "format version 2: safetensors files carry chunk digests only"
    m["target"]["tp_size"] = MAX_TP
    listed = {f["name"] for f in m["files"]}
    ranks = [rank_file_name(r, MAX_TP) for r in range(MAX_TP)]
    m["files"] += [{"name": n, "size": 0, "sha256": "0" * 64} for n in ranks if n not in listed]
    huge = {"name": "huge", "size": MAX_FILE_BYTES, "sha256": "f" * 64}
    m["files"].append(huge)
    m["layers"]["edge"] = {"n": MAX_DIM, "k": 1, "np": MAX_DIM, "kp": 1, "bias": False}
    _chunks_only(2)(m)
    assert check_manifest(m, "w") is m
    huge["size"] = MAX_FILE_BYTES + 1
    with pytest.raises(CorruptFileError, match="malformed files entry"):
        check_manifest(m, "w")


def test_load_manifest_of_a_checkpoint_says_to_convert_it(tmp_path: Path) -> None:
    ck = tmp_path / "my-model"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    with pytest.raises(InputError, match="no mpack.json: not a finished mpack sidecar") as e:
        load_manifest(ck)
    hint = f"if {ck} is a checkpoint, convert it: mpack convert {ck} -o my-model-marlin"
    assert e.value.hint == hint


# --- the rank files a manifest implies ---------------------------------------------------------


def test_expected_rank_tensors_are_the_real_rank_files(sidecar: Path) -> None:
    m, _ = load_manifest(sidecar)
    want = expected_rank_tensors(m)
    assert any(name.endswith(".bias") for name in want)
    for r in range(TP):
        path = sidecar / rank_file_name(r, TP)
        got = {name: (dtype, shape) for name, (dtype, shape, _) in _stock_view(path).items()}
        assert got == want, r
        assert rank_tensor_problems(read_file_map(path), m, path.name) == []


def test_rank_tensor_problems_name_every_difference(sidecar: Path, manifest: dict) -> None:
    qkv = "model.layers.0.self_attn.qkv_proj"
    manifest["layers"][qkv]["np"] += 64
    manifest["layers"]["model.layers.9.mlp.down_proj"] = {**manifest["layers"][qkv], "bias": False}
    name = rank_file_name(1, TP)
    problems = rank_tensor_problems(read_file_map(sidecar / name), manifest, name)
    np_, rows = manifest["layers"][qkv]["np"], manifest["layers"][qkv]["kp"] // 16
    was = np_ - 64
    assert problems == [
        f"{name}: tensor model.layers.9.mlp.down_proj.weight is missing",
        f"{name}: tensor model.layers.9.mlp.down_proj.weight_scale is missing",
        f"{name}: {qkv}.bias is ('F16', ({was},)), the manifest implies ('F16', ({np_},))",
        f"{name}: {qkv}.weight is ('I32', ({rows}, {4 * was})), "
        f"the manifest implies ('I32', ({rows}, {4 * np_}))",
        f"{name}: {qkv}.weight_scale is ('F16', (1, {was})), "
        f"the manifest implies ('F16', (1, {np_}))",
    ]


def test_each_digest_is_checked_once(sidecar: Path, tmp_path: Path, monkeypatch) -> None:
    """Note [checked once]: the same bytes are checked once per process; other bytes at the same
    path are checked in full, and a bad manifest is still refused after a good one was seen."""
    import shutil

    import mpack.sidecar as sc

    monkeypatch.setattr(sc, "_CHECKED", {})
    calls: list[Path] = []
    real = sc.check_manifest
    monkeypatch.setattr(sc, "check_manifest", lambda m, p: (calls.append(p), real(m, p))[1])
    copy_dir = tmp_path / "sc"
    shutil.copytree(sidecar, copy_dir)
    first = load_manifest(copy_dir)
    assert load_manifest(copy_dir) == first and load_manifest(sidecar) == first
    assert len(calls) == 1  # three loads of one digest
    again = load_manifest(copy_dir)[0]
    again["model"]["num_layers"] = -1  # callers get their own dict, not the cached check's
    assert load_manifest(copy_dir)[0] == first[0]

    bad = json.loads((copy_dir / MANIFEST_NAME).read_text())
    bad["format_version"] = 999
    (copy_dir / MANIFEST_NAME).write_text(json.dumps(bad))
    with pytest.raises(FormatVersionError):
        load_manifest(copy_dir)
    assert len(calls) == 2


def test_a_stages_tensors_are_one_byte_range_of_each_rank_file(tmp_path: Path) -> None:
    """Note [a layer range per stage] in docs/FORMAT.md: a pipeline stage's Marlin tensors are
    one contiguous byte range of each rank file, the stages' ranges in stage order, for every
    split of the decoder layers (the writer's order is layer by layer)."""
    from mpack import arch

    ck = make_checkpoint(
        tmp_path / "ck", hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=128, layers=5
    )
    convert(ck, tmp_path / "sc", tp=2, device="cpu")
    manifest, _ = load_manifest(tmp_path / "sc")
    for rank in range(2):
        entries = read_file_map(tmp_path / "sc" / rank_file_name(rank, 2)).entries
        for size in range(1, 6):
            ends = []
            for pp_rank in range(size):
                span = arch.pp_layers(5, pp_rank, size)
                held = arch.stage_layers(manifest["layers"], span)
                mine = sorted(
                    (e.offset, e.offset + e.nbytes)
                    for e in entries
                    if e.name.rpartition(".")[0] in held
                )
                assert len(mine) == 2 * len(held)  # weight, weight_scale (no bias)
                for (_, end), (start, _) in itertools.pairwise(mine):
                    assert start == end, (size, pp_rank)  # no other stage's bytes between
                ends.append((mine[0][0], mine[-1][1]))
            for (_, end), (start, _) in itertools.pairwise(ends):
                assert start == end  # stage after stage
