"""``SharedWeights``: the tensors of one served rank, as views into one allocation.

Note [lifetime of a mapping]: every tensor is a view of one uint8 base tensor that owns the
mapping (a read-only ``mmap`` of the daemon's memfd, or a read-only CUDA VMM mapping of its
exported allocation; see memfd.py and cuda_vmm.py). The mapping is released when the last view
of it is garbage-collected, never earlier, so a tensor the caller still holds can never point
at unmapped memory. ``close()`` ends the lease with the daemon and drops every reference this
object holds; once the caller drops its own views too, the mapping goes. A process that dies
releases it with its address space. The physical memory lives while *any* holder is left: the
daemon's handle, or a client's mapping. So mappings stay valid when the daemon dies, and the
memory is freed when the daemon and every client are gone.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mpack.sidecar import DTYPE_SIZES, torch_dtype

if TYPE_CHECKING:
    import torch

    from mpack.arch import Stage
    from mpack.sidecar import TensorEntry


# Note [unaligned tail tensors]: a torch view of another dtype must start at a multiple of its
# element size. Every 64-multiple-sized tensor of a sidecar is 64-aligned (docs/FORMAT.md), but
# the odd-sized tail of ``common.safetensors`` MAY start anywhere; such a tensor (a few bytes: a
# norm, a scalar) becomes a private copy instead of a view.
def view_of(base: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """Tensor ``e`` as a view of ``base`` (uint8 [size], any device) by byte offset: no data
    is copied, except for Note [unaligned tail tensors]."""
    raw = base[e.offset : e.offset + e.nbytes]  # uint8 [nbytes]
    if e.offset % DTYPE_SIZES[e.dtype]:
        raw = raw.clone()  # Note [unaligned tail tensors]
    return raw.view(torch_dtype(e.dtype)).view(e.shape)  # dtype [*shape]


def build_views(base: torch.Tensor, tensors: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Every tensor of ``tensors`` as a view of ``base`` (:func:`view_of`)."""
    return {e.name: view_of(base, e) for e in tensors}


# Note [views on first use]: making a tensor view costs a few microseconds of Python and torch
# per tensor; an engine may touch only some tensors, and attaching must not cost more with more
# tensors. So the views are made when a tensor is first looked up, and kept: the second lookup
# returns the same tensor object. Iterating and ``len`` make none.
class SharedWeights(Mapping[str, "torch.Tensor"]):
    """Every tensor of one rank of a sidecar (the rank file's and the pass-through ones).

    A ``Mapping[str, torch.Tensor]``; also ``manifest`` (the sidecar's mpack.json), ``digest``,
    ``rank``, ``device`` (``cpu`` or ``cuda:N``), ``backend`` (``private`` for :func:`load`,
    ``host`` or ``cuda`` for :func:`attach`), ``nbytes`` (bytes of the allocation), ``stage``
    (the pipeline stage held, :class:`mpack.arch.Stage`; None: the whole rank) and, when
    attached, ``daemon_pid`` (the daemon's process id, as the kernel reports the peer; None for
    a private load, or a daemon in a PID namespace this process cannot see).
    Attached tensors are read-only: a write fails in the writing process only. Use ``close()``
    or a ``with`` block; see Note [lifetime of a mapping]. Views are made on first lookup (Note
    [views on first use]).
    """

    def __init__(
        self,
        base: torch.Tensor,
        tensors: list[TensorEntry],
        *,
        manifest: dict[str, Any],
        digest: str,
        rank: int,
        device: str,
        backend: str,
        nbytes: int,
        lease: socket.socket | None = None,
        daemon_pid: int | None = None,
        stage: Stage | None = None,
    ) -> None:
        self._base: torch.Tensor | None = base
        self._entries = {e.name: e for e in tensors}
        self._views: dict[str, torch.Tensor] = {}
        self.manifest = manifest
        self.digest = digest
        self.rank = rank
        self.device = device
        self.backend = backend
        self.nbytes = nbytes
        self.daemon_pid = daemon_pid  # attached: the serving daemon's pid (SO_PEERCRED)
        #: The pipeline stage whose tensors these are (Note [a stage's allocation] in
        #: allocation.py); None: the whole rank.
        self.stage = stage
        self._lease = lease

    def _live(self) -> torch.Tensor:
        if self._base is None:
            raise ValueError("these SharedWeights are closed")
        return self._base

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor ``name``, a view made on first use (Note [views on first use])."""
        base = self._live()
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = view_of(base, self._entries[name])
        return view

    def __iter__(self) -> Iterator[str]:
        self._live()
        return iter(self._entries)

    def __len__(self) -> int:
        self._live()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        self._live()
        return name in self._entries

    @property
    def closed(self) -> bool:
        return self._base is None

    def close(self) -> None:
        """End the lease and drop this object's references (Note [lifetime of a mapping])."""
        self._base, self._views = None, {}
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} tensors"
        return (
            f"SharedWeights(rank={self.rank}, device={self.device!r}, backend={self.backend!r}, "
            f"{state}, {self.nbytes} bytes, digest={self.digest[:12]})"
        )
