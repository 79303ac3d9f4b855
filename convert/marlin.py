"""The Marlin FP8 layout (vLLM 0.33.0), in both directions. This module owns it.

What vLLM's FP8 Marlin kernel reads for one linear layer, and how mpack builds it from a
compressed-tensors checkpoint weight ``Wck`` (float8_e4m3fn ``[N, K]``, row-major):

* **Padding** (SPEC §3.3): ``N`` and ``K`` grow to ``(Np, Kp)``, zero bytes at the end of each.
* **Weight** (SPEC §5): the fp8 bytes are cut into tiles of 16 (k) x 64 (n), tiles in row-major
  order (k-tile outer), each 1024 bytes = 256 int32 words holding four k-values of one column
  apiece (which, where: docs/LAYOUT.md, "The tile formula"). The result is int32
  ``[Kp/16, 4*Np]``; a k-tile is one row of it.
* **Scales** (SPEC §7): one per output channel, cast to the activation dtype, zero-padded,
  permuted inside every group of 32 channels, and multiplied by ``2**8`` (fp16) or ``2**120``
  (bf16) to undo the exponent shift of the kernel's fp8 widening.
* **Bias** (SPEC §8): cast, zero-padded, same 32-group permutation, no fold.
* **Requantization** (SPEC §4, ``w8a8-marlin`` profile): shards re-expressed in the largest
  shard scale with vLLM's GPU arithmetic.

Every function works on CPU and CUDA tensors and gives the same bytes on both: the layout is
pure data movement, and the arithmetic is spelled out one IEEE operation at a time. Inverses
(``unpack_*``) live next to each packer; ``mpack verify`` and the tests use them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from mpack import target
from mpack.sidecar import torch_dtype

__all__ = [
    "SCALE_PERM",
    "TORCH_ACT_DTYPES",
    "broadcast_scales",
    "fold_factor",
    "marlin_padded_nk",
    "pack_bias",
    "pack_scales",
    "pack_weight",
    "repack",
    "lookup",
    "requant_tables",
    "requantize",
    "requantize_shards",
    "unpack_bias",
    "unpack_scales",
    "unpack_weight",
    "unrepack",
]

#: The torch dtype of each activation dtype of the kernel (the facts:
#: :data:`mpack.target.ACT_DTYPES`).
TORCH_ACT_DTYPES: dict[str, torch.dtype] = {
    name: torch_dtype(a.st) for name, a in target.ACT_DTYPES.items()
}

#: The 32-channel permutation of scales and bias (SPEC §7.4), one of the target's facts.
SCALE_PERM = target.SCALE_PERM

# The tile's axes (nt, w, h, t8 of n; kt, khi, kmid, klo of k) and their order in a packed row:
# docs/LAYOUT.md, "The tile formula". The shape comments below use those names.
#
# Note [word-level repack]: permuting single bytes through 8 axes is slow on CPU (strided copies
# with 2-element inner loops). Instead: (1) view the bytes as int16 lanes (k, k+1) and swap the
# khi/kmid lane axes, so each int32 holds bytes (k0, k1, k8, k9) of one (n, kt, kmid); (2) permute
# whole int32 words (n-tile axes, k-tile first); (3) swap the middle two bytes of every word,
# giving (k0, k8, k1, k9) = (klo, khi) order. Same bytes as the 8-axis byte permute, moved as
# 2- and 4-byte elements instead of single bytes (figures: docs/BENCHMARKS.md, sections 1 and 9).
_WORD_AXES = (4, 0, 3, 5, 1, 2)  # (nt,w,h,t8,kt,kmid) -> (kt,nt,t8,kmid,w,h)
_WORD_AXES_INV = tuple(_WORD_AXES.index(i) for i in range(6))

#: Input bytes per block of the CPU repack (Note [repack in blocks]).
REPACK_BLOCK_BYTES = 4 << 20

_EXP_FOLD = {TORCH_ACT_DTYPES[name]: a.exp_fold for name, a in target.ACT_DTYPES.items()}
_FP8_MAX = 448.0


#: The padding rule (SPEC §3.3) belongs to the target's facts; re-exported for the layout's users.
marlin_padded_nk = target.padded_nk


def _as_bytes(w: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a 1-byte tensor (float8_e4m3fn or uint8/int8), no copy."""
    if w.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype (float8_e4m3fn/uint8), got {w.dtype}")
    return w if w.dtype == torch.uint8 else w.view(torch.uint8)


