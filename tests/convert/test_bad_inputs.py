"""`mpack convert` on bad input (SPEC §1): exit 2, one message naming file/layer/value, no output.

Also the inputs that look odd but must convert: config fallbacks (text_config,
compression_config), older and newer compressed-tensors serialisations, ``torch_dtype``, and
the edge values that are still allowed.

Every case is a real checkpoint from ``make_checkpoint``, copied and mutated on disk, and a real
``python -m mpack.cli convert`` subprocess. The runs of all selected cases start together (see
``runs``) so their ~3 s of imports overlap.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from mpack.fixtures import make_autofp8_checkpoint, make_checkpoint  # noqa: E402
from tests.convert.helpers import (  # noqa: E402
    INDEX,
    SINGLE,
    CliPool,
    assert_refused,
    edit_config,
    explain,
    manifest,
    read_tensor,
    rewrite_shard,
    selected_params,
    set_tensors,
    shard_of,
    snapshot,
    tmp_dirs,
    weight_args,
)

#: base checkpoints, generated once per module
BASES: dict[str, dict[str, Any]] = {
    "llama": {},  # FP8: per-tensor weight scales [1] in bf16, static input scales
    "sharded": {"max_shard_size": "300KB"},  # several shards and an index
    "heads8": {"heads": 8, "kv_heads": 4},  # head_dim 32
    "heads6": {"hidden": 192, "heads": 6, "kv_heads": 3},  # head_dim 32
    "fp16": {"dtype": "float16"},
    "k258": {"hidden": 258, "heads": 1, "kv_heads": 1},  # K = 258, not a multiple of 4
    # AutoFP8 (quant_method fp8): float32 scalar weight scales, static input scales / none
    "autofp8s": {"autofp8": "static"},
    "autofp8d": {"autofp8": "dynamic"},
    # Phi-3: qkv_proj and gate_up_proj stored fused (q 256 + k 64 + v 64 rows: 1 KV head)
    "phi3": {"arch": "phi3", "kv_heads": 1},
}
L = "model.layers.1.mlp.up_proj"  # the layer most cases break
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
#: how a message names a quantized layer's weight when any layer may be the first one hit
ANY_WEIGHT = "model.layers."


@dataclass(frozen=True)
class Case:
    """One conversion: a base checkpoint, what to break, the options, and what must be said."""

    id: str
    base: str = "llama"
    prepare: Callable[[Path], dict[str, Any] | None] | None = None  # may return {"src": ...}
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()  # stderr substrings; "{ck}" = the checkpoint dir
    check: Callable[[Path], None] | None = None  # exit-0 cases: look at the sidecar
    out_inside: bool = False  # OUT goes inside the checkpoint

    def __str__(self) -> str:
        return self.id


@dataclass
class Run:
    """A started conversion: its checkpoint copy, its OUT, and its pending CompletedProcess."""

    ck: Path
    out: Path
    future: Any
    extra: dict[str, Any] = field(default_factory=dict)

    def result(self) -> Any:
        return self.future.result()


# --- mutations ------------------------------------------------------------------------------


def strategy(name: str, **extra: Any) -> Callable[[Path], None]:
    """Declare weight strategy ``name`` in config.json (the stored scales stay per-tensor)."""
    return weight_arg(strategy=name, **extra)


def weight_arg(**values: Any) -> Callable[[Path], None]:
    """Set keys of the config group's ``weights`` args."""

    def prep(ck: Path) -> None:
        edit_config(ck, lambda cfg: weight_args(cfg).update(values))

    return prep


def quant_config(**values: Any) -> Callable[[Path], None]:
    """Set top-level keys of config.json's quantization_config."""

    def prep(ck: Path) -> None:
        edit_config(ck, lambda cfg: cfg["quantization_config"].update(values))

    return prep


def scale_value(value: float, dtype: Any = None) -> Callable[[Path], None]:
    """Set layer L's per-tensor weight scale to ``value`` (in ``dtype``, default: as stored)."""

    def prep(ck: Path) -> None:
        old = read_tensor(ck, f"{L}.weight_scale")
        new = torch.full(old.shape, value, dtype=dtype or old.dtype)
        assert float(new.reshape(-1)[0]) == value or value != value  # exactly representable
        set_tensors(ck, {f"{L}.weight_scale": new})

    return prep


