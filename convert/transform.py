"""The per-layer transform (SPEC §3): read a unit's checkpoint tensors, fuse and slice them, pack.

``read_unit`` -> :func:`fuse` -> :func:`pack` is everything a conversion does to the bytes of one
layer; :func:`transform` is the last two in one call. The module is pure: no threads, and no I/O
besides :func:`read_unit`'s reads through the :class:`~mpack.convert.checkpoint.Checkpoint`.
The streaming pipeline (:mod:`mpack.convert.stream`) runs it for every layer, and verification
runs it again to compare.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from mpack import target
from mpack.convert import cuda_repack, marlin
from mpack.convert.checkpoint import Checkpoint, read_scale
from mpack.convert.plan import OutLayer
from mpack.sidecar import torch_dtype
from mpack.target import BIAS, SCALE, WEIGHT


def read_unit(
    ck: Checkpoint,
    unit: list[OutLayer],
    read_weight: Callable[[str], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor the unit's layers need: weights as uint8 ``[N, K]`` (read by
    ``read_weight``, default: into CPU memory), scales as float32, biases as stored."""
    src: dict[str, torch.Tensor] = {}
    for module in dict.fromkeys(p.module for p in unit[0].pieces):
        wname = f"{module}.{WEIGHT}"
        src[wname] = (read_weight or ck.read)(wname).view(torch.uint8)
        src[f"{module}.{SCALE}"] = read_scale(ck, module)
        if unit[0].has_bias:
            src[f"{module}.{BIAS}"] = ck.read(f"{module}.{BIAS}")
    return src


@dataclass
class Fused:
    """One rank's layer before packing: what the Marlin tensors encode, in checkpoint terms."""

    weight: torch.Tensor  # uint8 [N, K]: fused, sliced, and requantized when the layer is
    scale: torch.Tensor  # float32 [N]: one scale per output channel
    bias: torch.Tensor | None  # [N] in the checkpoint's dtype


def fuse(layer: OutLayer, src: dict[str, torch.Tensor]) -> Fused:
    """Fuse and slice the checkpoint pieces of ``layer`` (SPEC §3.1-§3.2, §6).

    Args:
        src: per checkpoint module, ``<module>.weight`` uint8 ``[N, K]``,
            ``<module>.weight_scale`` float32 ``[1]`` or ``[N]``, and ``<module>.bias`` if any.
    """
    rows = [
        src[f"{p.module}.{WEIGHT}"][p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]]
        for p in layer.pieces
    ]
    w = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()  # uint8 [N, K]
    if layer.strategy == "channel":
        scale_n = torch.cat(
            [src[f"{p.module}.{SCALE}"][p.rows[0] : p.rows[1]] for p in layer.pieces]
        )
    else:
        shard_scales = torch.cat([src[f"{p.module}.{SCALE}"] for p in layer.pieces])  # fp32 [S]
        if layer.requant:
            w, s_max = marlin.requantize_shards(w, shard_scales, layer.widths)
            scale_n = marlin.broadcast_scales(torch.tensor([s_max], dtype=torch.float32), layer.n)
        else:
            scale_n = marlin.broadcast_scales(shard_scales, layer.n, layer.widths)
    bias = None
    if layer.has_bias:
        bias = torch.cat([src[f"{p.module}.{BIAS}"][p.rows[0] : p.rows[1]] for p in layer.pieces])
    return Fused(w, scale_n, bias)


def pack(
    layer: OutLayer, f: Fused, act_dtype: str, pool: Executor | None = None
) -> list[torch.Tensor]:
    """One rank's Marlin tensors for a fused layer, in the order of its tensor specs.

    The weight is packed where it is (the fused kernel on CUDA); the scales and bias, a few KB,
    are computed on the host. The bytes are the same on every device. ``pool``: threads for the
    CPU repack's blocks (:func:`mpack.convert.host_repack.block_pool`).

    Returns:
        ``[weight int32 [Kp/16, 4Np], weight_scale dt [1, Np], (bias dt [Np])]``.
    """
    dt = torch_dtype(target.act_dtype(act_dtype).st)
    out = [
        cuda_repack.pack_weight_fast(f.weight, layer.np_, layer.kp, pool),
        marlin.pack_scales(f.scale.cpu(), dt, layer.np_),
    ]
    if f.bias is not None:
        out.append(marlin.pack_bias(f.bias.cpu(), dt, layer.np_))
    return out


def transform(
    layer: OutLayer, src: dict[str, torch.Tensor], act_dtype: str, pool: Executor | None = None
) -> list[torch.Tensor]:
    """:func:`fuse` then :func:`pack`: the checkpoint pieces of ``layer`` -> its Marlin tensors."""
    return pack(layer, fuse(layer, src), act_dtype, pool)
