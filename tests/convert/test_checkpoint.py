"""convert/checkpoint.py: opening a compressed-tensors checkpoint, reading its tensors, finding
and checking its quantized layers.

Real checkpoints from ``mpack.fixtures.make_checkpoint`` (single file, sharded with a scale in
another shard than its weight, per-channel, Qwen2 with biases, tied embeddings), compared with
the stock ``safetensors`` library's view of the same files. The CLI's refusals of damaged
checkpoints are in test_bad_inputs.py; here the library calls themselves.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors import safe_open

from mpack import target
from mpack.convert.checkpoint import (
    check_scale_values,
    find_layers,
    open_checkpoint,
    passthrough_names,
    read_scale,
)
from mpack.errors import CorruptFileError, SourceNotFoundError, UnsupportedSchemeError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import INDEX_NAME, SINGLE_NAME

TINY = dict(hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=128)
CHECKPOINTS = {
    "single": dict(scheme="FP8"),
    "sharded": dict(scheme="FP8", max_shard_size="60KB", scale_in_other_shard=True),
    "channel": dict(scheme="FP8_DYNAMIC", dtype="float16"),
    "qwen2": dict(arch="qwen2", scheme="FP8"),
    "tied": dict(arch="mistral", scheme="FP8_DYNAMIC", tie_embeddings=True),
}
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
MOVED = "model.layers.0.self_attn.q_proj.weight_scale"  # what scale_in_other_shard moves


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: make_checkpoint(root / name, **TINY, **kw) for name, kw in CHECKPOINTS.items()}


def _stock(ck: Path) -> dict[str, tuple[str, str, tuple[int, ...], bytes]]:
    """Every tensor of a checkpoint as the stock reader sees it: name -> (file, dtype, shape,
    data), the file taken from the index when there is one."""
    out = {}
    for path in sorted(ck.glob("*.safetensors")):
        for name, info in safetensors.deserialize(path.read_bytes()):
            out[name] = (path.name, info["dtype"], tuple(info["shape"]), bytes(info["data"]))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --- opening ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_open_checkpoint_sees_what_safetensors_sees(ckpts: dict[str, Path], name: str) -> None:
    ck = open_checkpoint(ckpts[name])
    stock = _stock(ckpts[name])
    assert set(ck.tensors) == set(stock)
    assert ck.files == sorted({f for f, *_ in stock.values()})
    for t in ck.tensors.values():
        file, dtype, shape, data = stock[t.name]
        assert (t.file, t.dtype, t.shape, t.nbytes) == (file, dtype, shape, len(data))
        with open(ck.root / t.file, "rb") as f:
            f.seek(t.offset)
            assert f.read(t.nbytes) == data, t.name
    assert ck.architecture == json.loads((ck.root / "config.json").read_text())["architectures"][0]
    assert ck.qconfig is not None and ck.qconfig.quant_method == "compressed-tensors"
    assert open_checkpoint(ckpts[name], scheme=False).qconfig is None


def test_sharded_checkpoint_follows_its_index(ckpts: dict[str, Path]) -> None:
    root = ckpts["sharded"]
    weight_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    ck = open_checkpoint(root)
    assert len(ck.files) >= 3 and not (root / SINGLE_NAME).exists()
    assert {n: t.file for n, t in ck.tensors.items()} == weight_map
    weight = MOVED.removesuffix("_scale")
    assert ck.tensors[MOVED].file != ck.tensors[weight].file
    layers = find_layers(ck)
    q = layers[MOVED.removesuffix(".weight_scale")]
    assert (q.n, q.k, q.strategy) == (128, 128, "tensor")
    with safe_open(str(root / weight_map[MOVED]), framework="pt") as f:
        assert _bytes(read_scale(ck, q.module)) == _bytes(f.get_tensor(MOVED).float().reshape(-1))


def test_index_with_a_missing_shard_or_a_tensor_twice(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    root = Path(shutil.copytree(ckpts["sharded"], tmp_path / "ck"))
    index = json.loads((root / INDEX_NAME).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(root / first, root / "copy.safetensors")
    index["weight_map"]["zz.extra"] = "copy.safetensors"
    (root / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CorruptFileError, match="also appears in copy.safetensors") as e:
        open_checkpoint(root)  # shards are read in name order: copy.safetensors first
    assert str(e.value).startswith(f"{root / first}: tensor ")
    index["weight_map"]["zz.extra"] = "model-99999.safetensors"
    (root / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SourceNotFoundError, match="lists shard model-99999.safetensors"):
        open_checkpoint(root)


def test_a_directory_without_weights(ckpts: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    shutil.copy(ckpts["single"] / "config.json", root / "config.json")
    with pytest.raises(SourceNotFoundError, match="no safetensors files"):
        open_checkpoint(root)
    with pytest.raises(SourceNotFoundError, match="no config.json"):
        open_checkpoint(tmp_path)


# --- reading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "sharded", "channel"])
def test_read_gives_the_safetensors_tensor(ckpts: dict[str, Path], name: str) -> None:
    ck = open_checkpoint(ckpts[name])
    root = ckpts[name]
    for tname, t in ck.tensors.items():
        got = ck.read(tname)
        with safe_open(str(root / t.file), framework="pt") as f:
            want = f.get_tensor(tname)
        assert got.dtype == want.dtype and got.shape == want.shape, tname
        assert _bytes(got) == _bytes(want), tname


def test_read_into_and_read_pieces_give_byte_ranges(ckpts: dict[str, Path]) -> None:
    ck = open_checkpoint(ckpts["single"])
    data = _stock(ckpts["single"])
    name = "model.embed_tokens.weight"  # 128 x 128 bf16: 32 KiB
    whole = data[name][3]
    out = bytearray(1000)
    ck.read_into(name, memoryview(out), skip=777)
    assert bytes(out) == whole[777:1777]
    a, b, c = bytearray(5000), bytearray(len(whole) - 9000), bytearray(1)
    pieces = [(memoryview(a), 0), (memoryview(b), 9000), (memoryview(c), 123)]  # several preads
    ck.read_pieces(name, pieces)
    assert bytes(a) == whole[:5000] and bytes(b) == whole[9000:] and bytes(c) == whole[123:124]
    ck.read_pieces(name, [])
    with pytest.raises(ValueError, match="pass the end"):
        ck.read_into(name, memoryview(bytearray(2)), skip=len(whole) - 1)


def test_reading_a_truncated_shard(ckpts: dict[str, Path], tmp_path: Path) -> None:
    root = Path(shutil.copytree(ckpts["single"], tmp_path / "ck"))
    ck = open_checkpoint(root)
    last = max(ck.tensors.values(), key=lambda t: t.offset)
    with open(root / SINGLE_NAME, "r+b") as f:
        f.truncate(last.offset + 10)
    with pytest.raises(CorruptFileError, match=f"tensor '{last.name}' is truncated at byte"):
        ck.read(last.name)


# --- layers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.parametrize("scheme", [True, False])
def test_find_layers_strategy_shape_and_bias(
    ckpts: dict[str, Path], name: str, scheme: bool
) -> None:
    """Every quantized linear with its weight's [N, K]; the strategy from the config (or, with
    ``scheme=False``, from the scale's shape); a bias where the model has one (Qwen2's q/k/v)."""
    ck = open_checkpoint(ckpts[name], scheme=scheme)
    layers = find_layers(ck)
    assert ck.layers is layers
    stock = _stock(ckpts[name])
    want = {f"model.layers.{i}.{s}" for i in range(2) for s in LINEARS}
    assert set(layers) == want
    dynamic = CHECKPOINTS[name]["scheme"] == "FP8_DYNAMIC"
    for module, ly in layers.items():
        assert (ly.n, ly.k) == stock[f"{module}.weight"][2]
        assert ly.strategy == ("channel" if dynamic else "tensor")
        scale_shape = stock[f"{module}.weight_scale"][2]
        assert math.prod(scale_shape) == (ly.n if dynamic else 1)
        qkv = module.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj")
        assert ly.has_bias is (name == "qwen2" and qkv), module
        assert ly.has_bias is (f"{module}.bias" in stock)


def test_find_layers_refuses_an_fp8_weight_without_scale(ckpts: dict[str, Path]) -> None:
    ck = open_checkpoint(ckpts["single"])
    del ck.tensors["model.layers.1.mlp.up_proj.weight_scale"]
    with pytest.raises(UnsupportedSchemeError, match="up_proj.weight: FP8 weight without"):
        find_layers(ck)


# --- scale values -------------------------------------------------------------------------------


@pytest.mark.parametrize("act", sorted(target.ACT_DTYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -0.0, -1e-3])
def test_scales_must_be_finite_and_positive(ckpts: dict[str, Path], act: str, bad: float) -> None:
    ck = open_checkpoint(ckpts["channel"])
    module = "model.layers.0.mlp.down_proj"
    where = f"{ck.root / ck.tensors[f'{module}.weight_scale'].file}: {module}.weight_scale"
    scale = torch.full((128,), 0.01)
    scale[3] = bad
    with pytest.raises(UnsupportedSchemeError, match=r"\[3\] = .* \(must be finite and > 0\)") as e:
        check_scale_values(ck, module, scale, act)
    assert str(e.value).startswith(where) and "re-quantize" in e.value.hint


@pytest.mark.parametrize("act", sorted(target.ACT_DTYPES))
def test_scales_up_to_the_fold_limit_of_each_act_dtype(ckpts: dict[str, Path], act: str) -> None:
    """Scales up to mpack.target's fold limit pass; the next float32 above it is refused."""
    ck = open_checkpoint(ckpts["channel"])
    module = "model.layers.0.self_attn.o_proj"
    limit = target.act_dtype(act).fold_limit
    scale = torch.full((128,), 1e-8)
    scale[5] = limit
    check_scale_values(ck, module, scale, act)
    scale[9] = torch.nextafter(torch.tensor(limit), torch.tensor(math.inf))
    with pytest.raises(UnsupportedSchemeError, match=rf"\[9\] = .* exceeds {limit} .* {act}") as e:
        check_scale_values(ck, module, scale, act)
    other = target.act_dtype("float16").fold_limit
    assert (f"use act_dtype='float16' (limit {other})" in e.value.hint) is (act == "bfloat16")


def test_real_scales_pass_and_read_as_float32(ckpts: dict[str, Path]) -> None:
    for name in ("single", "channel"):
        ck = open_checkpoint(ckpts[name])
        for module in find_layers(ck):
            s = read_scale(ck, module)
            assert s.dtype == torch.float32 and s.dim() == 1
            assert torch.equal(s, ck.read(f"{module}.weight_scale").float().reshape(-1))
            for act in target.ACT_DTYPES:
                check_scale_values(ck, module, s, act)


# --- pass-through ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "qwen2", "tied", "sharded"])
def test_passthrough_names_are_embeddings_norms_lm_head(ckpts: dict[str, Path], name: str) -> None:
    ck = open_checkpoint(ckpts[name])
    find_layers(ck)
    norms = [
        f"model.layers.{i}.{n}.weight"
        for i in range(2)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    want = ["model.embed_tokens.weight", *norms, "model.norm.weight"]
    if name != "tied":
        want.append("lm_head.weight")
    assert passthrough_names(ck) == sorted(want)
