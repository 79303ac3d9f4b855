"""mpack/arch.py: vLLM's fusion and TP rules (SPEC §6), checked against cases derived by hand
and against the golden checkpoints' real configs and weight shapes.

The hand cases are the SPEC's formulas worked out for the golden model's dimensions (4 heads,
2 KV heads, head_dim 64, intermediate 512): which rows of q, k, v, gate and up each rank holds
at TP 1, 2 and 4. The coverage tests then check, over many model shapes, that the ranks' rows
cover every row exactly once (q, gate, up) or, for k and v, that the ``distinct_ranks`` partition
them and every other rank holds a copy of its group's rows.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from safetensors import safe_open

from mpack import arch
from mpack.arch import Dims
from mpack.errors import UsageError

GOLDEN_DIMS = Dims(heads=4, kv_heads=2, head_dim=64, intermediate=512)
QKV = "model.layers.0.self_attn.qkv_proj"
GATE_UP = "model.layers.0.mlp.gate_up_proj"

# (tp, rank) -> rows of (q, k, v), worked out from SPEC §6 for GOLDEN_DIMS:
# TP 1: everything. TP 2: 2 q heads and 1 KV head per rank. TP 4: 1 q head per rank; 4 ranks on
# 2 KV heads, so ranks 0 and 1 share KV head 0 (rows 0..64) and ranks 2 and 3 share KV head 1.
QKV_ROWS = {
    (1, 0): [(0, 256), (0, 128), (0, 128)],
    (2, 0): [(0, 128), (0, 64), (0, 64)],
    (2, 1): [(128, 256), (64, 128), (64, 128)],
    (4, 0): [(0, 64), (0, 64), (0, 64)],
    (4, 1): [(64, 128), (0, 64), (0, 64)],
    (4, 2): [(128, 192), (64, 128), (64, 128)],
    (4, 3): [(192, 256), (64, 128), (64, 128)],
}


@pytest.mark.parametrize("tp, rank", sorted(QKV_ROWS))
def test_qkv_rows_of_the_golden_model_by_hand(tp: int, rank: int) -> None:
    assert arch.shard_rows(GOLDEN_DIMS, QKV, tp, rank) == QKV_ROWS[tp, rank]
    per = 512 // tp
    assert arch.shard_rows(GOLDEN_DIMS, GATE_UP, tp, rank) == [(rank * per, (rank + 1) * per)] * 2


def test_kv_split_and_distinct_ranks_of_the_golden_model() -> None:
    # (KV heads per rank, ranks sharing one KV group)
    assert [arch.kv_split(GOLDEN_DIMS, tp) for tp in (1, 2, 4)] == [(2, 1), (1, 1), (1, 2)]
    assert arch.distinct_ranks("k_proj", GOLDEN_DIMS, 4) == [0, 2]
    assert arch.distinct_ranks("v_proj", GOLDEN_DIMS, 4) == [0, 2]
    assert arch.distinct_ranks("q_proj", GOLDEN_DIMS, 4) == [0, 1, 2, 3]
    assert arch.distinct_ranks("k_proj", GOLDEN_DIMS, 2) == [0, 1]
    assert arch.distinct_ranks("gate_proj", GOLDEN_DIMS, 2) == [0, 1]
    # 8 heads over 4 KV heads at TP 8: pairs of ranks share a KV head
    assert arch.kv_split(Dims(8, 4, 32, 512), 8) == (1, 2)
    assert arch.distinct_ranks("v_proj", Dims(8, 4, 32, 512), 8) == [0, 2, 4, 6]


def test_row_parallel_linears_have_no_row_slices() -> None:
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        assert arch.shard_rows(GOLDEN_DIMS, name, 2, 1) is None
        assert arch.parallel_style(name) == "row"
    assert arch.parallel_style(QKV) == arch.parallel_style(GATE_UP) == "column"


@pytest.mark.parametrize(
    "dims, tp, problem",
    [
        (GOLDEN_DIMS, 1, None),
        (GOLDEN_DIMS, 2, None),
        (GOLDEN_DIMS, 4, None),
        (GOLDEN_DIMS, 3, "tp=3 does not divide num_attention_heads=4"),
        (GOLDEN_DIMS, 8, "tp=8 does not divide num_attention_heads=4"),
        (Dims(4, 2, 64, 510), 4, "tp=4 does not divide intermediate_size=510"),
        (Dims(6, 3, 32, 512), 2, "tp=2 does not fit num_key_value_heads=3"),  # T <= Hkv
        (Dims(6, 3, 32, 516), 3, None),
        (Dims(6, 3, 32, 516), 6, None),  # T > Hkv and T % Hkv == 0: replicated
        (Dims(12, 4, 32, 512), 2, None),
        (Dims(12, 4, 32, 516), 6, "tp=6 does not fit num_key_value_heads=4"),  # T > Hkv
        (Dims(8, 4, 32, 512), 8, None),
        (Dims(9, 3, 64, 1536), 3, None),  # SmolLM2-135M
        (Dims(9, 3, 64, 1536), 9, "tp=9 does not divide intermediate_size=1536"),
    ],
)
def test_tp_problem_follows_spec_1(dims: Dims, tp: int, problem: str | None) -> None:
    """SPEC §1: H % T == 0, I % T == 0, and Hkv % T == 0 when T <= Hkv, else T % Hkv == 0."""
    got = arch.tp_problem(dims, tp)
    if problem is None:
        assert got is None
    else:
        assert got is not None and got.startswith(problem), got


def _fitting() -> list[tuple[Dims, int]]:
    """Every (dims, tp) that fits, over a grid of head counts and TP sizes."""
    grid = itertools.product((1, 2, 3, 4, 6, 8, 12, 16), (1, 2, 3, 4, 8), range(1, 17))
    dims = [(Dims(heads, kv, 16, 96), tp) for heads, kv, tp in grid if heads % kv == 0]
    return [(d, tp) for d, tp in dims if arch.tp_problem(d, tp) is None]


FITTING = _fitting()


def test_the_grid_has_replicated_and_split_kv_cases() -> None:
    assert any(tp > d.kv_heads for d, tp in FITTING)
    assert any(1 < tp < d.kv_heads for d, tp in FITTING)
    assert len(FITTING) > 40


def _rows(dims: Dims, name: str, tp: int) -> list[list[tuple[int, int]]]:
    return [arch.shard_rows(dims, name, tp, r) for r in range(tp)]


@pytest.mark.parametrize("dims, tp", FITTING, ids=lambda v: str(v))
def test_ranks_cover_q_gate_and_up_rows_once(dims: Dims, tp: int) -> None:
    d = dims.head_dim
    for name, shard, total in (
        (QKV, 0, dims.heads * d),
        (GATE_UP, 0, dims.intermediate),
        (GATE_UP, 1, dims.intermediate),
    ):
        rows = [r[shard] for r in _rows(dims, name, tp)]
        assert rows[0][0] == 0 and rows[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows)), rows
        assert all(hi - lo == total // tp for lo, hi in rows)


@pytest.mark.parametrize("dims, tp", FITTING, ids=lambda v: str(v))
def test_distinct_ranks_partition_k_and_v_and_the_rest_replicate(dims: Dims, tp: int) -> None:
    total = dims.kv_heads * dims.head_dim
    rows = _rows(dims, QKV, tp)
    for shard, which in ((1, "k_proj"), (2, "v_proj")):
        distinct = arch.distinct_ranks(which, dims, tp)
        parts = [rows[r][shard] for r in distinct]
        assert parts[0][0] == 0 and parts[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts)), parts
        for r in range(tp):  # every rank holds one of those parts, whole
            owner = max(x for x in distinct if x <= r)
            assert rows[r][shard] == rows[owner][shard]
        assert len(distinct) == min(tp, dims.kv_heads)
    assert all(rows[r][1] == rows[r][2] for r in range(tp))  # k and v alike


# --- names and order ------------------------------------------------------------------------


LLAMA = arch.FAMILIES["llama"]


def test_fused_name_and_shard_modules_agree() -> None:
    p = "model.layers.7"
    assert arch.fused_name(f"{p}.self_attn.k_proj") == f"{p}.self_attn.qkv_proj"
    assert arch.fused_name(f"{p}.mlp.up_proj") == f"{p}.mlp.gate_up_proj"
    assert arch.fused_name(f"{p}.self_attn.o_proj") == f"{p}.self_attn.o_proj"
    # a module stored fused is its own linear (the planner then asks the family for its parts)
    assert arch.fused_name(f"{p}.self_attn.qkv_proj") == f"{p}.self_attn.qkv_proj"
    for other in ("lm_head", "model.embed_tokens", f"{p}.mlp.experts.0.w1"):
        assert arch.fused_name(other) is None, other
    assert arch.shard_modules(f"{p}.self_attn.qkv_proj", LLAMA) == [
        f"{p}.self_attn.q_proj",
        f"{p}.self_attn.k_proj",
        f"{p}.self_attn.v_proj",
    ]
    gate_up = f"{p}.mlp.gate_up_proj"
    assert arch.shard_modules(gate_up, LLAMA) == [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
    assert arch.shard_modules(f"{p}.mlp.down_proj", LLAMA) == [f"{p}.mlp.down_proj"]
    for name in (f"{p}.self_attn.qkv_proj", gate_up, f"{p}.self_attn.o_proj"):
        assert {arch.fused_name(m) for m in arch.shard_modules(name, LLAMA)} == {name}
        assert arch.part_modules(name, LLAMA) == arch.shard_modules(name, LLAMA)


def test_every_architecture_has_one_family() -> None:
    assert len(arch.ARCHITECTURES) == len(set(arch.ARCHITECTURES))
    for a in arch.ARCHITECTURES:
        fam = arch.family_of(a)
        assert fam is not None and a in fam.architectures
    for new in ("Gemma2ForCausalLM", "GraniteForCausalLM"):
        assert arch.family_of(new) is LLAMA
    for moe in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):  # their own families: experts
        fam = arch.family_of(moe)
        assert fam is not None and fam is not LLAMA and fam.experts is not None
    assert arch.family_of("DeepseekV3ForCausalLM") is None
    assert arch.family_of(None) is None


def test_parts_of_a_split_family_start_at_row_0_of_their_modules() -> None:
    assert arch.part_offsets(LLAMA, GOLDEN_DIMS, QKV) == [0, 0, 0]
    assert arch.part_offsets(LLAMA, GOLDEN_DIMS, GATE_UP) == [0, 0]


def test_expected_rows_of_a_fused_linear_are_its_parts_together() -> None:
    rows = arch.expected_rows(GOLDEN_DIMS)
    assert rows["qkv_proj"] == 256 + 128 + 128
    assert rows["gate_up_proj"] == 2 * 512


def test_layer_order_is_by_layer_then_forward_pass() -> None:
    forward = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    want = [f"model.layers.{i}.{leaf}" for i in range(12) for leaf in forward]
    shuffled = want[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(shuffled, key=arch.layer_order) == want
    assert sorted(want) != want  # string order would put layers.10 before layers.2


def test_natural_key_orders_numbers_by_value() -> None:
    names = [
        "model.layers.10.mlp.up_proj",
        "model.layers.9.mlp.up_proj",
        "model.layers.1.mlp.up_proj",
        "lm_head",
    ]
    assert sorted(names, key=arch.natural_key) == [names[3], names[2], names[1], names[0]]


# --- dimensions from real configs -------------------------------------------------------------


def _golden_input(golden: Path) -> Path:
    return golden / "cases" / "tiny-llama-tensor-w8a16-bf16-tp1" / "input"


def test_dims_of_the_golden_config_and_its_weight_shapes(golden: Path) -> None:
    ck = _golden_input(golden)
    cfg = json.loads((ck / "config.json").read_text())
    dims = arch.dims_of(cfg["architectures"][0], cfg)
    assert dims == GOLDEN_DIMS
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        shape = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 - not a dict
    for i in range(cfg["num_hidden_layers"]):
        for sub, n in arch.expected_rows(dims).items():
            if sub in arch.FUSED:  # stored in parts in this checkpoint
                continue
            where = "self_attn" if sub in ("q_proj", "k_proj", "v_proj") else "mlp"
            assert shape[f"model.layers.{i}.{where}.{sub}.weight"][0] == n, sub
        for sub, k in arch.expected_cols(dims).items():
            where = "self_attn" if sub == "o_proj" else "mlp"
            assert shape[f"model.layers.{i}.{where}.{sub}.weight"][1] == k, sub


def test_dims_of_head_dim_rules() -> None:
    cfg = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "head_dim": 32,
    }
    assert arch.dims_of("Qwen3ForCausalLM", cfg).head_dim == 32
    assert arch.dims_of("LlamaForCausalLM", cfg).head_dim == 32
    assert arch.dims_of("Qwen2ForCausalLM", cfg).head_dim == 64  # vLLM's Qwen2 ignores head_dim
    assert arch.dims_of(None, {**cfg, "head_dim": None}).head_dim == 64
    no_kv = {k: v for k, v in cfg.items() if k != "num_key_value_heads"}
    assert arch.dims_of("LlamaForCausalLM", no_kv).kv_heads == 4  # MHA: KV heads = heads
    assert arch.dims_of("LlamaForCausalLM", {**cfg, "num_key_value_heads": None}).kv_heads == 4


@pytest.mark.parametrize(
    "edit, error",
    [
        ({"intermediate_size": None}, TypeError),
        ({"hidden_size": "wide"}, ValueError),
        ({"num_attention_heads": [4]}, TypeError),
    ],
)
def test_dims_of_refuses_missing_and_non_numeric_dims(edit: dict, error: type) -> None:
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512, **edit}
    with pytest.raises(error):
        arch.dims_of("LlamaForCausalLM", cfg)
    with pytest.raises(KeyError):
        arch.dims_of("LlamaForCausalLM", {"hidden_size": 256, "num_attention_heads": 4})


def test_moe_layers_and_their_mlp_linears_follow_vllms_rule() -> None:
    """qwen2_moe.py / qwen3_moe.py: a layer has a MoE block unless ``mlp_only_layers`` names it
    or it is not a ``decoder_sparse_step``-th; a MoE block's dense linears are its shared
    expert's (Qwen2-MoE, when its size is not 0), and a dense layer's Llama's MLP."""
    from mpack.arch import FAMILIES, linear_dims, mlp_linears

    qwen2 = FAMILIES["qwen2_moe"]
    cfg = {"mlp_only_layers": [0], "decoder_sparse_step": 2, "shared_expert_intermediate_size": 96}
    assert [qwen2.experts.is_moe_layer(cfg, i) for i in range(5)] == [
        False, True, False, True, False,
    ]  # fmt: skip
    assert mlp_linears(qwen2, cfg, 0) == ["mlp.gate_up_proj", "mlp.down_proj"]
    assert mlp_linears(qwen2, cfg, 1) == [
        "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj",
    ]  # fmt: skip
    assert mlp_linears(qwen2, {**cfg, "shared_expert_intermediate_size": 0}, 1) == []
    assert mlp_linears(FAMILIES["mixtral"], {}, 7) == []  # every Mixtral layer is MoE
    assert mlp_linears(FAMILIES["llama"], cfg, 1) == ["mlp.gate_up_proj", "mlp.down_proj"]
    sizes = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    dims = arch.dims_of("Qwen2MoeForCausalLM", {**sizes, "intermediate_size": 512, **cfg})
    assert dims.mlps == (("shared_expert", 96),)
    shared = linear_dims(dims, "model.layers.1.mlp.shared_expert.gate_up_proj")
    assert shared.intermediate == 96 and linear_dims(dims, "model.layers.0.mlp.down_proj") == dims
    assert arch.tp_problem(dims, 4) is None
    odd = arch.dims_of(
        "Qwen2MoeForCausalLM",
        {**sizes, "intermediate_size": 512, "shared_expert_intermediate_size": 90},
    )
    assert (
        arch.tp_problem(odd, 4) == "tp=4 does not divide the shared_expert's intermediate size 90"
    )


