"""Architecture rules: how vLLM 0.33.0 fuses and splits the linears of the models mpack knows.

The one owner of these rules (SPEC §6): which architectures have them, which checkpoint modules
fuse into which vLLM linear and in what row order, which linears are row-parallel, the order of
the linears in a decoder layer, how the model dimensions are read from a (text) config, which TP
sizes fit them, and which rows of the K/V heads each rank holds. ``convert``'s planner, the
verification model and the vLLM loader all use them.

It imports neither torch nor anything else of mpack.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """How vLLM 0.33.0 builds the decoder layers of one family of models: the architectures in
    it, and what sets it apart from the Llama layout (fused ``qkv_proj`` and ``gate_up_proj``
    column-parallel, ``o_proj`` and ``down_proj`` row-parallel, under ``model.layers.<i>.``)."""

    architectures: tuple[str, ...]
    #: The checkpoint stores the fused linears themselves (Phi-3's ``qkv_proj`` and
    #: ``gate_up_proj``): vLLM cuts each into its parts (q, k, v; gate, up) by the config's sizes
    #: and slices every part for its rank, as if they had been separate tensors.
    prefused: bool = False
    #: config.json's ``head_dim`` is used; False: vLLM takes ``hidden_size // heads`` (Qwen2).
    reads_head_dim: bool = True


#: Every family whose fusion and TP rules mpack knows, by name. A new one is an entry here (and,
#: where it needs one, a module of its own): its vLLM model class's ``packed_modules_mapping``
#: must be :data:`FUSED`.
FAMILIES: dict[str, Family] = {
    "llama": Family(
        (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen3ForCausalLM",
            "Gemma2ForCausalLM",
            "GraniteForCausalLM",
        )
    ),
    "qwen2": Family(("Qwen2ForCausalLM",), reads_head_dim=False),
    # One weight_scale for a fused per-tensor linear: vLLM gives every part that scale.
    "phi3": Family(("Phi3ForCausalLM",), prefused=True),
}
#: Every architecture of :data:`FAMILIES`.
ARCHITECTURES = tuple(a for f in FAMILIES.values() for a in f.architectures)
#: Column-parallel fused linear -> its parts (vLLM's shards, checkpoint modules unless the
#: family is ``prefused``), in row order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Row-parallel linears (input features split across ranks), kept under their own names.
ROW_PARALLEL = ("o_proj", "down_proj")
#: Parts of ``qkv_proj`` that hold K/V heads (replicated when TP exceeds the KV heads).
KV_SHARDS = ("k_proj", "v_proj")
#: Within a decoder layer, the linears in the order the forward pass uses them.
LEAF_ORDER = {"qkv_proj": 0, "o_proj": 1, "gate_up_proj": 2, "down_proj": 3}
#: Where these families keep their decoder layers, in checkpoints and in vLLM's models:
#: ``model.layers.<i>.``, ``i`` from 0 to ``num_hidden_layers - 1``.
DECODER_PREFIX = "model.layers"
DECODER_INDEX = re.compile(re.escape(DECODER_PREFIX) + r"\.(\d+)\.")


def family_of(architecture: str | None) -> Family | None:
    """The family of ``architecture`` (config.json's ``architectures[0]``); None: unknown."""
    return next((f for f in FAMILIES.values() if architecture in f.architectures), None)


def unknown_architecture_hint() -> str:
    """What would make an architecture outside :data:`FAMILIES` convert."""
    return (
        "an architecture whose vLLM model class fuses qkv_proj and gate_up_proj as Llama's does "
        "is one entry of mpack.arch.FAMILIES; until then, "
        "use --fuse none --tp 1 to pack every layer under its checkpoint name, for "
        "mpack.runtime.attach or your own loader; vLLM's --load-format mpack cannot load such a "
        "sidecar (it needs --fuse vllm)"
    )


def fused_name(module: str) -> str | None:
    """The vLLM linear a checkpoint module belongs to (``...self_attn.q_proj`` ->
    ``...self_attn.qkv_proj``; a row-parallel or already fused module is its own); None: not
    one of these families' linears."""
    parent, _, leaf = module.rpartition(".")
    if leaf in ROW_PARALLEL or leaf in FUSED:
        return module
    fused = next((f for f, shards in FUSED.items() if leaf in shards), None)
    return None if fused is None else f"{parent}.{fused}"


def part_modules(name: str, family: Family) -> list[str]:
    """The checkpoint module of each part of vLLM linear ``name``, in row order: each part's
    own module, or the fused linear itself once per part (``prefused``)."""
    parent, _, leaf = name.rpartition(".")
    if leaf not in FUSED:
        return [name]
    return [name] * len(FUSED[leaf]) if family.prefused else [f"{parent}.{s}" for s in FUSED[leaf]]


def shard_modules(name: str, family: Family) -> list[str]:
    """The checkpoint modules of vLLM linear ``name``, each once, in row order."""
    return list(dict.fromkeys(part_modules(name, family)))


def part_offsets(family: Family, dims: Dims, name: str) -> list[int]:
    """Where each part of column-parallel linear ``name`` starts in its checkpoint module's
    rows: 0 for separate modules; q, k, v (gate, up) one after another when ``prefused``."""
    leaf = name.rpartition(".")[2]
    if not family.prefused:
        return [0] * len(FUSED[leaf])
    sizes = [expected_rows(dims)[s] for s in FUSED[leaf]]
    return [sum(sizes[:i]) for i in range(len(sizes))]


def parallel_style(name: str) -> str:
    """``column`` | ``row`` for a vLLM linear of the Llama family."""
    return "row" if name.rpartition(".")[2] in ROW_PARALLEL else "column"


def decoder_index(name: str) -> int | None:
    """The decoder layer a tensor or module name is in (``model.layers.7.mlp.up_proj`` -> 7);
    None outside the decoder layers."""
    m = DECODER_INDEX.match(name)
    return int(m.group(1)) if m else None


_NUM = re.compile(r"(\d+)")


def natural_key(name: str) -> list[Any]:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(p) if p.isdigit() else p for p in _NUM.split(name)]


