"""The torch backend: one rank's layers as torch tensors, on the CPU or a GPU; the one that
requantizes (``w8a8-marlin`` with per-tensor shards).

``read_units`` -> :func:`fuse_stack` -> :func:`pack_stack` is everything a conversion does to
the bytes of one layer, or of a batch of experts of one stacked tensor (Note [expert batches] in
mpack/convert/stream.py); :func:`transform_stack` is the last two in one call, :func:`transform`
and :func:`fuse` the same for one layer. These functions are pure: no threads, and no I/O
besides :func:`read_units`' reads through the :class:`~mpack.convert.checkpoint.Checkpoint`.
:class:`TorchBackend` runs them in the stream (:mod:`mpack.convert.stream`) with what a GPU
needs around them:

- **read**: on a GPU the checkpoint bytes of a batch are read straight into a ring of pinned
  host pieces, each filled with as many tensors as it holds, and copied to the GPU on a copy
  stream (``cudaMemcpyAsync`` from pinned memory, no staging copy inside the driver) into one
  buffer; on the CPU into one plain tensor;
- **transform**: on a GPU on a compute stream that waits for the batch's copies; the weight
  repack is the one chosen when the backend opened (:data:`PACKERS`), the small scale and bias
  tensors are computed on the host, where they already are, and the requantization is a table
  lookup (Note [requantization tables] in mpack/convert/marlin.py): no wait for the device;
- **write**: a GPU result goes back through a second ring of pinned pieces with asynchronous
  copies, each piece handed to the writer with its copy's event.

The pinned rings (Note [pinned rings] in mpack/iokit.py): every buffer on the host side of
the GPU is a piece of one of two pinned rings (``PIECE`` bytes, ``IN_PIECES`` + ``OUT_PIECES``
of them: 256 MiB in all), bounded whatever the layer size. A piece is reused only after the
copy that last used it has finished (the writer is done with a piece when it hands it back).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mpack import target
from mpack.convert import cuda_repack, host_repack, marlin
from mpack.convert.backends import Piece, Refused, check_cuda_here
from mpack.convert.checkpoint import Checkpoint, read_scale_arrays
from mpack.convert.plan import OutLayer, Plan
from mpack.convert.timeline import Timeline
from mpack.device import DeviceSpec
from mpack.iokit import PinnedRing
from mpack.sidecar import torch_dtype
from mpack.target import BIAS, SCALE, WEIGHT

PIECE = 16 * 1024 * 1024
IN_PIECES = 8
OUT_PIECES = 8
READS_AT_ONCE = 4  # pinned pieces filled by parallel preads before their copies are queued
WRITE_QUEUE = 16  # on the CPU: result tensors waiting for the writer

#: The weight repacks this backend can run, by name: ``kernel`` (the fused CUDA kernel,
#: :mod:`mpack.convert.cuda_repack`), ``native`` (the native host repack, CPU tensors),
#: ``ops`` (torch's ops, :func:`mpack.convert.marlin.pack_weight`, anywhere). Same bytes.
PACKERS = ("kernel", "native", "ops")


#: ``(checkpoint, weight names) -> uint8 [their bytes]``: the weights one after another, where a
#: batch's weights are read to (default :func:`_read_flat`: CPU memory; on a GPU the backend's
#: pinned ring onto the device).
Fill = Callable[[Checkpoint, list[str]], torch.Tensor]


def read_unit(
    ck: Checkpoint, unit: list[OutLayer], fill: Fill | None = None
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor the unit's layers need: :func:`read_units` of one unit."""
    return read_units(ck, [unit], fill)