def test_llama4_q_and_k_pieces_take_rows_in_vllms_rotary_order() -> None:
    """Llama4ForCausalLM.permute_qk_weight_for_rotary views each head's rows as [d/2, 2] and
    transposes them: the planner's pieces of q_proj and k_proj name the same rows, per rank;
    v_proj's and every other family's rows stay in order."""
    import torch

    from mpack.convert.plan import Piece

    fam, dims = arch.FAMILIES["llama4"], Dims(heads=4, kv_heads=2, head_dim=8, intermediate=64)
    assert [arch.rotary_head(fam, dims, p) for p in ("q_proj", "k_proj", "v_proj")] == [8, 8, 0]
    assert arch.rotary_head(arch.FAMILIES["llama"], dims, "q_proj") == 0
    rows = torch.arange(32)  # q_proj's rows, 4 heads of 8
    vllm = rows.view(4, 4, 2, 1).transpose(1, 2).reshape(32)  # vLLM's view(n, d/2, 2, K)
    for r0, r1 in ((0, 32), (8, 24)):  # all 4 heads (TP 1); heads 1 and 2 (a rank's)
        p = Piece("q_proj", (r0, r1), (0, 16), head=8)
        assert p.take == vllm[r0:r1].tolist()
    assert Piece("v_proj", (8, 16), (0, 16)).take == slice(8, 16)


