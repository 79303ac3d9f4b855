"""The Marlin FP8 weight repack on the host, native and torch-free.

Note [host repack]: the torch-op repack of :func:`mpack.convert.marlin.repack` makes three strided
passes over every block and runs one torch call at a time per Python thread; on the CPU it was a
conversion's bottleneck (issue 15; figures: docs/BENCHMARKS.md, section 6). ``convert/_repack.c``
does the same layout in one pass: per row and k-tile, one 16-byte load, a byte interleave and four
4-byte stores (the layout: docs/LAYOUT.md, "The tile formula"), padding included, reading the
checkpoint rows where they are (a fused or sliced layer is a list of row addresses, not a copy). It
releases the GIL, so the n-tiles of a layer are split over a pool of plain threads. Within an n-tile
it makes one pass over the 64 rows per block of :data:`K_BLOCK` k-tiles: the stores of one row go to
every k-tile, each in another output row 16*Np bytes away, and a whole row at a time
(``K_BLOCK = 0``) sends them to up to 896 such places, more than the first-level cache holds: a
block of 16 k-tiles keeps the 16 output tiles it writes there (figures: docs/BENCHMARKS.md, section
6.2).

Note [tile kernel]: the row kernel above stores 4 bytes at a time to 4 places 32 bytes apart, and a
row's next k-tile lands 16*Np bytes further on. On x86-64 the extension also has a kernel that
writes one whole 1 KB tile at a time, front to back: the eight rows of one ``t8`` own 32 consecutive
words of the tile, so eight 16-byte loads, a byte interleave each (SSE2 unpack) and two 4x4
transposes of 32-bit words give those 32 words as eight 16-byte stores. The 64 rows of an n-tile are
then read 16 bytes a k-tile at a time, sequentially each, and the kernel beats the row kernel per
core and inside a conversion (figures, with the command that measures them,
``scripts/bench_repack.py --kernels tile,rows:16,rows:0``: docs/BENCHMARKS.md, section 6.3). The
read-back (:func:`unpack_differs`) runs the same steps backwards (the transpose is its own inverse;
the interleave is undone by one pack of the even and the odd bytes). SSE2 is part of the x86-64 ABI,
so the plain build has it; elsewhere (aarch64) :data:`KERNEL` is ``"rows"``.

The extension is optional (setup.py): where it was not built, :func:`available` is False, the
host backend refuses and the torch backend repacks with torch's ops (``MPACK_NO_HOST_REPACK=1``
does the same where it is built). Both give the same bytes (tests/convert/test_host.py, against
the golden cases and torch's ops).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from mpack import iokit, target

try:
    from mpack.convert import _repack
except ImportError:  # not built here (no C compiler at install time)
    _repack = None

__all__ = [
    "KERNEL",
    "K_BLOCK",
    "RUN_BYTES",
    "available",
    "block_pool",
    "block_workers",
    "pack_rows",
    "rows_of",
    "unpack_differs",
]

#: Input bytes per call into the extension when a pool splits a layer (whole n-tiles).
RUN_BYTES = 4 << 20
#: k-tiles per pass over an n-tile's 64 rows (0: a whole row at a time). 16 keeps the 16 output
#: tiles a pass writes in the first-level cache: on the H200 host's Xeon 0.76-0.98 GB/s per core
#: against 0.32-0.45 for whole rows; on the 2-core AMD machine 10% slower than whole rows
#: (docs/BENCHMARKS.md section 6.2).
K_BLOCK = 16
#: Which kernel of the extension repacks (Note [tile kernel]): ``"tile"`` (SSE2, whole tiles
#: front to back) where it was built with it, else ``"rows"`` (portable C, row by row in blocks
#: of :data:`K_BLOCK` k-tiles). Both give the same bytes.
KERNEL = "tile" if _repack is not None and getattr(_repack, "TILE_KERNEL", 0) else "rows"


def available() -> bool:
    """The native repack is built here (whether a conversion uses it is the backends' choice:
    Note [choosing a backend] in :mod:`mpack.convert.backends`)."""
    return _repack is not None


def block_workers() -> int:
    """Repack threads for a CPU conversion: the cores its I/O and hashing threads leave (12 of
    16). Half the cores did no better in a whole 8B conversion (10.34 s against 9.99 s on the
    H200 host, docs/BENCHMARKS.md), although the synthetic sweep favoured them under load."""
    cores = iokit.usable_cores()
    return max(1, cores // 2, cores - 4)


@contextlib.contextmanager
def block_pool(workers: int | None = None) -> Iterator[Executor]:
    """Threads for a CPU repack's blocks, native or torch (default :func:`block_workers`)."""
    with iokit.pool("repack", workers or block_workers()) as p:
        yield p


def rows_of(a: np.ndarray, rows: tuple[int, int] | None = None, col: int = 0) -> np.ndarray:
    """The addresses of rows ``rows`` (default all) of a 2-D byte array, from column ``col``:
    uint64, one per row. ``a`` must stay alive while they are used."""
    if a.ndim != 2 or a.itemsize != 1 or a.strides[1] != 1:
        raise ValueError(f"expected a 2-D byte array with contiguous rows, got {a.dtype} {a.shape}")
    r0, r1 = rows if rows is not None else (0, a.shape[0])
    base = a.__array_interface__["data"][0] + col
    return base + np.arange(r0, r1, dtype=np.uint64) * np.uint64(a.strides[0])


@functools.cache
def _zero_row(k: int) -> np.ndarray:
    """``k`` zero bytes, kept for the life of the process (rows of :func:`zero_rows` point at
    them)."""
    return np.zeros((1, k), dtype=np.uint8)


