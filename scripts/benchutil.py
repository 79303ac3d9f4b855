"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import os


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