# --- pipeline stages (vLLM's get_pp_indices; compared with vLLM itself in
# tests/vllm/test_vllm_pipeline.py) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "size", "spec", "want"),
    [
        (32, 1, None, [32]),
        (32, 2, None, [16, 16]),
        (3, 2, None, [2, 1]),  # the remainder goes to the stages before the last
        (32, 3, None, [11, 11, 10]),
        (10, 4, None, [2, 3, 3, 2]),  # from the second-to-last backwards
        (2, 3, None, [1, 1, 0]),
        (32, 2, "17,15", [17, 15]),
        (3, 2, "0,3", [0, 3]),
    ],
)
def test_pp_partition(layers: int, size: int, spec: str | None, want: list[int]) -> None:
    assert arch.pp_partition(layers, size, spec) == want
    spans = [arch.pp_layers(layers, r, size, spec) for r in range(size)]
    assert [i for s in spans for i in s] == list(range(layers))  # each layer once, in order
    assert [len(s) for s in spans] == want


@pytest.mark.parametrize("spec", ["16,15", "8,8,16", "a,b", ""])
def test_pp_partition_refuses_a_spec_that_does_not_fit(spec: str) -> None:
    with pytest.raises(UsageError, match=arch.PP_PARTITION_ENV) as e:
        arch.pp_partition(32, 2, spec)
    assert "16,16" in (e.value.hint or "")


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (-1, 2), (0, 0)])
def test_pp_layers_refuses_a_stage_out_of_range(rank: int, size: int) -> None:
    with pytest.raises(UsageError, match="stage"):
        arch.pp_layers(4, rank, size)