def int8_weight(ck: Path) -> None:
    """Store layer L's weight as int8 (same bytes), every other tensor unchanged."""
    w = read_tensor(ck, f"{L}.weight")
    set_tensors(ck, {f"{L}.weight": w.view(torch.int8).clone()})


def packed_int4_weight(ck: Path) -> None:
    """Replace layer L's weight by an int32 ``weight_packed`` (as int4 checkpoints store it)."""
    w = read_tensor(ck, f"{L}.weight")
    n, k = w.shape
    packed = torch.zeros(n, k // 8, dtype=torch.int32)
    set_tensors(ck, {f"{L}.weight_packed": packed}, drop=[f"{L}.weight"])


def drop_scale(ck: Path) -> None:
    """Delete layer L's weight_scale from its shard and from the index."""
    assert (ck / INDEX).is_file()
    set_tensors(ck, {}, drop=[f"{L}.weight_scale"])
    assert f"{L}.weight_scale" not in json.loads((ck / INDEX).read_text())["weight_map"]


def drop_scale_keep_index(ck: Path) -> dict[str, Any]:
    """Delete layer L's weight_scale from its shard only: the index still points there."""
    shard = shard_of(ck, f"{L}.weight_scale")
    rewrite_shard(ck, shard, lambda d: d.pop(f"{L}.weight_scale"))
    return {"shard": shard}


def quantized_lm_head(ck: Path) -> None:
    """Replace the bf16 lm_head by an FP8 one (per-tensor scale) and un-ignore it."""
    w = read_tensor(ck, "lm_head.weight").float()
    scale = (w.abs().amax() / 448.0).reshape(1).to(torch.bfloat16)
    q = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    set_tensors(ck, {"lm_head.weight": q, "lm_head.weight_scale": scale})
    quant_config(ignore=[])(ck)


def per_channel_scale(ck: Path) -> None:
    """Give layer L one weight scale per output channel, ``[N]`` float32."""
    n = read_tensor(ck, f"{L}.weight").shape[0]
    set_tensors(ck, {f"{L}.weight_scale": torch.full((n,), 0.01, dtype=torch.float32)})


def extra_input_scale(ck: Path) -> None:
    """Add an input scale to layer L of a checkpoint without them."""
    set_tensors(
        ck,
        {
            f"{L}.input_scale": torch.tensor(0.5),
            f"{L}.weight_scale": read_tensor(ck, f"{L}.weight_scale"),
        },
    )


def drop_tensor(name: str) -> Callable[[Path], None]:
    def prep(ck: Path) -> None:
        set_tensors(ck, {}, drop=[name])

    return prep


def not_fp8_serialized(ck: Path) -> None:
    """Every FP8 weight as bfloat16 (its dequantized values), every scale gone: what a 16-bit
    checkpoint labelled ``quant_method: fp8`` holds."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = ck / SINGLE
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    out = {}
    for k, t in tensors.items():
        if k.endswith((".weight_scale", ".input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = (t.float() * tensors[k[: -len("weight")] + "weight_scale"]).bfloat16()
        out[k] = t
    save_file(out, str(path), metadata={"format": "pt"})


def architecture(name: str) -> Callable[[Path], None]:
    """Set config.json's ``architectures`` to ``[name]``."""

    def prep(ck: Path) -> None:
        edit_config(ck, lambda cfg: cfg.update(architectures=[name]))

    return prep


def truncate(nbytes: int) -> Callable[[Path], dict[str, Any]]:
    """Cut the last ``nbytes`` of model.safetensors; report the new size as ``{size}``."""

    def prep(ck: Path) -> dict[str, Any]:
        p = ck / SINGLE
        size = p.stat().st_size - nbytes
        with open(p, "r+b") as f:
            f.truncate(size)
        return {"size": size}

    return prep


def overwrite(offset: int, data: bytes) -> Callable[[Path], None]:
    """Overwrite model.safetensors at ``offset`` with ``data`` (8 bytes: header length)."""

    def prep(ck: Path) -> None:
        with open(ck / SINGLE, "r+b") as f:
            f.seek(offset)
            f.write(data)

    return prep


def other_source(fn: Callable[[Path], Path]) -> Callable[[Path], dict[str, Any]]:
    """Convert ``fn(ck)`` instead of the checkpoint directory."""
    return lambda ck: {"src": fn(ck)}


def config_text(text: str) -> Callable[[Path], None]:
    """Replace config.json by ``text``."""
    return lambda ck: (ck / "config.json").write_text(text)


def set_config(**values: Any) -> Callable[[Path], None]:
    """Set top-level ``values`` in config.json."""

    def prep(ck: Path) -> None:
        edit_config(ck, lambda cfg: cfg.update(values))

    return prep


def pop_config(*keys: str) -> Callable[[Path], None]:
    """Remove top-level ``keys`` from config.json."""

    def prep(ck: Path) -> None:
        def fn(cfg: dict[str, Any]) -> None:
            for k in keys:
                cfg.pop(k)

        edit_config(ck, fn)

    return prep


def qc_under_text_config(ck: Path) -> None:
    """A multimodal-style config: the text model's settings and quantization_config nested."""

    def fn(cfg: dict[str, Any]) -> None:
        text = {k: cfg.pop(k) for k in list(cfg) if k not in ("architectures", "model_type")}
        cfg["text_config"] = text
        assert "quantization_config" not in cfg and "dtype" not in cfg

    edit_config(ck, fn)


def qc_under_compression_config(wrapped: bool) -> Callable[[Path], None]:
    """Move quantization_config to ``compression_config`` (old wrapper form, or as it is)."""

    def prep(ck: Path) -> None:
        def fn(cfg: dict[str, Any]) -> None:
            qc = cfg.pop("quantization_config")
            cfg["compression_config"] = {"quantization_config": qc} if wrapped else qc

        edit_config(ck, fn)

    return prep


V019_DEFAULTS = {
    "observer": "minmax",
    "observer_kwargs": {},
    "scale_dtype": None,
    "zp_dtype": None,
    "actorder": None,
    "block_structure": None,
}


def torch_dtype_key(ck: Path) -> None:
    """Rename config.json's ``dtype`` to the older ``torch_dtype``."""
    edit_config(ck, lambda cfg: cfg.update(torch_dtype=cfg.pop("dtype")))


# --- checks of the sidecars that must be written ---------------------------------------------


def expect_target(**values: Any) -> Callable[[Path], None]:
    """The manifest's target has ``values``; with vLLM fusion, the 8 per-tensor layers."""

    def check(out: Path) -> None:
        m = manifest(out)
        for k, v in values.items():
            assert m["target"][k] == v, (k, m["target"])
        if m["target"]["fusion"] == "vllm":  # 2 layers x (qkv, o, gate_up, down), per-tensor
            assert len(m["layers"]) == 8
            assert {ly["strategy"] for ly in m["layers"].values()} == {"tensor"}

    return check


def expect_largest_scale(act_dtype: str, scale: float, fold: float) -> Callable[[Path], None]:
    """Layer L's scale reached the sidecar as ``scale * fold`` (SPEC §7), finite in act_dtype."""

    def check(out: Path) -> None:
        from safetensors import safe_open

        expect_target(act_dtype=act_dtype)(out)
        with safe_open(str(out / "rank-00-of-01.safetensors"), framework="pt") as f:
            s = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight_scale")
        assert s.dtype == getattr(torch, act_dtype) and bool(torch.isfinite(s).all())
        assert float(s.float().max()) == scale * fold

    return check


def expect_checkpoint_names(*extra: str) -> Callable[[Path], None]:
    """``--fuse none``: one layer per checkpoint module (plus ``extra``), one rank file."""

    def check(out: Path) -> None:
        m = manifest(out)
        assert m["target"]["fusion"] == "none" and m["target"]["tp_size"] == 1
        want = {f"model.layers.{i}.{s}" for i in range(2) for s in LINEARS} | set(extra)
        assert set(m["layers"]) == want
        assert [f["name"] for f in m["files"] if f["name"].startswith("rank-")] == [
            "rank-00-of-01.safetensors"
        ]

    return check


def expect_ranks(tp: int) -> Callable[[Path], None]:
    """``tp`` rank files, and qkv_proj sliced for 8 heads over 4 KV heads (head_dim 32)."""

    def check(out: Path) -> None:
        m = manifest(out)
        assert m["target"]["tp_size"] == tp
        ranks = sorted(p.name for p in out.glob("rank-*.safetensors"))
        assert ranks == [f"rank-{r:02d}-of-{tp:02d}.safetensors" for r in range(tp)]
        # 8 heads / 8 ranks, 4 KV heads replicated in pairs: 1 q, 1 k and 1 v head of d=32 each
        assert m["layers"]["model.layers.0.self_attn.qkv_proj"]["n"] == 3 * 32

    return check


# --- the cases ------------------------------------------------------------------------------

REFUSED = [
    # weight schemes vLLM's FP8 Marlin path does not take
    Case(
        "strategy-block",
        prepare=strategy("block", block_structure=[128, 128]),
        expect=(
            "{ck}/model.safetensors: " + ANY_WEIGHT,
            "weight strategy 'block'",
            "mpack packs tensor- and channel-scaled FP8 only; vLLM loads a block FP8 "
            "checkpoint itself",
        ),
    ),
    Case(
        "strategy-group",
        prepare=strategy("group", group_size=128),
        expect=("{ck}/model.safetensors: " + ANY_WEIGHT, "weight strategy 'group'"),
    ),
    Case(
        "int8-weight",
        prepare=int8_weight,
        expect=(f"{{ck}}/model.safetensors: {L}.weight", "weight dtype I8, expected F8_E4M3"),
    ),
    Case(
        "packed-int4-weight",
        prepare=packed_int4_weight,
        expect=(f"{L}.weight_scale", f"no {L}.weight"),
    ),
    Case(
        "not-8-bit",
        prepare=weight_arg(num_bits=4),
        expect=(
            "{ck}/config.json: quantization scheme W4A8 (fp4 weights, per tensor; fp8 "
            "activations) is not FP8",
            "FP8_DYNAMIC",
        ),
    ),
    Case(
        "int-weights",
        prepare=weight_arg(type="int"),
        expect=(
            "{ck}/config.json: quantization scheme W8A8 (int8 weights, per tensor; fp8 "
            "activations) is not FP8",
            "float8_e4m3fn",
        ),
    ),
    Case(
        "scale-shape-vs-channel",
        prepare=strategy("channel"),
        expect=(".weight_scale: scale shape [1]", "strategy 'channel'"),
    ),
    # scale values
    Case(
        "scale-nan",
        prepare=scale_value(float("nan")),
        expect=(f"{{ck}}/model.safetensors: {L}.weight_scale", "scale[0] = nan"),
    ),
    Case(
        "scale-zero",
        prepare=scale_value(0.0),
        expect=(f"{L}.weight_scale", "scale[0] = 0.0", "must be finite and > 0"),
    ),
    Case(
        "scale-negative", prepare=scale_value(-0.5), expect=(f"{L}.weight_scale", "scale[0] = -0.5")
    ),
    Case(
        "scale-inf",
        prepare=scale_value(float("inf")),
        expect=(f"{L}.weight_scale", "scale[0] = inf"),
    ),
    Case(
        "scale-fold-overflow-bf16",
        prepare=scale_value(300.0),
        args=("--act-dtype", "bfloat16"),
        expect=(f"{L}.weight_scale", "scale[0] = 300.0", "exceeds 255.0", "bfloat16"),
    ),
    Case(
        "scale-fold-overflow-bf16-default",
        prepare=scale_value(255.5, torch.float32),
        expect=(f"{L}.weight_scale", "scale[0] = 255.5", "exceeds 255.0", "bfloat16"),
    ),
    Case(
        "scale-fold-overflow-fp16",
        prepare=scale_value(256.0),
        args=("--act-dtype", "float16"),
        expect=(f"{L}.weight_scale", "scale[0] = 256.0", "exceeds 255.875", "float16"),
    ),
    # missing pieces
    Case(
        "missing-weight-scale",
        base="sharded",
        prepare=drop_scale,
        expect=(f"{L}.weight", "FP8 weight without a weight_scale"),
    ),
    Case(
        "index-lists-missing-scale",
        base="sharded",
        prepare=drop_scale_keep_index,
        expect=(f"{{ck}}/{INDEX}", f"maps '{L}.weight_scale' to {{shard}}", "no shard"),
    ),
    # fusion / TP
    Case(
        "unknown-architecture",
        prepare=architecture("GPT2LMHeadModel"),
        expect=("{ck}/config.json", "architecture 'GPT2LMHeadModel'", "--fuse none --tp 1"),
    ),
    Case(
        "quantized-lm-head",
        prepare=quantized_lm_head,
        expect=("a quantized lm_head", "fused Llama-family"),
    ),
    Case(
        "tp-not-dividing-heads",
        args=("--tp", "3"),
        expect=("{ck}/config.json", "--tp 3", "num_attention_heads=4"),
    ),
    Case(
        "tp-not-fitting-kv-heads",
        base="heads6",
        args=("--tp", "2"),
        expect=("{ck}/config.json", "--tp 2", "num_key_value_heads=3"),
    ),
    Case(
        "fuse-none-tp2",
        args=("--fuse", "none", "--tp", "2"),
        expect=("--fuse none", "--tp 1 (got --tp 2)"),
    ),
    Case("k-not-multiple-of-4", base="k258", expect=(ANY_WEIGHT, "K=258", "multiple of 4")),
    # num_hidden_layers against the layers the weights hold (2): refused at plan time, not by
    # vLLM once it has built the model
    # A fused Phi-3 qkv_proj whose rows are not the parts config.json gives (2 KV heads would be
    # 256 + 128 + 128): the file, the tensor, both row counts and the parts are named.
    Case(
        "phi3-fused-rows-do-not-add-up",
        base="phi3",
        prepare=set_config(num_key_value_heads=2),
        expect=(
            "{ck}/model.safetensors: model.layers.0.self_attn.qkv_proj.weight has N=384 rows",
            "config.json implies 512 (q 256 + k 128 + v 128)",
            "num_key_value_heads 2",
        ),
    ),
    Case(
        "layers-config-more",
        prepare=set_config(num_hidden_layers=1_000_000),
        expect=(
            "{ck}/config.json: num_hidden_layers is 1000000, but the weights hold decoder "
            "layers 0-1 (no shard holds model.layers.2.*)",
            "a model of 2 layers",
        ),
    ),
    Case(
        "layers-config-fewer",
        prepare=set_config(num_hidden_layers=1),
        expect=(
            "{ck}/config.json: num_hidden_layers is 1, but the weights hold decoder layers 0-1 "
            "({ck}/model.safetensors holds model.layers.1.",
            "a model of 2 layers",
        ),
    ),
    Case(
        "layers-config-sharded-fewer",
        base="sharded",
        prepare=set_config(num_hidden_layers=1),
        expect=("{ck}/config.json: num_hidden_layers is 1", "holds model.layers.1."),
    ),
    Case(
        "layers-config-missing",
        prepare=pop_config("num_hidden_layers"),
        expect=("{ck}/config.json: has no num_hidden_layers",),
    ),
    Case(
        "layers-config-not-a-number",
        prepare=set_config(num_hidden_layers="2"),
        expect=("{ck}/config.json: num_hidden_layers is '2', not a positive whole number",),
    ),
    # damaged files
    Case(
        "truncated-safetensors",
        prepare=truncate(100),
        expect=("{ck}/model.safetensors", "truncated", "file has {size} bytes"),
    ),
    Case(
        "header-length-garbage",
        prepare=overwrite(0, b"\xff" * 8),
        expect=("{ck}/model.safetensors", "header length 18446744073709551615"),
    ),
    Case(
        "header-json-garbage",
        prepare=overwrite(8, b"#!garbage!#"),
        expect=("{ck}/model.safetensors", "malformed safetensors header"),
    ),
    Case(
        "config-json-garbage",
        prepare=config_text('{"architectures": ['),
        expect=("{ck}/config.json", "malformed JSON"),
    ),
    Case(
        "not-quantized",
        prepare=pop_config("quantization_config"),
        expect=("{ck}/config.json", "no quantization_config"),
    ),
    Case(
        "other-quant-method",
        prepare=quant_config(quant_method="gptq"),
        expect=("{ck}/config.json", "quant_method is 'gptq'", "compressed-tensors and fp8"),
    ),
    Case(
        "mllama",
        prepare=architecture("MllamaForConditionalGeneration"),
        expect=(
            "{ck}/config.json: architecture MllamaForConditionalGeneration: vLLM 0.33.0 cannot "
            "run it",
            "removed Mllama",
        ),
    ),
    # AutoFP8 (quant_method fp8): what vLLM's Fp8LinearMethod would refuse or misload
    Case(
        "autofp8-block",
        base="autofp8d",
        prepare=quant_config(weight_block_size=[128, 128]),
        expect=(
            "{ck}/config.json: quantization_config.weight_block_size is [128, 128]: block FP8",
            "vLLM loads a block FP8 checkpoint itself",
        ),
    ),
    Case(
        "autofp8-no-activation-scheme",
        base="autofp8s",
        prepare=lambda ck: edit_config(
            ck, lambda cfg: cfg["quantization_config"].pop("activation_scheme")
        ),
        expect=("{ck}/config.json", "has no activation_scheme", "vLLM 0.33.0 cannot load"),
    ),
    Case(
        "autofp8-missing-weight-scale",
        base="autofp8s",
        prepare=drop_tensor(f"{L}.weight_scale"),
        expect=(f"{{ck}}/model.safetensors: {L}.weight", "FP8 weight without a weight_scale"),
    ),
    Case(
        "autofp8-static-missing-input-scale",
        base="autofp8s",
        prepare=drop_tensor(f"{L}.input_scale"),
        expect=(
            f"{{ck}}/model.safetensors: {L}.weight",
            f"activation_scheme is static, but the checkpoint has no {L}.input_scale",
        ),
    ),
    Case(
        "autofp8-dynamic-with-input-scale",
        base="autofp8d",
        prepare=extra_input_scale,
        expect=(
            f"{{ck}}/model.safetensors: {L}.input_scale",
            "activation_scheme is dynamic",
            "vLLM 0.33.0 cannot load this checkpoint either",
        ),
    ),
    Case(
        "autofp8-per-channel-scale",
        base="autofp8s",
        prepare=per_channel_scale,
        expect=(
            f"{{ck}}/model.safetensors: {L}.weight_scale: per-channel scale shape [512]",
            "Fp8LinearMethod",
        ),
    ),
    Case(
        "autofp8-ignored-fp8-layer",
        base="autofp8s",
        prepare=quant_config(ignored_layers=["lm_head", L]),
        expect=(f"{{ck}}/model.safetensors: {L}.weight", f"ignored_layers lists {L}"),
    ),
    Case(
        "autofp8-not-fp8-serialized",
        base="autofp8s",
        prepare=not_fp8_serialized,
        expect=("{ck}: quant_method is fp8", "not FP8-serialized", "fp8_per_tensor"),
    ),
    Case(
        "autofp8-w8a8-profile",
        base="autofp8s",
        args=("--profile", "w8a8-marlin"),
        expect=("{ck}/config.json: quant_method fp8", "Fp8LinearMethod", "never as w8a8-marlin"),
    ),
    Case(
        "no-model-dtype",
        prepare=pop_config("dtype"),
        expect=("{ck}/config.json", "model dtype None", "--act-dtype"),
    ),
    # where the source is
    Case(
        "source-missing",
        prepare=other_source(lambda ck: ck.parent / "no-such-ckpt"),
        expect=("{src}", "no such directory"),
    ),
    Case(
        "source-is-a-file",
        prepare=other_source(lambda ck: ck / "config.json"),
        expect=("{src}", "is a file"),
    ),
    Case(
        "revision-on-local-dir",
        args=("--revision", "main"),
        expect=("--revision main", "local directory"),
    ),
    Case("out-inside-source", out_inside=True, expect=("lies inside the source checkpoint",)),
    # options
    Case("bad-profile", args=("--profile", "w4a16"), expect=("--profile", "'w4a16'")),
    Case("bad-act-dtype", args=("--act-dtype", "float32"), expect=("--act-dtype", "'float32'")),
    Case("bad-device-name", args=("--device", "tpu"), expect=("--device", "'tpu'")),
    Case("bad-device-type", args=("--device", "meta"), expect=("--device", "'meta'")),
    Case("bad-tp", args=("--tp", "0"), expect=("--tp must be at least 1, got 0",)),
]

ACCEPTED = [
    Case("autofp8-static", base="autofp8s", check=expect_target(profile="w8a16")),
    Case(
        "autofp8-dynamic-tp2",
        base="autofp8d",
        args=("--tp", "2"),
        check=expect_target(profile="w8a16", tp_size=2),
    ),
    Case(
        "fuse-none-unknown-architecture",
        prepare=architecture("GPT2LMHeadModel"),
        args=("--fuse", "none", "--tp", "1"),
        check=expect_checkpoint_names(),
    ),
    Case(
        "fuse-none-quantized-lm-head",
        prepare=quantized_lm_head,
        args=("--fuse", "none"),
        check=expect_checkpoint_names("lm_head"),
    ),
    Case("tp8-over-4-kv-heads", base="heads8", args=("--tp", "8"), check=expect_ranks(8)),
    Case(
        "scale-255-bf16",
        prepare=scale_value(255.0),
        check=expect_largest_scale("bfloat16", 255.0, 2.0**120),
    ),
    Case(
        "scale-255.875-fp16",
        prepare=scale_value(255.875, torch.float32),
        args=("--act-dtype", "float16"),
        check=expect_largest_scale("float16", 255.875, 2.0**8),
    ),
    Case(
        "qc-under-text-config",
        prepare=qc_under_text_config,
        check=expect_target(act_dtype="bfloat16"),
    ),
    Case(
        "qc-under-compression-config-wrapped",
        prepare=qc_under_compression_config(True),
        check=expect_target(act_dtype="bfloat16"),
    ),
    Case(
        "qc-under-compression-config-plain",
        prepare=qc_under_compression_config(False),
        check=expect_target(act_dtype="bfloat16"),
    ),
    Case(
        "ct-0.19-serialisation",
        prepare=weight_arg(**V019_DEFAULTS),
        check=expect_target(act_dtype="bfloat16"),
    ),
    Case(
        "ct-unknown-future-field",
        prepare=weight_arg(some_future_field=1),
        check=expect_target(act_dtype="bfloat16"),
    ),
    Case(
        "torch-dtype-key",
        base="fp16",
        prepare=torch_dtype_key,
        check=expect_target(act_dtype="float16"),
    ),
]

FOREIGN = ["no-force", "force"]


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint per BASES entry; cases copy them before mutating."""
    root = tmp_path_factory.mktemp("bases")
    return {
        name: make_autofp8_checkpoint(root / name, activation=kw["autofp8"])
        if "autofp8" in kw
        else make_checkpoint(root / name, **kw)
        for name, kw in BASES.items()
    }


@pytest.fixture(scope="module")
def runs(request, bases, tmp_path_factory) -> Any:
    """Prepare every selected case and start its conversion; tests wait for their own."""
    pool = CliPool()
    started: dict[str, Run] = {}
    try:
        for case in selected_params(request, "case"):
            d = tmp_path_factory.mktemp(case.id)
            ck = Path(shutil.copytree(bases[case.base], d / "ckpt"))
            extra = case.prepare(ck) if case.prepare else None
            extra = extra if isinstance(extra, dict) else {}
            src = extra.get("src", ck)
            out = ck / "sidecar" if case.out_inside else d / "out"
            fut = pool.submit("convert", src, "-o", out, *case.args)
            started[case.id] = Run(ck, out, fut, extra)
        for mode in selected_params(request, "mode"):
            d = tmp_path_factory.mktemp(f"foreign-{mode}")
            ck = Path(shutil.copytree(bases["llama"], d / "ckpt"))
            out = d / "out"
            (out / "sub").mkdir(parents=True)
            (out / "notes.txt").write_text("my notes\n")
            (out / "sub" / "data.bin").write_bytes(bytes(range(256)))
            force = ("--force",) if mode == "force" else ()
            fut = pool.submit("convert", ck, "-o", out, *force)
            started[f"foreign-{mode}"] = Run(ck, out, fut, {"before": snapshot(out)})
        yield started
    finally:
        pool.close()


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_refused(case: Case, runs) -> None:
    """Exit 2, a message naming the file/layer/value, no OUT and no work dir left."""
    run = runs[case.id]
    r = run.result()
    fmt = {"ck": run.ck.resolve(), **run.extra}
    fmt.setdefault("src", run.ck)
    assert_refused(r, run.out, *(s.format(**fmt) for s in case.expect))


@pytest.mark.parametrize("case", ACCEPTED, ids=str)
def test_accepted(case: Case, runs) -> None:
    """Odd but valid inputs convert (exit 0) into the sidecar the case expects."""
    run = runs[case.id]
    r = run.result()
    assert r.returncode == 0, explain(r)
    assert "Traceback" not in r.stderr
    assert (run.out / "mpack.json").is_file() and tmp_dirs(run.out) == []
    case.check(run.out)


@pytest.mark.parametrize("mode", FOREIGN)
def test_foreign_out_dir_is_refused_and_untouched(mode: str, runs) -> None:
    """A non-empty directory mpack did not write is never replaced, not even with --force."""
    run = runs[f"foreign-{mode}"]
    r = run.result()
    assert_refused(
        r,
        run.out,
        f"{run.out} already holds files that are not an mpack sidecar",
        "choose another -o directory",
        exists=True,
    )
    assert snapshot(run.out) == run.extra["before"]
    assert sorted(p.name for p in run.out.parent.iterdir()) == ["ckpt", "out"]
