"""Tiny random mixture-of-experts FP8 checkpoints, in the files' form on the Hub.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters, which compressed-tensors'
``Linear`` targets do not reach, so these checkpoints are written directly: every tensor under
the name and in the dtype the Hub's compressed-tensors FP8 MoE checkpoints use (llm-compressor's
per-expert ``experts.<e>.<linear>`` modules), with a ``quantization_config`` as llm-compressor
writes it. The config is transformers' own config class's. Weights are drawn from one seed and
quantized here: per tensor (scale ``amax / 448``, ``[1]``) or per output channel (``[N, 1]``).

Families (:data:`MOE_ARCHS`): Mixtral (``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``),
Qwen3-MoE (``mlp``, experts ``gate_proj`` / ``up_proj`` / ``down_proj``, q/k norms), Qwen2-MoE
(as Qwen3-MoE's, with q/k/v biases, and a shared expert with its gate) and Llama 4 (the
multimodal wrapper: ``feed_forward`` blocks in every second layer with a shared expert and a
``router``, dense MLPs between, a tiny vision tower). The routers and the
shared expert's gate stay in the model dtype (their ``ignore`` entries), as in the Hub's
checkpoints.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MOE_ARCHS", "MoeArch", "make_moe_checkpoint"]

FP8_MAX = 448.0


@dataclass(frozen=True)
class MoeArch:
    """How one MoE family names its checkpoint and sizes its config."""

    config_class: str
    architecture: str
    block: str  # the MoE block under each decoder layer
    linears: tuple[str, str, str]  # an expert's gate, up and down linears
    experts_key: str  # config.json's expert count
    intermediate_key: str  # config.json's per-expert intermediate size
    qk_norm: bool = False
    qkv_bias: bool = False
    #: the block's unquantized linears, in the model dtype: the router (``[experts, hidden]``),
    #: then Qwen2-MoE's shared expert's gate (``shared_expert_gate``, ``[1, hidden]``)
    gates: tuple[str, ...] = ("gate",)
    #: a shared expert, an FP8 dense MLP of this many times an expert's intermediate size
    #: (0: none)
    shared: int = 0
    #: Llama 4's: a multimodal wrapper (the language model under ``language_model.``, a tiny
    #: vision tower and projector in the model dtype), every second decoder layer a MoE block
    #: (``interleave_moe_layer_step`` 2) and the others a dense FP8 MLP under ``block``
    llama4: bool = False


MOE_ARCHS: dict[str, MoeArch] = {
    "mixtral": MoeArch(
        "MixtralConfig",
        "MixtralForCausalLM",
        "block_sparse_moe",
        ("w1", "w3", "w2"),
        "num_local_experts",
        "intermediate_size",
    ),
    "qwen2_moe": MoeArch(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        "num_experts",
        "moe_intermediate_size",
        qkv_bias=True,
        gates=("gate", "shared_expert_gate"),
        shared=2,
    ),
    "llama4": MoeArch(
        "Llama4TextConfig",
        "Llama4ForConditionalGeneration",
        "feed_forward",
        ("gate_proj", "up_proj", "down_proj"),
        "num_local_experts",
        "intermediate_size",
        gates=("router",),
        shared=1,
        llama4=True,
    ),
    "qwen3_moe": MoeArch(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        "num_experts",
        "moe_intermediate_size",
        qk_norm=True,
    ),
}
SCHEMES = ("FP8", "FP8_DYNAMIC")


def make_moe_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "mixtral",
    scheme: str = "FP8",
    dtype: str = "bfloat16",
    layers: int = 2,
    experts: int = 4,
    hidden: int = 256,
    moe_intermediate: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1000,
    seed: int = 0,
    autofp8: str | None = None,
) -> Path:
    """Write a random compressed-tensors FP8 MoE checkpoint (one ``model.safetensors``) and
    return its path. ``scheme``: ``FP8`` (per-tensor weight scales, static per-tensor input
    scales) or ``FP8_DYNAMIC`` (per-channel weight scales, dynamic per-token activations).
    ``autofp8``: an AutoFP8 checkpoint instead (``quant_method: fp8``, as
    Mixtral-8x7B-Instruct-v0.1-FP8 is), with this activation scheme (``static``: input scales;
    ``dynamic``: none); its scales are float32 scalars, per tensor (``scheme`` is ``FP8``)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    if arch not in MOE_ARCHS:
        raise ValueError(f"unknown MoE arch {arch!r}; expected one of {sorted(MOE_ARCHS)}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    if autofp8 not in (None, "static", "dynamic"):
        raise ValueError(f"autofp8 is {autofp8!r}; expected static or dynamic")
    if autofp8 and scheme != "FP8":
        raise ValueError("an AutoFP8 checkpoint has per-tensor scales: scheme FP8")
    a = MOE_ARCHS[arch]
    head_dim = hidden // heads
    dense = 4 * moe_intermediate  # a dense MLP's intermediate size (Qwen3-MoE's: none here)
    sizes = {"intermediate_size": dense}
    sizes.update({a.experts_key: experts, a.intermediate_key: moe_intermediate})
    if a.shared and not a.llama4:
        sizes["shared_expert_intermediate_size"] = a.shared * moe_intermediate
    if a.llama4:  # its dense MLPs' size; MoE blocks in every second layer; no top-2
        sizes.update(intermediate_size_mlp=dense, interleave_moe_layer_step=2)
    config = getattr(transformers, a.config_class)(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        num_experts_per_tok=1 if a.llama4 else 2,
        **sizes,
    )
    lm = "language_model." if a.llama4 else ""  # where the checkpoint keeps the language model
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def plain(name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        v = torch.randn(shape, generator=gen)
        tensors[name] = (1.0 + 0.1 * v if norm else 0.02 * v).to(dt)

    def input_scale() -> torch.Tensor:  # one per input: the linears reading it share it
        return (0.01 + 0.01 * torch.rand(1, generator=gen)).to(dt)

    def fp8(module: str, n: int, k: int, act: torch.Tensor) -> None:
        w = 0.02 * torch.randn((n, k), generator=gen)
        if scheme == "FP8":
            scale = w.abs().amax().reshape(1) / FP8_MAX
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        tensors[f"{module}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        if autofp8:  # float32 scalars
            tensors[f"{module}.weight_scale"] = scale.float().reshape(())
            if autofp8 == "static":
                tensors[f"{module}.input_scale"] = act.float().reshape(())
            return
        tensors[f"{module}.weight_scale"] = scale.to(dt)
        if scheme == "FP8":  # a calibrated static input scale
            tensors[f"{module}.input_scale"] = act.clone()

    plain(f"{lm}model.embed_tokens.weight", (vocab, hidden))
    plain(f"{lm}model.norm.weight", (hidden,), norm=True)
    plain(f"{lm}lm_head.weight", (vocab, hidden))
    q, kv = heads * head_dim, kv_heads * head_dim

    def mlp(x: str, size: int) -> None:  # a dense FP8 MLP under module x
        gate_up_in = input_scale()
        fp8(f"{x}.{a.linears[0]}", size, hidden, gate_up_in)
        fp8(f"{x}.{a.linears[1]}", size, hidden, gate_up_in)
        fp8(f"{x}.{a.linears[2]}", hidden, size, input_scale())

    for i in range(layers):
        p = f"{lm}model.layers.{i}"
        plain(f"{p}.input_layernorm.weight", (hidden,), norm=True)
        plain(f"{p}.post_attention_layernorm.weight", (hidden,), norm=True)
        qkv_in = input_scale()
        for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            fp8(f"{p}.self_attn.{name}", n, hidden, qkv_in)
            if a.qkv_bias:
                plain(f"{p}.self_attn.{name}.bias", (n,))
        fp8(f"{p}.self_attn.o_proj", hidden, q, input_scale())
        if a.qk_norm:
            plain(f"{p}.self_attn.q_norm.weight", (head_dim,), norm=True)
            plain(f"{p}.self_attn.k_norm.weight", (head_dim,), norm=True)
        gate, up, down = a.linears
        if a.llama4 and i % 2 == 0:  # interleave_moe_layer_step 2: a dense layer
            mlp(f"{p}.{a.block}", dense)
            continue
        router, *shared_gate = a.gates  # Qwen2-MoE's shared expert has a gate
        plain(f"{p}.{a.block}.{router}.weight", (experts, hidden))
        if a.shared:
            mlp(f"{p}.{a.block}.shared_expert", a.shared * moe_intermediate)
        for g in shared_gate:
            plain(f"{p}.{a.block}.{g}.weight", (1, hidden))
        for e in range(experts):
            x = f"{p}.{a.block}.experts.{e}"
            gate_up_in = input_scale()
            fp8(f"{x}.{gate}", moe_intermediate, hidden, gate_up_in)
            fp8(f"{x}.{up}", moe_intermediate, hidden, gate_up_in)
            fp8(f"{x}.{down}", hidden, moe_intermediate, input_scale())

    if a.llama4:
        tensors.update(_llama4_vision(config, dt, seed))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    cfg = config.to_dict()
    cfg.update(architectures=[a.architecture], dtype=dtype)
    if a.experts_key not in cfg:  # the Hub's name (transformers 5 writes its own)
        cfg[a.experts_key] = cfg.pop("num_local_experts")
    cfg.pop("torch_dtype", None)
    if a.llama4:  # the wrapper's config around the text config
        cfg = _llama4_config(cfg, dtype)
    if autofp8:
        routers = [f"{lm}model.layers.{i}.{a.block}.{g}" for i in range(layers) for g in a.gates]
        routers += ["re:vision_model.*", "re:multi_modal_projector.*"] if a.llama4 else []
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": autofp8,
            "ignored_layers": [f"{lm}lm_head", *routers],
        }
    else:
        cfg["quantization_config"] = _quantization_config(scheme, a)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


#: Llama 4's tiny vision tower (Llama4VisionConfig's arguments).
_LLAMA4_VISION = dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
    image_size=56, patch_size=14, vision_output_dim=64, projector_input_dim=64,
    projector_output_dim=64,
)  # fmt: skip


def _llama4_config(text: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Llama4ForConditionalGeneration's config.json around the text config ``text``."""
    import transformers

    vision = transformers.Llama4VisionConfig(**_LLAMA4_VISION).to_dict()
    text = {k: v for k, v in text.items() if k != "architectures"}
    cfg = transformers.Llama4Config(vision_config=vision, text_config=text).to_dict()
    cfg.update(architectures=["Llama4ForConditionalGeneration"], dtype=dtype)
    cfg.pop("torch_dtype", None)
    return cfg


def _llama4_vision(text: Any, dt: Any, seed: int) -> dict[str, Any]:
    """Llama 4's vision tower and projector (``vision_model.*``, ``multi_modal_projector.*``,
    the Hub's names), built by transformers from seed ``seed`` in dtype ``dt``."""
    import torch
    import transformers
    from transformers.models.llama4 import modeling_llama4

    vision = transformers.Llama4VisionConfig(**_LLAMA4_VISION)
    torch.manual_seed(seed)
    out = {}
    parts = {
        "vision_model.": transformers.Llama4VisionModel(vision),
        "multi_modal_projector.": modeling_llama4.Llama4MultiModalProjector(
            transformers.Llama4Config(vision_config=vision.to_dict(), text_config=text.to_dict())
        ),
    }
    for prefix, module in parts.items():
        for name, t in module.state_dict().items():
            out[prefix + name] = t.to(dt).contiguous()
    return out


def _quantization_config(scheme: str, a: MoeArch) -> dict[str, Any]:
    """llm-compressor's ``quantization_config`` for the preset, the routers and lm_head
    ignored."""
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": "tensor" if scheme == "FP8" else "channel",
    }
    acts = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": scheme != "FP8",
        "strategy": "tensor" if scheme == "FP8" else "token",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
        "ignore": [
            "re:.*lm_head" if a.llama4 else "lm_head",
            *(f"re:.*{a.block}.{g}$" for g in a.gates),
            *(["re:vision_model.*", "re:multi_modal_projector.*"] if a.llama4 else []),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m mpack.fixtures_moe OUT [options]``: write a checkpoint and print its path."""
    p = argparse.ArgumentParser(
        prog="python -m mpack.fixtures_moe",
        description="Write a tiny random compressed-tensors FP8 MoE checkpoint (offline).",
    )
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--arch", default="mixtral", choices=sorted(MOE_ARCHS))
    p.add_argument("--scheme", default="FP8", choices=list(SCHEMES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autofp8", choices=["static", "dynamic"], default=None)
    args = vars(p.parse_args(argv))  # every option is make_moe_checkpoint's keyword
    print(make_moe_checkpoint(args.pop("out"), **args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
