"""A Llama-3.1-8B-shaped (or Qwen3-30B-A3B-shaped) compressed-tensors FP8 checkpoint, random
but valid, for benchmarks.

No transformers model is built (8 B parameters would not fit the point): the safetensors shards
are written directly, in the layout llm-compressor produces for the ``FP8`` preset — per-tensor
weight scales, static per-tensor input scales, bf16 embeddings, norms and ``lm_head``, and a
``config.json`` whose ``quantization_config`` parses with compressed-tensors' own models.
FP8 bytes are uniform over all finite codes (NaN codes 0x7F/0xFF are remapped), each weight a
window of one random pool (:data:`POOL_BYTES`).

    python scripts/synth_checkpoint.py OUT [--layers 32] [--hidden 4096] ...
    python scripts/synth_checkpoint.py OUT --model qwen3-30b-a3b [--layers 48]

``--model qwen3-30b-a3b`` (:data:`QWEN3_30B_A3B`) writes Qwen3-MoE's layout instead of
Llama's MLP: per decoder layer q/k norms, the router ``mlp.gate`` (bf16, ignored as
RedHatAI's Qwen3-30B-A3B-FP8 checkpoints ignore it) and ``experts`` experts of three FP8
linears each (``mlp.experts.<e>.{gate,up,down}_proj``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mpack.sidecar import FileMap, TensorSpec, torch_dtype

LLAMA_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256)
#: Qwen3-30B-A3B's config.json (its dense intermediate_size is unused: every layer is MoE).
QWEN3_30B_A3B = dict(
    hidden=2048, intermediate=6144, layers=48, heads=32, kv_heads=4, vocab=151936,
    head_dim=128, experts=128, moe_intermediate=768,
)  # fmt: skip
MODELS = {"llama-8b": LLAMA_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
SHARD_BYTES = 5 * 1024**3

QUANT_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": "float-quantized",
            "input_activations": {
                "dynamic": False,
                "num_bits": 8,
                "strategy": "tensor",
                "symmetric": True,
                "type": "float",
                "observer": "static_minmax",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "dynamic": False,
                "num_bits": 8,
                "strategy": "tensor",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "ignore": ["lm_head"],
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "version": "0.20.1",
}
#: AutoFP8's ``quantization_config`` (as mpack.fixtures.make_autofp8_checkpoint writes it).
AUTOFP8_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "static",
    "ignored_layers": ["lm_head"],
}
#: How each format stores a per-tensor scale: safetensors dtype and shape.
SCALE_FORM = {"compressed-tensors": ("BF16", (1,)), "autofp8": ("F32", ())}


def _specs(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    head_dim: int = 0,
    experts: int = 0,
    moe_intermediate: int = 0,
    quant: str = "compressed-tensors",
) -> list[TensorSpec]:
    d = head_dim or hidden // heads
    out = [TensorSpec("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    lin = {
        "self_attn.q_proj": (heads * d, hidden),
        "self_attn.k_proj": (kv_heads * d, hidden),
        "self_attn.v_proj": (kv_heads * d, hidden),
        "self_attn.o_proj": (hidden, heads * d),
    }
    mlp = {
        "gate_proj": (moe_intermediate or intermediate, hidden),
        "up_proj": (moe_intermediate or intermediate, hidden),
        "down_proj": (hidden, moe_intermediate or intermediate),
    }
    experts_of = [f"mlp.experts.{e}." for e in range(experts)] if experts else ["mlp."]
    lin |= {x + name: shape for x in experts_of for name, shape in mlp.items()}
    scale_dtype, scale_shape = SCALE_FORM[quant]
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, (n, k) in lin.items():
            out += [
                TensorSpec(p + name + ".weight", "F8_E4M3", (n, k)),
                TensorSpec(p + name + ".weight_scale", scale_dtype, scale_shape),
                TensorSpec(p + name + ".input_scale", scale_dtype, scale_shape),
            ]
        out += [
            TensorSpec(p + "input_layernorm.weight", "BF16", (hidden,)),
            TensorSpec(p + "post_attention_layernorm.weight", "BF16", (hidden,)),
        ]
        if experts:  # Qwen3-MoE: q/k norms and the router
            out += [
                TensorSpec(p + "self_attn.q_norm.weight", "BF16", (d,)),
                TensorSpec(p + "self_attn.k_norm.weight", "BF16", (d,)),
                TensorSpec(p + "mlp.gate.weight", "BF16", (experts, hidden)),
            ]
    out += [
        TensorSpec("model.norm.weight", "BF16", (hidden,)),
        TensorSpec("lm_head.weight", "BF16", (vocab, hidden)),
    ]
    return out


#: FP8 weights are windows of one random pool at random offsets: drawing every byte costs more
#: than writing it (a Qwen3-30B-A3B layer is 0.6 GB), and no benchmark reads the values.
POOL_BYTES = 128 * 1024**2


def _pool(gen: torch.Generator) -> torch.Tensor:
    b = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes in a valid checkpoint
    return b


def _data(spec: TensorSpec, gen: torch.Generator, pool: torch.Tensor) -> torch.Tensor:
    if spec.dtype == "F8_E4M3":
        n = spec.nbytes
        if n > pool.numel():
            return pool.repeat(-(-n // pool.numel()))[:n].view(spec.shape)
        at = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=gen))
        return pool[at : at + n].view(spec.shape)
    # scales are bf16 values in either form (float32 holds each exactly): the same checkpoint
    if spec.name.endswith(("input_scale", "weight_scale")):
        if spec.name.endswith("input_scale"):  # one for all: vLLM wants gate's and up's equal
            s = torch.full(spec.shape, 5e-4)
        else:
            s = torch.rand(spec.shape, generator=gen) * 1e-3 + 1e-4
        stored = s.to(torch.bfloat16).to(torch_dtype(spec.dtype))
        return stored.reshape(-1).view(torch.uint8)
    return (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8)


def write_checkpoint(
    out: str | Path,
    *,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    quant: str = "compressed-tensors",
    **dims: int,
) -> Path:
    """Write the checkpoint into ``out`` (shards + index + config) in ``quant``'s form (a key of
    :data:`SCALE_FORM`); return ``out``."""
    dims = {**LLAMA_8B, **dims}  # a MoE model passes every one of QWEN3_30B_A3B's
    if quant == "autofp8" and dims.get("experts"):
        raise SystemExit("--quant autofp8: Llama's shape only")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = _specs(**dims, quant=quant)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if size + s.nbytes > shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    gen = torch.Generator().manual_seed(seed)
    pool = _pool(gen)
    weight_map = {}
    for i, group in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        file_map = FileMap.plan(group, {"format": "pt"})
        with open(out / name, "wb") as f:
            f.write(file_map.header)
            by_name = {s.name: s for s in group}
            for e in file_map.entries:
                f.write(_data(by_name[e.name], gen, pool).numpy().tobytes())
                weight_map[e.name] = name
    total = sum(s.nbytes for s in specs)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "bfloat16",
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["intermediate"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "head_dim": dims.get("head_dim") or dims["hidden"] // dims["heads"],
        "vocab_size": dims["vocab"],
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "quantization_config": AUTOFP8_CONFIG if quant == "autofp8" else QUANT_CONFIG,
    }
    if dims.get("experts"):  # Qwen3-30B-A3B's config.json
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=dims["experts"],
            moe_intermediate_size=dims["moe_intermediate"],
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            quantization_config={**QUANT_CONFIG, "ignore": ["lm_head", "re:.*mlp.gate$"]},
        )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-8b")
    for k in QWEN3_30B_A3B:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, help="default: the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quant", choices=sorted(SCALE_FORM), default="compressed-tensors")
    a = vars(ap.parse_args())
    out, model, quant = a.pop("out"), MODELS[a.pop("model")], a.pop("quant")
    dims = {k: v for k, v in a.items() if v is not None and k != "seed"}
    print(write_checkpoint(out, seed=a["seed"], quant=quant, **{**model, **dims}))


if __name__ == "__main__":
    main()
