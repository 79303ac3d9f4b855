"""The torch backend: one rank's layers as torch tensors, on the CPU or a GPU; the one that
requantizes (``w8a8-marlin`` with per-tensor shards).

``read_unit`` -> :func:`fuse` -> :func:`pack` is everything a conversion does to the bytes of one
layer; :func:`transform` is the last two in one call. These functions are pure: no threads, and
no I/O besides :func:`read_unit`'s reads through the :class:`~mpack.convert.checkpoint.Checkpoint`.
:class:`TorchBackend` runs them in the stream (:mod:`mpack.convert.stream`) with what a GPU
needs around them:

- **read**: on a GPU the checkpoint bytes of a unit are read straight into a ring of pinned host
  pieces and copied to the GPU on a copy stream (``cudaMemcpyAsync`` from pinned memory, no
  staging copy inside the driver); on the CPU into plain tensors;
- **transform**: on a GPU on a compute stream that waits for the unit's copies; the weight
  repack is the one chosen when the backend opened (:data:`PACKERS`), the small scale and bias
  tensors are computed on the host, where they already are;
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

import torch

from mpack import target
from mpack.convert import cuda_repack, host_repack, marlin
from mpack.convert.backends import Piece, Refused, check_cuda_here
from mpack.convert.checkpoint import Checkpoint, read_scale
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

    # N: the layer's rows, zero rows between its pieces included (OutLayer.rows)
    weight: torch.Tensor  # uint8 [N, K]: fused, sliced, and requantized when the layer is
    scale: torch.Tensor  # float32 [N]: one scale per output channel
    bias: torch.Tensor | None  # [N] in the checkpoint's dtype


def fuse(layer: OutLayer, src: dict[str, torch.Tensor]) -> Fused:
    """Fuse and slice the checkpoint pieces of ``layer`` (SPEC §3.1-§3.2, §6).

    Args:
        src: per checkpoint module, ``<module>.weight`` uint8 ``[N, K]``,
            ``<module>.weight_scale`` float32 ``[1]`` or ``[N]``, and ``<module>.bias`` if any.
    """
    rows = [src[f"{p.module}.{WEIGHT}"][p.take][:, p.cols[0] : p.cols[1]] for p in layer.pieces]
    w = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()  # uint8 [N, K]
    if layer.strategy == "channel":
        scale_n = torch.cat([src[f"{p.module}.{SCALE}"][p.take] for p in layer.pieces])
    else:
        shard_scales = torch.cat([src[f"{p.module}.{SCALE}"] for p in layer.pieces])  # fp32 [S]
        if layer.requant:
            w, s_max = marlin.requantize_shards(w, shard_scales, layer.widths)
            scale_n = marlin.broadcast_scales(torch.tensor([s_max], dtype=torch.float32), layer.n)
        else:
            scale_n = marlin.broadcast_scales(shard_scales, layer.n, layer.widths)
    bias = None
    if layer.has_bias:
        bias = torch.cat([src[f"{p.module}.{BIAS}"][p.take] for p in layer.pieces])
    index = layer.row_index()
    if index is not None:  # zero rows between pieces, with scales 0 (Piece.pad)
        w, scale_n = (_spread(t, index, layer.rows) for t in (w, scale_n))
        bias = _spread(bias, index, layer.rows) if bias is not None else None
    return Fused(w, scale_n, bias)


def _spread(t: torch.Tensor, index: list[int], rows: int) -> torch.Tensor:
    """``t``'s rows at ``index`` of ``rows`` zero rows."""
    out = t.new_zeros((rows, *t.shape[1:]))
    out[torch.tensor(index, device=t.device)] = t
    return out


