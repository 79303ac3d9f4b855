"""convert/plan.py: fusion, TP slices, padding and file layouts, planned from real checkpoints.

Every plan is made from a real compressed-tensors checkpoint (``mpack.fixtures``) and checked
against facts outside the planner: the checkpoint's weights as the stock ``safetensors`` reader
returns them (the rank slices must put them back together), dimensions worked out by hand from
SPEC §3.3 and §6, and the files ``mpack.convert.convert`` actually writes for the same options.
The CLI's refusals are in test_bad_inputs.py; here the planner's own errors and messages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors import safe_open

from mpack.convert import convert
from mpack.convert.checkpoint import Checkpoint, find_layers, open_checkpoint
from mpack.convert.plan import Plan, make_plan
from mpack.errors import UnsupportedSchemeError, UsageError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import COMMON_NAME, MANIFEST_NAME, rank_file_name, read_file_map

CHECKPOINTS = {
    # the golden model's dims: 4 heads, 2 KV heads, head_dim 64, intermediate 512
    "llama": dict(scheme="FP8"),
    "qwen2": dict(arch="qwen2", scheme="FP8", hidden=128, intermediate=256, vocab=128),
    # qkv N = 96 + 32 + 32 = 160, K = 96: every layer needs padding
    "padded": dict(
        scheme="FP8_DYNAMIC",
        hidden=96,
        heads=3,
        kv_heads=1,
        head_dim=32,
        intermediate=160,
        vocab=128,
    ),
    "eleven": dict(
        scheme="FP8_DYNAMIC", layers=11, hidden=64, heads=2, kv_heads=1, intermediate=128, vocab=128
    ),
    # down_proj K = 12: 6 per rank at TP 2, not a multiple of 4
    "k-slice": dict(scheme="FP8", hidden=64, heads=2, kv_heads=2, intermediate=12, vocab=128),
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
FORWARD = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: make_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


def opened(path: Path) -> Checkpoint:
    """A freshly opened checkpoint with its layers found (tests may edit it)."""
    ck = open_checkpoint(path)
    find_layers(ck)
    return ck


def plan_of(
    path: Path,
    *,
    profile: str = "w8a16",
    act: str = "bfloat16",
    tp: int = 1,
    fusion: str = "vllm",
    passthrough: bool = True,
) -> Plan:
    return make_plan(
        opened(path), profile=profile, act_dtype=act, tp=tp, fusion=fusion, passthrough=passthrough
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every FP8 weight of the checkpoint as raw bytes ``[N, K]`` (the stock reader's view)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, info in safetensors.deserialize(f.read_bytes()):
            if info["dtype"] == "F8_E4M3":
                data = torch.frombuffer(bytearray(info["data"]), dtype=torch.uint8)
                out[name.removesuffix(".weight")] = data.reshape(info["shape"])
    return out


# --- order and names ------------------------------------------------------------------------


def test_units_in_layer_order_then_forward_order(ckpts: dict[str, Path]) -> None:
    plan = plan_of(ckpts["eleven"], tp=2)
    want = [f"model.layers.{i}.{leaf}" for i in range(11) for leaf in FORWARD]
    assert [unit[0].name for unit in plan.units] == want
    for unit in plan.units:
        assert [ly.rank for ly in unit] == [0, 1] and {ly.name for ly in unit} == {unit[0].name}


def test_fuse_none_keeps_checkpoint_names_in_natural_order(ckpts: dict[str, Path]) -> None:
    plan = plan_of(ckpts["eleven"], fusion="none")
    want = [f"model.layers.{i}.{leaf}" for i in range(11) for leaf in sorted(LINEARS)]
    assert [unit[0].name for unit in plan.units] == want
    weights = _weights(ckpts["eleven"])
    for (ly,) in plan.units:
        n, k = weights[ly.name].shape
        assert ly.parallel == "none"
        (piece,) = ly.pieces
        assert (piece.module, piece.rows, piece.cols) == (ly.name, (0, n), (0, k))
    assert plan.target["fusion"] == "none"


# --- slices -----------------------------------------------------------------------------------


SLICED = [
    ("llama", 1),
    ("llama", 2),
    ("llama", 4),
    ("qwen2", 2),
    ("qwen2", 4),
    ("padded", 1),
    ("eleven", 1),
]


@pytest.mark.parametrize("name, tp", SLICED, ids=str)
def test_rank_slices_put_the_checkpoint_weights_back_together(ckpts, name: str, tp: int) -> None:
    """Column-parallel: each module's row slices over the ranks (a replicated K/V slice counted
    once) concatenate to its whole weight. Row-parallel: the column slices do."""
    plan = plan_of(ckpts[name], tp=tp)
    weights = _weights(ckpts[name])
    seen = set()
    for unit in plan.units:
        by_module: dict[str, list] = {}
        for ly in unit:
            for p in ly.pieces:
                by_module.setdefault(p.module, []).append(p)
        for module, pieces in by_module.items():
            seen.add(module)
            w = weights[module]
            if unit[0].parallel == "row":
                assert all(p.rows == (0, w.shape[0]) for p in pieces)
                got = torch.cat([w[:, p.cols[0] : p.cols[1]] for p in pieces], dim=1)
            else:
                assert all(p.cols == (0, w.shape[1]) for p in pieces)
                distinct = list(dict.fromkeys(p.rows for p in pieces))
                got = torch.cat([w[a:b] for a, b in distinct])
            assert torch.equal(got, w), module
    assert seen == set(weights)


def test_kv_rows_at_tp_4_over_2_kv_heads_by_hand(ckpts: dict[str, Path]) -> None:
    """SPEC §6 for 4 heads, 2 KV heads, d 64 at TP 4: one q head per rank; ranks 0-1 hold KV
    head 0 (rows 0..64), ranks 2-3 KV head 1; qkv N = 3 x 64 on every rank."""
    plan = plan_of(ckpts["llama"], tp=4)
    (qkv,) = [u for u in plan.units if u[0].name == "model.layers.1.self_attn.qkv_proj"]
    for r, ly in enumerate(qkv):
        kv = (0, 64) if r < 2 else (64, 128)
        assert [(p.module.rpartition(".")[2], p.rows) for p in ly.pieces] == [
            ("q_proj", (64 * r, 64 * r + 64)),
            ("k_proj", kv),
            ("v_proj", kv),
        ]
        assert (ly.n, ly.k, ly.np_, ly.kp) == (192, 256, 192, 256)


# --- dimensions and the manifest's layers ---------------------------------------------------------


def test_padded_dims_by_hand(ckpts: dict[str, Path]) -> None:
    """SPEC §3.3 worked out for the padded checkpoint: (N, K) -> (Np, Kp)."""
    plan = plan_of(ckpts["padded"])
    want = {
        "self_attn.qkv_proj": (160, 96, 192, 128),
        "self_attn.o_proj": (96, 96, 128, 128),
        "mlp.gate_up_proj": (320, 96, 320, 128),
        "mlp.down_proj": (96, 160, 128, 192),
    }
    for (ly,) in plan.units:
        assert (ly.n, ly.k, ly.np_, ly.kp) == want[ly.name.split(".", 3)[3]], ly.name
        assert ly.strategy == "channel" and not ly.requant


@pytest.mark.parametrize("profile", ["w8a16", "w8a8-marlin"])
def test_layers_manifest_of_tp_2(ckpts: dict[str, Path], profile: str) -> None:
    m = plan_of(ckpts["qwen2"], tp=2, profile=profile).layers_manifest()
    p = "model.layers.1"
    requant = profile == "w8a8-marlin"  # and the checkpoint is per-tensor
    assert m[f"{p}.self_attn.qkv_proj"] == {
        "index": 4,
        "n": 128,
        "k": 128,
        "np": 128,
        "kp": 128,
        "strategy": "tensor",
        "parallel": "column",
        "bias": True,
        "requantized": requant,
        "shards": [
            {"module": f"{p}.self_attn.q_proj", "rows": 64},
            {"module": f"{p}.self_attn.k_proj", "rows": 32},
            {"module": f"{p}.self_attn.v_proj", "rows": 32},
        ],
    }
    assert m[f"{p}.self_attn.o_proj"] == {
        "index": 5,
        "n": 128,
        "k": 64,
        "np": 128,
        "kp": 64,
        "strategy": "tensor",
        "parallel": "row",
        "bias": False,
        "requantized": requant,
        "shards": [{"module": f"{p}.self_attn.o_proj", "rows": 128}],
    }
    assert [ly["index"] for ly in m.values()] == list(range(8))


# --- file layouts against the files convert writes ---------------------------------------------


@pytest.mark.parametrize("name, tp, act", [("qwen2", 2, "float16"), ("padded", 1, "bfloat16")])
def test_file_layouts_are_the_files_convert_writes(ckpts, tmp_path, name, tp, act) -> None:
    plan = plan_of(ckpts[name], tp=tp, act=act)
    out = tmp_path / "sc"
    convert(ckpts[name], out, tp=tp, act_dtype=act, device="cpu")
    on_disk = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(plan.files) == on_disk
    assert on_disk == sorted([COMMON_NAME, *(rank_file_name(r, tp) for r in range(tp))])
    for fname, file_map in plan.files.items():
        got = read_file_map(out / fname)
        assert (got.header, got.entries, got.size) == (
            file_map.header,
            file_map.entries,
            file_map.size,
        )
    assert plan.total_bytes == sum((out / f).stat().st_size for f in on_disk)
    written = json.loads((out / MANIFEST_NAME).read_text())
    assert written["layers"] == plan.layers_manifest() and written["target"] == plan.target


def test_common_layout_is_the_passthrough_tensors(ckpts: dict[str, Path]) -> None:
    plan = plan_of(ckpts["qwen2"], tp=2)
    with safe_open(str(ckpts["qwen2"] / "model.safetensors"), framework="pt") as f:
        stock = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        linear = (".weight_scale", ".input_scale", "_proj.weight", "_proj.bias")
        want = {
            k: (s.get_dtype(), tuple(s.get_shape()))
            for k, s in stock.items()
            if not k.endswith(linear)
        }
    entries = plan.files[COMMON_NAME].entries
    assert {e.name: (e.dtype, e.shape) for e in entries} == want
    assert sorted(plan.passthrough) == sorted(want) and "lm_head.weight" in want
    bare = plan_of(ckpts["qwen2"], tp=2, passthrough=False)
    assert bare.passthrough == [] and COMMON_NAME not in bare.files
    assert sorted(bare.files) == [rank_file_name(0, 2), rank_file_name(1, 2)]


META = {
    "format": "mpack-sidecar",
    "format_version": "2",
    "tp_size": "4",
    "profile": "w8a16",
    "act_dtype": "float16",
}


def test_every_rank_file_lays_out_its_units_tensors(ckpts: dict[str, Path]) -> None:
    plan = plan_of(ckpts["llama"], tp=4, act="float16")
    for r in range(4):
        file_map = plan.files[rank_file_name(r, 4)]
        specs = [s for unit in plan.units for s in unit[r].tensor_specs("float16")]
        got = {(e.name, e.dtype, e.shape) for e in file_map.entries}
        assert got == {(s.name, s.dtype, s.shape) for s in specs}
        assert file_map.metadata == {**META, "rank": str(r)}


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, tp, problem",
    [
        ("llama", 3, "tp=3 does not divide num_attention_heads=4"),
        ("llama", 8, "tp=8 does not divide num_attention_heads=4"),
        ("padded", 3, "tp=3 does not divide intermediate_size=160"),
    ],
)
def test_a_tp_that_does_not_fit_names_config_json(ckpts, name: str, tp: int, problem: str) -> None:
    with pytest.raises(UnsupportedSchemeError) as e:
        plan_of(ckpts[name], tp=tp)
    assert str(e.value) == f"{ckpts[name] / 'config.json'}: {problem}"
    assert e.value.hint == "choose a tp that divides them"  # the API's words (Note [API wording])


def test_an_unknown_architecture_names_config_json(ckpts: dict[str, Path]) -> None:
    ck = opened(ckpts["llama"])
    ck.config["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedSchemeError, match="architecture 'GPT2LMHeadModel' has no") as e:
        make_plan(ck, profile="w8a16", act_dtype="bfloat16", tp=1, fusion="vllm")
    assert str(e.value).startswith(f"{ckpts['llama'] / 'config.json'}: ")
    assert "fuse='none' tp=1" in e.value.hint
    plan = make_plan(ck, profile="w8a16", act_dtype="bfloat16", tp=1, fusion="none")
    assert len(plan.units) == 14


def test_fuse_none_with_tp_2_is_a_usage_error(ckpts: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match=r"needs tp=1 \(got tp=2\)"):
        plan_of(ckpts["llama"], tp=2, fusion="none")


def test_a_k_slice_that_is_not_a_multiple_of_4(ckpts: dict[str, Path]) -> None:
    assert plan_of(ckpts["k-slice"], tp=1).units
    message = "model.layers.0.mlp.down_proj on rank 0: K slice 6 is not a multiple of 4"
    with pytest.raises(UnsupportedSchemeError, match=message):
        plan_of(ckpts["k-slice"], tp=2)


P = "model.layers.1"
#: an edit of a real, opened checkpoint -> what make_plan must say about it
BROKEN = {
    "missing-shard": (
        lambda ck: ck.layers.pop(f"{P}.self_attn.k_proj"),
        f"{P}.self_attn.qkv_proj needs {P}.self_attn.q_proj, {P}.self_attn.k_proj, "
        f"{P}.self_attn.v_proj; quantized FP8 {P}.self_attn.k_proj not found",
    ),
    "mixed-strategies": (
        lambda ck: setattr(ck.layers[f"{P}.mlp.up_proj"], "strategy", "channel"),
        f"{P}.mlp.gate_up_proj: fused shards mix strategies ['channel', 'tensor']",
    ),
    "bias-on-one-shard": (
        lambda ck: setattr(ck.layers[f"{P}.self_attn.q_proj"], "has_bias", True),
        f"{P}.self_attn.qkv_proj: some fused shards have a bias and some do not",
    ),
    "config-disagrees": (
        lambda ck: ck.config.update(intermediate_size=256),
        "model.safetensors: model.layers.0.mlp.gate_proj.weight has N=512 rows, config.json "
        "implies 256",
    ),
    "config-lacks-heads": (
        lambda ck: ck.config.pop("num_attention_heads"),
        "config.json: missing or bad model dimension 'num_attention_heads'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_shapes_and_shards_that_do_not_fit_the_rules(ckpts, case: str) -> None:
    edit, message = BROKEN[case]
    ck = opened(ckpts["llama"])
    edit(ck)
    with pytest.raises(UnsupportedSchemeError) as e:
        make_plan(ck, profile="w8a16", act_dtype="bfloat16", tp=1, fusion="vllm")
    assert message in str(e.value) and str(e.value).startswith(str(ckpts["llama"]))
