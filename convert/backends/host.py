"""The host backend: one rank's layers with numpy and the native repack, without torch.

Note [host path]: on a CPU-only runner, a conversion spent a large share of its time importing
torch (figures: docs/BENCHMARKS.md, sections 6 and 9), which it needed for nothing but tensor
arithmetic on bytes it already had in memory. This module does one rank's layer (SPEC §3) with
numpy: the weight through the native repack (:mod:`mpack.convert.host_repack`) straight from
the checkpoint rows, and the scales and bias, a few KB, with numpy's IEEE casts. The rounding
is torch's, spelled out: float16 by numpy's own round-to-nearest-even cast, bfloat16 by the
rule torch's CPU cast uses (:func:`bf16_bits`), NaN included. The bytes are those of the torch
backend (:mod:`mpack.convert.backends.torch`); tests/convert/test_host.py checks them against it
and the golden cases.

What it does not do, and leaves to the torch backend (:func:`unsupported` says why):
requantization (``w8a8-marlin`` with per-tensor shards) and a bias stored in another dtype than
BF16, F16 or F32. The driver backend (:mod:`mpack.convert.backends.driver`) is this one with the
weight repack on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from mpack import target
from mpack.convert import host_repack
from mpack.convert.backends import Piece, Refused
from mpack.convert.checkpoint import Checkpoint, float32_values, read_scale_arrays
from mpack.convert.plan import OutLayer, Plan
from mpack.target import BIAS, SCALE, WEIGHT

if TYPE_CHECKING:
    from mpack.convert.timeline import Timeline

__all__ = [
    "Buffers",
    "HostBackend",
    "act_bits",
    "backwards",
    "bf16_bits",
    "bias_bits",
    "bias_vector",
    "f16_bits",
    "gpu_pieces",
    "open_host",
    "pack_bias",
    "pack_scales",
    "read_unit",
    "read_units",
    "scale_vector",
    "transform_stack",
    "unpack_bias",
    "unpack_scales",
    "unsupported",
    "weight_rows",
]

#: Results that may wait for the writer: each holds its arrays until written.
WRITE_QUEUE = 16

#: The weight repack of layers of one shape: ``(jobs, k, Np, Kp, out)`` fills ``out``, int32
#: ``[len(jobs), Kp/16, 4*Np]``, job ``j`` the pieces of layer ``j``, each ``(rows [R, >= K]
#: uint8, (r0, r1), (c0, c1))`` (:func:`gpu_pieces`; the driver backend's GPU).
PackPieces = Callable[..., np.ndarray]

_BIAS_DTYPES = ("BF16", "F16", "F32")
_PERM = np.array(target.SCALE_PERM, dtype=np.intp)


def unsupported(plan: Plan) -> str | None:
    """Why this backend does not convert every layer of ``plan`` (None: it does)."""
    ck = plan.ckpt
    for unit in plan.units:
        for layer in unit:
            if layer.requant:
                return f"{layer.name}: requantizing per-tensor shards ({plan.profile}) is torch's"
            for p in layer.pieces if layer.has_bias else ():
                dt = ck.tensors[f"{p.module}.{BIAS}"].dtype
                if dt not in _BIAS_DTYPES:
                    return f"{p.module}.{BIAS}: a {dt} bias is cast by torch"
    return None


def open_host(plan: Plan, off: frozenset[str]) -> HostBackend:
    """The host backend for ``plan``, or :class:`Refused` and why (Note [choosing a backend])."""
    if "native-repack" in off:
        raise Refused("turned off (MPACK_NO_HOST_REPACK)")
    if not host_repack.available():
        raise Refused("the native repack is not built here")
    why = unsupported(plan)
    if why is not None:
        raise Refused(why)
    return HostBackend()


# --- buffers ----------------------------------------------------------------------------------


# Note [recycled buffers]: a fresh array of a few hundred MB is fresh memory, and the first
# write to each of its pages is a page fault in which the kernel zeroes the page; under a
# sandboxing kernel (gVisor) a fault costs more. The host path reads and writes each weight once,
# so the stream reuses its arrays: :meth:`Buffers.take` gives a cached array of that size when
# one is free, :meth:`Buffers.give` caches an array once nothing reads it any more. At most
# ``keep`` arrays of each size are cached, so the cache is bounded by the largest layers, not by
# the model. Figures: docs/BENCHMARKS.md, sections 6.1 and 9.
class Buffers:
    """Byte arrays handed round again: a checkpoint weight once its unit is transformed, a packed
    weight once it is written; at most ``keep`` of each size are cached (Note [recycled
    buffers]).

    ``alloc``: makes the arrays of :data:`MIN_BYTES` or more instead of ``np.empty``, returning
    ``(array, handle)``; ``free(handle)`` releases one that the cache has no room for, and
    :meth:`close` all the others (the driver backend's page-locked memory, Note [driver path] in
    :mod:`mpack.convert.backends.driver`). Nothing may read an array after it was given back, or
    after :meth:`close`.
    """

    MIN_BYTES = 1 << 20  # smaller arrays are cheap to make: not cached

    def __init__(
        self,
        keep: int = 3,
        alloc: Callable[[int], tuple[np.ndarray, Any]] | None = None,
        free: Callable[[Any], None] | None = None,
    ) -> None:
        self.keep, self._alloc, self._release = keep, alloc, free
        self._free: dict[int, list[np.ndarray]] = {}
        self._made: dict[int, tuple[np.ndarray, Any]] = {}  # id -> (array, handle) from alloc
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` (contents undefined)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        if self._alloc is None or nbytes < self.MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        a, handle = self._alloc(nbytes)
        with self._lock:
            self._made[id(a)] = (a, handle)
        return a

    def give(self, a: np.ndarray) -> None:
        """Cache the array ``a`` views (its root base), which nothing may read any more."""
        while isinstance(a.base, np.ndarray):
            a = a.base
        with self._lock:
            made = id(a) in self._made
            if not made and (a.base is not None or a.dtype != np.uint8 or a.ndim != 1):
                return  # not one of ours (a view of foreign memory)
            if a.nbytes < self.MIN_BYTES:
                return
            free = self._free.setdefault(a.nbytes, [])
            if any(f is a for f in free):
                return
            if len(free) < self.keep:
                free.append(a)
                return
            handle = self._made.pop(id(a))[1] if made else None
        if handle is not None and self._release is not None:
            self._release(handle)

    def close(self) -> None:
        """Release every array ``alloc`` made (none of them may be read any more)."""
        with self._lock:
            made, self._made, self._free = list(self._made.values()), {}, {}
        if self._release is not None:
            for _, handle in made:
                self._release(handle)


def _root(x: Any) -> np.ndarray | None:
    """The array a numpy array views (itself if it owns its memory); None for anything else."""
    if not isinstance(x, np.ndarray):
        return None
    while isinstance(x.base, np.ndarray):
        x = x.base
    return x


# --- casts ------------------------------------------------------------------------------------


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), as torch casts on the CPU: round to nearest even,
    every NaN to ``0xFFFF``."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(x), np.uint32(0xFFFF), rounded).astype(np.uint16)


def f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 bits (uint16), as torch casts on the CPU: numpy's round to nearest
    even (inf past the range), and a NaN keeps its sign and payload's top bits, made quiet."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        bits = x.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(x), bits | np.uint16(0x0200), bits).astype(np.uint16)


def act_bits(x: np.ndarray, act: str) -> np.ndarray:
    """float32 -> the bits (uint16) of activation dtype ``act``, rounded to nearest even."""
    if act == "float16":
        return f16_bits(x)
    if act == "bfloat16":
        return bf16_bits(x)
    raise ValueError(f"activation dtype must be float16 or bfloat16, got {act!r}")


def _bits_to_f32(bits: np.ndarray, act: str) -> np.ndarray:
    if act == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _pad_permute(bits: np.ndarray, np_: int) -> np.ndarray:
    """Zero-pad the last axis to ``np_`` and permute every group of 32 (SPEC §7.3-7.4); the
    leading axes (several layers' values) stay."""
    n, lead = bits.shape[-1], bits.shape[:-1]
    if n > np_:
        raise ValueError(f"{n} channels do not fit in Np={np_}")
    out = np.zeros((*lead, np_), dtype=np.uint16)
    out[..., :n] = bits
    return out.reshape(*lead, -1, 32)[..., _PERM].reshape(*lead, np_)


# --- the packed tensors -----------------------------------------------------------------------


def pack_scales(scale_n: np.ndarray, act: str, np_: int) -> np.ndarray:
    """float32 ``[N]`` -> the bits of ``weight_scale`` (uint16 ``[1, Np]``): cast, padded,
    permuted, then multiplied by the exponent fold (SPEC §7). The fold is a power of two, so the
    product is exact in float32 and its cast back exact too (inf past the fold limit, which
    :func:`mpack.convert.checkpoint.check_scale_values` refuses first). Several layers' at once:
    ``[m, N]`` -> ``[m, 1, Np]``."""
    scale_n = np.asarray(scale_n)
    s = _pad_permute(act_bits(scale_n, act), np_)
    folded = _bits_to_f32(s, act) * np.float32(target.act_dtype(act).exp_fold)
    return act_bits(folded, act).reshape(*scale_n.shape[:-1], 1, np_)


def pack_bias(bias_bits: np.ndarray, np_: int) -> np.ndarray:
    """Bias bits in the activation dtype (:func:`read_units`) -> ``bias`` (uint16 ``[Np]``):
    padded and permuted, no fold (SPEC §8)."""
    return _pad_permute(bias_bits, np_)


# --- one unit ---------------------------------------------------------------------------------


def bias_bits(raw: np.ndarray, dtype: str, act: str) -> np.ndarray:
    """A bias's stored bytes (safetensors ``dtype``) as the bits of activation dtype ``act``
    (uint16): as they are when already in it, else cast (rounded to nearest even)."""
    if dtype == target.act_dtype(act).st:
        return raw.view("<u2")
    return act_bits(float32_values(raw, dtype), act)


def read_unit(
    ck: Checkpoint, unit: list[OutLayer], act: str, buffers: Buffers | None = None
) -> dict[str, np.ndarray]:
    """The checkpoint arrays the unit's layers need: :func:`read_units` of one unit."""
    return read_units(ck, [unit], act, buffers)


def read_units(
    ck: Checkpoint, units: list[list[OutLayer]], act: str, buffers: Buffers | None = None
) -> dict[str, np.ndarray]:
    """The checkpoint arrays the layers of a batch of units need (Note [expert batches] in
    mpack/convert/stream.py): weights as uint8 ``[N, K]``, views of one array (from ``buffers``
    when given) read with one open per shard, scales as float32, biases already cast to ``act``
    (uint16 bits; the cast is elementwise, so it commutes with fusing and slicing)."""
    modules = [m for unit in units for m in unit[0].modules()]
    weights = [ck.tensors[f"{m}.{WEIGHT}"] for m in modules]
    total = sum(t.nbytes for t in weights)
    flat = buffers.take(total) if buffers is not None else np.empty(total, dtype=np.uint8)
    src: dict[str, np.ndarray] = {}
    parts = []
    at = 0
    for t in weights:
        view = flat[at : at + t.nbytes]
        parts.append((t.name, view, 0))
        src[t.name] = view.reshape(t.shape)
        at += t.nbytes
    ck.read_parts(parts)
    src.update((f"{m}.{SCALE}", s) for m, s in read_scale_arrays(ck, modules).items())
    for unit in units:
        for module in unit[0].modules() if unit[0].has_bias else ():
            bname = f"{module}.{BIAS}"
            src[bname] = bias_bits(ck.read_bytes(bname), ck.tensors[bname].dtype, act)
    return src


def transform_stack(
    layers: list[OutLayer],
    src: dict[str, np.ndarray],
    act_dtype: str,
    pool: Executor | None = None,
    buffers: Buffers | None = None,
    pack: PackPieces | None = None,
) -> list[np.ndarray]:
    """The Marlin tensors of ``layers`` (of one shape: one layer, or experts of one stacked
    tensor) from :func:`read_units`'s arrays, in the order of their tensor specs, each stacked:
    ``[weight int32 [m, Kp/16, 4Np], weight_scale [m, 1, Np], (bias [m, Np])]`` (the last two
    as the uint16 bits of the activation dtype; one layer's: ``[0]`` of each). The weights go
    into one array from ``buffers`` when given, repacked by ``pack`` when given (the driver
    backend's GPU, every layer in one round trip), else by the native repack on ``pool``'s
    threads."""
    first = layers[0]
    shape = (len(layers), *target.packed_weight_shape(first.np_, first.kp))
    nbytes = 4 * shape[0] * shape[1] * shape[2]
    raw = buffers.take(nbytes) if buffers is not None else np.empty(nbytes, dtype=np.uint8)
    dst = raw.view(np.int32).reshape(shape)
    if pack is not None:
        pack([gpu_pieces(ly, src) for ly in layers], first.k, first.np_, first.kp, dst)
    else:
        for ly, d in zip(layers, dst, strict=True):
            host_repack.pack_rows(weight_rows(ly, src), ly.k, ly.np_, ly.kp, pool, d)
    scales = np.stack([scale_vector(ly, src) for ly in layers])  # float32 [m, rows]
    out = [dst, pack_scales(scales, act_dtype, first.np_)]
    if first.has_bias:
        out.append(pack_bias(np.stack([bias_vector(ly, src) for ly in layers]), first.np_))
    return out


def gpu_pieces(layer: OutLayer, src: dict[str, np.ndarray]) -> list[tuple[Any, ...]]:
    """The layer's rows as pieces for a GPU repack (:data:`PackPieces`): each checkpoint piece
    (its rows in rotary order copied out: the kernel reads row ranges), and rows of zeros for
    its padding (:attr:`mpack.convert.plan.Piece.pad`)."""
    pieces: list[tuple[Any, ...]] = []
    for p in layer.pieces:
        w = src[f"{p.module}.{WEIGHT}"]
        if p.head:
            pieces.append((np.ascontiguousarray(w[p.take]), (0, p.width), p.cols))
        else:
            pieces.append((w, p.rows, p.cols))
        if p.pad:
            pieces.append((np.zeros((p.pad, layer.k), np.uint8), (0, p.pad), (0, layer.k)))
    return pieces


def weight_rows(layer: OutLayer, src: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The addresses of the layer's rows, piece by piece (fused in order, sliced in place):
    :func:`mpack.convert.host_repack.rows_of` of :func:`read_units`'s arrays, and a row of zeros
    for each padding row (:attr:`mpack.convert.plan.Piece.pad`)."""
    out = []
    for p in layer.pieces:
        rows = host_repack.rows_of(src[f"{p.module}.{WEIGHT}"], p.rows, p.cols[0])
        out.append(rows[np.asarray(p.take) - p.rows[0]] if p.head else rows)
        if p.pad:
            out.append(host_repack.zero_rows(p.pad, layer.k))
    return out


def scale_vector(layer: OutLayer, src: dict[str, np.ndarray]) -> np.ndarray:
    """The layer's float32 scale per row ``[rows]`` (0 on padding rows), from
    :func:`read_units`'s arrays."""
    if layer.strategy == "channel":
        v = np.concatenate([src[f"{p.module}.{SCALE}"][p.take] for p in layer.pieces])
    else:  # one scale per shard, each over its rows (requantized layers are not taken here)
        shard = np.concatenate([src[f"{p.module}.{SCALE}"] for p in layer.pieces])
        v = np.repeat(shard, layer.widths)
    return _spread(v, layer)


def bias_vector(layer: OutLayer, src: dict[str, np.ndarray]) -> np.ndarray:
    """The layer's bias bits in the activation dtype ``[rows]`` (uint16), fused and sliced."""
    v = np.concatenate([src[f"{p.module}.{BIAS}"][p.take] for p in layer.pieces])
    return _spread(v, layer)


def _spread(v: np.ndarray, layer: OutLayer) -> np.ndarray:
    """The layer's ``n`` values ``v`` at their rows, zeros between pieces (Piece.pad)."""
    index = layer.row_index()
    if index is None:
        return v
    out = np.zeros(layer.rows, dtype=v.dtype)
    out[index] = v
    return out


# --- the layout read backwards (mpack verify) -------------------------------------------------


def _unpermute(packed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pad_permute`'s permutation (padding kept)."""
    g = np.asarray(packed).reshape(-1, 32)
    out = np.empty_like(g)
    out[:, _PERM] = g
    return out.reshape(-1)


def unpack_scales(packed: np.ndarray, act: str, n: int) -> np.ndarray:
    """The inverse of :func:`pack_scales`: bits ``[1, Np]`` -> the cast scales' bits ``[N]``
    (unpermuted, the fold divided out: exact, a power of two)."""
    s = _bits_to_f32(_unpermute(packed), act) / np.float32(target.act_dtype(act).exp_fold)
    return act_bits(s, act)[:n]


def unpack_bias(packed: np.ndarray, n: int) -> np.ndarray:
    """The inverse of :func:`pack_bias`: bits ``[Np]`` -> ``[N]``."""
    return _unpermute(packed)[:n]


def backwards(
    layer: OutLayer,
    src: dict[str, np.ndarray],
    packed: list[np.ndarray],
    act_dtype: str,
    pool: Executor | None = None,
) -> list[tuple[str, bool]]:
    """The layout read backwards on one rank's packed tensors (:func:`transform_stack`'s order,
    one layer): ``(what, differs)`` for the weight (unpacked by the native code, to the
    checkpoint rows ``src`` holds), the scales and the bias (to the checkpoint values cast to
    ``act_dtype``). The words of ``mpack verify``'s torch path (:mod:`mpack.verify.rederive`)."""
    rows = weight_rows(layer, src)
    want_scales = act_bits(scale_vector(layer, src), act_dtype)
    out = [
        (
            f"{layer.name}.weight does not unpack to the checkpoint bytes",
            host_repack.unpack_differs(packed[0], rows, layer.k, pool),
        ),
        (
            f"{layer.name}.weight_scale does not unpack to the checkpoint scales",
            not np.array_equal(unpack_scales(packed[1], act_dtype, layer.rows), want_scales),
        ),
    ]
    if layer.has_bias:
        out.append(
            (
                f"{layer.name}.bias does not unpack to the checkpoint bias",
                not np.array_equal(unpack_bias(packed[2], layer.rows), bias_vector(layer, src)),
            )
        )
    return out


# --- the backend ------------------------------------------------------------------------------


class HostBackend:
    """The host backend (the module docstring; :class:`mpack.convert.backends.Backend`): numpy
    arrays handed round again by :class:`Buffers` (Note [recycled buffers]), the weight repacked
    by ``pack`` (default: the native repack on a pool of threads, made on first use).

    ``buffers``/``pack``/``where``/``detail``: the driver backend's page-locked arrays and GPU.
    """

    name = "host"
    write_queue = WRITE_QUEUE

    def __init__(
        self,
        buffers: Buffers | None = None,
        pack: PackPieces | None = None,
        where: str = "cpu",
        detail: str = f"weights repacked by the native repack ({host_repack.KERNEL} kernel)",
    ) -> None:
        self.buffers = buffers if buffers is not None else Buffers()
        self.where, self.detail, self._pack = where, detail, pack
        self.refused: dict[str, str] = {}
        self._stack = contextlib.ExitStack()
        self._pool: Executor | None = None

    def pool(self) -> Executor:
        """Threads for the native repack's (and unpack's) blocks, made on first use."""
        if self._pool is None:
            self._pool = self._stack.enter_context(host_repack.block_pool())
        return self._pool

    def takes(self, plan: Plan) -> str | None:
        return unsupported(plan)

    def streaming(self, abort: threading.Event, tl: Timeline) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def read_units(
        self, ck: Checkpoint, units: list[list[OutLayer]], act: str
    ) -> tuple[dict[str, np.ndarray], None]:
        return read_units(ck, units, act, self.buffers), None

    def from_raw(self, raw: dict[str, Any], ck: Checkpoint, act: str) -> dict[str, np.ndarray]:
        """What :meth:`read_units` gives, from a batch read once for several targets (weights and
        scales as arrays, biases as ``(bytes, dtype)``): the biases cast to ``act``."""
        return {n: bias_bits(*x, act) if isinstance(x, tuple) else x for n, x in raw.items()}

    def on_unit(self, src: dict[str, Any], ready: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def transform(self, layer: OutLayer, src: dict[str, np.ndarray], act: str) -> list[np.ndarray]:
        return [x[0] for x in self.transform_stack([layer], src, act)]

    def transform_stack(
        self, layers: list[OutLayer], src: dict[str, np.ndarray], act: str
    ) -> list[np.ndarray]:
        pool = None if self._pack is not None else self.pool()
        return transform_stack(layers, src, act, pool, self.buffers, self._pack)

    def read_back(
        self, layer: OutLayer, src: dict[str, np.ndarray], outs: list[np.ndarray], act: str
    ) -> list[tuple[str, bool]]:
        return backwards(layer, src, outs, act, self.pool())

    def settle(self) -> None:
        """Nothing is queued: :meth:`read_back` answers as it runs."""

    def pieces(self, result: np.ndarray) -> Iterator[Piece]:
        flat = np.ascontiguousarray(result).view(np.uint8).reshape(-1)
        yield 0, flat, None, functools.partial(self.buffers.give, result)

    def done_with(self, src: dict[str, Any]) -> None:
        # each array once: a batch's weights are views of one (given twice, it could be handed
        # out twice)
        roots = {id(r): r for r in map(_root, src.values()) if r is not None}
        for r in roots.values():
            self.buffers.give(r)

    def close(self) -> None:
        """Stop the threads, then release the arrays (nothing reads them any more)."""
        self._stack.close()
        self.buffers.close()
