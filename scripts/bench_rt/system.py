"""The machine as the benchmark sees it: the page cache (cold and warm files) and memory in use.

Page cache: ``evict`` makes files cold (``drop_caches`` as root, ``POSIX_FADV_DONTNEED`` on the
files in any case) and ``resident_fraction`` (mincore) checks it. Memory: ``host_memory`` is the
CPU analogue of a GPU's memory in use, ``mem_summary`` the weights held once the contexts of the
clients are taken out (scripts/bench_runtime.py's docstring, "memory").
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any

from benchutil import drop_caches, proc_status_bytes, read_files

#: /proc/<pid>/status fields of a process's own memory on the host backend (not the shared mapping).
OWN_MEMORY = ("RssAnon:", "VmPTE:")


# --- page cache ----------------------------------------------------------------------------------


def resident_fraction(files: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (mincore), or None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
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


# --- memory ---------------------------------------------------------------------------------------


def host_memory(groups: set[int]) -> int:
    """CPU analogue of GPU memory used: all shared memory (``Shmem``: memfds, torch's shared
    tensors) + anonymous memory and page tables of the processes this benchmark started, the
    process groups ``groups`` (other processes of a shared machine come and go; theirs would be
    noise)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
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
    """Weights held with ``n`` clients, contexts subtracted (scripts/bench_runtime.py's docstring,
    "memory")."""
    ctx = (idle - one) / n
    own_ctx = ctx if own is None else own
    weights = att - m0 - n * ctx - own_ctx
    return {
        "baseline": m0,
        "one": one,
        "idle": idle,
        "attached": att,
        "clients": n,
        "one_copy_bytes": copy,
        "context_per_client": ctx,
        "server_context": own_ctx,
        "attach_added": att - idle,
        "weights_with_clients": weights,
        "raw_ratio": (att - m0) / copy,
        "ratio": weights / copy,
    }