def layer_order(name: str) -> tuple[Any, ...]:
    """Sort key of a linear: by decoder layer, then as the forward pass uses them."""
    parent, _, leaf = name.rpartition(".")
    block = parent.rpartition(".")[0] if leaf in LEAF_ORDER else parent
    return (natural_key(block), LEAF_ORDER.get(leaf, len(LEAF_ORDER)), natural_key(name))


@dataclass(frozen=True)
class Dims:
    """The model dimensions the fusion and TP rules use."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def dims_of(architecture: str | None, config: Mapping[str, Any]) -> Dims:
    """Read :class:`Dims` from a (text) config. Qwen2 ignores ``head_dim`` (vLLM's rule:
    :attr:`Family.reads_head_dim`).

    Raises:
        KeyError, TypeError, ValueError: a dimension is missing or not a number.
    """
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    inter = int(config["intermediate_size"])
    head_dim = hidden // heads
    family = family_of(architecture)
    if (family is None or family.reads_head_dim) and config.get("head_dim"):
        head_dim = int(config["head_dim"])
    return Dims(heads, kv, head_dim, inter)


def tp_problem(dims: Dims, tp: int) -> str | None:
    """Why ``tp`` does not fit the model (SPEC §1: H % T == 0, I % T == 0, and Hkv % T == 0
    when T <= Hkv, else T % Hkv == 0); None when it fits."""
    if dims.heads % tp:
        return f"--tp {tp} does not divide num_attention_heads={dims.heads}"
    if dims.intermediate % tp:
        return f"--tp {tp} does not divide intermediate_size={dims.intermediate}"
    kv = dims.kv_heads
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        return (
            f"--tp {tp} does not fit num_key_value_heads={kv} "
            "(it must divide the KV heads, or be a multiple of them)"
        )
    return None


def kv_split(dims: Dims, tp: int) -> tuple[int, int]:
    """``(KV heads per rank, ranks sharing one KV group)``: ranks replicate K/V heads when TP
    exceeds the KV heads."""
    if tp >= dims.kv_heads:
        return 1, tp // dims.kv_heads
    return dims.kv_heads // tp, 1


def shard_rows(dims: Dims, name: str, tp: int, rank: int) -> list[tuple[int, int]] | None:
    """Rows ``[r0, r1)`` of each shard of column-parallel linear ``name`` that ``rank`` holds
    (SPEC §6); None for a row-parallel linear (it splits its input features instead)."""
    leaf = name.rpartition(".")[2]
    d = dims.head_dim
    if leaf == "qkv_proj":
        nq = dims.heads // tp
        nkv, rep = kv_split(dims, tp)
        kv = ((rank // rep) * nkv * d, (rank // rep + 1) * nkv * d)
        return [(rank * nq * d, (rank + 1) * nq * d), kv, kv]
    if leaf == "gate_up_proj":
        per = dims.intermediate // tp
        return [(rank * per, (rank + 1) * per)] * 2
    return None


def distinct_ranks(shard: str, dims: Dims, tp: int) -> list[int]:
    """Ranks whose rows of ``shard`` are distinct: one per KV group for K/V shards (the others
    replicate them), every rank otherwise. Concatenated in this order they give the full rows."""
    if shard in KV_SHARDS:
        return list(range(0, tp, kv_split(dims, tp)[1]))
    return list(range(tp))


def expected_rows(dims: Dims) -> dict[str, int]:
    """Output channels (N) of each part, and of each fused linear, of the whole (TP 1) model."""
    d = dims.head_dim
    parts = {
        "q_proj": dims.heads * d,
        "k_proj": dims.kv_heads * d,
        "v_proj": dims.kv_heads * d,
        "gate_proj": dims.intermediate,
        "up_proj": dims.intermediate,
    }
    return parts | {f: sum(parts[s] for s in shards) for f, shards in FUSED.items()}


def expected_cols(dims: Dims) -> dict[str, int]:
    """Input channels (K) of each row-parallel linear of the whole (TP 1) model."""
    return {"o_proj": dims.heads * dims.head_dim, "down_proj": dims.intermediate}
