"""Small valid sidecars of random bytes for the runtime tests (no convert step needed).

Each rank file holds, per layer, Marlin-shaped tensors (int32 weights [Kp/16, 4*Np], bf16
scales [1, Np]); common.safetensors holds bf16 pass-through tensors, one of them of a size that
is not a multiple of 64 (so the unaligned tail of the layout is exercised). Everything is
written through mpack.sidecar (FileMap.plan, HashingWriter, new_manifest, write_manifest),
so the files are exactly what the format module accepts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from mpack.sidecar import (
    COMMON_NAME,
    FileMap,
    HashingWriter,
    TensorSpec,
    new_manifest,
    rank_file_name,
    read_file_map,
    target_of,
    write_manifest,
)


def _write(path: Path, specs: list[TensorSpec], rng: np.random.Generator) -> dict:
    file_map = FileMap.plan(specs, metadata={"format": "pt"})
    w = HashingWriter(path, file_map)
    for e in file_map.entries:
        w.write_at(e.offset, rng.integers(0, 256, size=e.nbytes, dtype=np.uint8).tobytes())
    size, digest = w.finish()
    return {"name": path.name, "size": size, "sha256": digest}


def make_sidecar(
    out: Path,
    *,
    tp: int = 1,
    layers: int = 2,
    hidden: int = 256,
    inter: int = 512,
    vocab: int = 512,
    common: bool = True,
    seed: int = 0,
) -> Path:
    """Write a sidecar to ``out`` (created) and return it.

    Per layer and rank: qkv_proj [Kp/16, 4*(3*hidden/tp)], o_proj, gate_up_proj, down_proj
    weights (int32) and their bf16 scales. Sizes: about 4 * layers * (4*h*h + 3*h*i) / tp bytes.
    """
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    table = {}  # the manifest's layers: every rank holds the same names and shapes (FORMAT.md)
    for i in range(layers):
        p = f"model.layers.{i}"
        for name, n, k, parallel in (
            ("self_attn.qkv_proj", 3 * hidden // tp, hidden, "column"),
            ("self_attn.o_proj", hidden, hidden // tp, "row"),
            ("mlp.gate_up_proj", 2 * inter // tp, hidden, "column"),
            ("mlp.down_proj", hidden, inter // tp, "row"),
        ):
            table[f"{p}.{name}"] = {
                "index": len(table),
                "n": n,
                "k": k,
                "np": n,
                "kp": k,
                "strategy": "channel",
                "parallel": parallel,
                "bias": False,
                "requantized": False,
                "shards": [],
            }
    for r in range(tp):
        specs = []
        for name, ly in table.items():
            specs.append(TensorSpec(f"{name}.weight", "I32", (ly["kp"] // 16, 4 * ly["np"])))
            specs.append(TensorSpec(f"{name}.weight_scale", "BF16", (1, ly["np"])))
        files.append(_write(out / rank_file_name(r, tp), specs, rng))
    if common:
        specs = [
            TensorSpec("model.embed_tokens.weight", "BF16", (vocab, hidden)),
            TensorSpec("lm_head.weight", "BF16", (vocab, hidden)),
            TensorSpec("model.norm.weight", "BF16", (hidden,)),
            TensorSpec("model.odd.scalar", "F32", ()),  # 4 bytes: after the 64-multiples
            TensorSpec("model.odd.weight", "BF16", (37,)),  # 74 bytes: the unaligned tail
        ]
        files.append(_write(out / COMMON_NAME, specs, rng))
    manifest = new_manifest(
        target=target_of(profile="w8a16", act_dtype="bfloat16", tp=tp, fusion="vllm"),
        source={"repo": "test/random", "revision": f"seed-{seed}", "files": []},
        model={"architecture": "LlamaForCausalLM", "hidden_size": hidden, "layers": layers},
        layers=table,
        files=files,
    )
    write_manifest(out, manifest)
    return out


def expected_tensors(sidecar: Path, rank: int = 0) -> dict[str, bytes]:
    """Every tensor a rank serves (rank file + common), as raw bytes read from the files."""
    import json

    m = json.loads((sidecar / "mpack.json").read_text())
    names = [rank_file_name(rank, m["target"]["tp_size"])]
    if any(f["name"] == COMMON_NAME for f in m["files"]):
        names.append(COMMON_NAME)
    out = {}
    for name in names:
        data = (sidecar / name).read_bytes()
        for e in read_file_map(sidecar / name).entries:
            out[e.name] = data[e.offset : e.offset + e.nbytes]
    return out


def digest_of_tensors(tensors: dict[str, bytes]) -> str:
    """One sha256 over (name, bytes) in name order; the probes compute the same from views."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name])
    return h.hexdigest()
