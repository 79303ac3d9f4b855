"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import time
from pathlib import Path


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_files(files: list[Path], chunk: int = 16 * 1024 * 1024) -> float:
    """Read every file front to back with plain sequential I/O; the seconds it took."""
    t = time.perf_counter()
    buf = bytearray(chunk)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def proc_status_bytes(pid: int, keys: tuple[str, ...]) -> int:
    """The sum of ``keys`` (e.g. ``("VmHWM:",)``, kB values) in /proc/<pid>/status, in bytes;
    0 once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(keys))
