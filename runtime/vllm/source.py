"""Where ``--load-format mpack`` reads from: the sidecar, as a local directory, and the TP rank's
tensors from it, attached zero-copy from ``mpack serve`` or loaded privately.

The loader (runtime/vllm/loader.py) calls these; they import neither vLLM nor torch, so they run
(and are tested) without vLLM.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mpack.errors import DaemonError, InputError
from mpack.runtime.vllm.checks import Options
from mpack.sidecar import MANIFEST_NAME
from mpack.target import dir_name

log = logging.getLogger("mpack.vllm")


def sidecar_dir(
    opts: Options,
    model: str,
    revision: str | None = None,
    *,
    rank: int | None = None,
    target: dict[str, Any] | None = None,
) -> Path:
    """The sidecar, as a local directory: ``{"sidecar": PATH_OR_REPO_ID}``, else the model
    itself (a directory, or a Hub repo id at vLLM's ``--revision``).

    A repo id is fetched through the HF cache (mpack/hub_sidecar.py): the manifest, then the
    files of TP rank ``rank`` (every rank's for None). ``target``: the engine's target, whose
    folder is taken in a multi-target repo (or directory) named without one. vLLM's
    ``--revision`` is the model's: a ``"sidecar"`` beside another checkpoint takes its own
    ``@revision``."""
    from mpack.hub_sidecar import resolve_sidecar

    if opts.sidecar:
        return resolve_sidecar(opts.sidecar, rank=rank, target=target)
    local = Path(model).exists()
    path = resolve_sidecar(model, None if local else revision, rank=rank, target=target)
    if (path / MANIFEST_NAME).is_file():
        return path
    raise InputError(
        f"{model}: not an mpack sidecar (no {MANIFEST_NAME}"
        + (f", nor a folder {dir_name(target)} holding one" if target else "")
        + ") and no sidecar named",
        hint="serve the sidecar (a directory or Hub repo id) as the model, or pass "
        '--model-loader-extra-config \'{"sidecar": "PATH_OR_REPO_ID"}\'',
    )


def rank_weights(sidecar: Path, opts: Options, rank: int, device: str) -> Any:
    """The rank's ``SharedWeights``: attached (zero-copy) or loaded privately, per ``attach``."""
    from mpack.runtime import attach, load

    if opts.attach != "never":
        try:
            w = attach(sidecar, rank=rank, device=device, socket=opts.socket)
            log.info("mpack: rank %d attached zero-copy (%d bytes on %s)", rank, w.nbytes, device)
            return w
        except DaemonError as e:
            if opts.attach == "require":
                raise DaemonError(
                    f"attach: require, but {e.message}",
                    hint=f"start it: mpack serve {sidecar} --rank {rank} --device {device}",
                ) from None
            log.warning("mpack: rank %d loads privately: %s", rank, e.message)
    w = load(sidecar, rank=rank, device=device)
    log.info("mpack: rank %d loaded privately (%d bytes on %s)", rank, w.nbytes, device)
    return w


__all__ = ["rank_weights", "sidecar_dir"]
