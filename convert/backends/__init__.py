"""Which code reads a unit and transforms a layer: the conversion's backends, and the one place
that picks one (:func:`open_backend`).

A backend does one rank's layers of a conversion (SPEC §3) and of a re-derivation (``mpack verify
--source``) for :class:`mpack.convert.stream.Streamer`:

- ``host`` (:mod:`.host`): numpy and the native repack, on the CPU, without torch (Note [host
  path]);
- ``driver`` (:mod:`.driver`): the host backend with page-locked arrays and the weight repack on a
  GPU through cuda-bindings, without torch (Note [driver path]);
- ``torch`` (:mod:`.torch`): torch tensors on the CPU or a GPU, the one that requantizes
  (``w8a8-marlin`` on per-tensor shards); its weight repack is the fused CUDA kernel, the native
  repack or torch's ops, chosen when it opens.

Every backend gives the same bytes (tests/convert/test_backends.py runs each one that is usable
here on the golden cases). A new path, such as ROCm, is one module here and one entry in
:func:`_candidates`.

Note [choosing a backend]: as vLLM's kernel chooser does, :func:`open_backend` keeps a priority
list of candidates for the device asked for, asks each in turn whether it can convert this plan
here, honours one disable list (:data:`SWITCHES`, from the environment or given), and records each
refusal's reason (``-v`` and ``--json`` print them). The list: ``cpu`` -> host, torch on the CPU;
``cuda``/``cuda:i`` -> driver, torch on that GPU; ``auto`` -> the same as ``cpu`` followed by the
GPU's, where there is surely no GPU or on :data:`AUTO_HOST_CORES` usable cores or more (Note [auto
device]), else the GPU's first. A GPU named outright that is not here is the user's error
(``UsageError``), not a refusal.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mpack import env_flag, iokit
from mpack.convert.options import BACKENDS, check_backend_name
from mpack.device import CONVERT, DeviceSpec, no_cuda_here
from mpack.errors import UsageError, arg

if TYPE_CHECKING:
    import threading

    from mpack.convert.checkpoint import Checkpoint
    from mpack.convert.plan import OutLayer, Plan
    from mpack.convert.timeline import Timeline

__all__ = [
    "AUTO_HOST_CORES",
    "BACKENDS",
    "SWITCHES",
    "Backend",
    "Piece",
    "Refused",
    "disabled_by_env",
    "turned_off",
    "open_backend",
    "prefetch_files",
]

_log = logging.getLogger(__name__)


#: What can be turned off -> the environment variable that turns it off. ``native-repack``: the
#: host backend, and the native repack under the torch backend on the CPU; ``cuda-kernel``: the
#: driver backend, and the fused kernel under the torch backend on a GPU; ``driver``: the driver
#: backend; ``direct-write``: O_DIRECT writes of the sidecar (Note [direct writes] in
#: mpack/iokit.py; the pipeline asks :meth:`mpack.convert.options.ConvertOptions.turned_off`).
#: The same bytes come out whatever is off.
SWITCHES = {
    "native-repack": "MPACK_NO_HOST_REPACK",
    "driver": "MPACK_NO_DRIVER_PATH",
    "cuda-kernel": "MPACK_NO_CUDA_KERNEL",
    "direct-write": "MPACK_NO_DIRECT_WRITE",
}

#: ``--device auto`` puts the host backend first on this many usable cores even where a GPU is
#: (Note [auto device]).
AUTO_HOST_CORES = 8

# Note [auto device]: the bytes are the same on every backend, so ``auto`` takes the fastest one
# here. On a many-core machine with a GPU (the 16-core H200 host), the host backend converted the
# 8B checkpoint as fast as the driver backend, and faster than torch on the GPU: a tie, so the
# host backend, which starts no GPU and pins no memory. On few cores the host backend is CPU-bound,
# most of its CPU time the repack, and the driver backend needs far fewer CPU-seconds, so below 8
# cores ``auto`` tries the GPU first when there may be one. Figures: docs/BENCHMARKS.md, sections
# 6.1, 6.2 and 9.

#: One piece of a result for the writer: ``(offset in the tensor, bytes, ready, done)``; the
#: writer waits for ``ready`` (``.synchronize()``) before it reads the bytes and calls ``done``
#: once it wrote them. Either may be None.
Piece = tuple[int, Any, Any, Callable[[], None] | None]


class Refused(Exception):
    """A candidate backend cannot convert this plan here; the message says why, for people."""


class Backend(Protocol):
    """One rank's layers of a conversion, from the checkpoint's bytes to the Marlin tensors'.

    ``name``: one of :data:`BACKENDS`; ``where``: ``cpu`` or ``cuda:<i>``; ``detail``: what it
    runs, for people (e.g. the torch backend's weight repack); ``refused``: the candidates tried
    before it, ``"<name> (<where>)" -> reason``; ``write_queue``: results that may wait for the
    writer (0: unbounded, the backend bounds them itself).
    """

    name: str
    where: str
    detail: str
    refused: dict[str, str]
    write_queue: int

    def takes(self, plan: Plan) -> str | None:
        """Why this open backend cannot convert ``plan`` (None: it can); for reuse across the
        targets of one run."""
        ...

    def streaming(self, abort: threading.Event, tl: Timeline) -> AbstractContextManager[None]:
        """Around one stream: what it holds for the stream's length (pinned rings, streams);
        ``abort`` stops a wait inside, ``tl`` gets its waits."""
        ...

    def read_units(
        self, ck: Checkpoint, units: list[list[OutLayer]], act: str
    ) -> tuple[dict[str, Any], Any]:
        """The checkpoint arrays of a batch of units (one unit, or consecutive experts: Note
        [expert batches] in mpack/convert/stream.py), as :meth:`transform` takes them for
        activation dtype ``act``, and what the transform waits for before it reads them (None:
        nothing)."""
        ...

    def from_raw(self, raw: dict[str, Any], ck: Checkpoint, act: str) -> dict[str, Any]:
        """What :meth:`read_units` gives, from a batch read once for several targets
        (:func:`mpack.convert.stream.read_raw`)."""
        ...

    def on_unit(self, src: dict[str, Any], ready: Any) -> AbstractContextManager[None]:
        """Around the transforms of one batch read by :meth:`read_units`."""
        ...

    def transform(self, layer: OutLayer, src: dict[str, Any], act: str) -> list[Any]:
        """One rank's Marlin tensors for ``layer``, in the order of its tensor specs."""
        ...

    def transform_stack(self, layers: list[OutLayer], src: dict[str, Any], act: str) -> list[Any]:
        """One rank's part of stacked tensors for ``layers``, experts of one stacked tensor with
        consecutive indices: per tensor spec, the results :meth:`transform` gives for each
        layer, one after another (``[len(layers), ...]``)."""
        ...

    def read_back(
        self, layer: OutLayer, src: dict[str, Any], outs: list[Any], act: str
    ) -> list[tuple[str, Any]]:
        """The layout read backwards on :meth:`transform`'s results: ``(what, differs)`` per
        tensor; ``differs`` may be a value that is read only after :meth:`settle`."""
        ...

    def settle(self) -> None:
        """Wait until every queued :meth:`read_back` comparison can be read."""
        ...

    def pieces(self, result: Any) -> Iterator[Piece]:
        """A result of :meth:`transform` as pieces for the writer (Piece)."""
        ...

    def done_with(self, src: dict[str, Any]) -> None:
        """Nothing reads a unit's arrays any more: they may be handed round again."""
        ...

    def close(self) -> None:
        """Release what the backend holds (GPU, threads, page-locked memory)."""
        ...


def disabled_by_env() -> frozenset[str]:
    """What the environment turns off (:data:`SWITCHES`)."""
    return frozenset(what for what, var in SWITCHES.items() if env_flag(var))


def turned_off(disabled: Iterable[str] | None) -> frozenset[str]:
    """What is off: ``disabled`` when given (each one of :data:`SWITCHES`, else a
    ``UsageError``), else what the environment turns off."""
    off = disabled_by_env() if disabled is None else frozenset(disabled)
    unknown = off - set(SWITCHES)
    if unknown:
        raise UsageError(f"cannot turn off {', '.join(sorted(unknown))}: not one of {SWITCHES}")
    return off


@dataclass(frozen=True)
class _Candidate:
    name: str
    gpu: bool  # on the GPU the device names (``auto``: ``cuda``)

    def label(self, spec: DeviceSpec) -> str:
        return f"{self.name} ({_where(spec) if self.gpu else 'cpu'})"


_CPU = DeviceSpec("cpu", None, None)


def _where(spec: DeviceSpec) -> str:
    return f"cuda:{spec.ordinal}"


def _candidates(spec: DeviceSpec) -> list[_Candidate]:
    """The priority list for a device (Note [choosing a backend])."""
    cpu = [_Candidate("host", False), _Candidate("torch", False)]
    gpu = [_Candidate("driver", True), _Candidate("torch", True)]
    if spec.kind == "cpu":
        return cpu
    if spec.kind == "cuda":
        return gpu
    if no_cuda_here() or iokit.usable_cores() >= AUTO_HOST_CORES:
        return cpu[:1] + gpu + cpu[1:]
    return gpu + cpu


def open_backend(
    device: str | DeviceSpec,
    plan: Plan,
    *,
    backend: str = "auto",
    disabled: frozenset[str] | None = None,
    option: str = "device",
    tl: Timeline | None = None,
    spans: tuple[str, str] = ("driver", "torch"),
    opened: list[Backend] | None = None,
) -> Backend:
    """The backend that converts ``plan``'s layers for ``device`` here (Note [choosing a
    backend]); close it after use.

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:i``, or the :class:`DeviceSpec` it was
            parsed into (:data:`mpack.device.CONVERT`), which is not parsed again.
        backend: ``auto`` (the first that can), or one of :data:`BACKENDS` (that one or an error).
        disabled: what is turned off (default: :func:`disabled_by_env`).
        option: the argument an error names (``device``; verify's ``rederive_device``), as
            :func:`mpack.errors.arg` words it (Note [API wording]).
        tl: gets ``main`` spans named ``spans``: opening the GPU for the driver backend, and
            importing torch (and checking its device) for the torch backend.
        opened: backends this run already opened (several targets): a candidate among them
            that takes ``plan`` is used again rather than opened twice (the caller closes it).

    One function by design (Note [choosing a backend]): the whole choice, its refusals and its
    errors read in one place.

    Raises:
        UsageError: a bad device name, a GPU named that is not here, an unknown ``backend``, or
            a ``backend`` asked for that cannot convert this plan here (its reason said).
    """
    spec = DeviceSpec.of(device, CONVERT, option)
    check_backend_name(backend)
    off = turned_off(disabled)
    from mpack.convert.timeline import Timeline

    tl = tl or Timeline()
    refused: dict[str, str] = {}
    for cand in _candidates(spec):
        if backend not in ("auto", cand.name):
            continue
        where = _where(spec) if cand.gpu else "cpu"
        again = [b for b in opened or () if (b.name, b.where) == (cand.name, where)]
        if again and again[0].takes(plan) is None:
            return again[0]
        try:
            chosen = _open(cand, spec, plan, off, option, tl, spans)
        except Refused as r:
            refused[cand.label(spec)] = str(r)
            continue
        chosen.refused = refused
        _log.debug("%s", describe(chosen))
        return chosen
    if not refused:
        where = "a GPU" if backend == "driver" else "the CPU"
        raise UsageError(
            f"{arg('backend', backend)} does not run on {arg(option, str(device))}",
            hint=f"the {backend} backend runs on {where}: use "
            + arg(option, "cuda" if backend == "driver" else "cpu"),
        )
    why = "; ".join(f"{k}: {v}" for k, v in refused.items())
    raise UsageError(
        f"{arg('backend', backend)} cannot convert this checkpoint with "
        f"{arg(option, str(device))}: {why}",
        hint=f"leave {arg('backend')} at auto (every backend writes the same bytes)",
    )


def _open(
    cand: _Candidate,
    spec: DeviceSpec,
    plan: Plan,
    off: frozenset[str],
    option: str,
    tl: Timeline,
    spans: tuple[str, str],
) -> Backend:
    if cand.name == "host":
        from mpack.convert.backends import host

        return host.open_host(plan, off)
    if cand.name == "driver":
        from mpack.convert.backends import driver

        with tl.span("main", spans[0]):
            return driver.open_driver(spec, plan, off, option)
    from mpack.convert.backends import torch

    with tl.span("main", spans[1]):
        return torch.open_torch(spec if cand.gpu else _CPU, plan, off, option)


def check_device_here(device: str | DeviceSpec, option: str = "device") -> None:
    """Refuse a ``device`` that is not one of convert's names (:data:`mpack.device.CONVERT`), or
    a CUDA one on a machine surely without CUDA (:func:`mpack.device.no_cuda_here`), before any
    work: no torch, no CUDA call, no output. Where there may be a GPU, the count is checked once
    a backend opens (the same ``UsageError``). ``option``: the argument named in the error;
    ``device``: text or a parsed :class:`DeviceSpec` (:meth:`DeviceSpec.of`)."""
    if DeviceSpec.of(device, CONVERT, option).kind == "cuda" and no_cuda_here():
        check_cuda_here(device, 0, option)


def check_cuda_here(device: str | DeviceSpec, count: int, option: str = "device") -> None:
    """Raise ``UsageError`` where ``device`` (``cuda`` or ``cuda:i``, as text or a parsed
    :class:`DeviceSpec`) names a CUDA device that is not among the ``count`` here; ``option``:
    the argument named."""
    if count == 0:
        raise UsageError(
            f"{arg(option, str(device))}: no CUDA device here",
            hint=f"use {arg(option, 'cpu')} (identical bytes)",
        )
    if DeviceSpec.of(device, CONVERT, option).ordinal >= count:
        raise UsageError(f"{arg(option, str(device))}: only {count} CUDA device(s)")


def prefetch_files(device: str | DeviceSpec) -> list[Path]:
    """The libraries a conversion on ``device`` will load, for the kernel to read ahead while the
    process starts (Note [prefetch] in mpack/iokit.py): the CUDA driver's and NVRTC's for a GPU
    named outright (the driver backend's first step), else none (``auto`` on a many-core machine
    converts on the host). A bad name: none (refused later, in the conversion's own words).
    ``device``: text or a parsed :class:`DeviceSpec`."""
    try:
        kind = DeviceSpec.of(device, CONVERT).kind
    except UsageError:
        return []
    if kind != "cuda":
        return []
    from mpack import cudadrv

    with contextlib.suppress(Exception):  # a hint: nothing to read ahead is no error
        return cudadrv.library_files()
    return []


def report(b: Backend) -> dict[str, Any]:
    """What ``--json`` says of the backend: ``{name, device, detail, refused}``."""
    return {"name": b.name, "device": b.where, "detail": b.detail, "refused": dict(b.refused)}


def describe(b: Backend) -> str:
    """One line for people (``-v``): the backend, where, what it runs, and each refusal."""
    line = f"backend {b.name} on {b.where}: {b.detail}"
    if b.refused:
        line += "; not " + "; not ".join(f"{k}: {v}" for k, v in b.refused.items())
    return line