def test_stage_layers_keeps_the_stages_decoder_layers() -> None:
    names = [f"model.layers.{i}.{leaf}" for i in range(4) for leaf in ("a", "b")]
    layers = {n: i for i, n in enumerate(names)} | {"visual.merger.x": -1}
    got = arch.stage_layers(layers, range(1, 3))
    assert sorted(got) == sorted([*names[2:6], "visual.merger.x"])
    wrapped = {"language_model.model.layers.3.a": 0, "language_model.model.layers.0.a": 1}
    assert list(arch.stage_layers(wrapped, range(3, 4), "language_model.model.layers")) == [
        "language_model.model.layers.3.a"
    ]


def test_stage_of_a_split() -> None:
    s = arch.Stage.of(5, 1, 2)
    assert (s.rank, s.split, s.layers, s.first, s.last, s.whole) == (
        1,
        (3, 2),
        range(3, 5),
        False,
        True,
        False,
    )
    assert str(s) == "stage 1 of 2 (layers 3..4; split [3, 2])"
    assert arch.Stage.of(5, 0, 2, "1,4").layers == range(0, 1)
    assert arch.Stage.of(5, 0, 1).whole
    with pytest.raises(UsageError, match="out of range"):
        arch.Stage.of(5, 2, 2)
    # vLLM reads an empty VLLM_PP_LAYER_PARTITION as unset
    assert arch.pp_partition_spec({arch.PP_PARTITION_ENV: ""}) is None
    assert arch.pp_partition_spec({arch.PP_PARTITION_ENV: "1,4"}) == "1,4"
    assert arch.pp_partition_spec({}) is None


