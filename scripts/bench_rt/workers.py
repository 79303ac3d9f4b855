"""The benchmark's workers: scripts/bench_runtime.py run with ``--_worker KIND --_args JSON`` in a
fresh process, reporting JSON lines on stdout (``emit``) and taking commands on stdin.

- ``floor``: the floor (Note [the floor]), warm and cold;
- ``safetensors``: ``safetensors.torch.load_file`` of the rank's files;
- ``attach-client``: one client that attaches on each ``attach`` line;
- ``tmp-producer``: one ``torch.multiprocessing`` producer and its rounds of consumers;
- ``meminfo``: device memory in use, asked of the driver (when nvidia-smi is not there).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import GB, MiB
from .procs import CLIENT_TIMEOUT_S, REPLY_TIMEOUT_S, BenchError
from .system import evict

DEPTH = 4  # the floor's ring slots (the loader's own ring is deeper: loader.DEPTH)


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def _cuda_init(torch: Any, dev: str) -> None:
    """CUDA initialised, plus the kernels ``_probe`` runs (loaded lazily: their memory would
    otherwise show up as memory that attaching added)."""
    torch.cuda.init()
    torch.zeros(4096, dtype=torch.uint8, device=dev).sum().item()
    torch.cuda.synchronize(dev)


def _every_pointer(torch: Any, tensors: Any, dev: str) -> float:
    """``data_ptr()`` of every tensor of a mapping, then a synchronize on CUDA: what a client
    does before it can use them. The time (``perf_counter``) once done."""
    for t in tensors.values():
        t.data_ptr()
    if dev != "cpu":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _probe(torch: Any, t: Any) -> int:
    """A small checksum of a tensor's first bytes: every method must see the same ones."""
    return int(t.reshape(-1).view(torch.uint8)[:4096].sum().item())


# --- the floor -----------------------------------------------------------------------------------
# Note [the floor]: the fill ``serve`` does, minus everything it checks: the files read front to
# back in ``chunk`` pieces into the loader's own pinned ring (mpack.iokit.PinnedRing: pinned with
# CUDA, pageable without), each piece copied asynchronously into one preallocated device buffer;
# no hashing.


@dataclass
class Floor:
    """What every floor pass reuses: the ring, and with CUDA the device buffer (uint8 [total])
    and the copy stream."""

    ring: Any
    dst: Any = None
    stream: Any = None


def floor_ring(torch: Any, dev: str, total: int, depth: int, size: int) -> Floor:
    from mpack.iokit import PinnedRing

    if dev == "cpu":
        return Floor(PinnedRing(depth, size, pin=False))
    floor = Floor(
        PinnedRing(depth, size),
        torch.empty(total, dtype=torch.uint8, device=dev),
        torch.cuda.Stream(device=dev),
    )
    torch.cuda.synchronize(dev)
    return floor


def floor_pass(
    floor: Floor, regions: list[tuple[Path, int, int]], total: int, chunk: int, copy: bool
) -> float:
    """One pass of the floor (Note [the floor]); the seconds it took. Without ``copy`` only the
    reads (disk or page cache alone). On CPU (no ``floor.dst``) a copying pass reads straight
    into a fresh shared anonymous mapping, as the daemon does into its memfd."""
    from mpack.iokit import read_full

    cuda = floor.dst is not None
    mm = mmap.mmap(-1, total) if copy and not cuda else None  # shared anonymous, like a memfd
    host = memoryview(mm) if mm is not None else None
    k = 0
    t0 = time.perf_counter()
    for path, off, size in regions:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for pos in range(0, size, chunk):
                n = min(chunk, size - pos)
                slot = None if host is not None else floor.ring[k]
                view = host[off + pos : off + pos + n] if slot is None else slot.view[:n]
                if read_full(f, view) != n:
                    raise BenchError(f"{path}: short read")
                del view
                if cuda and copy:
                    slot.to_device(floor.dst[off + pos : off + pos + n], floor.stream)
                k += 1
    if cuda:
        floor.stream.synchronize()
    dt = time.perf_counter() - t0
    if mm is not None and host is not None:
        host.release()
        mm.close()
    return dt


