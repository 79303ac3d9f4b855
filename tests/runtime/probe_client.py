"""A client process for the runtime tests: attaches, then answers commands on stdin with JSON.

    python probe_client.py SIDECAR --rank R --device D [--socket PATH]

On start it prints ``{"event": "attached", ...}`` (or ``{"event": "error", ...}`` and exits 1).
Commands, one per line: ``check`` (re-hash every tensor), ``maps`` (the memfd mappings and
their smaps counters), ``write`` (a kernel/CPU write into a
shared tensor), ``copy-write`` (a memcpy into one), ``close`` (close and drop every view),
``exit``. A write that is refused kills this process or raises; a write that succeeds prints
``{"event": "wrote"}``, which the tests treat as a failure.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return -1


def memfd_mappings() -> list[dict]:
    """The mpack memfd mappings of this process with their inode and smaps counters (bytes)."""
    out, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping header line
            cur = None
            if len(parts) >= 6 and "memfd:mpack:" in parts[5]:
                cur = {"inode": int(parts[4]), "perms": parts[1]}
                out.append(cur)
        elif cur is not None and parts and parts[0].endswith(":") and len(parts) >= 2:
            key = parts[0][:-1]
            if key in (
                "Rss",
                "Shared_Clean",
                "Shared_Dirty",
                "Private_Clean",
                "Private_Dirty",
                "Anonymous",
            ):
                cur[key] = int(parts[1]) * 1024
    return out


def digest(w) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(w):
        t = w[name]
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def emit(**doc) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sidecar")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--socket", default=None)
    a = ap.parse_args()

    import torch

    from mpack.errors import MpackError
    from mpack.runtime import attach

    cuda = a.device.startswith("cuda")
    free0 = 0
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=a.device)  # create the context before measuring
        free0 = torch.cuda.mem_get_info(a.device)[0]
    # import what attach() imports first, so the anon RSS delta measures the attach, not imports
    import mpack.runtime.client  # noqa: F401
    import mpack.runtime.weights  # noqa: F401

    anon0 = rss_anon()
    t0 = time.perf_counter()
    try:
        w = attach(a.sidecar, rank=a.rank, device=a.device, socket=a.socket)
    except MpackError as e:
        emit(event="error", kind=type(e).__name__, message=str(e))
        return 1
    attach_ms = (time.perf_counter() - t0) * 1e3
    d = digest(w)
    info = {"rss_anon_delta": rss_anon() - anon0, "mappings": memfd_mappings()}
    if cuda:
        info["free_delta"] = free0 - torch.cuda.mem_get_info(a.device)[0]
        info["torch_allocated"] = torch.cuda.memory_allocated(a.device)
    emit(event="attached", pid=os.getpid(), attach_ms=attach_ms, digest=d, nbytes=w.nbytes, **info)

    name = sorted(k for k in w if k.endswith(".weight"))[0]
    t = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            emit(event="check", digest=digest(w))
        elif cmd == "maps":
            emit(event="maps", mappings=memfd_mappings())
        elif cmd in ("write", "copy-write"):
            t = w[name]
            try:
                if cmd == "write":
                    t.view(-1)[:8].add_(1)  # CPU: a store to a PROT_READ page; CUDA: a kernel
                else:
                    t.copy_(torch.zeros(t.shape, dtype=t.dtype))  # CUDA: an H2D memcpy
                if cuda:
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported to the test
                emit(event="write-failed", error=f"{type(e).__name__}: {e}"[:500])
                return 3
            emit(event="wrote")
        elif cmd == "close":
            w.close()
            t = None
            gc.collect()
            emit(event="closed", mappings=memfd_mappings())
        elif cmd == "exit":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