@pytest.mark.parametrize("tied", [False, True, None])
def test_stage_holds_what_vllms_llama_builds_on_each_stage(tied: bool | None) -> None:
    """llama.py: the embeddings on the first stage (and the last when tied), the final norm and
    lm_head on the last; a decoder layer's tensors on its stage; ``tied`` unknown: as tied."""
    lay = arch.layout_of("LlamaForCausalLM")
    first, middle, last = (arch.Stage(r, (2, 2, 1)) for r in range(3))
    holds = {
        name: [arch.stage_holds(name, lay, s, tied) for s in (first, middle, last)]
        for name in (
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.2.input_layernorm.weight",
            "model.layers.4.self_attn.qkv_proj.weight",
        )
    }
    assert holds == {
        "model.embed_tokens.weight": [True, False, tied is not False],
        "model.norm.weight": [False, False, True],
        "lm_head.weight": [False, False, True],
        "model.layers.2.input_layernorm.weight": [False, True, False],
        "model.layers.4.self_attn.qkv_proj.weight": [False, False, True],
    }
    whole = arch.Stage(0, (5,))
    assert all(arch.stage_holds(n, lay, whole, tied) for n in holds)


def test_stage_holds_the_ends_on_every_stage_where_vllm_builds_them_there() -> None:
    """gemma2.py, mixtral.py, ...: ``embed_tokens``, ``norm`` and ``lm_head`` on every stage; a
    wrapper's vision tower on every stage, its language model's ends by its text model."""
    gemma = arch.layout_of("Gemma2ForCausalLM")
    middle = arch.Stage(1, (2, 2, 1))
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert arch.stage_holds(name, gemma, middle, True)
    assert not arch.stage_holds("model.layers.0.input_layernorm.weight", gemma, middle, True)
    llava = arch.layout_of("LlavaForConditionalGeneration", "LlamaForCausalLM")
    assert arch.stage_holds("vision_tower.encoder.weight", llava, middle, False)
    assert not arch.stage_holds("language_model.model.embed_tokens.weight", llava, middle, False)
    assert arch.stage_holds("language_model.model.layers.2.mlp.x", llava, middle, False)