def pack(
    layer: OutLayer, f: Fused, act_dtype: str, packer: str = "ops", pool: Executor | None = None
) -> list[torch.Tensor]:
    """One rank's Marlin tensors for a fused layer, in the order of its tensor specs.

    The weight is packed where it is, by ``packer`` (:data:`PACKERS`); the scales and bias, a few
    KB, are computed on the host. The bytes are the same on every device and packer. ``pool``:
    threads for a CPU repack's blocks (:func:`mpack.convert.host_repack.block_pool`).

    Returns:
        ``[weight int32 [Kp/16, 4Np], weight_scale dt [1, Np], (bias dt [Np])]``.
    """
    dt = torch_dtype(target.act_dtype(act_dtype).st)
    out = [
        pack_weight(f.weight, layer.np_, layer.kp, packer, pool),
        marlin.pack_scales(f.scale.cpu(), dt, layer.np_),
    ]
    if f.bias is not None:
        out.append(marlin.pack_bias(f.bias.cpu(), dt, layer.np_))
    return out


def pack_weight(
    w: torch.Tensor, np_: int, kp: int, packer: str = "ops", pool: Executor | None = None
) -> torch.Tensor:
    """uint8 ``[N, K]`` -> int32 ``[Kp/16, 4*Np]`` on ``w``'s device, by ``packer``."""
    if packer == "kernel":
        return cuda_repack.pack_weight_cuda(w, np_, kp)
    if packer == "native":
        rows = w if w.stride(1) == 1 else w.contiguous()
        k = rows.shape[1]
        packed = host_repack.pack_rows(host_repack.rows_of(rows.numpy()), k, np_, kp, pool)
        return torch.from_numpy(packed)
    if packer == "ops":
        return marlin.pack_weight(w, np_, kp, pool)
    raise ValueError(f"packer must be one of {', '.join(PACKERS)}, got {packer!r}")


def transform(
    layer: OutLayer,
    src: dict[str, torch.Tensor],
    act_dtype: str,
    packer: str = "ops",
    pool: Executor | None = None,
) -> list[torch.Tensor]:
    """:func:`fuse` then :func:`pack`: the checkpoint pieces of ``layer`` -> its Marlin tensors."""
    return pack(layer, fuse(layer, src), act_dtype, packer, pool)


# --- the layout read backwards (mpack verify) -------------------------------------------------


def backwards(
    layer: OutLayer,
    fused: Fused,
    packed: list[torch.Tensor],
    act_dtype: str,
    pool: Executor | None = None,
) -> list[tuple[str, Any]]:
    """The layout read backwards on one rank's packed tensors (:func:`pack`'s order): ``(what,
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

    def read_unit(
        self, ck: Checkpoint, unit: list[OutLayer], act: str
    ) -> tuple[dict[str, torch.Tensor], Any]:
        if not self.cuda:
            return read_unit(ck, unit), None
        src = read_unit(ck, unit, lambda name: self._upload(ck, name).view(ck.tensors[name].shape))
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        return src, ready

    def _upload(self, ck: Checkpoint, name: str) -> torch.Tensor:
        """Disk -> pinned pieces (several preads at once) -> GPU, on the copy stream."""
        nbytes = ck.tensors[name].nbytes
        with torch.cuda.stream(self.copy_stream):
            dev = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        spans = [(a, min(a + PIECE, nbytes)) for a in range(0, nbytes, PIECE)]
        batch = max(1, min(READS_AT_ONCE, self.in_ring.count // 2))  # never more than the ring
        for i in range(0, len(spans), batch):
            group = spans[i : i + batch]
            t = time.perf_counter()
            slots = [self.in_ring.acquire() for _ in group]
            self._tl.add("read", "wait-ring", t, time.perf_counter())
            pairs = list(zip(slots, group, strict=True))
            ck.read_pieces(name, [(s.view[: b - a], a) for s, (a, b) in pairs])
            for s, (a, b) in pairs:
                s.to_device(dev[a:b], self.copy_stream)
                self.in_ring.release(s)
        return dev

    def from_raw(self, raw: dict[str, Any], ck: Checkpoint, act: str) -> dict[str, torch.Tensor]:
        """What :meth:`read_unit` gives, over a unit read once for several targets (weights and
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
        return pack(layer, fuse(layer, src), act, self.packer, self.pool())

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
