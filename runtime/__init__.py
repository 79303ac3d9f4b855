"""mpack.runtime: load a sidecar rank once, share it read-only, zero-copy, across processes.

    from mpack.runtime import attach, load

    with attach("llama-marlin/", rank=0, device="cuda:0") as w:  # needs `mpack serve` running
        w["model.layers.0.self_attn.qkv_proj.weight"]               # int32 [Kp/16, 4*Np], read-only

    w = load("llama-marlin/", rank=0, device="cpu")               # a private copy, no daemon

Modules: protocol (wire format, socket naming), allocation (where each byte goes), loader
(verified pipelined fill, ``load``), memfd (host backend), cuda_vmm (CUDA VMM backend, cuda-bindings
imported lazily), daemon (``serve``), client (``attach``, status), weights (``SharedWeights``),
spawn (start and stop a daemon process from code: the READY fields, the logs), vllm
(``--load-format mpack``). Importing this package imports neither torch nor cuda-bindings and never
initialises CUDA. The protocol and the lifecycle guarantees are specified in docs/RUNTIME.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpack.runtime.weights import SharedWeights

__all__ = ["SharedWeights", "attach", "load", "serve", "warm"]


def load(
    sidecar: Any,
    *,
    rank: int = 0,
    device: str = "cpu",
    revision: str | None = None,
    checkpoint: Any = None,
    stage: Any = None,
) -> SharedWeights:
    """A private copy of one rank of a sidecar, no daemon (see ``mpack.runtime.loader.load``);
    of one pipeline ``stage`` of it only (an :class:`mpack.arch.Stage`), if given.

    ``sidecar``: a directory, or a Hub repo id ``org/name[/<target>][@revision]`` (or
    ``revision=``): only this rank's files are fetched (``mpack.hub_sidecar``, docs/HUB.md). A
    directory of targets (``OUT/<target>/``) gives its one target; one of several is refused,
    listing them: pass ``OUT/<target>`` (Note [target layout] in mpack/target_dirs.py).
    ``checkpoint``: the checkpoint the weights go with (a directory or a Hub repo id in the
    local HF cache); refused with ``SourceMismatchError`` unless the sidecar was made from it
    (Note [a sidecar is bound to its checkpoint] in mpack/binding.py)."""
    from mpack.hub_sidecar import resolve_sidecar
    from mpack.runtime.loader import load as _load

    path = resolve_sidecar(sidecar, revision, rank=rank)
    _check_bound(path, checkpoint)
    return _load(path, rank=rank, device=device, stage=stage)


def _check_bound(path: Any, checkpoint: Any) -> None:
    """:func:`mpack.binding.check_bound` of the sidecar at ``path``, if a checkpoint is named."""
    if checkpoint is None:
        return
    from mpack.binding import check_bound
    from mpack.sidecar import load_manifest

    manifest, _ = load_manifest(path)
    check_bound(manifest, checkpoint, where=path, override="leave checkpoint= out")


def attach(
    sidecar: Any,
    *,
    rank: int = 0,
    device: str = "cpu",
    socket: Any = None,
    revision: str | None = None,
    checkpoint: Any = None,
    **kw: Any,
) -> SharedWeights:
    """Zero-copy read-only views of a daemon's memory (see ``mpack.runtime.client.attach``;
    ``timeout`` and ``stage`` there). ``sidecar``: a directory or a Hub repo id, as for
    :func:`load`; only its ``mpack.json`` is fetched (the daemon is found by the manifest's
    digest).
    ``checkpoint``: as for :func:`load`."""
    from mpack.hub_sidecar import resolve_sidecar
    from mpack.runtime.client import attach as _attach

    path = resolve_sidecar(sidecar, revision, fetch="manifest")
    _check_bound(path, checkpoint)
    return _attach(path, rank=rank, device=device, socket=socket, **kw)


def serve(
    sidecar: Any, *, rank: int = 0, device: str = "cpu", socket: Any = None, **kw: Any
) -> None:
    """Run the daemon in this process until SIGTERM/SIGINT (see ``mpack.runtime.daemon.serve``;
    ``stage`` there: one pipeline stage only); ``sidecar`` a directory or a Hub repo id, as for
    :func:`load`."""
    from mpack.hub_sidecar import resolve_sidecar
    from mpack.runtime.daemon import serve as _serve

    _serve(resolve_sidecar(sidecar, rank=rank), rank=rank, device=device, socket_path=socket, **kw)


# Note [warm attach]: a process pays for the first attach() once: the import of the client, the
# Hub-or-directory resolver, the manifest checks and the backend's module, and the first call of
# each (compiled regexes, the JSON decoder). Those are the same for every sidecar, so they can
# be paid before anyone waits: warm() does it, and the vLLM plugin calls it when vLLM loads its
# plugins, long before the model is built. It initialises no device (a process may still fork
# after it) and loads no torch. Figures: docs/BENCHMARKS.md, section 10.
# For CUDA, the first driver call of a process also loads libcuda and has cuda-bindings look up
# every driver entry point; cuDriverGetVersion does both without cuInit, so warm() makes that
# call (cuda_vmm.prepare, cudadrv.preload), where a GPU may be present. What stays with the first
# attach needs the device: cuInit (after it a forked child cannot use CUDA), the primary context
# (torch's, created by torch.cuda.init() in a process whose torch has not used CUDA yet), and
# the import, map and access calls themselves.
def warm(device: str = "cpu") -> None:
    """Import what :func:`attach` and :func:`load` use for ``device`` (``cpu``: the host
    backend; ``cuda``/``cuda:N``: the CUDA one, cuda-bindings included when installed), so that
    the first call in this process does not pay for it (Note [warm attach]). Touches no device;
    cheap after the first call."""
    import importlib

    from mpack.device import SERVE, DeviceSpec

    for name in ("mpack.hub_sidecar", "mpack.runtime.client", "mpack.runtime.weights"):
        importlib.import_module(name)
    if DeviceSpec.parse(device, SERVE).kind == "cpu":
        importlib.import_module("mpack.runtime.memfd")
        return
    # cuda-bindings imported, the driver loaded and its entry points looked up, no cuInit;
    # where cuda-bindings is absent, attach says so with its hint.
    importlib.import_module("mpack.runtime.cuda_vmm").prepare()


def __getattr__(name: str) -> Any:
    if name == "SharedWeights":
        from mpack.runtime.weights import SharedWeights

        return SharedWeights
    raise AttributeError(name)