def zero_rows(count: int, k: int) -> np.ndarray:
    """The addresses of ``count`` rows of ``k`` zero bytes (all the same row), for
    :func:`pack_rows` and :func:`unpack_differs`."""
    return np.full(count, _zero_row(k).__array_interface__["data"][0], dtype=np.uint64)


def _require() -> None:
    if _repack is None:
        raise RuntimeError("mpack's host repack extension is not built here")


def _tile_kernel() -> bool:
    """Whether to call the tile kernel (:data:`KERNEL`, checked against what was built)."""
    if KERNEL not in ("tile", "rows"):
        raise ValueError(f"host_repack.KERNEL must be 'tile' or 'rows', not {KERNEL!r}")
    if KERNEL == "tile" and not getattr(_repack, "TILE_KERNEL", 0):
        raise RuntimeError("mpack's host repack extension was built without the tile kernel")
    return KERNEL == "tile"


def _addresses(rows: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
    """Row addresses as one contiguous uint64 array (a sequence is concatenated)."""
    return np.ascontiguousarray(
        rows if isinstance(rows, np.ndarray) else np.concatenate(list(rows)), dtype=np.uint64
    )


def packed_out(np_: int, kp: int, out: np.ndarray | None = None) -> np.ndarray:
    """``out`` checked to be a C-contiguous int32 ``[Kp/16, 4*Np]`` (the packed weight's
    array), or a new one; raises ``ValueError``."""
    shape = target.packed_weight_shape(np_, kp)
    if out is None:
        return np.empty(shape, dtype=np.int32)
    if out.shape != shape or out.dtype != np.int32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous int32 {shape}, got {out.dtype} {out.shape}")
    return out


def _over_tiles(
    call: Callable[[int, int], Any], tiles: int, kp: int, pool: Executor | None
) -> list[Any]:
    """``call(t0, t1)`` over n-tiles ``[0, tiles)`` in runs of about :data:`RUN_BYTES` of input,
    on ``pool``'s threads when given; the results in order."""
    step = max(1, RUN_BYTES // (64 * max(kp, 16)))  # n-tiles per call
    runs = [(t, min(t + step, tiles)) for t in range(0, tiles, step)]
    if pool is None or len(runs) <= 1:
        return [call(*r) for r in runs]
    return list(pool.map(lambda r: call(*r), runs))


def pack_rows(
    rows: np.ndarray | Sequence[np.ndarray],
    k: int,
    np_: int | None = None,
    kp: int | None = None,
    pool: Executor | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Zero-pad to ``(Np, Kp)`` and repack (SPEC §3.3, §5), from row addresses.

    Args:
        rows: uint64 addresses of the layer's ``N`` rows, each with ``k`` readable bytes (see
            :func:`rows_of`; a sequence is concatenated, e.g. one per fused shard).
        k: bytes per row (``K``).
        np_, kp: padded dims; default :func:`mpack.target.padded_nk` ``(N, K)``.
        pool: threads to split the n-tiles over (the GIL is released).
        out: where to write (int32 ``[Kp/16, 4*Np]``, C-contiguous); default a new array.

    Returns:
        int32 ``[Kp/16, 4*Np]``, the bytes of :func:`mpack.convert.marlin.pack_weight`.
    """
    _require()
    addrs = _addresses(rows)
    n = addrs.shape[0]
    if np_ is None or kp is None:
        np_, kp = target.padded_nk(n, k)
    out = packed_out(np_, kp, out)
    a_rows, a_out, tile = addrs.ctypes.data, out.ctypes.data, _tile_kernel()
    _over_tiles(
        lambda t0, t1: _repack.repack_tiles(a_rows, n, k, np_, kp, a_out, t0, t1, K_BLOCK, tile),
        np_ // 64,
        kp,
        pool,
    )
    return out


def unpack_differs(
    packed: np.ndarray,
    rows: np.ndarray | Sequence[np.ndarray],
    k: int,
    pool: Executor | None = None,
) -> bool:
    """Whether the Marlin tiles ``packed`` (int32 ``[Kp/16, 4*Np]``) unpack to other bytes than
    the ``N`` rows at ``rows`` (addresses as for :func:`pack_rows`, ``k`` bytes each): the layout
    read backwards, as ``mpack verify`` does. The padding is not looked at. ``pool``: threads to
    split the n-tiles over (the GIL is released).

    Raises:
        ValueError: ``packed`` is not C-contiguous int32 ``[Kp/16, 4*Np]`` holding ``N`` x ``k``.
    """
    _require()
    addrs = _addresses(rows)
    n = addrs.shape[0]
    if packed.dtype != np.int32 or packed.ndim != 2 or not packed.flags.c_contiguous:
        raise ValueError(
            f"expected C-contiguous int32 [Kp/16, 4*Np], got {packed.dtype} {packed.shape}"
        )
    kp, np_ = 16 * packed.shape[0], packed.shape[1] // 4
    if packed.shape[1] % 256 or np_ < n or kp < k:
        raise ValueError(f"packed weight {packed.shape} does not hold a [{n}, {k}] layer")
    a_rows, a_out, tile = addrs.ctypes.data, packed.ctypes.data, _tile_kernel()
    return any(
        _over_tiles(
            lambda t0, t1: _repack.unpack_differs(
                a_rows, n, k, np_, kp, a_out, t0, t1, K_BLOCK, tile
            ),
            -(-n // 64),
            kp,
            pool,
        )
    )
