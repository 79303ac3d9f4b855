"""Benchmark `mpack serve` / `mpack.runtime.attach` against their floors and the usual ways.

    python scripts/bench_runtime.py --sidecar /tmp/mpack-bench/out-cuda --device cuda:0 \\
        [--json runtime.json]
    python scripts/bench_runtime.py --workdir /tmp/brt [--layers 32] [--vocab 128256] ...
    python scripts/bench_runtime.py --workdir /tmp/brt --layers 2 --vocab 32000 --device cpu

Everything is measured in the same run, on the same files (one rank: its rank file and
``common.safetensors``, exactly the bytes ``serve`` loads):

- **floor**: a fresh process reads the files front to back in 16 or 64 MiB pieces (the faster
  warm is used cold) into a ring of 4 pinned buffers, each then copied asynchronously into one
  preallocated device buffer (no hashing, no checks): cold and warm. Also the same reads, no copy
  ("read only": disk or page cache alone, not PCIe). With ``--device cpu`` the floor reads
  straight into a fresh shared anonymous mapping (what the daemon does with its memfd).
- **serve**: ``mpack serve SIDECAR --device D --socket S`` in a fresh process, cold (page cache
  dropped first) and warm; ``load_s`` from its READY line (the verified fill only, comparable
  with the floor) and the wall time from ``Popen`` to READY (interpreter, torch, CUDA init too).
- **safetensors**: ``safetensors.torch.load_file(f, device=D)`` of the same files in a fresh
  process, timed after ``torch.cuda.init()`` and a first allocation, up to a synchronize. (On
  CPU ``load_file`` maps the file lazily, so each tensor is also cloned: a private copy.)
- **attach**: one daemon; N = 1, 2, 4, 8 fresh client processes import torch and mpack and
  initialise CUDA, then are released together and time ``attach(...)`` (building every tensor
  view included); also each client's ``data_ptr()`` of every tensor + synchronize, and a second
  attach in a warm process.
- **memory** (``nvidia-smi memory.used``; on CPU ``Shmem`` + the anonymous memory of the
  processes it started, see host_memory): nothing running; the daemon alone; daemon + 8 idle
  clients (CUDA initialised: their contexts); the same 8 attached. Weights held with 8 clients
  = attached - baseline - 9 contexts (a context measured as (idle - daemon alone) / 8; the
  daemon's counted as one more on CUDA, its own RssAnon on CPU), against the rank's size. Also
  raw (attached - baseline, contexts included) and what attaching added (attached - idle).
- **torch.multiprocessing**: one producer loads the same tensors with ``load_file(f, device=D)``
  and sends the dict to spawned ``torch.multiprocessing`` consumers, pickled by torch's
  reductions (one CUDA IPC handle per tensor, as vLLM's daemon does) over a pipe, as
  ``mp.Queue`` does; consumers time the get (receive + unpickle) up to having every tensor
  (``data_ptr()`` each, then a synchronize); N = 1, 2, 4, 8, and memory with 8.

Targets (ratios measured in this run): cold load <= 1.15 x floor and < safetensors; attach <= 20
ms with 8 clients and faster than torch.mp; 8 clients hold <= 1.05 x one copy. The table of
ratios is printed LAST; ``--json`` writes every number. Cold = ``drop_caches`` (root; the whole
page cache, libraries too: a cold ``serve`` also imports torch from disk, outside ``load_s``) and
``POSIX_FADV_DONTNEED`` on the sidecar's files (any user); mincore then checks that they are out
of the cache, and a run that was not cold is flagged. Every process it starts runs in a session
of its own and is killed (its whole process group) when it ends, fails or is interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import drop_caches, proc_status_bytes, read_files  # noqa: E402

from mpack.runtime.loader import read_full  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = Path(__file__).resolve()
MiB = 1024 * 1024
GB = 1e9
#: /proc/<pid>/status fields of a process's own memory on the host backend (not the shared mapping).
OWN_MEMORY = ("RssAnon:", "VmPTE:")
DEPTH = 4  # the floor's ring slots (the loader's own ring is deeper: loader.DEPTH)
LLAMA_8B_LAYERS, LLAMA_8B_VOCAB = 32, 128256  # scripts/synth_checkpoint.py's defaults
READY_TIMEOUT_S = 900.0  # a cold 8B load from a slow disk, after a cold torch import
CLIENT_TIMEOUT_S = 300.0  # 8 processes importing torch and initialising CUDA at once
REPLY_TIMEOUT_S = 120.0


class BenchError(Exception):
    pass


# --- page cache ----------------------------------------------------------------------------------


def resident_fraction(files: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (mincore), or None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]  # fmt: skip
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    pages = resident = 0
    for p in files:
        size = os.path.getsize(p)
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                pages += n
                resident += n - bytes(vec).count(0)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / pages if pages else 0.0


def evict(files: list[Path], how: str) -> dict[str, Any]:
    """Make ``files`` cold: drop the whole page cache (``how="drop"``, root) and in any case
    ``POSIX_FADV_DONTNEED`` each file; report how much of them is still cached."""
    os.sync()
    dropped = drop_caches() if how == "drop" else False
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    frac = resident_fraction(files)
    cold = frac < 0.02 if frac is not None else dropped
    return {"drop_caches": dropped, "fadvise": True, "resident_after": frac, "cold": cold}


def ensure_warm(files: list[Path]) -> float | None:
    """Read the files once unless (nearly) all of them are cached; the residency before."""
    frac = resident_fraction(files)
    if frac is None or frac < 0.99:
        read_files(files)
    return frac


# --- workers (this script run with --_worker KIND; JSON lines on stdout) -------------------------


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def _cuda_init(torch: Any, dev: str) -> None:
    """CUDA initialised, plus the kernels ``_probe`` runs (loaded lazily: their memory would
    otherwise show up as memory that attaching added)."""
    torch.cuda.init()
    torch.zeros(4096, dtype=torch.uint8, device=dev).sum().item()
    torch.cuda.synchronize(dev)


def _probe(torch: Any, t: Any) -> int:
    """A small checksum of a tensor's first bytes: every method must see the same ones."""
    return int(t.reshape(-1).view(torch.uint8)[:4096].sum().item())


