"""The output plan: fusion, TP slices, padding, and every output tensor's name, shape and offset.

Built from headers alone (SPEC §6, §9), before any tensor data moves: when :func:`make_plan`
returns, every file of the sidecar is mapped and every rejection has already happened.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack import arch, target
from mpack.arch import Dims
from mpack.convert import moe
from mpack.convert.checkpoint import Checkpoint, find_layers, open_checkpoint, passthrough_names
from mpack.convert.options import TargetSpec, check_fusion_tp
from mpack.errors import MpackError, UnsupportedSchemeError, UsageError, arg, quote
from mpack.sidecar import (
    COMMON_NAME,
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    FileMap,
    TensorSpec,
    rank_file_name,
    target_of,
)
from mpack.target import ACT_DTYPES, dir_name

if TYPE_CHECKING:
    from mpack.convert.scheme_check import SchemeCheck


@dataclass(frozen=True)
class Piece:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of one checkpoint module's weight, then
    ``pad`` rows of zeros (their scales 0: vLLM's Marlin MoE tile padding of each of gate and up,
    ``marlin_moe_padded_intermediate``)."""

    module: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    pad: int = 0
    #: Heads of this many rows, each in vLLM's rotary order (its even rows, then its odd ones:
    #: Llama 4's q and k, :attr:`mpack.arch.Family.rotary_permuted`); 0: the rows in order.
    head: int = 0

    @property
    def width(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def take(self) -> slice | list[int]:
        """The module's rows of the piece, in the order the layer holds them: an index for
        its weight (torch or numpy) and its per-channel scales or bias."""
        r0, r1 = self.rows
        if not self.head:
            return slice(r0, r1)
        h = self.head
        return [h0 + j for h0 in range(r0, r1, h) for j in (*range(0, h, 2), *range(1, h, 2))]


@dataclass(frozen=True)
class Stack:
    """Where one expert's layer sits in its MoE block's stacked tensors: expert ``index`` of
    ``count`` (mpack/convert/moe.py)."""

    index: int
    count: int


@dataclass
class OutLayer:
    """One Marlin linear of one rank: its pieces (fused in row order) and padded dims; for an
    expert of a MoE block, its slot in the block's stacked tensors (``stack``)."""

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
    stack: Stack | None = None

    @property
    def widths(self) -> list[int]:
        return [p.width for p in self.pieces]

    @property
    def rows(self) -> int:
        """The rows of the fused matrix the Marlin tensors encode: ``n``, and the zero rows
        between pieces (:attr:`Piece.pad`)."""
        return self.n + sum(p.pad for p in self.pieces)

    def row_index(self) -> list[int] | None:
        """Where the ``n`` checkpoint rows sit among :attr:`rows` (None: in order, no
        padding between pieces)."""
        if not any(p.pad for p in self.pieces):
            return None
        out: list[int] = []
        at = 0
        for p in self.pieces:
            out.extend(range(at, at + p.width))
            at += p.width + p.pad
        return out

    def modules(self) -> list[str]:
        """The checkpoint modules the layer is made of, each once, in row order."""
        return list(dict.fromkeys(p.module for p in self.pieces))

    def tensor_specs(self, act_dtype: str) -> list[TensorSpec]:
        """The tensors the layer is written into (a stacked one whole: :meth:`slot`)."""
        experts = self.stack.count if self.stack else None
        specs = target.packed_specs(self.name, self.np_, self.kp, act_dtype, self.has_bias, experts)
        return [TensorSpec(*spec) for spec in specs]

    def file_specs(self, act_dtype: str) -> list[TensorSpec]:
        """The tensors the layer adds to its rank file's plan: all of them, or for an expert,
        the stacked tensors once (with expert 0)."""
        return self.tensor_specs(act_dtype) if not self.stack or not self.stack.index else []

    def slot(self, offset: int, nbytes: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of the layer's part of a tensor at ``offset`` of ``nbytes``:
        the whole of it, or an expert's slice of a stacked one."""
        if self.stack is None:
            return offset, nbytes
        one = nbytes // self.stack.count
        return offset + self.stack.index * one, one


@dataclass
class Plan:
    """Everything ``convert`` will write. ``units[i]`` = the i-th output layer on every rank
    that has it."""

    ckpt: Checkpoint
    profile: str
    act_dtype: str
    tp: int
    fusion: str
    #: [unit][one per rank in rank order; an expert-parallel target's expert: its rank only]
    units: list[list[OutLayer]]
    passthrough: list[str]
    files: dict[str, FileMap] = field(default_factory=dict)  # file name -> its map
    ep: bool = False  # experts split whole across the ranks (mpack.target.EXPERT_PARALLEL)

    @property
    def target(self) -> dict[str, Any]:
        return target_of(
            profile=self.profile,
            act_dtype=self.act_dtype,
            tp=self.tp,
            fusion=self.fusion,
            ep=self.ep,
        )

    def layers_manifest(self) -> dict[str, Any]:
        """Per output layer (rank 0 shown; every rank has the same dims). A MoE block's stacked
        layer is one entry (its first expert's unit and shards) with ``experts``, the count per
        rank."""
        out = {}
        for i, unit in enumerate(self.units):
            ly = unit[0]
            if ly.stack is not None and (ly.stack.index or ly.rank):
                continue
            out[ly.name] = {
                "index": i,
                "n": ly.n,
                "k": ly.k,
                "np": ly.np_,
                "kp": ly.kp,
                "strategy": ly.strategy,
                "parallel": ly.parallel,
                "bias": ly.has_bias,
                "requantized": ly.requant,
                "shards": [
                    {"module": p.module, "rows": p.width, **({"pad": p.pad} if p.pad else {})}
                    for p in ly.pieces
                ],
                **({"experts": ly.stack.count} if ly.stack else {}),
            }
        return out

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


# --- model dimensions ---------------------------------------------------------------------


def layout(ck: Checkpoint) -> arch.Layout:
    """Where the checkpoint keeps its language model, and that model's family (None: unknown;
    :func:`family` refuses it). A wrapper's language model is found from config.json
    (:func:`mpack.arch.text_architecture`)."""
    return arch.layout_of(ck.architecture, arch.text_architecture(ck.architecture, ck.config))


def model_dims(ck: Checkpoint) -> Dims:
    try:
        return arch.dims_of(layout(ck).text_architecture, ck.text_config)
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedSchemeError(
            f"{ck.root / CONFIG_NAME}: missing or bad model dimension {e}"
        ) from None


def check_decoder_layers(ck: Checkpoint) -> None:
    """The decoder layers the weights hold (``model.layers.<i>.``; a wrapper's language
    model's, in vLLM's names; every tensor, quantized or not) are exactly
    ``0 .. num_hidden_layers - 1`` of config.json, for the architectures whose rules mpack knows:
    vLLM builds ``num_hidden_layers`` layers and refuses the sidecar only after it has
    allocated them, minutes in.

    Raises:
        UnsupportedSchemeError: ``num_hidden_layers`` missing or not a positive whole number, or
            other layers than it says (naming the value, the layers found and a file).
    """
    lay = layout(ck)
    if lay.family is None:
        return
    cfg = ck.root / CONFIG_NAME
    n = ck.text_config.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        what = "has no num_hidden_layers" if n is None else f"num_hidden_layers is {quote(n)}"
        raise UnsupportedSchemeError(
            f"{cfg}: {what}, not a positive whole number of decoder layers",
            hint="use the checkpoint's own config.json",
        )
    found = {i for i in map(lay.decoder_index, ck.tensors) if i is not None}
    extra = sorted(i for i in found if i >= n)
    if not extra and len(found) == n:
        return
    held = _spans(sorted(found)) or "none"
    if extra:
        held_by = (t for t in ck.tensors if lay.decoder_index(t) == extra[0])
        first = min(held_by, key=arch.natural_key)  # the layer's first tensor, as people sort
        why = f"{ck.root / ck.tensors[first].file} holds {first}"
    else:
        gap = next(i for i in range(n) if i not in found)
        named = " in vLLM's names" if lay.wrapper is not None else ""
        why = f"no shard holds {lay.decoder_prefix}.{gap}.*{named}"
    contiguous = len(found) > 0 and max(found) == len(found) - 1
    raise UnsupportedSchemeError(
        f"{cfg}: num_hidden_layers is {n}, but the weights hold decoder layers {held} ({why}): "
        "the config does not describe these weights, and vLLM would refuse the sidecar",
        hint=(
            f"these weights are a model of {len(found)} layers: correct num_hidden_layers, or "
            "use the config.json that came with them"
            if contiguous
            else "a shard is missing or belongs to another model: download the checkpoint again"
        ),
    )


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``; the first 8 runs, then how many more."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    shown_runs = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:8]]
    more = f" (and {len(runs) - 8} more runs)" if len(runs) > 8 else ""
    return ", ".join(shown_runs) + more


def check_tp(ck: Checkpoint, dims: Dims, tp: int) -> None:
    """The TP size must fit the heads and the MLP (:func:`mpack.arch.tp_problem`)."""
    problem = arch.tp_problem(dims, tp)
    if problem:
        raise UnsupportedSchemeError(
            f"{ck.root / CONFIG_NAME}: {problem}", hint=f"choose a {arg('tp')} that divides them"
        )


# --- planning -----------------------------------------------------------------------------


def family(ck: Checkpoint) -> arch.Family:
    """The family of the checkpoint's (language) model (:data:`mpack.arch.FAMILIES`).

    Raises:
        UnsupportedSchemeError: an architecture mpack has no fusion/TP rules for, or a wrapper
            (:data:`mpack.arch.WRAPPERS`) whose language model is one.
    """
    why = arch.NOT_IN_VLLM.get(ck.architecture or "")
    if why:
        raise UnsupportedSchemeError(
            f"{ck.root / CONFIG_NAME}: architecture {ck.architecture}: vLLM 0.33.0 cannot run "
            f"it ({why}), so there is no Marlin layout to pack for",
            hint="serve it with an engine that supports it, without mpack",
        )
    lay = layout(ck)
    if lay.wrapper is not None and lay.family is None:
        text = ck.text_config.get("model_type") if lay.text_architecture is None else None
        what = (
            f"language model {lay.text_architecture!r}"
            if lay.text_architecture
            else f"language model of text_config.model_type {text!r}"
        )
        raise UnsupportedSchemeError(
            f"{ck.root / CONFIG_NAME}: {ck.architecture} wraps a {what}, which has no "
            f"fusion/TP rules in mpack (known: {', '.join(arch.ARCHITECTURES)})",
            hint=arch.unknown_architecture_hint(),
        )
    fam = lay.family
    if fam is None:
        raise UnsupportedSchemeError(
            f"{ck.root / CONFIG_NAME}: architecture {ck.architecture!r} has no fusion/TP rules in "
            f"mpack (known: {', '.join(arch.ARCHITECTURES + arch.WRAPPER_ARCHITECTURES)})",
            hint=arch.unknown_architecture_hint(),
        )
    return fam


def _group_vllm(ck: Checkpoint, fam: arch.Family) -> list[tuple[str, list[str]]]:
    """Group quantized modules into vLLM's fused linears: [(out_name, [modules in row order])],
    ``out_name`` vLLM's (a wrapper's: :meth:`mpack.arch.Layout.vllm_name`), the modules the
    checkpoint's."""
    lay = layout(ck)
    groups: dict[str, list[str]] = {}
    for module in (m for m in ck.layers if not moe.is_expert(fam, m)):  # experts: moe's
        name = arch.fused_name(module)
        part = lay.part_of(lay.vllm_name(module))
        if part != arch.LANGUAGE_MODEL:
            raise UnsupportedSchemeError(
                f"{ck.root}: quantized module {module!r} is in the {part}, not in the language "
                "model's decoder layers: mpack packs the language model's linears only",
                hint="use a checkpoint whose quantization ignores the vision tower and the "
                "projector (llm-compressor's multimodal recipes do)",
            )
        if name is None:
            leaf = module.rpartition(".")[2]
            what = "a quantized lm_head" if leaf == "lm_head" else f"quantized module {module!r}"
            raise UnsupportedSchemeError(
                f"{ck.root}: {what} is not part of vLLM's fused Llama-family linears",
                hint="use a checkpoint that leaves it unquantized (ignore), or "
                f"{arg('fuse', 'none')} {arg('tp', 1)} (a sidecar vLLM's --load-format mpack "
                f"cannot load: it needs {arg('fuse', 'vllm')})",
            )
        groups.setdefault(name, []).append(module)
    for name, members in groups.items():
        want = arch.shard_modules(name, fam)
        missing = [m for m in want if m not in members]
        if missing:
            raise UnsupportedSchemeError(
                f"{ck.root}: {name} needs {', '.join(want)}; "
                f"quantized FP8 {', '.join(missing)} not found"
            )
        groups[name] = want
    named = ((lay.vllm_name(name), members) for name, members in groups.items())
    return sorted(named, key=lambda g: arch.layer_order(g[0]))


def _slices(
    ck: Checkpoint, fam: arch.Family, dims: Dims, name: str, members: list[str], tp: int, rank: int
) -> tuple[list[Piece], str]:
    """Rows/cols of each part on ``rank`` (SPEC §6) and the parallel style."""
    L = ck.layers
    dims = arch.linear_dims(dims, name)
    style = arch.parallel_style(name)
    rows = arch.shard_rows(dims, name, tp, rank)  # at TP 1: every row (_check_shapes)
    if rows is not None:
        # The checkpoint's name of the linear: vLLM's, unless a wrapper maps it (Layout).
        ck_name = arch.fused_name(members[0])
        assert ck_name is not None, "_group_vllm grouped it"
        leaf = name.rpartition(".")[2]
        parts = zip(
            arch.part_modules(ck_name, fam),
            arch.FUSED[leaf],
            rows,
            arch.part_offsets(fam, dims, name),
            strict=True,
        )
        return [
            Piece(m, (r0 + at, r1 + at), (0, L[m].k), head=arch.rotary_head(fam, dims, part))
            for m, part, (r0, r1), at in parts
        ], style
    (m,) = members
    per = L[m].k // tp
    return [Piece(m, (0, L[m].n), (rank * per, (rank + 1) * per))], style


def _check_shapes(ck: Checkpoint, dims: Dims, name: str, members: list[str]) -> None:
    layers = [ck.layers[m] for m in members]
    for what, values in (
        ("have different K", {ly.k for ly in layers}),
        ("mix strategies", {ly.strategy for ly in layers}),
    ):
        if len(values) != 1:
            raise UnsupportedSchemeError(f"{ck.root}: {name}: fused shards {what} {sorted(values)}")
    if len({ly.has_bias for ly in layers}) != 1:
        raise UnsupportedSchemeError(
            f"{ck.root}: {name}: some fused shards have a bias and some do not"
        )
    dims = arch.linear_dims(dims, name)
    want_n, want_k = arch.expected_rows(dims), arch.expected_cols(dims)
    for m, ly in zip(members, layers, strict=True):
        sub = m.rpartition(".")[2]
        where = f"{ck.root / ck.tensors[m + '.weight'].file}: {m}.weight"
        if sub in want_n and ly.n != want_n[sub]:
            parts = arch.FUSED.get(sub)
            made_of = (
                " (" + " + ".join(f"{p.removesuffix('_proj')} {want_n[p]}" for p in parts) + ")"
                if parts
                else ""
            )
            raise UnsupportedSchemeError(
                f"{where} has N={ly.n} rows, {CONFIG_NAME} implies {want_n[sub]}{made_of} "
                f"(num_attention_heads {dims.heads}, "
                f"num_key_value_heads {dims.kv_heads}, head_dim {dims.head_dim}, "
                f"intermediate_size {dims.intermediate})",
                hint=f"the weights and {CONFIG_NAME} are of different models: use the "
                "checkpoint's own config.json",
            )
        if sub in want_k and ly.k != want_k[sub]:
            raise UnsupportedSchemeError(
                f"{where} has K={ly.k}, {CONFIG_NAME} implies {want_k[sub]}",
                hint=f"the weights and {CONFIG_NAME} are of different models: use the "
                "checkpoint's own config.json",
            )


def _groups(
    ck: Checkpoint, fusion: str, tp: int
) -> tuple[list[tuple[str, list[str]]], tuple[arch.Family, Dims] | None]:
    """The output layers and their checkpoint modules; the family and model dims when fusing."""
    if fusion == "none":
        check_fusion_tp(fusion, tp)
        return sorted(((m, [m]) for m in ck.layers), key=lambda g: arch.natural_key(g[0])), None
    fam = family(ck)
    groups = _group_vllm(ck, fam)
    dims = model_dims(ck)
    check_tp(ck, dims, tp)
    for name, members in groups:
        _check_shapes(ck, dims, name, members)
    return groups, (fam, dims)


def _out_layer(
    ck: Checkpoint,
    name: str,
    members: list[str],
    fused: tuple[arch.Family, Dims] | None,
    tp: int,
    rank: int,
    profile: str,
) -> OutLayer:
    """``name`` on ``rank``: its pieces and padded dims."""
    if fused is None:
        m = members[0]
        pieces, parallel = [Piece(m, (0, ck.layers[m].n), (0, ck.layers[m].k))], "none"
    else:
        pieces, parallel = _slices(ck, *fused, name, members, tp, rank)
    n = sum(p.width for p in pieces)
    k = pieces[0].cols[1] - pieces[0].cols[0]
    if k % 4:
        raise UnsupportedSchemeError(
            f"{ck.root}: {name} on rank {rank}: K slice {k} is not a multiple of 4"
        )
    np_, kp = target.padded_nk(n, k)
    first = ck.layers[members[0]]
    return OutLayer(
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
    )


def _with_experts(
    ck: Checkpoint, fam: arch.Family, units: list[list[OutLayer]], tp: int, ep: bool
) -> list[list[OutLayer]]:
    """``units`` and the MoE blocks' expert units (mpack/convert/moe.py), each decoder layer's
    after its dense linears.

    Raises:
        UnsupportedSchemeError: an expert-parallel target (``ep``) of a dense model.
    """
    blocks = moe.blocks_of(ck, fam)
    if not blocks:
        if ep:
            raise UnsupportedSchemeError(
                f"{ck.root / CONFIG_NAME}: {arg('ep', True)} splits a mixture-of-experts "
                f"model's experts across the ranks; {ck.architecture} has none",
                hint=f"convert with {arg('ep', False)}",
            )
        return units
    count, inter = moe.check_blocks(ck, fam, blocks, tp, ep)
    for block in blocks:
        units += moe.out_units(ck, fam, block, count, inter, tp, ep)

    def order(unit: list[OutLayer]) -> tuple[int, int]:
        return (arch.decoder_index(unit[0].name) or 0, unit[0].stack is not None)

    return sorted(units, key=order)  # stable: the dense order, then the experts'


def check_profile(ck: Checkpoint, profile: str) -> None:
    """``profile`` must be one vLLM 0.33.0 runs the checkpoint's format with on Marlin
    (:data:`mpack.target.QUANT_METHODS`).

    Raises:
        UnsupportedSchemeError: naming the format, the profile and the profiles it has.
    """
    runs = target.QUANT_METHODS[ck.quant_method]
    if profile not in runs:
        raise UnsupportedSchemeError(
            f"{ck.root / CONFIG_NAME}: quant_method {ck.quant_method}: vLLM 0.33.0 runs this "
            f"checkpoint on Marlin with {', '.join(runs.values())}, the {', '.join(runs)} "
            f"profile, never as {profile}",
            hint=f"convert with {arg('profile', next(iter(runs)))}",
        )


def make_plan(
    ck: Checkpoint,
    *,
    profile: str,
    act_dtype: str,
    tp: int,
    fusion: str,
    passthrough: bool = True,
    ep: bool = False,
) -> Plan:
    """Fuse, slice and pad every quantized layer; lay out every output file.

    Raises:
        UsageError: ``--fuse none`` with ``tp > 1``.
        UnsupportedSchemeError: a profile vLLM does not run the checkpoint with, an unknown
            architecture for fusion, a TP size that does not fit, shapes that disagree with
            config.json.
    """
    check_profile(ck, profile)
    groups, fused = _groups(ck, fusion, tp)
    units = [
        [_out_layer(ck, name, members, fused, tp, rank, profile) for rank in range(tp)]
        for name, members in groups
    ]
    through = passthrough_names(ck) if passthrough else []
    if fused is not None:
        units = _with_experts(ck, fused[0], units, tp, ep)
        if passthrough:
            through = sorted(through + moe.input_scales(ck, fused[0]))
    elif ep:
        raise UsageError(
            f"{arg('ep', True)} needs {arg('fuse', 'vllm')}: expert parallelism is vLLM's layout"
        )
    plan = Plan(ck, profile, act_dtype, tp, fusion, units, through, ep=ep)
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "tp_size": str(tp),
        "profile": profile,
        "act_dtype": act_dtype,
    }
    for rank in range(tp):
        specs = [s for u in units for ly in u if ly.rank == rank for s in ly.file_specs(act_dtype)]
        plan.files[rank_file_name(rank, tp)] = FileMap.plan(specs, {**meta, "rank": str(rank)})
    if plan.passthrough:
        specs = [TensorSpec(n, ck.tensors[n].dtype, ck.tensors[n].shape) for n in plan.passthrough]
        # no target keys: the same bytes in every target of one source (Note [shared uploads]
        # in mpack/hub.py)
        common_meta = {k: meta[k] for k in ("format", "format_version")}
        plan.files[COMMON_NAME] = FileMap.plan(specs, {**common_meta, "content": "pass-through"})
    return plan


# --- open and plan every target -----------------------------------------------------------


def act_dtype_of(ck: Checkpoint, requested: str | None) -> str:
    """The activation dtype of a target: ``requested``, else the checkpoint's own dtype."""
    if requested:
        return requested
    dt = ck.dtype
    if dt in ACT_DTYPES:
        return dt
    raise UnsupportedSchemeError(
        f"{ck.root / CONFIG_NAME}: model dtype {dt!r} is not an activation dtype Marlin supports",
        hint=f"pass {arg('act_dtype', 'bfloat16')} or {arg('act_dtype', 'float16')}",
    )


# Note [planning without the cyclic collector]: planning a MoE model makes some hundred
# thousand small objects that live on (a header entry and a SourceTensor per tensor, an OutLayer
# and its Pieces per expert and rank), and CPython's cyclic collector walks every live object
# each time its oldest generation grows by a quarter: seven full walks while planning
# Qwen3-30B-A3B's 48 layers (56,000 tensors), which free nothing (the plan holds no cycles) and
# took a third of the planning (figures: docs/BENCHMARKS.md, section 18). So the collector is off
# while :func:`open_and_plan` runs, and back as it was after (reference counting frees as
# always).
@contextlib.contextmanager
def _no_cyclic_collector() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def open_and_plan(
    root: Path,
    check: SchemeCheck,
    specs: Sequence[TargetSpec],
    *,
    fuse: str,
    passthrough: bool,
    skip_invalid: bool = False,
) -> tuple[Checkpoint, list[Plan], list[tuple[str, str]]]:
    """Parse every header and find and validate every layer once (SPEC §1), then plan every
    target: what a conversion (:func:`mpack.convert.pipeline.run_convert`) and a re-derivation
    (:mod:`mpack.verify.rederive`) both start with. Returns the checkpoint, a plan per target
    (named by :func:`mpack.target.dir_name`, repeats dropped) and the ``(name, why)`` of each
    target left out (only with ``skip_invalid``).

    With the scheme check in a child (``check``), its error comes first: the same order as
    inline. Errors of the checkpoint itself (every target hits them) are raised as they are;
    a target that cannot be planned refuses the run, naming it, unless ``skip_invalid`` and
    another can. The scale values are checked later, once a backend is open. Python's cyclic
    collector is off meanwhile (Note [planning without the cyclic collector]).
    """
    with check.errors_first(), _no_cyclic_collector():
        ck = open_checkpoint(root, scheme=not check.deferred)
        find_layers(ck)
        check_decoder_layers(ck)
        plans: dict[str, Plan] = {}
        bad: list[tuple[str, MpackError]] = []
        for s in specs:
            act = act_dtype_of(ck, s.act_dtype)
            t = target_of(profile=s.profile, act_dtype=act, tp=s.tp, fusion=fuse, ep=s.ep)
            name = dir_name(t)
            if name in plans or any(n == name for n, _ in bad):
                continue  # the checkpoint's dtype named both ways
            try:
                plans[name] = make_plan(
                    ck,
                    profile=s.profile,
                    act_dtype=act,
                    tp=s.tp,
                    fusion=fuse,
                    passthrough=passthrough,
                    ep=s.ep,
                )
            except (UnsupportedSchemeError, UsageError) as e:
                bad.append((name, e))
    if bad and not plans and len({str(e) for _, e in bad}) == 1:
        raise bad[0][1]  # one error for every target: the checkpoint's own
    if bad and (not skip_invalid or not plans):
        listed = "; ".join(f"{n}: {e}" for n, e in bad)
        raise UnsupportedSchemeError(
            f"{len(bad)} of {len(bad) + len(plans)} targets cannot be made: {listed}",
            hint=f"drop them from {arg('tp')} / {arg('profile')} / {arg('act_dtype')}, or pass "
            f"{arg('skip_invalid', True)} to convert the others",
        )
    units = [[(u[0].name, u[0].modules()) for u in p.units] for p in plans.values()]
    assert all(u == units[0] for u in units), "targets of one fusion share their units"
    return ck, list(plans.values()), [(n, str(e)) for n, e in bad]