def w_floor(a: dict[str, Any]) -> None:
    """The floor (Note [the floor]): each chunk size warm, the best one cold; reads alone too."""
    import torch

    dev, cuda = a["device"], a["device"] != "cpu"
    regions = [(Path(p), off, n) for p, off, n in a["regions"]]
    files = [r[0] for r in regions]
    total, reps = a["total"], a["reps"]
    chunks = [c * MiB for c in a["chunks"]]
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "depth": a["depth"],
        "chunks_mib": a["chunks"],
    }
    if cuda:
        _cuda_init(torch, dev)
        out["gpu"], out["cuda"] = torch.cuda.get_device_name(dev), torch.version.cuda
    floor = floor_ring(torch, dev, total, a["depth"], max(chunks))

    def one(chunk: int, copy: bool) -> float:
        return floor_pass(floor, regions, total, chunk, copy)

    h, nb, t0 = hashlib.sha256(), 0, time.perf_counter()
    piece = floor.ring.slots[0].view
    while nb < 2**30:  # what the daemon's one hashing thread can do, for comparison
        h.update(piece)
        nb += len(piece)
    out["sha256_gbps"] = nb / (time.perf_counter() - t0) / GB
    out["prewarm_s"] = one(chunks[0], False)  # fills the page cache if it was not
    out["copy_warm"] = {str(c // MiB): [one(c, True) for _ in range(reps)] for c in chunks}
    best = min(chunks, key=lambda c: min(out["copy_warm"][str(c // MiB)]))
    out["best_chunk_mib"] = best // MiB
    out["read_warm"] = [one(best, False) for _ in range(reps)]
    if a["cold"] != "none":
        out["copy_cold_state"] = evict(files, a["cold"])
        out["copy_cold"] = one(best, True)
        out["read_cold_state"] = evict(files, a["cold"])
        out["read_cold"] = one(best, False)
    emit({"floor": out})


# --- the other ways to load and share ------------------------------------------------------------


def w_safetensors(a: dict[str, Any]) -> None:
    """``safetensors.torch.load_file(f, device=D)`` of every file, timed after CUDA init."""
    import safetensors
    import torch
    from safetensors.torch import load_file

    dev, cuda = a["device"], a["device"] != "cpu"
    files = [Path(p) for p in a["files"]]
    if cuda:
        _cuda_init(torch, dev)
    state = evict(files, a["cold"]) if a["cold"] != "none" else None
    tensors: dict[str, Any] = {}
    t0 = time.perf_counter()
    for p in files:
        d = load_file(str(p), device=dev)
        if not cuda:  # load_file maps the file lazily on CPU: make the private copy real
            d = {k: v.clone() for k, v in d.items()}
        tensors.update(d)
    if cuda:
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    emit(
        {
            "safetensors": {
                "seconds": dt,
                "tensors": len(tensors),
                "version": safetensors.__version__,
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "cold_state": state,
                "probe": _probe(torch, tensors[a["probe"]]),
            }
        }
    )


def client_start(dev: str) -> tuple[Callable[..., Any], float, float]:
    """What a client does before it attaches: import torch and ``mpack.runtime.warm(dev)``
    (what an engine's vLLM plugin does at start: imports are not attach latency), then on CUDA
    ``_cuda_init``. (``attach``, import
    seconds, CUDA seconds)."""
    t0 = time.perf_counter()
    import torch

    from mpack.runtime import attach, warm

    warm(dev)  # as the vLLM plugin does at registration (Note [warm attach])
    t1 = time.perf_counter()
    if dev != "cpu":
        _cuda_init(torch, dev)
    return attach, t1 - t0, time.perf_counter() - t1


def w_attach_client(a: dict[str, Any]) -> None:
    """Init, say ready, then on each ``attach`` line: (re)attach and report the times."""
    import gc

    import torch

    dev = a["device"]
    attach, _, _ = client_start(dev)
    emit({"ready": os.getpid()})
    w = None
    while line := sys.stdin.readline():
        cmd = line.strip()
        if cmd == "exit":
            break
        if cmd != "attach":
            continue
        if w is not None:
            w.close()
            w = None
            gc.collect()
        t0 = time.perf_counter()
        w = attach(a["sidecar"], rank=a["rank"], device=dev, socket=a["socket"])
        t1 = time.perf_counter()
        t2 = _every_pointer(torch, w, dev)
        emit(
            {
                "attach_ms": (t1 - t0) * 1e3,
                "total_ms": (t2 - t0) * 1e3,
                "tensors": len(w),
                "nbytes": w.nbytes,
                "probe": _probe(torch, w[a["probe"]]),
            }
        )
    if w is not None:
        w.close()


def _tmp_consumer(
    conn: Any, ready_q: Any, res_q: Any, go: Any, release: Any, dev: str, probe: str
) -> None:
    """A torch.multiprocessing consumer (spawned by w_tmp_producer)."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    cuda = dev != "cpu"
    if cuda:
        _cuda_init(torch, dev)
    ready_q.put(os.getpid())
    go.wait()
    t0 = time.perf_counter()
    d = ForkingPickler.loads(conn.recv_bytes())  # what mp.Queue.get() does
    t1 = time.perf_counter()
    t2 = _every_pointer(torch, d, dev)
    seen = _probe(torch, d[probe])
    res_q.put(
        {
            "pid": os.getpid(),
            "get_ms": (t1 - t0) * 1e3,
            "total_ms": (t2 - t0) * 1e3,
            "tensors": len(d),
            "probe": seen,
        }
    )
    release.wait()
    del d


def _tmp_load(torch: Any, files: list[str], dev: str) -> dict[str, Any]:
    """Every tensor of ``files`` by ``load_file(f, device=dev)``; on CPU moved into shared
    memory once, here, not in the first put."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for p in files:
        d = load_file(str(p), device=dev)
        if dev == "cpu":
            d = {k: v.clone().share_memory_() for k, v in d.items()}
        tensors.update(d)
    if dev != "cpu":
        torch.cuda.synchronize(dev)
    return tensors


class _TmpRound:
    """One round: ``n`` spawned consumers (``_tmp_consumer``), each at the end of its own pipe."""

    def __init__(self, ctx: Any, n: int, dev: str, probe: str) -> None:
        self.n = n
        self.rq, self.resq = ctx.Queue(), ctx.Queue()
        self.go, self.release = ctx.Event(), ctx.Event()
        self.pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
        args = (self.rq, self.resq, self.go, self.release, dev, probe)
        self.procs = [
            ctx.Process(target=_tmp_consumer, args=(r, *args), daemon=True) for r, _ in self.pipes
        ]
        for p in self.procs:
            p.start()

    def ready(self) -> dict[str, Any]:
        try:
            return {"ready": [self.rq.get(timeout=CLIENT_TIMEOUT_S) for _ in range(self.n)]}
        except queue.Empty:
            return {"error": f"torch.mp consumers not ready within {CLIENT_TIMEOUT_S} s"}

    def send(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Pickle ``tensors`` for each consumer, write them, release the consumers; their times."""
        from multiprocessing.reduction import ForkingPickler

        t0 = time.perf_counter()
        blobs = [bytes(ForkingPickler.dumps(tensors)) for _ in self.pipes]  # one pickle each
        pickle_ms = (time.perf_counter() - t0) * 1e3 / max(1, self.n)
        writers = [
            threading.Thread(target=w.send_bytes, args=(b,), daemon=True)
            for (_, w), b in zip(self.pipes, blobs, strict=True)
        ]
        for w in writers:
            w.start()
        self.go.set()
        try:
            results = [self.resq.get(timeout=REPLY_TIMEOUT_S) for _ in range(self.n)]
        except queue.Empty:
            return {"error": f"torch.mp consumers silent for {REPLY_TIMEOUT_S} s"}
        for w in writers:
            w.join(10)
        return {"results": results, "pickle_ms": pickle_ms, "pickle_bytes": len(blobs[0])}

    def end(self) -> dict[str, Any]:
        self.release.set()
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
        return {"released": self.n}


def w_tmp_producer(a: dict[str, Any]) -> None:
    """Load the tensors once, then serve rounds of N consumers on commands from stdin
    (``round N``, ``go``, ``release``, ``quit``).

    Each consumer gets the dict pickled by torch's reductions (one CUDA IPC handle per tensor)
    through a pipe: exactly what ``mp.Queue.put``/``get`` do, except that the pickling is done
    (and timed, ``pickle_ms``) before the consumers are released, not by a feeder thread.
    """
    import torch
    import torch.multiprocessing as tmp

    dev = a["device"]
    if dev != "cpu":
        _cuda_init(torch, dev)
    t0 = time.perf_counter()
    tensors = _tmp_load(torch, a["files"], dev)
    emit(
        {
            "loaded": True,
            "load_s": time.perf_counter() - t0,
            "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "probe": _probe(torch, tensors[a["probe"]]),
        }
    )
    ctx = tmp.get_context("spawn")
    rnd: _TmpRound | None = None
    while line := sys.stdin.readline():
        cmd, *rest = line.split()
        if cmd == "round":
            rnd = _TmpRound(ctx, int(rest[0]), dev, a["probe"])
            doc = rnd.ready()
        elif cmd in ("go", "release") and rnd is not None:
            doc = rnd.send(tensors) if cmd == "go" else rnd.end()
        elif cmd == "quit":
            break
        else:
            continue
        emit(doc)
        if "error" in doc:
            return


def w_meminfo(a: dict[str, Any]) -> None:
    """Device memory in use (total - free) on each line read: a fallback for nvidia-smi."""
    import torch

    _cuda_init(torch, a["device"])
    emit({"ready": os.getpid()})
    while sys.stdin.readline():
        free, total = torch.cuda.mem_get_info(a["device"])
        emit({"used": total - free})


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "floor": w_floor,
    "safetensors": w_safetensors,
    "attach-client": w_attach_client,
    "tmp-producer": w_tmp_producer,
    "meminfo": w_meminfo,
}
