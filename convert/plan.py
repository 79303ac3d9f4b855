"""The output plan: fusion, TP slices, padding, and every output tensor's name, shape and offset.

Built from headers alone (SPEC §6, §9), before any tensor data moves: when :func:`make_plan`
returns, the whole sidecar layout is known and every rejection has already happened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mpack.convert.checkpoint import BIAS, SCALE, WEIGHT, Checkpoint, passthrough_names
from mpack.convert.marlin import marlin_padded_nk
from mpack.errors import UnsupportedSchemeError, UsageError
from mpack.sidecar import (
    ACT_DTYPE_ST,
    COMMON_NAME,
    FORMAT,
    FORMAT_VERSION,
    FileLayout,
    TensorSpec,
    rank_file_name,
    target_of,
)

#: Architectures whose fusion and TP rules mpack knows (vLLM's Llama family).
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: fused output suffix -> checkpoint shard suffixes, in row order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Piece:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of one checkpoint module's weight."""

    module: str
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def width(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass
class OutLayer:
    """One Marlin linear of one rank: its pieces (fused in row order) and padded dims."""

    name: str
    rank: int
    pieces: list[Piece]
    n: int
    k: int
    np_: int
    kp: int
    strategy: str  # "tensor" | "channel"
    parallel: str  # "column" | "row" | "none"
    has_bias: bool
    requant: bool  # w8a8-marlin + tensor strategy: shards requantized to the max scale

    @property
    def widths(self) -> list[int]:
        return [p.width for p in self.pieces]

    def tensor_specs(self, act_dtype: str) -> list[TensorSpec]:
        dt = ACT_DTYPE_ST[act_dtype]
        specs = [
            TensorSpec(f"{self.name}.{WEIGHT}", "I32", (self.kp // 16, 4 * self.np_)),
            TensorSpec(f"{self.name}.{SCALE}", dt, (1, self.np_)),
        ]
        if self.has_bias:
            specs.append(TensorSpec(f"{self.name}.{BIAS}", dt, (self.np_,)))
        return specs


@dataclass
class Plan:
    """Everything ``convert`` will write. ``units[i]`` = the i-th output layer on every rank."""

    ckpt: Checkpoint
    profile: str
    act_dtype: str
    tp: int
    fusion: str
    units: list[list[OutLayer]]  # [unit][rank]
    passthrough: list[str]
    files: dict[str, FileLayout] = field(default_factory=dict)  # file name -> layout

    @property
    def target(self) -> dict[str, Any]:
        return target_of(
            profile=self.profile, act_dtype=self.act_dtype, tp=self.tp, fusion=self.fusion
        )

    def layers_manifest(self) -> dict[str, Any]:
        """Per output layer (rank 0 shown; every rank has the same dims)."""
        out = {}
        for i, unit in enumerate(self.units):
            ly = unit[0]
            out[ly.name] = {
                "index": i, "n": ly.n, "k": ly.k, "np": ly.np_, "kp": ly.kp, "strategy": ly.strategy,
                "parallel": ly.parallel, "bias": ly.has_bias, "requantized": ly.requant,
                "shards": [{"module": p.module, "rows": p.width} for p in ly.pieces],
            }  # fmt: skip
        return out

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


# --- model dimensions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def model_dims(ck: Checkpoint) -> Dims:
    c = ck.text_config
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        inter = int(c["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedSchemeError(
            f"{ck.root / 'config.json'}: missing or bad model dimension {e}"
        ) from None
    head_dim = hidden // heads
    if ck.architecture != "Qwen2ForCausalLM" and c.get("head_dim"):
        head_dim = int(c["head_dim"])
    return Dims(heads, kv, head_dim, inter)


def check_tp(ck: Checkpoint, dims: Dims, tp: int) -> None:
    """SPEC §1: H % T == 0, I % T == 0, and Hkv % T == 0 when T <= Hkv, else T % Hkv == 0."""
    where = ck.root / "config.json"
    fix = "choose a --tp that divides them"
    if dims.heads % tp:
        raise UnsupportedSchemeError(
            f"{where}: --tp {tp} does not divide num_attention_heads={dims.heads}", hint=fix
        )
    if dims.intermediate % tp:
        raise UnsupportedSchemeError(
            f"{where}: --tp {tp} does not divide intermediate_size={dims.intermediate}", hint=fix
        )
    if (tp <= dims.kv_heads and dims.kv_heads % tp) or (tp > dims.kv_heads and tp % dims.kv_heads):
        raise UnsupportedSchemeError(
            f"{where}: --tp {tp} does not fit num_key_value_heads={dims.kv_heads} "
            "(it must divide the KV heads, or be a multiple of them)",
            hint=fix,
        )


# --- planning -----------------------------------------------------------------------------


_LAYER_NUM = re.compile(r"(\d+)")


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in _LAYER_NUM.split(name)]


def _group_vllm(ck: Checkpoint) -> list[tuple[str, list[str]]]:
    """Group quantized modules into vLLM's fused linears: [(out_name, [modules in row order])]."""
    arch = ck.architecture
    if arch not in LLAMA_FAMILY:
        raise UnsupportedSchemeError(
            f"{ck.root / 'config.json'}: architecture {arch!r} has no fusion/TP rules in mpack "
            f"(known: {', '.join(LLAMA_FAMILY)})",
            hint="use --fuse none --tp 1 to pack every layer under its checkpoint name",
        )
    groups: dict[str, list[str]] = {}
    for module in ck.layers:
        parent, _, leaf = module.rpartition(".")
        if leaf in ROW_PARALLEL:
            groups[module] = [module]
            continue
        fused = next((f for f, shards in FUSED.items() if leaf in shards), None)
        if fused is None:
            what = "a quantized lm_head" if leaf == "lm_head" else f"quantized module {module!r}"
            raise UnsupportedSchemeError(
                f"{ck.root}: {what} is not part of vLLM's fused Llama-family linears",
                hint="use --fuse none --tp 1, or a checkpoint that leaves it unquantized (ignore)",
            )
        groups.setdefault(f"{parent}.{fused}", []).append(module)
    out = []
    for name, members in groups.items():
        leaf = name.rpartition(".")[2]
        if leaf in FUSED:
            parent = name.rpartition(".")[0]
            want = [f"{parent}.{s}" for s in FUSED[leaf]]
            missing = [m for m in want if m not in members]
            if missing:
                raise UnsupportedSchemeError(
                    f"{ck.root}: {name} needs {', '.join(want)}; quantized FP8 {', '.join(missing)} not found"
                )
            members = want
        out.append((name, members))
    return sorted(out, key=lambda g: _layer_order(g[0]))


#: Within a decoder layer, outputs go in the order the forward pass uses them.
_LEAF_ORDER = {"qkv_proj": 0, "o_proj": 1, "gate_up_proj": 2, "down_proj": 3}


def _layer_order(name: str) -> tuple[Any, ...]:
    parent, _, leaf = name.rpartition(".")
    block = parent.rpartition(".")[0] if leaf in _LEAF_ORDER else parent
    return (_natural_key(block), _LEAF_ORDER.get(leaf, len(_LEAF_ORDER)), _natural_key(name))


def _slices(
    ck: Checkpoint, dims: Dims, name: str, members: list[str], tp: int, rank: int
) -> tuple[list[Piece], str]:
    """Rows/cols of each member on ``rank`` (SPEC §6) and the parallel style."""
    leaf = name.rpartition(".")[2]
    L = ck.layers
    d = dims.head_dim
    if tp == 1:
        return [
            Piece(m, (0, L[m].n), (0, L[m].k)) for m in members
        ], "column" if leaf in FUSED else "row"
    if leaf == "qkv_proj":
        nq = dims.heads // tp
        nkv, rep = (1, tp // dims.kv_heads) if tp >= dims.kv_heads else (dims.kv_heads // tp, 1)
        q, k, v = members
        kvr = ((rank // rep) * nkv * d, (rank // rep + 1) * nkv * d)
        return [
            Piece(q, (rank * nq * d, (rank + 1) * nq * d), (0, L[q].k)),
            Piece(k, kvr, (0, L[k].k)),
            Piece(v, kvr, (0, L[v].k)),
        ], "column"
    if leaf == "gate_up_proj":
        per = dims.intermediate // tp
        return [Piece(m, (rank * per, (rank + 1) * per), (0, L[m].k)) for m in members], "column"
    (m,) = members
    per = L[m].k // tp
    return [Piece(m, (0, L[m].n), (rank * per, (rank + 1) * per))], "row"


def _check_shapes(ck: Checkpoint, dims: Dims, name: str, members: list[str]) -> None:
    d = dims.head_dim
    want_n = {
        "q_proj": dims.heads * d, "k_proj": dims.kv_heads * d, "v_proj": dims.kv_heads * d,
        "gate_proj": dims.intermediate, "up_proj": dims.intermediate,
    }  # fmt: skip
    want_k = {"o_proj": dims.heads * d, "down_proj": dims.intermediate}
    ks = {ck.layers[m].k for m in members}
    if len(ks) != 1:
        raise UnsupportedSchemeError(
            f"{ck.root}: {name}: fused shards have different K {sorted(ks)}"
        )
    strategies = {ck.layers[m].strategy for m in members}
    if len(strategies) != 1:
        raise UnsupportedSchemeError(
            f"{ck.root}: {name}: fused shards mix strategies {sorted(strategies)}"
        )
    biases = {ck.layers[m].has_bias for m in members}
    if len(biases) != 1:
        raise UnsupportedSchemeError(
            f"{ck.root}: {name}: some fused shards have a bias and some do not"
        )
    for m in members:
        sub = m.rpartition(".")[2]
        ly = ck.layers[m]
        if sub in want_n and ly.n != want_n[sub]:
            raise UnsupportedSchemeError(
                f"{ck.root}: {m}.weight has N={ly.n}, config.json implies {want_n[sub]} (heads/head_dim/intermediate)"
            )
        if sub in want_k and ly.k != want_k[sub]:
            raise UnsupportedSchemeError(
                f"{ck.root}: {m}.weight has K={ly.k}, config.json implies {want_k[sub]}"
            )


def make_plan(
    ck: Checkpoint, *, profile: str, act_dtype: str, tp: int, fusion: str, passthrough: bool = True
) -> Plan:
    """Fuse, slice and pad every quantized layer; lay out every output file.

    Raises:
        UsageError: ``--fuse none`` with ``tp > 1``.
        UnsupportedSchemeError: an unknown architecture for fusion, a TP size that does not fit,
            shapes that disagree with config.json.
    """
    if fusion == "none" and tp != 1:
        raise UsageError(
            f"--fuse none packs layers under checkpoint names and needs --tp 1 (got --tp {tp})"
        )
    if fusion == "vllm":
        groups = _group_vllm(ck)
        dims = model_dims(ck)
        check_tp(ck, dims, tp)
        for name, members in groups:
            _check_shapes(ck, dims, name, members)
    else:
        groups = sorted(((m, [m]) for m in ck.layers), key=lambda g: _natural_key(g[0]))
        dims = None
    units: list[list[OutLayer]] = []
    for name, members in groups:
        unit = []
        for rank in range(tp):
            if dims is None:
                m = members[0]
                pieces, parallel = [Piece(m, (0, ck.layers[m].n), (0, ck.layers[m].k))], "none"
            else:
                pieces, parallel = _slices(ck, dims, name, members, tp, rank)
            n = sum(p.width for p in pieces)
            k = pieces[0].cols[1] - pieces[0].cols[0]
            if k % 4:
                raise UnsupportedSchemeError(
                    f"{ck.root}: {name} on rank {rank}: K slice {k} is not a multiple of 4"
                )
            np_, kp = marlin_padded_nk(n, k)
            first = ck.layers[members[0]]
            unit.append(
                OutLayer(
                    name=name,
                    rank=rank,
                    pieces=pieces,
                    n=n,
                    k=k,
                    np_=np_,
                    kp=kp,
                    strategy=first.strategy,
                    parallel=parallel,
                    has_bias=first.has_bias,
                    requant=profile == "w8a8-marlin" and first.strategy == "tensor",
                )  # fmt: skip
            )
        units.append(unit)
    plan = Plan(
        ck, profile, act_dtype, tp, fusion, units, passthrough_names(ck) if passthrough else []
    )
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "tp_size": str(tp),
            "profile": profile, "act_dtype": act_dtype}  # fmt: skip
    for rank in range(tp):
        specs = [s for unit in units for s in unit[rank].tensor_specs(act_dtype)]
        plan.files[rank_file_name(rank, tp)] = FileLayout.plan(specs, {**meta, "rank": str(rank)})
    if plan.passthrough:
        specs = [TensorSpec(n, ck.tensors[n].dtype, ck.tensors[n].shape) for n in plan.passthrough]
        plan.files[COMMON_NAME] = FileLayout.plan(specs, {**meta, "content": "pass-through"})
    return plan