def read_units(
    ck: Checkpoint, units: list[list[OutLayer]], fill: Fill | None = None
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor the layers of a batch of units need (Note [expert batches] in
    mpack/convert/stream.py): weights as uint8 ``[N, K]``, views of one buffer ``fill`` wrote
    (default: CPU memory, read with one open per shard), scales as float32, biases as stored."""
    modules = [m for unit in units for m in unit[0].modules()]
    names = [f"{m}.{WEIGHT}" for m in modules]
    flat = (fill or _read_flat)(ck, names)
    src: dict[str, torch.Tensor] = {}
    at = 0
    for name in names:
        t = ck.tensors[name]
        src[name] = flat[at : at + t.nbytes].view(t.shape)
        at += t.nbytes
    for m, scale in read_scale_arrays(ck, modules).items():
        src[f"{m}.{SCALE}"] = torch.from_numpy(scale)
    for unit in units:
        for module in unit[0].modules() if unit[0].has_bias else ():
            src[f"{module}.{BIAS}"] = ck.read(f"{module}.{BIAS}")
    return src


def _read_flat(ck: Checkpoint, names: list[str]) -> torch.Tensor:
    """The tensors ``names``, one after another, in one new uint8 CPU tensor."""
    flat = np.empty(sum(ck.tensors[n].nbytes for n in names), dtype=np.uint8)
    at, parts = 0, []
    for n in names:
        size = ck.tensors[n].nbytes
        parts.append((n, memoryview(flat[at : at + size]), 0))
        at += size
    ck.read_parts(parts)
    return torch.from_numpy(flat)


@dataclass
class Fused:
    """One rank's layer before packing, or layers of one shape stacked (``[m, ...]``): what the
    Marlin tensors encode, in checkpoint terms."""

    # N: the layer's rows, zero rows between its pieces included (OutLayer.rows)
    weight: torch.Tensor  # uint8 [(m,) N, K]: fused, sliced, and requantized when the layer is
    scale: torch.Tensor  # float32 [(m,) N]: one scale per output channel
    bias: torch.Tensor | None  # [(m,) N] in the checkpoint's dtype


def fuse(layer: OutLayer, src: dict[str, torch.Tensor]) -> Fused:
    """Fuse and slice the checkpoint pieces of ``layer`` (SPEC §3.1-§3.2, §6): :func:`fuse_stack`
    of the one layer.

    Args:
        src: per checkpoint module, ``<module>.weight`` uint8 ``[N, K]``,
            ``<module>.weight_scale`` float32 ``[1]`` or ``[N]``, and ``<module>.bias`` if any.
    """
    f = fuse_stack([layer], src)
    return Fused(f.weight[0], f.scale[0], f.bias[0] if f.bias is not None else None)


def fuse_stack(layers: list[OutLayer], src: dict[str, torch.Tensor]) -> Fused:
    """:func:`fuse` of each of ``layers`` (of one shape: one layer, or experts of one stacked
    tensor), stacked ``[m, ...]``: each step once for all of them, the requantization one table
    lookup (Note [requantization tables] in mpack/convert/marlin.py)."""
    first, m = layers[0], len(layers)
    w = _read_in_place(layers, src)  # uint8 [m, N, K]
    if w is None:
        parts = []  # per piece: uint8 [m, width, K]
        for j, p in enumerate(first.pieces):
            rows = [
                src[f"{q.module}.{WEIGHT}"][q.take][:, p.cols[0] : p.cols[1]]
                for q in (ly.pieces[j] for ly in layers)
            ]
            parts.append(rows[0][None] if m == 1 else torch.stack(rows))
        w = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()

    def cat(what: str, take: bool) -> torch.Tensor:  # each layer's pieces of one tensor, [m, *]
        return torch.stack(
            [
                torch.cat(
                    [src[f"{p.module}.{what}"][p.take if take else slice(None)] for p in ly.pieces]
                )
                for ly in layers
            ]
        )

    if first.strategy == "channel":
        scale_n = cat(SCALE, take=True)  # fp32 [m, N]
    else:
        shards = cat(SCALE, take=False)  # fp32 [m, S]: one scale per piece
        widths = torch.tensor(first.widths)
        if first.requant:
            s_max = shards.max(dim=1).values  # fp32 [m]
            tables = marlin.requant_tables(shards.reshape(-1), s_max.repeat_interleave(len(widths)))
            runs = [(i, wd) for i, wd in enumerate(first.widths * m)]  # row runs, table i
            n, k = w.shape[1:]
            w = marlin.lookup(w.view(m * n, k), tables, runs).view(m, n, k)
            scale_n = s_max[:, None].expand(m, first.n).clone()
        else:
            scale_n = torch.repeat_interleave(shards, widths, dim=1)
    bias = cat(BIAS, take=True) if first.has_bias else None
    if any(p.pad for p in first.pieces):  # zero rows between pieces, with scales 0 (Piece.pad)
        w, scale_n = (_spread(t, first) for t in (w, scale_n))
        bias = _spread(bias, first) if bias is not None else None
    return Fused(w, scale_n, bias)


def _read_in_place(layers: list[OutLayer], src: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The layers' fused weights, uint8 ``[m, N, K]``, as a view of the buffer they were read
    into, where they already lie fused and stacked: every piece a whole checkpoint weight, each
    right after the one before (:func:`read_units` reads a batch's weights one after another:
    a batch of experts at TP 1, a fused dense layer); else None (they are copied together)."""
    first = layers[0]
    base = src[f"{first.pieces[0].module}.{WEIGHT}"]
    storage, at = base.untyped_storage().data_ptr(), base.data_ptr()
    for ly in layers:
        for p in ly.pieces:
            w = src[f"{p.module}.{WEIGHT}"]
            whole = p.rows == (0, w.shape[0]) and p.cols == (0, w.shape[1])
            same = w.untyped_storage().data_ptr() == storage and w.data_ptr() == at
            if p.head or p.pad or not whole or not w.is_contiguous() or not same:
                return None
            at += w.numel()
    shape = (len(layers), first.n, first.k)
    return base.as_strided(shape, (first.n * first.k, first.k, 1))


def _spread(t: torch.Tensor, layer: OutLayer) -> torch.Tensor:
    """``t`` (``[m, n, ...]``, the layer's pieces one after another) with each piece's zero rows
    after it (:attr:`mpack.convert.plan.Piece.pad`): ``[m, rows, ...]``."""
    out = t.new_zeros((t.shape[0], layer.rows, *t.shape[2:]))
    at = got = 0
    for p in layer.pieces:
        out[:, at : at + p.width] = t[:, got : got + p.width]
        at, got = at + p.width + p.pad, got + p.width
    return out


def pack_stack(
    layers: list[OutLayer],
    f: Fused,
    act_dtype: str,
    packer: str = "ops",
    pool: Executor | None = None,
) -> list[torch.Tensor]:
    """The Marlin tensors of layers of one shape, fused and stacked (:func:`fuse_stack`), in the
    order of their tensor specs, each stacked ``[m, ...]``.

    The weights are packed where they are, by ``packer`` (:data:`PACKERS`), one layer at a time
    into one stacked tensor; the scales and bias, a few KB a layer, are computed on the host, in
    one pass for all layers. The bytes are the same on every device and packer. ``pool``:
    threads for a CPU repack's blocks (:func:`mpack.convert.host_repack.block_pool`).

    Returns:
        ``[weight int32 [m, Kp/16, 4Np], weight_scale dt [m, 1, Np], (bias dt [m, Np])]``.
    """
    first, m = layers[0], len(layers)
    np_, kp = first.np_, first.kp
    dt = torch_dtype(target.act_dtype(act_dtype).st)
    w = f.weight
    packed = torch.empty(
        (m, *target.packed_weight_shape(np_, kp)), dtype=torch.int32, device=w.device
    )
    for j in range(m):
        pack_weight(w[j], np_, kp, packer, pool, packed[j])
    out = [packed, _rows_packed(marlin.pack_scales, f.scale, dt, np_).reshape(m, 1, np_)]
    if f.bias is not None:
        out.append(_rows_packed(marlin.pack_bias, f.bias, dt, np_))
    return out


def _rows_packed(
    fn: Callable[..., torch.Tensor], rows: torch.Tensor, dt: torch.dtype, np_: int
) -> torch.Tensor:
    """``fn`` (:func:`mpack.convert.marlin.pack_scales` or ``pack_bias``) of each row of ``rows``
    (``[m, N]``) at once, on the host: ``dt [m, Np]``. Each row is zero-padded to ``Np`` first,
    so the 32-channel groups of one never reach into the next (zeros cast to zeros, as padded
    after the cast)."""
    m, n = rows.shape
    padded = rows.new_zeros((m, np_), device="cpu")
    padded[:, :n] = rows.cpu()
    return fn(padded.reshape(-1), dt, m * np_).reshape(m, np_)


def pack_weight(
    w: torch.Tensor,
    np_: int,
    kp: int,
    packer: str = "ops",
    pool: Executor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 ``[N, K]`` -> int32 ``[Kp/16, 4*Np]`` on ``w``'s device, by ``packer``; into ``out``
    when given (contiguous, on that device)."""
    if packer == "kernel":
        return cuda_repack.pack_weight_cuda(w, np_, kp, out)
    if packer == "native":
        rows = w if w.stride(1) == 1 else w.contiguous()
        k = rows.shape[1]
        dst = out.numpy() if out is not None else None
        packed = host_repack.pack_rows(host_repack.rows_of(rows.numpy()), k, np_, kp, pool, dst)
        return out if out is not None else torch.from_numpy(packed)
    if packer == "ops":
        packed = marlin.pack_weight(w, np_, kp, pool)
        return out.copy_(packed) if out is not None else packed
    raise ValueError(f"packer must be one of {', '.join(PACKERS)}, got {packer!r}")


def transform(
    layer: OutLayer,
    src: dict[str, torch.Tensor],
    act_dtype: str,
    packer: str = "ops",
    pool: Executor | None = None,
) -> list[torch.Tensor]:
    """The checkpoint pieces of ``layer`` -> its Marlin tensors: :func:`transform_stack` of the
    one layer."""
    return [x[0] for x in transform_stack([layer], src, act_dtype, packer, pool)]


def transform_stack(
    layers: list[OutLayer],
    src: dict[str, torch.Tensor],
    act_dtype: str,
    packer: str = "ops",
    pool: Executor | None = None,
) -> list[torch.Tensor]:
    """:func:`fuse_stack` then :func:`pack_stack`: layers of one shape -> their stacked Marlin
    tensors."""
    return pack_stack(layers, fuse_stack(layers, src), act_dtype, packer, pool)


# --- the layout read backwards (mpack verify) -------------------------------------------------


def backwards(
    layer: OutLayer,
    fused: Fused,
    packed: list[torch.Tensor],
    act_dtype: str,
    pool: Executor | None = None,
) -> list[tuple[str, Any]]:
    """The layout read backwards on one rank's packed tensors (:func:`transform`'s order): ``(what,
    differs)`` for the weight, the scales and the bias, against the fused checkpoint tensors.
    ``differs`` is a bool, or on CUDA a bool tensor not read yet."""
    dt = torch_dtype(target.act_dtype(act_dtype).st)
    what = "requantized" if layer.requant else "checkpoint"
    # the tensors' names (a MoE expert's: its stacked tensors', and which expert it is)
    at = f" (expert {layer.stack.index})" if layer.stack is not None else ""
    names = [f"{s.name}{at}" for s in layer.tensor_specs(act_dtype)]
    out = [
        (
            f"{names[0]} does not unpack to the {what} bytes",
            _weight_differs(packed[0], fused.weight, layer.rows, layer.k, pool),
        ),
        (
            f"{names[1]} does not unpack to the checkpoint scales",
            _differs(marlin.unpack_scales(packed[1], layer.rows), fused.scale.to(dt)),
        ),
    ]
    if fused.bias is not None:
        out.append(
            (
                f"{names[2]} does not unpack to the checkpoint bias",
                _differs(marlin.unpack_bias(packed[2], layer.rows), fused.bias.to(dt)),
            )
        )
    return out


def _differs(a: torch.Tensor, b: torch.Tensor) -> Any:
    """Whether ``a`` and ``b`` differ in shape or bytes: a bool, or on CUDA a bool tensor whose
    reading (a sync) waits until :meth:`TorchBackend.settle`."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return True
    if a.is_cuda:
        return (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).any()
    return not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _weight_differs(
    packed: torch.Tensor, weight: torch.Tensor, n: int, k: int, pool: Executor | None
) -> Any:
    """Whether ``packed`` (int32 ``[Kp/16, 4*Np]``) unpacks to other bytes than ``weight``
    (uint8 ``[N, K]``).

    On the CPU with a pool, in blocks of n-tiles on its threads, as the repack runs (Note [repack
    in blocks] in :mod:`mpack.convert.marlin`): unpacking a whole layer with torch's own threads
    costs twice the repack on 2 cores. The Marlin weight is n-tiles of 256 consecutive words in
    every packed row (SPEC §5, :mod:`mpack.convert.marlin`'s docstring), so a column slice of
    whole n-tiles unpacks (:func:`mpack.convert.marlin.unrepack`) to their 64 rows each, alone.
    """
    if pool is None or packed.is_cuda:
        return _differs(marlin.unpack_weight(packed, n, k), weight)
    kt, cols = packed.shape
    kp = 16 * kt
    if packed.dtype != torch.int32 or cols % 256 or cols // 4 < n or kp < k:
        return _differs(marlin.unpack_weight(packed, n, k), weight)  # raises as the layout does
    step = max(1, marlin.REPACK_BLOCK_BYTES // (64 * kp))  # n-tiles per block
    w = weight.view(torch.uint8)

    def same(j: int) -> bool:
        r0, r1 = 64 * j, min(64 * (j + step), n)  # padding rows are not compared
        block = packed[:, 256 * j : 256 * (j + step)].contiguous()  # int32 [Kp/16, 256 * tiles]
        rows = marlin.unrepack(block)[: r1 - r0, :k]  # uint8 [r1 - r0, K]
        return torch.equal(rows, w[r0:r1])

    with marlin._one_torch_thread():  # the pool's threads are the parallelism, as in repack
        return not all(pool.map(same, range(0, -(-n // 64), step)))


# --- the backend ------------------------------------------------------------------------------


def open_torch(spec: DeviceSpec, plan: Plan, off: frozenset[str], option: str) -> TorchBackend:
    """The torch backend on ``spec`` (``cpu``; ``cuda``/``cuda:i``/``auto``: that GPU), its weight
    repack the fastest that is on and works here (:data:`PACKERS`), or :class:`Refused`.

    Raises:
        UsageError: ``spec`` names a CUDA device that is not here.
    """
    if spec.kind == "cpu":
        on = "native-repack" not in off and host_repack.available()
        return TorchBackend(torch.device("cpu"), "native" if on else "ops")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec.kind == "cuda":
        check_cuda_here(spec, count, option)  # parsed: not parsed again
    elif count == 0:
        raise Refused("no CUDA device here")
    dev = torch.device("cuda", spec.ordinal)
    kernel = "cuda-kernel" not in off and cuda_repack.available(dev)
    return TorchBackend(dev, "kernel" if kernel else "ops")


class TorchBackend:
    """The torch backend on ``device`` with weight repack ``packer`` (the module docstring;
    :class:`mpack.convert.backends.Backend`)."""

    name = "torch"

    def __init__(self, device: torch.device, packer: str) -> None:
        if packer not in PACKERS:
            raise ValueError(f"packer must be one of {', '.join(PACKERS)}, got {packer!r}")
        self.dev, self.packer = device, packer
        self.cuda = device.type == "cuda"
        self.where = f"cuda:{device.index or 0}" if self.cuda else "cpu"
        names = {"kernel": "the fused repack kernel", "native": "the native repack", "ops": ""}
        self.detail = "weights repacked by " + (names[packer] or "torch's ops")
        self.refused: dict[str, str] = {}
        self.write_queue = 0 if self.cuda else WRITE_QUEUE  # on a GPU the out ring bounds them
        self._stack = contextlib.ExitStack()
        self._pool: Executor | None = None
        self._tl = Timeline()
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.compute_stream = torch.cuda.Stream(device)

    def pool(self) -> Executor | None:
        """On the CPU: threads for the repack's (and unpack's) blocks, made on first use (Note
        [repack in blocks])."""
        if self.cuda:
            return None
        if self._pool is None:
            self._pool = self._stack.enter_context(host_repack.block_pool())
        return self._pool

    def takes(self, plan: Plan) -> str | None:
        """Every plan (the one backend that requantizes)."""
        return None

    @contextlib.contextmanager
    def streaming(self, abort: threading.Event, tl: Timeline) -> Iterator[None]:
        """The pinned rings of a stream on a GPU; ``abort`` stops a wait for a piece."""
        self._tl = tl
        if not self.cuda:
            yield
            return
        self.in_ring = PinnedRing(IN_PIECES, PIECE, abort=abort, name="convert")
        self.out_ring = PinnedRing(OUT_PIECES, PIECE, abort=abort, name="convert")
        try:
            yield
        finally:
            self.compute_stream.synchronize()
            self.copy_stream.synchronize()

    # --- read ---------------------------------------------------------------------------

    def read_units(
        self, ck: Checkpoint, units: list[list[OutLayer]], act: str
    ) -> tuple[dict[str, torch.Tensor], Any]:
        if not self.cuda:
            return read_units(ck, units), None
        src = read_units(ck, units, self._upload)
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        return src, ready

    def _upload(self, ck: Checkpoint, names: list[str]) -> torch.Tensor:
        """Disk -> pinned pieces (several preads at once) -> GPU, on the copy stream: the
        tensors ``names`` one after another in one device buffer (uint8), each pinned piece as
        full of them as it holds, so a batch of small experts takes a few copies, not one
        each."""
        sizes = [ck.tensors[n].nbytes for n in names]
        total = sum(sizes)
        with torch.cuda.stream(self.copy_stream):
            dev = torch.empty(total, dtype=torch.uint8, device=self.dev)
        cuts = []  # (tensor, its byte, the buffer's byte, length): cut where the pieces end
        at = 0
        for name, size in zip(names, sizes, strict=True):
            done = 0
            while done < size:
                n = min(PIECE - at % PIECE, size - done)
                cuts.append((name, done, at, n))
                done, at = done + n, at + n
        spans = [(a, min(a + PIECE, total)) for a in range(0, total, PIECE)]
        batch = max(1, min(READS_AT_ONCE, self.in_ring.count // 2))  # never more than the ring
        c = 0
        for i in range(0, len(spans), batch):
            group = spans[i : i + batch]
            t = time.perf_counter()
            slots = [self.in_ring.acquire() for _ in group]
            self._tl.add("read", "wait-ring", t, time.perf_counter())
            parts = []
            for s, (a, b) in zip(slots, group, strict=True):
                while c < len(cuts) and cuts[c][2] < b:
                    name, skip, where, n = cuts[c]
                    parts.append((name, s.view[where - a : where - a + n], skip))
                    c += 1
            ck.read_parts(parts)
            for s, (a, b) in zip(slots, group, strict=True):
                s.to_device(dev[a:b], self.copy_stream)
                self.in_ring.release(s)
        return dev

    def from_raw(self, raw: dict[str, Any], ck: Checkpoint, act: str) -> dict[str, torch.Tensor]:
        """What :meth:`read_units` gives, over a batch read once for several targets (weights and
        scales as arrays, biases as ``(bytes, dtype)``): weights uint8 on this device, scales
        float32, biases in their stored dtype on the host."""
        out = {}
        for name, x in raw.items():
            if isinstance(x, tuple):
                b, dt = x
                out[name] = (
                    torch.from_numpy(b).view(torch_dtype(dt)).reshape(ck.tensors[name].shape)
                )
            elif name.endswith(f".{WEIGHT}"):
                w = torch.from_numpy(x)
                out[name] = w.to(self.dev) if self.cuda else w
            else:
                out[name] = torch.from_numpy(x)
        return out

    # --- transform ----------------------------------------------------------------------

    @contextlib.contextmanager
    def on_unit(self, src: dict[str, Any], ready: Any) -> Iterator[None]:
        """On a GPU: the unit's transforms on the compute stream, after its copies (``ready``,
        else whatever the current stream queued)."""
        if not self.cuda:
            yield
            return
        if ready is not None:
            self.compute_stream.wait_event(ready)
        else:
            self.compute_stream.wait_stream(torch.cuda.current_stream(self.dev))
        for x in src.values():
            if x.is_cuda:
                x.record_stream(self.compute_stream)
        with torch.cuda.stream(self.compute_stream):
            yield

    def transform(
        self, layer: OutLayer, src: dict[str, torch.Tensor], act: str
    ) -> list[torch.Tensor]:
        return transform(layer, src, act, self.packer, self.pool())

    def transform_stack(
        self, layers: list[OutLayer], src: dict[str, torch.Tensor], act: str
    ) -> list[torch.Tensor]:
        return transform_stack(layers, src, act, self.packer, self.pool())

    def read_back(
        self, layer: OutLayer, src: dict[str, torch.Tensor], outs: list[torch.Tensor], act: str
    ) -> list[tuple[str, Any]]:
        """Against the layer fused again (cheap next to the repack; requantization included)."""
        return backwards(layer, fuse(layer, src), outs, act, self.pool())

    def settle(self) -> None:
        """Wait for the device (the queued comparisons are tensors on it)."""
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    # --- write --------------------------------------------------------------------------

    def pieces(self, result: torch.Tensor) -> Iterator[Piece]:
        """A CPU result whole; a GPU one through the out ring, piece by piece, each with the
        event of its copy and the piece handed back once written."""
        flat = result.contiguous().view(torch.uint8).reshape(-1)
        if not flat.is_cuda:
            yield 0, flat.numpy(), None, None
            return
        for a in range(0, flat.numel(), PIECE):
            b = min(a + PIECE, flat.numel())
            t = time.perf_counter()
            slot = self.out_ring.acquire()
            self._tl.add("transform", "wait-ring", t, time.perf_counter())
            ev = slot.from_device(flat[a:b], self.compute_stream)
            yield a, slot.view[: b - a], ev, functools.partial(self.out_ring.release, slot)

    def done_with(self, src: dict[str, Any]) -> None:
        """Nothing to hand round: the caching allocator does (on a GPU, after the stream)."""

    def close(self) -> None:
        self._stack.close()