def w_floor(a: dict[str, Any]) -> None:
    """The floor: sequential reads into a pinned ring + async H2D copies into one device buffer."""
    import torch

    dev, cuda = a["device"], a["device"] != "cpu"
    regions = [(Path(p), off, n) for p, off, n in a["regions"]]
    files = [r[0] for r in regions]
    total, depth, reps = a["total"], a["depth"], a["reps"]
    chunks = [c * MiB for c in a["chunks"]]
    out: dict[str, Any] = {"torch": torch.__version__, "depth": depth, "chunks_mib": a["chunks"]}
    if cuda:
        _cuda_init(torch, dev)
        out["gpu"], out["cuda"] = torch.cuda.get_device_name(dev), torch.version.cuda
        dst = torch.empty(total, dtype=torch.uint8, device=dev)
        pinned = [
            torch.empty(max(chunks), dtype=torch.uint8, pin_memory=True) for _ in range(depth)
        ]
        ring = [memoryview(p.numpy()) for p in pinned]
        stream = torch.cuda.Stream(device=dev)
        torch.cuda.synchronize(dev)
    else:
        ring = [memoryview(bytearray(max(chunks))) for _ in range(depth)]

    def one(chunk: int, copy: bool) -> float:
        events: list[Any] = [None] * depth
        mm = mmap.mmap(-1, total) if copy and not cuda else None  # shared anonymous, like a memfd
        host = memoryview(mm) if mm is not None else None
        k = 0
        t0 = time.perf_counter()
        for path, off, size in regions:
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                pos = 0
                while pos < size:
                    n, i = min(chunk, size - pos), k % depth
                    if host is not None:
                        view = host[off + pos : off + pos + n]
                    else:
                        if events[i] is not None:
                            events[i].synchronize()
                        view = ring[i][:n]
                    if read_full(f, view) != n:
                        raise BenchError(f"{path}: short read")
                    del view
                    if cuda and copy:
                        with torch.cuda.stream(stream):
                            dst[off + pos : off + pos + n].copy_(pinned[i][:n], non_blocking=True)
                            ev = torch.cuda.Event()
                            ev.record(stream)
                        events[i] = ev
                    pos += n
                    k += 1
        if cuda:
            stream.synchronize()
        dt = time.perf_counter() - t0
        if mm is not None and host is not None:
            host.release()
            mm.close()
        return dt

    h, nb, t0 = hashlib.sha256(), 0, time.perf_counter()
    while nb < 2**30:  # what the daemon's one hashing thread can do, for comparison
        h.update(ring[0])
        nb += len(ring[0])
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
    emit({"safetensors": {"seconds": dt, "tensors": len(tensors), "version": safetensors.__version__,
                          "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                          "cold_state": state, "probe": _probe(torch, tensors[a["probe"]])}})  # fmt: skip


def w_attach_client(a: dict[str, Any]) -> None:
    """Init, say ready, then on each ``attach`` line: (re)attach and report the times."""
    import gc

    import torch

    import mpack.runtime.client  # noqa: F401 - imports are not attach latency
    import mpack.runtime.weights  # noqa: F401
    from mpack.runtime import attach

    dev, cuda = a["device"], a["device"] != "cpu"
    if cuda:
        import mpack.runtime.cuda_vmm  # noqa: F401

        with contextlib.suppress(ImportError):
            from cuda.bindings import driver  # noqa: F401
        _cuda_init(torch, dev)
    else:
        import mpack.runtime.host  # noqa: F401
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
        for t in w.values():
            t.data_ptr()
        if cuda:
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        emit({"attach_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3, "tensors": len(w),
              "nbytes": w.nbytes, "probe": _probe(torch, w[a["probe"]])})  # fmt: skip
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
    for t in d.values():
        t.data_ptr()
    if cuda:
        torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    seen = _probe(torch, d[probe])
    res_q.put({"pid": os.getpid(), "get_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3,
               "tensors": len(d), "probe": seen})  # fmt: skip
    release.wait()
    del d


def w_tmp_producer(a: dict[str, Any]) -> None:
    """Load the tensors once, then serve rounds of N consumers on commands from stdin.

    Each consumer gets the dict pickled by torch's reductions (one CUDA IPC handle per tensor)
    through a pipe: exactly what ``mp.Queue.put``/``get`` do, except that the pickling is done
    (and timed, ``pickle_ms``) before the consumers are released, not by a feeder thread.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as tmp
    from safetensors.torch import load_file

    dev, cuda = a["device"], a["device"] != "cpu"
    if cuda:
        _cuda_init(torch, dev)
    t0 = time.perf_counter()
    tensors: dict[str, Any] = {}
    for p in a["files"]:
        d = load_file(str(p), device=dev)
        if not cuda:  # CPU: into shared memory once, here, not in the first put
            d = {k: v.clone().share_memory_() for k, v in d.items()}
        tensors.update(d)
    if cuda:
        torch.cuda.synchronize(dev)
    emit({"loaded": True, "load_s": time.perf_counter() - t0, "tensors": len(tensors),
          "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
          "probe": _probe(torch, tensors[a["probe"]])})  # fmt: skip
    ctx = tmp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[tuple[Any, Any]] = []
    rq = resq = go = release = None
    n = 0
    while line := sys.stdin.readline():
        cmd, *rest = line.split()
        if cmd == "round":
            n = int(rest[0])
            rq, resq, go, release = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
            pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
            args = (rq, resq, go, release, dev, a["probe"])
            procs = [ctx.Process(target=_tmp_consumer, args=(r, *args), daemon=True)
                     for r, _ in pipes]  # fmt: skip
            for p in procs:
                p.start()
            try:
                pids = [rq.get(timeout=CLIENT_TIMEOUT_S) for _ in range(n)]
            except queue.Empty:
                emit({"error": f"torch.mp consumers not ready within {CLIENT_TIMEOUT_S} s"})
                return
            emit({"ready": pids})
        elif cmd == "go":
            t0 = time.perf_counter()
            blobs = [bytes(ForkingPickler.dumps(tensors)) for _ in pipes]  # one pickle each
            pickle_ms = (time.perf_counter() - t0) * 1e3 / max(1, n)
            writers = [threading.Thread(target=w.send_bytes, args=(b,), daemon=True)
                       for (_, w), b in zip(pipes, blobs, strict=True)]  # fmt: skip
            for w in writers:
                w.start()
            go.set()
            try:
                results = [resq.get(timeout=REPLY_TIMEOUT_S) for _ in range(n)]
            except queue.Empty:
                emit({"error": f"torch.mp consumers silent for {REPLY_TIMEOUT_S} s"})
                return
            for w in writers:
                w.join(10)
            emit({"results": results, "pickle_ms": pickle_ms, "pickle_bytes": len(blobs[0])})
        elif cmd == "release":
            release.set()
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
                    p.join(10)
            emit({"released": n})
        elif cmd == "quit":
            break


def w_meminfo(a: dict[str, Any]) -> None:
    """Device memory in use (total - free) on each line read: a fallback for nvidia-smi."""
    import torch

    _cuda_init(torch, a["device"])
    emit({"ready": os.getpid()})
    while sys.stdin.readline():
        free, total = torch.cuda.mem_get_info(a["device"])
        emit({"used": total - free})


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "floor": w_floor, "safetensors": w_safetensors, "attach-client": w_attach_client,
    "tmp-producer": w_tmp_producer, "meminfo": w_meminfo,
}  # fmt: skip


# --- child processes -----------------------------------------------------------------------------


class Child:
    """A subprocess in a session of its own: lines on stdout (timestamped as they arrive),
    commands on stdin, stderr to a log file. Ending it ends its whole process group (a
    torch.mp producer's consumers too); ``Child.kill_all()`` ends every one still running."""

    live: ClassVar[list[Child]] = []
    _n: ClassVar[int] = 0

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        Child._n += 1
        self.name = name
        self.log = cwd / f"{Child._n:02d}-{name}.log"
        with open(self.log, "w") as err:
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env, cwd=cwd,
                                         start_new_session=True)  # fmt: skip
        Child.live.append(self)
        self._lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self._pumper = threading.Thread(target=self._pump, daemon=True)
        self._pumper.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put((time.perf_counter(), line.rstrip("\n")))
        self._lines.put((time.perf_counter(), None))

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""

    def read_line(self, timeout: float, pred: Callable[[str], bool] = bool) -> tuple[float, str]:
        """The next stdout line for which ``pred`` holds, with the time it arrived."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(
                    f"{self.name}: nothing within {timeout:g} s\n{self.tail()}"
                ) from None
            if line is None:
                raise BenchError(f"{self.name} closed its stdout (exited?)\n{self.tail()}")
            if pred(line):
                return t, line

    def read_json(self, key: str, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """The next JSON line (an object) holding ``key``; one holding ``error`` raises."""
        while True:
            _, line = self.read_line(timeout, lambda s: s.startswith("{"))
            doc = json.loads(line)
            if "error" in doc:
                raise BenchError(f"{self.name}: {doc['error']}\n{self.tail()}")
            if key in doc:
                return doc

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise BenchError(f"{self.name} is gone\n{self.tail()}") from None

    def _exited(self) -> bool:
        """Whether the leader exited (left a zombie: its pid, the group's id, stays ours)."""
        try:
            r = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return r is not None

    def _wait_exited(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._exited():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def end(self, sig: int | None = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the leader (``sig``; None: close its stdin) and wait; then SIGKILL the group."""
        if sig is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
        elif not self._exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
        clean = self._wait_exited(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the leader is unreaped: the id is ours
        code = self.proc.wait()
        self._pumper.join(10)  # EOF once the group is gone
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if f is not None:
                    f.close()
        with contextlib.suppress(ValueError):
            Child.live.remove(self)
        return code if clean else None

    @classmethod
    def kill_all(cls) -> None:
        for c in list(cls.live):
            c.end(signal.SIGKILL, 10)


# --- the benchmark -------------------------------------------------------------------------------


@dataclass
class Ctx:
    args: argparse.Namespace
    sidecar: Path
    tmp: Path
    env: dict[str, str]
    regions: list[tuple[Path, int, int]]
    total: int
    tensors: int
    probe: str
    meminfo: Child | None = None
    smi_id: str | None = None
    res: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def cuda(self) -> bool:
        return self.args.device != "cpu"

    @property
    def files(self) -> list[Path]:
        return [r[0] for r in self.regions]

    @property
    def socket(self) -> Path:
        return self.tmp / "s.sock"

    def worker(self, kind: str, args: dict[str, Any]) -> Child:
        cmd = [sys.executable, str(SCRIPT), "--_worker", kind, "--_args", json.dumps(args)]
        return Child(kind, cmd, self.env, self.tmp)

    def run_worker(self, kind: str, args: dict[str, Any], key: str, timeout: float) -> Any:
        c = self.worker(kind, args)
        try:
            return c.read_json(key, timeout)[key]
        finally:
            c.end(None, 60)

    def serve(self) -> tuple[Child, dict[str, Any]]:
        """``mpack serve`` in a fresh process; its READY fields and ``wall_s`` (Popen to READY)."""
        cmd = [sys.executable, "-m", "mpack.cli", "serve", str(self.sidecar), "--rank",
               str(self.args.rank), "--device", self.device, "--socket", str(self.socket)]  # fmt: skip
        c = Child("serve", cmd, self.env, self.tmp)
        try:
            t, line = c.read_line(READY_TIMEOUT_S, lambda s: s.startswith("READY "))
        except BaseException:
            c.end(signal.SIGKILL, 10)
            raise
        ready: dict[str, Any] = dict(kv.split("=", 1) for kv in line.split()[1:])
        ready["load_s"] = float(ready["load_s"])
        ready["bytes"] = int(ready["bytes"])
        ready["wall_s"] = t - c.t0
        return c, ready

    # --- memory ------------------------------------------------------------------------------

    def mem_sample(self) -> int:
        if not self.cuda:
            return host_memory()
        if self.meminfo is None:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", str(self.smi_id)], capture_output=True, text=True,
                                 timeout=30, check=True).stdout  # fmt: skip
            return int(out.split()[0]) * MiB
        self.meminfo.send("q")
        return int(self.meminfo.read_json("used")["used"])

    def mem(self, settle: float = 1.0) -> int:
        """Memory in use once things settled: the median of 3 samples."""
        time.sleep(settle)
        samples = []
        for _ in range(3):
            samples.append(self.mem_sample())
            time.sleep(0.15)
        return int(statistics.median(samples))


def host_memory() -> int:
    """CPU analogue of GPU memory used: all shared memory (``Shmem``: memfds, torch's shared
    tensors) + anonymous memory and page tables of the processes this benchmark started (other
    processes of a shared machine come and go; theirs would be noise)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
    groups = {c.proc.pid for c in Child.live}
    total = info["Shmem"]
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            pgrp = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[2])
            if pgrp in groups:
                total += proc_status_bytes(int(d), OWN_MEMORY)
        except (OSError, IndexError, ValueError):
            continue
    return total


def mem_summary(m0: int, one: int, idle: int, att: int, n: int, copy: int, own: int | None) -> dict:
    """Weights held with ``n`` clients, contexts subtracted (see the module docstring)."""
    ctx = (idle - one) / n
    own_ctx = ctx if own is None else own
    weights = att - m0 - n * ctx - own_ctx
    return {"baseline": m0, "one": one, "idle": idle, "attached": att, "clients": n,
            "one_copy_bytes": copy, "context_per_client": ctx, "server_context": own_ctx,
            "attach_added": att - idle, "weights_with_clients": weights,
            "raw_ratio": (att - m0) / copy, "ratio": weights / copy}  # fmt: skip


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def gbps(nbytes: int, s: float | None) -> str:
    return f"{nbytes / s / GB:.2f} GB/s" if s else "n/a"


# --- sections ------------------------------------------------------------------------------------


def section_floor(c: Ctx) -> dict[str, Any]:
    chunks = [int(x) for x in c.args.floor_chunks.split(",")]
    f = c.run_worker("floor", {"device": c.device, "regions": [[str(p), o, n] for p, o, n in c.regions],
                               "total": c.total, "depth": DEPTH, "chunks": chunks,
                               "reps": c.args.warm_reps, "cold": c.args.cold}, "floor", 1800)  # fmt: skip
    f["copy_warm_best"] = min(min(v) for v in f["copy_warm"].values())
    b = c.total
    copy = "file -> pinned -> device" if c.cuda else "file -> shared mapping"
    for k in ("copy_cold", "read_cold"):
        st = f.get(k + "_state")
        if st and not st["cold"]:
            print(f"  WARNING: {k} was not cold: {st}")
    print(f"  {copy} ({f['best_chunk_mib']} MiB x {DEPTH}): cold {f.get('copy_cold', 0):.2f} s "
          f"({gbps(b, f.get('copy_cold'))}), warm {f['copy_warm_best']:.2f} s "
          f"({gbps(b, f['copy_warm_best'])})")  # fmt: skip
    print(f"  read only: cold {f.get('read_cold', 0):.2f} s ({gbps(b, f.get('read_cold'))}), warm "
          f"{min(f['read_warm']):.2f} s ({gbps(b, min(f['read_warm']))}); per chunk (warm, s): "
          + ", ".join(f"{k} MiB {min(v):.2f}" for k, v in f["copy_warm"].items()))  # fmt: skip
    print(f"  sha256, one thread: {f['sha256_gbps']:.2f} GB/s ({b / GB / f['sha256_gbps']:.2f} s "
          "for these bytes as one stream; serve hashes 64 MiB chunks on several threads)")  # fmt: skip
    return f


def _cold_and_warm(c: Ctx, one: Callable[[str], dict[str, Any]], key: str) -> dict[str, Any]:
    """``one("cold")`` once (unless ``--cold none``), then ``one("warm")`` ``--warm-reps`` times;
    ``warm_best`` is the smallest ``key`` of the warm runs."""
    out: dict[str, Any] = {"warm": []}
    for temp in (["cold"] if c.args.cold != "none" else []) + ["warm"] * c.args.warm_reps:
        r = one(temp)
        if temp == "cold":
            out["cold"] = r
        else:
            out["warm"].append(r)
    out["warm_best"] = min(r[key] for r in out["warm"]) if out["warm"] else None
    return out


def section_serve(c: Ctx) -> dict[str, Any]:
    def one(temp: str) -> dict[str, Any]:
        state = (
            evict(c.files, c.args.cold)
            if temp == "cold"
            else {"resident_before": ensure_warm(c.files)}
        )
        d, ready = c.serve()
        code = d.end(signal.SIGTERM, 60)
        r = {"load_s": ready["load_s"], "wall_s": ready["wall_s"], "bytes": ready["bytes"],
             "startup_s": ready["wall_s"] - ready["load_s"], "exit": code, "state": state}  # fmt: skip
        print(f"  serve ({temp}): load_s {r['load_s']:.2f} s ({gbps(c.total, r['load_s'])}), "
              f"Popen to READY {r['wall_s']:.2f} s, SIGTERM exit {code}")  # fmt: skip
        return r

    return _cold_and_warm(c, one, "load_s")


def section_safetensors(c: Ctx) -> dict[str, Any]:
    def one(temp: str) -> dict[str, Any]:
        if temp == "warm":
            ensure_warm(c.files)
        args = {"device": c.device, "files": [str(p) for p in c.files], "probe": c.probe,
                "cold": c.args.cold if temp == "cold" else "none"}  # fmt: skip
        r = c.run_worker("safetensors", args, "safetensors", 1800)
        print(f"  load_file ({temp}): {r['seconds']:.2f} s ({gbps(r['bytes'], r['seconds'])}), "
              f"{r['tensors']} tensors, safetensors {r['version']}")  # fmt: skip
        return r

    return _cold_and_warm(c, one, "seconds")


def _clients(c: Ctx, n: int) -> list[Child]:
    args = {"device": c.device, "sidecar": str(c.sidecar), "rank": c.args.rank,
            "socket": str(c.socket), "probe": c.probe}  # fmt: skip
    kids = [c.worker("attach-client", args) for _ in range(n)]
    try:
        for k in kids:
            k.read_json("ready", CLIENT_TIMEOUT_S)
    except BaseException:
        for k in kids:
            k.end(signal.SIGKILL, 10)
        raise
    return kids


def _stats(xs: list[float]) -> dict[str, float]:
    return {"max": max(xs), "median": statistics.median(xs), "min": min(xs)}


def section_attach(c: Ctx, m0: int) -> dict[str, Any]:
    ensure_warm(c.files)
    out: dict[str, Any] = {"tensors": c.tensors, "rounds": {}}
    d, ready = c.serve()
    try:
        out["daemon_bytes"] = ready["bytes"]
        m_one = c.mem()
        own = None if c.cuda else proc_status_bytes(d.proc.pid, OWN_MEMORY)
        counts = c.args.clients
        for n in counts:
            kids = _clients(c, n)
            try:
                m_idle = c.mem() if n == max(counts) else None
                for k in kids:  # the barrier: every client is initialised and waits for this
                    k.send("attach")
                docs = [k.read_json("attach_ms") for k in kids]
                rnd = {"attach_ms": _stats([x["attach_ms"] for x in docs]),
                       "total_ms": _stats([x["total_ms"] for x in docs]),
                       "tensors": sorted({x["tensors"] for x in docs}),
                       "probes": sorted({x["probe"] for x in docs})}  # fmt: skip
                if m_idle is not None:
                    from mpack.runtime.client import status_of

                    m_att = c.mem()
                    rnd["daemon_clients"] = len(status_of(c.socket)["clients"])
                    out["memory"] = mem_summary(m0, m_one, m_idle, m_att, n, c.total, own)
                if n == 1:
                    again = []
                    for _ in range(3):
                        kids[0].send("attach")
                        again.append(kids[0].read_json("attach_ms")["attach_ms"])
                    out["reattach_ms"] = _stats(again)
                out["rounds"][str(n)] = rnd
                a = rnd["attach_ms"]
                print(f"  {n} client(s): attach max {a['max']:.1f} ms, median {a['median']:.1f} ms "
                      f"(with data_ptr + sync: max {rnd['total_ms']['max']:.1f} ms), "
                      f"{rnd['tensors']} tensors")  # fmt: skip
                if len(rnd["probes"]) != 1:
                    print(f"  WARNING: clients saw different bytes: probes {rnd['probes']}")
            finally:
                for k in kids:  # EOF on stdin: it closes its lease and exits
                    k.end(None, 60)
        if "reattach_ms" in out:
            print(f"  attach again in a warm process: median {out['reattach_ms']['median']:.2f} ms")
        if "memory" in out:
            m = out["memory"]
            print(f"  memory: baseline {gib(m0)}, daemon alone +{gib(m_one - m0)}, context/client "
                  f"{gib(m['context_per_client'])}, {m['clients']} attached add "
                  f"{gib(m['attach_added'])}: weights {gib(m['weights_with_clients'])} = "
                  f"{m['ratio']:.3f} x one copy ({gib(c.total)}); raw {m['raw_ratio']:.3f} x")  # fmt: skip
    finally:
        out["daemon_exit"] = d.end(signal.SIGTERM, 60)
    return out


def section_torch_mp(c: Ctx, m0: int) -> dict[str, Any]:
    ensure_warm(c.files)
    args = {"device": c.device, "files": [str(p) for p in c.files], "probe": c.probe}
    p = c.worker("tmp-producer", args)
    out: dict[str, Any] = {"rounds": {}}
    try:
        out.update(p.read_json("loaded", 1800))
        m_one = c.mem()
        own = None if c.cuda else proc_status_bytes(p.proc.pid, OWN_MEMORY)
        counts = c.args.clients
        for n in counts:
            p.send(f"round {n}")
            p.read_json("ready", CLIENT_TIMEOUT_S)
            m_idle = c.mem() if n == max(counts) else None
            p.send("go")
            doc = p.read_json("results")
            res = doc["results"]
            if m_idle is not None:
                m_att = c.mem()
                out["memory"] = mem_summary(m0, m_one, m_idle, m_att, n, out["bytes"], own)
            p.send("release")
            p.read_json("released")
            rnd = {"get_ms": _stats([r["get_ms"] for r in res]),
                   "total_ms": _stats([r["total_ms"] for r in res]),
                   "probes": sorted({r["probe"] for r in res}),
                   "producer_pickle_ms": doc["pickle_ms"], "pickle_bytes": doc["pickle_bytes"]}  # fmt: skip
            out["rounds"][str(n)] = rnd
            print(f"  {n} consumer(s): get max {rnd['get_ms']['max']:.1f} ms, with data_ptr + sync "
                  f"max {rnd['total_ms']['max']:.1f} ms, median {rnd['total_ms']['median']:.1f} ms "
                  f"(producer: {doc['pickle_ms']:.1f} ms to pickle each, {doc['pickle_bytes']} B)")  # fmt: skip
        if "memory" in out:
            m = out["memory"]
            print(f"  memory: producer alone +{gib(m_one - m0)}, {m['clients']} consumers add "
                  f"{gib(m['attach_added'])}: weights {gib(m['weights_with_clients'])} = "
                  f"{m['ratio']:.3f} x one copy ({gib(out['bytes'])}); raw {m['raw_ratio']:.3f} x")  # fmt: skip
        p.send("quit")
        out["exit"] = p.end(None, 60)
    finally:
        if p in Child.live:
            p.end(signal.SIGKILL, 10)
    return out


# --- setup ---------------------------------------------------------------------------------------


def prepare_sidecar(a: argparse.Namespace, env: dict[str, str], cwd: Path) -> Path:
    if a.sidecar:
        return Path(a.sidecar).resolve()
    work = Path(a.workdir).resolve()
    src, out = work / "src", work / "sidecar"
    cfg = src / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        if (c["num_hidden_layers"], c["vocab_size"]) != (a.layers, a.vocab):
            raise SystemExit(f"{src} has {c['num_hidden_layers']} layers and vocab "
                             f"{c['vocab_size']}, not {a.layers} and {a.vocab}: use another "
                             "--workdir")  # fmt: skip
    if (out / "mpack.json").is_file():
        print(f"reusing {out}", flush=True)
        return out
    if not cfg.is_file():
        t = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / "synth_checkpoint.py"), str(src), "--layers",
                        str(a.layers), "--vocab", str(a.vocab)], check=True, env=env, cwd=cwd)  # fmt: skip
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mpack.cli", "convert", str(src), "-o", str(out),
                    "--device", a.device, "--quiet"], check=True, env=env, cwd=cwd)  # fmt: skip
    print(f"converted to {out} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def smi_id(device: str) -> str | None:
    """The nvidia-smi id of ``cuda:N`` (through CUDA_VISIBLE_DEVICES), None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    n = int(device.partition(":")[2] or 0)
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return vis[n] if n < len(vis) else str(n)


def meta(c: Ctx) -> dict[str, Any]:
    m: dict[str, Any] = {
        "sidecar": str(c.sidecar), "device": c.device, "rank": c.args.rank, "bytes": c.total,
        "tensors": c.tensors, "files": {p.name: n for p, _, n in c.regions},
        "python": sys.version.split()[0], "cpus": os.cpu_count(), "cold_method": c.args.cold,
    }  # fmt: skip
    if c.cuda and c.smi_id is not None:
        with contextlib.suppress(Exception):
            m["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                       "--format=csv,noheader", "-i", c.smi_id],
                                      capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    return m


# --- summary -------------------------------------------------------------------------------------


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarize(c: Ctx) -> list[dict[str, Any]]:
    """The rows of the final table: each a measured ratio (or ms) against its target."""
    r = c.res
    temp = "cold" if _get(r, "serve", "cold") is not None else "warm"
    if temp == "cold":
        serve, floor = _get(r, "serve", "cold", "load_s"), _get(r, "floor", "copy_cold")
        st = _get(r, "safetensors", "cold", "seconds")
    else:
        serve, floor = _get(r, "serve", "warm_best"), _get(r, "floor", "copy_warm_best")
        st = _get(r, "safetensors", "warm_best")
    top = str(max(c.args.clients))
    att = _get(r, "attach", "rounds", top, "attach_ms", "max")
    att_total = _get(r, "attach", "rounds", top, "total_ms", "max")
    tmp_total = _get(r, "torch_mp", "rounds", top, "total_ms", "max")
    mem = _get(r, "attach", "memory") or {}
    tensors = _get(r, "attach", "rounds", top, "tensors")

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    where = "GPU" if c.cuda else "host"
    weights = mem.get("weights_with_clients")
    rows = [
        {"name": f"{temp} load / floor", "value": ratio(serve, floor), "unit": "x", "op": "<=",
         "target": 1.15, "from": f"load_s {sec(serve)} s / floor {sec(floor)} s"},
        {"name": f"{temp} load / safetensors load_file", "value": ratio(serve, st), "unit": "x",
         "op": "<", "target": 1.0, "from": f"{sec(serve)} s / {sec(st)} s"},
        {"name": f"attach ms, max of {top} clients", "value": att, "unit": "ms", "op": "<=",
         "target": 20.0, "from": f"{tensors[0] if tensors else '?'} tensors"},
        {"name": f"attach / torch.mp, max of {top}", "value": ratio(att_total, tmp_total),
         "unit": "x", "op": "<", "target": 1.0,
         "from": f"{ms(att_total)} ms / {ms(tmp_total)} ms (+ data_ptr, sync)"},
        {"name": f"{where} memory, {top} clients / one copy", "value": mem.get("ratio"),
         "unit": "x", "op": "<=", "target": 1.05,
         "from": "n/a" if weights is None else f"{gib(weights)} / {gib(c.total)}, contexts out"},
    ]  # fmt: skip
    for row in rows:
        v, t = row["value"], row["target"]
        row["pass"] = None if v is None else bool(v <= t if row["op"] == "<=" else v < t)
    return rows


def probes(c: Ctx) -> dict[str, list[int]]:
    """The checksum of the same tensor's first bytes, as each method saw it (all must agree)."""
    r = c.res
    loads = [_get(r, "safetensors", "cold"), *(_get(r, "safetensors", "warm") or [])]
    out = {"load_file": [x["probe"] for x in loads if isinstance(x, dict) and "probe" in x]}
    for name in ("attach", "torch_mp"):
        out[name] = [p for rnd in (_get(r, name, "rounds") or {}).values() for p in rnd["probes"]]
    if _get(r, "torch_mp", "probe") is not None:
        out["torch_mp"].append(r["torch_mp"]["probe"])
    return {k: sorted(set(v)) for k, v in out.items() if v}


def print_table(c: Ctx, rows: list[dict[str, Any]]) -> None:
    r = c.res
    print(f"\n{c.sidecar}: rank {c.args.rank}, {c.total / GB:.2f} GB, {c.tensors} tensors, "
          f"device {c.device}" + ("" if c.cuda else " (CPU analogues: the targets are for CUDA)"))  # fmt: skip
    cold = [_get(r, "floor", "copy_cold_state", "cold"), _get(r, "serve", "cold", "state", "cold")]
    if c.args.cold == "none":
        print("cold runs skipped (--cold none): the load ratios are warm")
    elif False in cold:
        print(
            f"WARNING: a cold run was not cold (floor, serve: {cold}); run as root or --cold fadvise"
        )
    seen = r.get("probes", {})
    if len({v for vs in seen.values() for v in vs}) > 1:
        print(f"WARNING: the methods saw different bytes of {c.probe}: {seen}")
    print(f"{'metric':<40}{'value':>10}{'target':>9}  {'result':<7}from")
    for row in rows:
        v, ok = row["value"], row["pass"]
        val = "n/a" if v is None else (f"{v:.1f} ms" if row["unit"] == "ms" else f"{v:.3f}x")
        res = "n/a" if ok is None else "PASS" if ok else "MISS"
        print(f"{row['name']:<40}{val:>10}{row['op'] + ' ' + format(row['target'], 'g'):>9}  "
              f"{res:<7}{row['from']}")  # fmt: skip


# --- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--sidecar", help="an existing sidecar (e.g. bench_convert's <workdir>/out-cuda)"
    )
    src.add_argument("--workdir", help="build (or reuse) DIR/src and DIR/sidecar")
    ap.add_argument("--layers", type=int, default=LLAMA_8B_LAYERS, help="with --workdir")
    ap.add_argument("--vocab", type=int, default=LLAMA_8B_VOCAB, help="with --workdir")
    ap.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--clients", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")],
                    help="client counts (memory at the largest)")  # fmt: skip
    ap.add_argument("--warm-reps", type=int, default=2)
    ap.add_argument("--floor-chunks", default="16,64", help="MiB; the best warm one is used cold")
    ap.add_argument("--cold", choices=["drop", "fadvise", "none"], default="drop",
                    help="drop: drop_caches (root) + fadvise the files; fadvise: only the files")  # fmt: skip
    ap.add_argument(
        "--skip", default="", help="sections to skip: floor,serve,safetensors,attach,torch_mp"
    )
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--_worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--_args", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a._worker and not (a.sidecar or a.workdir):
        ap.error("give --sidecar PATH or --workdir DIR")
    if a.device != "cpu" and not a.device.startswith("cuda"):
        ap.error("--device must be cuda, cuda:N or cpu")
    if a.device == "cuda":
        a.device = "cuda:0"
    return a