def _swap_middle_bytes_(words: torch.Tensor) -> torch.Tensor:
    """In place: bytes (b0, b1, b2, b3) of every int32 -> (b0, b2, b1, b3). Self-inverse."""
    t = words >> 8
    t ^= words
    t &= 0xFF00
    words ^= t
    t <<= 8
    words ^= t
    return words


# Note [repack in blocks]: on the CPU the three passes (pair the int16 lanes, permute the words,
# swap their middle bytes) run over a block of n-tiles at a time, about ``REPACK_BLOCK_BYTES`` of
# input, so each pass reads what the previous one left in cache instead of streaming the whole layer
# through memory three times. Each pass is small, so torch's own intra-op threads (OpenMP, a barrier
# per pass) stall whenever one of them loses its core to the conversion's I/O and hashing threads; a
# conversion therefore gives the blocks to a pool of plain threads, each running torch ops on one
# thread (``host_repack.block_pool``). Blocks are 4 MiB, not 1 MiB (about one core's L2): alone the
# two sizes tie, but next to busy hashing threads, the case of a conversion, fewer torch calls mean
# fewer hand-overs of the GIL among the pool's threads. For the same reason a first pass made of
# shifts and masks (twice the torch calls), faster on one core, was slower on many threads: not
# kept. On a GPU the whole layer is one block (the fused kernel of :mod:`mpack.convert.cuda_repack`
# is the fast path there). This module is torch's ops only: where the native host repack is built,
# the torch backend repacks CPU tensors with it instead (Note [host repack] in
# :mod:`mpack.convert.host_repack`: faster on fewer threads), a choice made when the backend opens
# (Note [choosing a backend] in :mod:`mpack.convert.backends`); these ops stay as that backend's
# last resort and as a second implementation the tests compare the others with. Figures:
# docs/BENCHMARKS.md, sections 1, 6 and 9.
def repack(wck: torch.Tensor, pool: Executor | None = None) -> torch.Tensor:
    """Repack checkpoint fp8 rows into Marlin tiles, without padding (SPEC §5).

    Args:
        wck: float8_e4m3fn or uint8 ``[N, K]``, row-major; ``N % 64 == 0``, ``K % 16 == 0``.
        pool: CPU only: repack the blocks on these threads (``host_repack.block_pool``; Note
            [repack in blocks]).

    Returns:
        int32 ``[K/16, 4*N]`` on ``wck``'s device (little-endian words).
    """
    n, k = wck.shape
    if n % 64 or k % 16:
        raise ValueError(f"repack needs N % 64 == 0 and K % 16 == 0, got N={n}, K={k}")
    w = _as_bytes(wck).contiguous()
    out = torch.empty(target.packed_weight_shape(n, k), dtype=torch.int32, device=w.device)
    tiles = out.view(k // 16, n // 64, 8, 4, 4, 2)  # (kt, nt, t8, kmid, w, h)
    step = n // 64 if w.is_cuda else max(1, REPACK_BLOCK_BYTES // (64 * k))  # n-tiles per block

    def one(j: int) -> None:
        rows = w[64 * j : 64 * (j + step)]
        nt = rows.shape[0] // 64
        lanes = rows.view(torch.int16).view(64 * nt, k // 16, 2, 4)  # (n, kt, khi, kmid)
        pairs = lanes.transpose(2, 3).contiguous()  # (n, kt, kmid, khi) int16
        words = pairs.view(torch.int32).view(nt, 4, 2, 8, k // 16, 4)  # (nt,w,h,t8,kt,kmid)
        block = tiles[:, j : j + nt]
        block.copy_(words.permute(*_WORD_AXES))  # (kt, nt, t8, kmid, w, h)
        _swap_middle_bytes_(block)

    starts = range(0, n // 64, step)
    if pool is None or len(starts) == 1:  # a GPU layer is one block
        for j in starts:
            one(j)
    else:
        with _one_torch_thread():
            list(pool.map(one, starts))
    return out


_torch_threads_lock = threading.Lock()
_torch_threads_users = [0, 0]  # [repacks in a pool now, torch's thread count before the first]


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch runs each op on one thread meanwhile (``torch.set_num_threads(1)``, restored when
    the last of overlapping users leaves): the pool's threads are the parallelism."""
    with _torch_threads_lock:
        if _torch_threads_users[0] == 0:
            _torch_threads_users[1] = torch.get_num_threads()
            torch.set_num_threads(1)
        _torch_threads_users[0] += 1
    try:
        yield
    finally:
        with _torch_threads_lock:
            _torch_threads_users[0] -= 1
            if _torch_threads_users[0] == 0:
                torch.set_num_threads(_torch_threads_users[1])


def unrepack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`repack`.

    Args:
        packed: int32 ``[K/16, 4*N]`` Marlin tiles.

    Returns:
        uint8 ``[N, K]``: the checkpoint fp8 bytes.
    """
    kt, cols = packed.shape
    if packed.dtype != torch.int32 or cols % 256:
        raise ValueError(
            f"expected int32 [K/16, 4*N] with N % 64 == 0, got {packed.dtype} {tuple(packed.shape)}"
        )
    n, k = cols // 4, kt * 16
    words = _swap_middle_bytes_(packed.clone()).view(kt, n // 64, 8, 4, 4, 2)  # (kt,nt,t8,kmid,w,h)
    pairs = words.permute(*_WORD_AXES_INV).contiguous()  # (nt, w, h, t8, kt, kmid)
    lanes = (
        pairs.view(torch.int16).view(n, kt, 4, 2).transpose(2, 3).contiguous()
    )  # (n,kt,khi,kmid)
    return lanes.view(torch.uint8).view(n, k)  # [N, K]


def pack_weight(
    wck: torch.Tensor, np_: int | None = None, kp: int | None = None, pool: Executor | None = None
) -> torch.Tensor:
    """Zero-pad to ``(Np, Kp)`` and repack: what the sidecar stores as ``<layer>.weight``.

    Args:
        wck: float8_e4m3fn or uint8 ``[N, K]``, ``K % 4 == 0`` (fused/sliced rows of one rank).
        np_, kp: padded dims; default :func:`marlin_padded_nk` ``(N, K)``.
        pool: CPU only: threads for the repack's blocks (``host_repack.block_pool``).

    Returns:
        int32 ``[Kp/16, 4*Np]`` on ``wck``'s device.
    """
    n, k = wck.shape
    if np_ is None or kp is None:
        np_, kp = marlin_padded_nk(n, k)
    if np_ < n or kp < k:
        raise ValueError(f"padded dims ({np_}, {kp}) smaller than the layer ({n}, {k})")
    w = _as_bytes(wck)
    if (np_, kp) != (n, k):
        padded = torch.zeros((np_, kp), dtype=torch.uint8, device=w.device)
        padded[:n, :k] = w
        w = padded  # [Np, Kp]
    return repack(w, pool)


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: int32 ``[Kp/16, 4*Np]`` -> uint8 ``[N, K]``
    (padding dropped)."""
    w = unrepack(packed)  # [Np, Kp]
    if w.shape[0] < n or w.shape[1] < k:
        raise ValueError(
            f"packed weight is {tuple(w.shape)} bytes, smaller than the layer ({n}, {k})"
        )
    return w[:n, :k].contiguous()


def fold_factor(act_dtype: torch.dtype) -> float:
    """The exponent-bias fold (SPEC §7.5): ``2**8`` for float16, ``2**120`` for bfloat16."""
    try:
        return _EXP_FOLD[act_dtype]
    except KeyError:
        raise ValueError(f"activation dtype must be float16 or bfloat16, got {act_dtype}") from None


def broadcast_scales(
    scale: torch.Tensor, n: int, widths: Sequence[int] | None = None
) -> torch.Tensor:
    """One float32 scale per output channel (SPEC §7.2).

    Args:
        scale: float32/bf16/fp16; numel 1 (per-tensor), ``len(widths)`` (one per fused shard)
            or ``n`` (per-channel; ``[N]`` or ``[N, 1]``).
        n: output channels ``N`` of the (fused, sliced) layer.
        widths: rows of each shard, summing to ``n``; needed only for per-shard scales.

    Returns:
        float32 ``[N]``.
    """
    s = scale.detach().reshape(-1).to(torch.float32)
    if s.numel() == n:
        return s.clone()
    if s.numel() == 1:
        return s.expand(n).clone()
    if widths is not None and s.numel() == len(widths):
        if sum(widths) != n:
            raise ValueError(f"shard widths {list(widths)} do not sum to N={n}")
        reps = torch.tensor(list(widths), device=s.device)
        return torch.repeat_interleave(s, reps)
    raise ValueError(f"cannot broadcast {s.numel()} scales to N={n} (shard widths {widths})")


def _permute_groups(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply the 32-channel permutation (or its inverse) to a 1-D tensor whose length % 32 == 0."""
    perm = torch.tensor(SCALE_PERM, device=x.device)
    g = x.reshape(-1, 32)  # [Np/32, 32]
    if inverse:
        out = torch.empty_like(g)
        out[:, perm] = g
        return out.reshape(-1)
    return g[:, perm].reshape(-1)


def _pad1d(x: torch.Tensor, np_: int) -> torch.Tensor:
    if x.numel() > np_:
        raise ValueError(f"{x.numel()} channels do not fit in Np={np_}")
    out = torch.zeros(np_, dtype=x.dtype, device=x.device)
    out[: x.numel()] = x
    return out


def pack_scales(scale_n: torch.Tensor, act_dtype: torch.dtype, np_: int) -> torch.Tensor:
    """Per-channel scales -> the kernel's ``weight_scale`` (SPEC §7).

    Args:
        scale_n: float32 ``[N]`` (see :func:`broadcast_scales`).
        act_dtype: torch.float16 or torch.bfloat16.
        np_: padded N (a multiple of 64).

    Returns:
        ``act_dtype`` ``[1, Np]``: cast (round to nearest even), zero-padded, permuted, folded.
        A scale too large to fold (> 255 in bf16, > 255.875 in fp16) becomes inf: callers
        validate before packing.
    """
    factor = fold_factor(act_dtype)
    s = _pad1d(scale_n.reshape(-1).to(torch.float32).to(act_dtype), np_)  # [Np] dt
    s = _permute_groups(s)  # [Np] dt
    return (s * factor).reshape(1, np_)  # exact: a power of two, in dt


def unpack_scales(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_scales`: ``dt [1, Np]`` -> ``dt [N]`` (the cast scales, unfolded)."""
    factor = fold_factor(packed.dtype)
    s = _permute_groups(packed.reshape(-1), inverse=True)
    return (s / factor)[:n].contiguous()


def pack_bias(bias: torch.Tensor, act_dtype: torch.dtype, np_: int) -> torch.Tensor:
    """Bias -> the kernel's ``bias`` (SPEC §8).

    Args:
        bias: any float dtype, ``[N]``.
        act_dtype: torch.float16 or torch.bfloat16.
        np_: padded N.

    Returns:
        ``act_dtype`` ``[Np]``: cast, zero-padded, permuted (no fold).
    """
    fold_factor(act_dtype)  # validates the dtype
    return _permute_groups(_pad1d(bias.reshape(-1).to(act_dtype), np_))


def unpack_bias(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bias`: ``dt [Np]`` -> ``dt [N]``."""
    return _permute_groups(packed.reshape(-1), inverse=True)[:n].contiguous()


def _f32(x: float | torch.Tensor) -> torch.Tensor:
    """float32 on the CPU: a scalar (0-dim) when one value, else as shaped."""
    t = torch.as_tensor(x, dtype=torch.float32, device="cpu")
    return t.reshape(()) if t.numel() == 1 else t


def requantize(
    wck: torch.Tensor, s_shard: float | torch.Tensor, s_max: float | torch.Tensor
) -> torch.Tensor:
    """Re-express fp8 weights quantized with ``s_shard`` in the scale ``s_max`` (SPEC §4).

    Mirrors vLLM's GPU path one rounding at a time, so CPU and CUDA give identical bytes::

        s16 = fp16(s_shard); dq = fp16(fp8(w) * s16); x = fp32(dq * fp32(1 / s_max))
        q = e4m3_rne(clamp(x, -448, 448)), NaN -> 448

    Args:
        wck: float8_e4m3fn or uint8 ``[...]`` (any shape).
        s_shard, s_max: the shard's and the layer's float32 scales: scalars, or CPU tensors
            broadcast against ``wck`` (:func:`requant_tables` passes columns, one row per pair).

    Returns:
        uint8 on ``wck``'s device, of ``wck``'s shape (broadcast with the scales').
    """
    dev = wck.device
    s16 = _f32(s_shard).to(torch.float16).to(torch.float32)  # exact fp16 value as fp32
    inv = torch.reciprocal(_f32(s_max))  # correctly rounded 1/s_max, computed on CPU
    w = _as_bytes(wck).view(torch.float8_e4m3fn).to(torch.float32)  # exact widening
    dq = (w * s16.to(dev)).to(torch.float16)  # the fp32 product is exact; one RNE to fp16
    x = dq.to(torch.float32) * inv.to(dev)  # one fp32 multiply by the reciprocal
    x = torch.nan_to_num(x, nan=_FP8_MAX).clamp_(-_FP8_MAX, _FP8_MAX)  # fmax(-448, fmin(x, 448))
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


# Note [requantization tables]: requantizing a shard maps each fp8 byte to a byte, the same
# function of the byte for the whole shard (its scale and the layer's largest are fixed). So
# :func:`requantize` runs once on the 256 codes per shard, on the CPU, and the shard's bytes go
# through that table: the same bytes as the arithmetic on every byte (the golden's requant vectors
# are such tables, and the GPU tests hold CUDA's arithmetic to them), for a lookup per byte
# instead of eight float passes, and on a GPU without the two scalars copied to the device per
# shard (a copy from pageable memory waits for the stream). On the CPU the lookup is
# ``bytes.translate``; on a GPU one gather for every shard of a layer, or of a batch of experts,
# the tables uploaded from pinned memory without a wait. Figures: docs/BENCHMARKS.md, section 18.
_CODES = torch.arange(256, dtype=torch.uint8)


def requant_tables(scales: torch.Tensor, s_max: float | torch.Tensor) -> torch.Tensor:
    """uint8 ``[S, 256]`` on the CPU: row ``i`` maps each fp8 byte of a shard of scale
    ``scales[i]`` to that byte requantized to ``s_max`` (one scale, or one per shard: ``[S]``;
    Note [requantization tables])."""
    s_max = _f32(s_max)
    col = s_max.reshape(-1, 1) if s_max.dim() else s_max
    return requantize(_CODES, scales.reshape(-1, 1), col).reshape(-1, 256)


def lookup(w: torch.Tensor, tables: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """uint8 ``[R, K]`` (a new tensor on ``w``'s device): the rows of ``w`` (uint8 ``[R, K]``,
    contiguous) mapped through ``tables`` (uint8 ``[T, 256]``, CPU), run by run: ``(table,
    rows)`` pairs, in row order, their rows summing to ``R``."""
    if sum(r for _, r in runs) != w.shape[0]:
        raise ValueError(f"runs {list(runs)} do not cover {w.shape[0]} rows")
    if w.is_cuda:
        which = torch.tensor([256 * t for t, _ in runs], dtype=torch.int32)
        first = torch.repeat_interleave(which, torch.tensor([r for _, r in runs]))  # int32 [R]
        flat, first = (x.pin_memory().to(w.device, non_blocking=True) for x in (tables, first))
        index = w.to(torch.int32)  # int32 [R, K]: into the flat tables, once offset
        index += first.reshape(-1, 1)
        return flat.reshape(-1).index_select(0, index.reshape(-1)).reshape(w.shape)
    out = torch.empty(w.shape, dtype=torch.uint8)
    rows_in, rows_out = w.reshape(w.shape[0], -1).numpy(), out.reshape(w.shape[0], -1).numpy()
    at = 0
    for t, r in runs:
        mapped = rows_in[at : at + r].tobytes().translate(tables[t].numpy().tobytes())
        rows_out[at : at + r] = np.frombuffer(mapped, dtype=np.uint8).reshape(r, -1)
        at += r
    return out


def requantize_shards(
    wck: torch.Tensor, scales: Sequence[float] | torch.Tensor, widths: Sequence[int]
) -> tuple[torch.Tensor, float]:
    """Requantize each row-shard of a fused layer to the largest shard scale (SPEC §4), through
    a table per shard (Note [requantization tables]).

    Args:
        wck: float8_e4m3fn or uint8 ``[N, K]``; shard ``i`` is the next ``widths[i]`` rows.
        scales: float32 per-shard scales, ``len(widths)`` of them.
        widths: rows per shard, summing to ``N``.

    Returns:
        (uint8 ``[N, K]``, ``s_max`` as a Python float holding the float32 value).
    """
    s = torch.as_tensor(scales, dtype=torch.float32, device="cpu").reshape(-1)
    if s.numel() != len(widths) or sum(widths) != wck.shape[0]:
        raise ValueError(
            f"{s.numel()} scales / widths {list(widths)} do not match N={wck.shape[0]}"
        )
    s_max = s.max()
    w = _as_bytes(wck).contiguous()
    return lookup(w, requant_tables(s, s_max), list(enumerate(widths))), float(s_max)
