"""Host backend (``--device cpu``): one sealed memfd per served rank, mapped read-only by clients.

Note [read-only host mapping]: the daemon fills the memfd through a writable mapping, unmaps
it, then seals the memfd (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL). From then
on the kernel refuses every way to change the bytes, to every holder of the fd, the daemon
included: ``write()``, a shared writable ``mmap``, ``ftruncate``. Clients map it ``PROT_READ``
and ``MAP_SHARED``, so all of them read the same page-cache pages (no copy; the pages count as
shared memory, not as any client's anonymous memory). A client that writes through a tensor
touches a read-only page and gets SIGSEGV: that process dies, nothing else is affected. A
client could still map the fd ``MAP_PRIVATE`` and write: that makes a private copy-on-write
copy, invisible to everyone else.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import time
import warnings
from typing import TYPE_CHECKING

from mpack import fsutil
from mpack.runtime.loader import FillStats, HostDest, Progress, fill

if TYPE_CHECKING:
    import torch

    from mpack.cache import VerifiedFiles
    from mpack.runtime.allocation import Allocation

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MEMFD_PREFIX = "mpack:"  # shows in /proc/<pid>/maps as /memfd:mpack:... (deleted)


class HostExport:
    """The daemon's side: a sealed memfd of ``size`` bytes holding one rank's files."""

    backend = "host"

    def __init__(self, fd: int, size: int, stats: FillStats, alloc_s: float = 0.0) -> None:
        self.fd = fd
        self.size = size
        self.stats = stats
        self.alloc_s = alloc_s  # seconds from the start of ``create`` to the fill's

    @classmethod
    def create(
        cls,
        plan: Allocation,
        name: str,
        progress: Progress | None = None,
        verified: VerifiedFiles | None = None,
    ) -> HostExport:
        """Allocate, fill (verifying checksums; ``progress`` and ``verified`` as ``loader.fill``
        takes them) and seal. Raises what ``loader.fill`` raises."""
        t0 = time.perf_counter()
        size = plan.size
        fd = os.memfd_create(MEMFD_PREFIX + name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            alloc_s = time.perf_counter() - t0
            try:
                stats = fill(plan, HostDest(memoryview(mm)), progress=progress, verified=verified)
            finally:
                # After a failed fill a traceback may still hold a view; the writable mapping
                # then goes with it (and the memfd is closed below, unsealed and unserved).
                with contextlib.suppress(BufferError):
                    mm.close()
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # Note [read-only host mapping]
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, stats, alloc_s)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def memfd_problem(fd: int, size: int) -> str | None:
    """What is wrong with ``fd`` as a served rank of ``size`` bytes, or None: it must be a regular
    file (a memfd) of exactly ``size`` bytes carrying ``SEALS`` (Note [read-only host mapping]).

    A client checks this before mapping what a peer sent: a pipe cannot be mapped, a file shorter
    than ``size`` faults (SIGBUS) on the first read past its end, and one without the shrink seal
    could be truncated under the mapping later.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = fsutil.kind_of(st.st_mode)
        return f"{'a descriptor of another kind' if kind.startswith('not') else kind}, not a memfd"
    if st.st_size != size:
        return f"a file of {st.st_size} bytes, not the {size} bytes announced"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: not a file that can carry seals (only a memfd can)
        seals = 0
    if seals & SEALS != SEALS:
        return (
            f"a file without the write, shrink and grow seals (seals {seals:#x}, need {SEALS:#x})"
        )
    return None


def map_readonly(fd: int, size: int) -> torch.Tensor:
    """A uint8 [size] CPU tensor over a read-only shared mapping of ``fd`` (which the caller
    may close afterwards). The mapping lives as long as the tensor or any view of it."""
    import numpy as np
    import torch

    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)  # read-only array, holds the mapping
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; the page protection enforces it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
