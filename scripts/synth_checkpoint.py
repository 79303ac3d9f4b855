"""A Llama-3.1-8B-shaped compressed-tensors FP8 checkpoint, random but valid, for benchmarks.

No transformers model is built (8 B parameters would not fit the point): the safetensors shards
are written directly, in the layout llm-compressor produces for the ``FP8`` preset — per-tensor
weight scales, static per-tensor input scales, bf16 embeddings, norms and ``lm_head``, and a
``config.json`` whose ``quantization_config`` parses with compressed-tensors' own models.
FP8 bytes are uniform over all finite codes (NaN codes 0x7F/0xFF are remapped).

    python scripts/synth_checkpoint.py OUT [--layers 32] [--hidden 4096] ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mpack.sidecar import FileMap, TensorSpec

LLAMA_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256)
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


def _specs(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> list[TensorSpec]:
    d = hidden // heads
    out = [TensorSpec("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    lin = {
        "self_attn.q_proj": (heads * d, hidden),
        "self_attn.k_proj": (kv_heads * d, hidden),
        "self_attn.v_proj": (kv_heads * d, hidden),
        "self_attn.o_proj": (hidden, heads * d),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, (n, k) in lin.items():
            out += [
                TensorSpec(p + name + ".weight", "F8_E4M3", (n, k)),
                TensorSpec(p + name + ".weight_scale", "BF16", (1,)),
                TensorSpec(p + name + ".input_scale", "BF16", (1,)),
            ]
        out += [
            TensorSpec(p + "input_layernorm.weight", "BF16", (hidden,)),
            TensorSpec(p + "post_attention_layernorm.weight", "BF16", (hidden,)),
        ]
    out += [
        TensorSpec("model.norm.weight", "BF16", (hidden,)),
        TensorSpec("lm_head.weight", "BF16", (vocab, hidden)),
    ]
    return out


def _data(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    if spec.dtype == "F8_E4M3":
        b = torch.randint(0, 256, spec.shape, dtype=torch.uint8, generator=gen)
        b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes in a valid checkpoint
        return b
    if spec.name.endswith(("weight_scale", "input_scale")):
        s = torch.rand(spec.shape, generator=gen) * 1e-3 + 1e-4
        return s.to(torch.bfloat16).view(torch.uint8)
    return (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8)


def write_checkpoint(
    out: str | Path, *, seed: int = 0, shard_bytes: int = SHARD_BYTES, **dims: int
) -> Path:
    """Write the checkpoint into ``out`` (shards + index + config); return ``out``."""
    dims = {**LLAMA_8B, **dims}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = _specs(**dims)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if size + s.nbytes > shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, group in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        file_map = FileMap.plan(group, {"format": "pt"})
        with open(out / name, "wb") as f:
            f.write(file_map.header)
            for e in file_map.entries:
                spec = next(s for s in group if s.name == e.name)
                f.write(_data(spec, gen).numpy().tobytes())
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
        "head_dim": dims["hidden"] // dims["heads"],
        "vocab_size": dims["vocab"],
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "quantization_config": QUANT_CONFIG,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    for k, v in LLAMA_8B.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--seed", type=int, default=0)
    a = vars(ap.parse_args())
    out = a.pop("out")
    print(write_checkpoint(out, **a))


if __name__ == "__main__":
    main()
