"""Mixture-of-experts blocks: the experts of one decoder layer as vLLM 0.33.0's ``FusedMoE``
holds them after its Marlin MoE preparation (``prepare_fp8_moe_layer_for_marlin``).

Per block, every expert ``e`` of ``E`` gives two Marlin linears, written into stacked tensors
under ``<block>.experts.routed_experts.`` (:data:`mpack.arch.EXPERTS_PARAMS`):

- ``w13``: the expert's gate rows, then its up rows, each sliced for the rank like a
  ``gate_up_proj`` (rows ``[r*I/T, (r+1)*I/T)``); stacked ``w13_weight`` ``[E, H/16, 8*I/T]``
  and ``w13_weight_scale`` ``[E, 1, 2*I/T]``;
- ``w2``: the down linear, its columns sliced like a ``down_proj``; ``w2_weight``
  ``[E, I/T/16, 4*H]`` and ``w2_weight_scale`` ``[E, 1, H]``.

Each expert's linear is packed exactly as a dense one (SPEC §5, §7), with one difference of
vLLM's MoE path: per-tensor scales are always requantized to the larger of gate's and up's
(``process_fp8_weight_tensor_strategy_moe``, whatever the profile: the MoE kernel is
weight-only), and never for ``w2``; and an intermediate size per rank ``I`` that is not a
multiple of 64 is zero-padded to the next one, ``Ip`` (``marlin_moe_padded_intermediate``), per
shard: ``w13`` encodes ``[gate I | 0 | up I | 0]`` with scales 0 on the zero rows
(:attr:`mpack.convert.plan.Piece.pad`), ``w2`` zero columns after its ``I``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from mpack import arch
from mpack.errors import UnsupportedSchemeError, arg
from mpack.sidecar import CONFIG_NAME

if TYPE_CHECKING:
    from mpack.convert.checkpoint import Checkpoint
    from mpack.convert.plan import OutLayer

#: vLLM's Marlin MoE tile: the intermediate size per rank, and the hidden size, are multiples.
TILE = 64


def is_expert(fam: arch.Family, module: str) -> bool:
    """Whether checkpoint module ``module`` is an expert's linear of one of ``fam``'s MoE
    blocks."""
    return fam.experts is not None and fam.experts.expert_of(module) is not None


def blocks_of(ck: Checkpoint, fam: arch.Family) -> dict[str, dict[int, set[int]]]:
    """The experts' quantized modules by MoE block: ``{block: {expert: {linear index}}}``
    (a dense family has none)."""
    blocks: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for module in ck.layers:
        hit = fam.experts.expert_of(module) if fam.experts else None
        if hit is not None:
            blocks[hit[0]][hit[1]].add(hit[2])
    return blocks


def check_blocks(
    ck: Checkpoint,
    fam: arch.Family,
    blocks: dict[str, dict[int, set[int]]],
    tp: int,
    ep: bool = False,
) -> tuple[int, int]:
    """Every MoE block has every expert of config.json, each with its three FP8 linears of the
    same shapes; the hidden size fits vLLM's Marlin MoE tile, the intermediate size splits into
    ``tp`` parts (under expert parallelism, ``ep``: the experts do). Returns
    ``(experts, intermediate)``.

    Raises:
        UnsupportedSchemeError: naming config.json or the tensor.
    """
    ex = fam.experts
    assert ex is not None
    cfg = ck.root / CONFIG_NAME
    text = ck.text_config
    count_key = next((k for k in ex.count_keys if k in text), ex.count_keys[0])
    try:
        count, inter = int(text[count_key]), int(text[ex.intermediate_key])
        hidden = int(text["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedSchemeError(f"{cfg}: missing or bad MoE dimension {e}") from None
    for block, experts in sorted(blocks.items(), key=lambda b: arch.natural_key(b[0])):
        extra = sorted(e for e in experts if e >= count)
        if extra:
            raise UnsupportedSchemeError(
                f"{ck.root}: {ex.module(block, extra[0], 0)}: expert {extra[0]}, but "
                f"{CONFIG_NAME} says {count_key}={count}",
                hint="the weights and config.json are of different models: use the "
                "checkpoint's own config.json",
            )
        for e in range(count):
            missing = [i for i in range(3) if i not in experts.get(e, ())]
            if missing:
                raise UnsupportedSchemeError(
                    f"{ck.root}: {ex.module(block, e, missing[0])}: no FP8 weight with a "
                    f"weight_scale in any shard, though {CONFIG_NAME} says {count_key}="
                    f"{count}",
                    hint="the checkpoint is incomplete: download it again",
                )
            for i, want in enumerate(((inter, hidden), (inter, hidden), (hidden, inter))):
                m = ex.module(block, e, i)
                ly = ck.layers[m]
                if (ly.n, ly.k) != want:
                    raise UnsupportedSchemeError(
                        f"{ck.root / ck.tensors[m + '.weight'].file}: {m}.weight is "
                        f"[{ly.n}, {ly.k}], {CONFIG_NAME} implies {list(want)} "
                        f"({ex.intermediate_key} {inter}, hidden_size {hidden})",
                        hint="every expert of a block has the same shapes",
                    )
        strategies = {
            ck.layers[ex.module(block, e, i)].strategy for e in range(count) for i in range(3)
        }
        if len(strategies) != 1:
            raise UnsupportedSchemeError(
                f"{ck.root}: {block}: experts mix weight strategies {sorted(strategies)}"
            )
    if hidden % TILE:
        raise UnsupportedSchemeError(
            f"{cfg}: hidden_size {hidden} is not a multiple of {TILE}: vLLM 0.33.0's Marlin MoE "
            "kernel cannot run these experts (its limit, not mpack's)",
            hint="serve the model with another --moe-backend, from the checkpoint itself",
        )
    if ep and count % tp:
        raise UnsupportedSchemeError(
            f"{cfg}: {count_key}={count} experts do not split into {arg('tp', tp)} equal "
            "parts: mpack's expert-parallel targets hold the same experts per rank (mpack's "
            "limit; vLLM gives the first ranks one more)",
            hint=f"choose a {arg('tp')} that divides {count} for {arg('ep', True)}, or convert "
            f"with {arg('ep', False)}",
        )
    if not ep and inter % tp:
        raise UnsupportedSchemeError(
            f"{cfg}: {ex.intermediate_key}={inter} does not split into {arg('tp', tp)} equal "
            "parts (vLLM 0.33.0 asserts it does)",
            hint=f"choose a {arg('tp')} that divides {inter}",
        )
    return count, inter


def padded(per: int) -> int:
    """vLLM's intermediate size per rank after ``marlin_moe_padded_intermediate`` (FP8 weights,
    no groups): the next multiple of :data:`TILE`."""
    return -(-per // TILE) * TILE


def input_scales(ck: Checkpoint, fam: arch.Family) -> list[str]:
    """The experts' static input scales (``<expert>.<linear>.input_scale``), which the sidecar
    passes through: vLLM keeps their maximum on the block after loading them (a dense layer's
    input scale goes)."""
    names = (f"{m}.input_scale" for m in ck.layers if is_expert(fam, m))
    return sorted(n for n in names if n in ck.tensors)


def owner(expert: int, count: int, tp: int) -> tuple[int, int]:
    """``(rank, local index)`` of ``expert`` of ``count`` under expert parallelism over ``tp``
    ranks: vLLM 0.33.0's ``linear`` placement (``determine_expert_map``), ``count / tp``
    consecutive experts per rank (:func:`check_blocks` refuses an uneven split)."""
    per = count // tp
    return expert // per, expert % per


def out_units(
    ck: Checkpoint,
    fam: arch.Family,
    block: str,
    count: int,
    inter: int,
    tp: int,
    ep: bool = False,
) -> list[list[OutLayer]]:
    """The block's units: every expert's ``w13``, then every expert's ``w2``, each one
    :class:`~mpack.convert.plan.OutLayer` per rank; under expert parallelism (``ep``), one
    only, on the rank that holds the whole expert (:func:`owner`)."""
    from mpack.convert.plan import OutLayer, Piece, Stack

    ex = fam.experts
    assert ex is not None
    w13, w2 = (f"{block}.experts.{p}" for p in arch.EXPERTS_PARAMS)
    per = inter if ep else inter // tp
    ip = padded(per)
    units: list[list[OutLayer]] = []
    for name in (w13, w2):
        for e in range(count):
            gate, up, down = (ex.module(block, e, i) for i in range(3))
            strategy = ck.layers[gate].strategy
            hidden = ck.layers[gate].k
            unit = []
            for rank in [owner(e, count, tp)[0]] if ep else range(tp):
                cut = 0 if ep else rank
                mine = (cut * per, (cut + 1) * per)  # the gate/up rows, the down columns
                if name == w13:
                    pieces = [Piece(m, mine, (0, hidden), ip - per) for m in (gate, up)]
                    n, k, np_, kp, parallel = 2 * per, hidden, 2 * ip, hidden, "column"
                    requant = strategy == "tensor"
                else:
                    pieces = [Piece(down, (0, hidden), mine)]
                    n, k, np_, kp, parallel, requant = hidden, per, hidden, ip, "row", False
                stack = Stack(*owner(e, count, tp)[1:], count // tp) if ep else Stack(e, count)
                unit.append(
                    OutLayer(
                        name=name,
                        rank=rank,
                        pieces=pieces,
                        n=n,
                        k=k,
                        np_=np_,
                        kp=kp,
                        strategy=strategy,
                        parallel=parallel,
                        has_bias=False,
                        requant=requant,
                        stack=stack,
                    )
                )
            units.append(unit)
    return units
