"""The output directory of ``convert``: where it is, who writes it, what it holds, and the swap.

A run checks ``-o`` before any work (:func:`output_path`, :func:`check_apart`), holds OUT's
parent directory open and its lock (:func:`output_lock`) from before it reads the source until
OUT is in place, and writes the sidecar through :func:`staged_sidecar`: OUT found up to date, or
a hidden work directory filled and swapped into place at the end. One module each:

- :mod:`.path`: where OUT is, ``-o`` resolved and checked (Note [output path]);
- :mod:`.lock`: who writes OUT: the held parent, the lock, the hidden names and what dead runs
  left (Note [output lock], Note [held parent]);
- :mod:`.existing`: what OUT holds already: this sidecar (up to date), another one, or foreign;
- :mod:`.swap`: the work directory and its swap into place (Note [atomic output], Note [what
  the swap replaces]).
"""

from __future__ import annotations

from mpack.convert.output.lock import lock_path, output_lock, work_dirs
from mpack.convert.output.path import check_apart, output_path, target_output
from mpack.convert.output.swap import staged_sidecar

__all__ = [
    "check_apart",
    "lock_path",
    "output_lock",
    "output_path",
    "staged_sidecar",
    "target_output",
    "work_dirs",
]