def main() -> int:
    a = parse_args()
    if a._worker:
        WORKERS[a._worker](json.loads(a._args))
        return 0
    for sig in (signal.SIGTERM, signal.SIGHUP):  # so that `finally` ends every child
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tmp = Path(tempfile.mkdtemp(prefix="brt-", dir="/tmp"))  # short: the socket lives here
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    t_start = time.perf_counter()
    try:
        sidecar = prepare_sidecar(a, env, tmp)
        from mpack.errors import MpackError
        from mpack.runtime.layout import plan_rank

        try:
            plan = plan_rank(sidecar, a.rank)
        except MpackError as e:
            raise SystemExit(f"bench_runtime: {e}") from None
        c = Ctx(a, sidecar, tmp, env, [(r.path, r.offset, r.size) for r in plan.regions],
                plan.size, len(plan.tensors), plan.tensors[0].name)  # fmt: skip
        if c.cuda:
            c.smi_id = smi_id(a.device)
            if c.smi_id is not None:
                try:
                    c.mem_sample()
                except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
                    print(f"nvidia-smi -i {c.smi_id} failed ({e}): asking the driver instead")
                    c.smi_id = None
            if c.smi_id is None:  # a process of ours asks the driver (its context: a constant)
                c.meminfo = c.worker("meminfo", {"device": a.device})
                c.meminfo.read_json("ready", CLIENT_TIMEOUT_S)
        c.res["meta"] = meta(c)
        c.res["meta"]["memory_source"] = (
            "Shmem + RssAnon of ours"
            if not c.cuda
            else "nvidia-smi"
            if c.meminfo is None
            else "torch.mem_get_info"
        )
        print(f"{sidecar}: {c.total / GB:.2f} GB in {len(c.regions)} files, {c.tensors} tensors; "
              f"device {a.device}", flush=True)  # fmt: skip
        m0 = c.res["memory_baseline"] = c.mem(0.0)
        skip = set(a.skip.split(","))
        sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("floor", lambda: section_floor(c)),
            ("serve", lambda: section_serve(c)),
            ("safetensors", lambda: section_safetensors(c)),
            ("attach", lambda: section_attach(c, m0)),
            ("torch_mp", lambda: section_torch_mp(c, m0)),
        ]
        for name, fn in sections:
            if name in skip:
                continue
            print(f"== {name}", flush=True)
            t = time.perf_counter()
            try:
                c.res[name] = fn()
            except Exception as e:  # a failed section is recorded; the others still run
                c.res[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
            c.res[name]["section_s"] = time.perf_counter() - t
            sys.stdout.flush()
        c.res["memory_end"] = c.mem()
        c.res["total_s"] = time.perf_counter() - t_start
        print(f"== memory at the end {gib(c.res['memory_end'] - m0)} above the start; total "
              f"{c.res['total_s']:.0f} s")  # fmt: skip
        c.res["probes"] = probes(c)
        rows = c.res["summary"] = summarize(c)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(c.res, indent=2, default=str))
            print(f"wrote {a.json_out}")
        print_table(c, rows)
    finally:
        Child.kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
