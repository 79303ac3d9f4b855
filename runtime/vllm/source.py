"""Where ``--load-format mpack`` reads from: the sidecar, as a local directory, and the TP rank's
tensors from it, attached zero-copy from ``mpack serve`` or loaded privately.

The loader (runtime/vllm/loader.py) calls these; they import neither vLLM nor torch, so they run
(and are tested) without vLLM.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mpack.arch import Stage
from mpack.errors import DaemonError, InputError, StageMismatchError, shown
from mpack.runtime.client import serve_command
from mpack.runtime.vllm import logger
from mpack.runtime.vllm.checks import Options
from mpack.sidecar import MANIFEST_NAME
from mpack.target import dir_name
from mpack.target_dirs import target_names


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
    ``@revision``.

    Raises:
        InputError: a directory that is no sidecar and has no folder of the engine's target,
            naming that folder and the targets it has (:func:`not_a_sidecar`).
    """
    from mpack.hub_sidecar import resolve_sidecar

    if opts.sidecar:
        path = resolve_sidecar(opts.sidecar, rank=rank, target=target)
        if (path / MANIFEST_NAME).is_file() or not path.is_dir():
            return path  # no such directory: the reader says so
        raise not_a_sidecar(opts.sidecar, path, target, named=True)
    local = Path(model).exists()
    path = resolve_sidecar(model, None if local else revision, rank=rank, target=target)
    if (path / MANIFEST_NAME).is_file():
        return path
    raise not_a_sidecar(model, path, target, named=False)


#: The most targets a refusal lists.
_LISTED_TARGETS = 12


def not_a_sidecar(
    given: str, path: Path, target: dict[str, Any] | None, *, named: bool
) -> InputError:
    """The error for ``path`` (``given`` by the user: the ``"sidecar"`` key when ``named``, else
    the model) holding no ``mpack.json``: the folder of the engine's ``target`` it looked for,
    and the targets' folders the directory has (a multi-target ``mpack convert`` output)."""
    found = target_names(path)  # Note [target layout] in mpack/target_dirs.py
    what = f"{shown(given)}: not an mpack sidecar (no {MANIFEST_NAME}"
    if target:
        what += f", nor a folder {dir_name(target)} (the engine's target) holding one"
    if found:
        listed = ", ".join(shown(n) for n in found[:_LISTED_TARGETS])
        more = f" and {len(found) - _LISTED_TARGETS} more" if len(found) > _LISTED_TARGETS else ""
        what += f"; it holds the targets {listed}{more}"
    what += ")" + ("" if named else " and no sidecar named")
    if found:
        hint = (
            "run vLLM with the settings of one of its targets (tp<N>-<profile>-<act dtype>: "
            "--tensor-parallel-size, the checkpoint's scheme, --dtype), or convert this one: "
            "mpack convert CHECKPOINT -o OUT"
            + (
                f" --tp {target['tp_size']} --profile {target['profile']} "
                f"--act-dtype {target['act_dtype']}"
                if target
                else ""
            )
        )
    else:
        hint = (
            "serve the sidecar (a directory or Hub repo id) as the model, or pass "
            '--model-loader-extra-config \'{"sidecar": "PATH_OR_REPO_ID"}\''
        )
    return InputError(what, hint=hint)


def rank_weights(
    sidecar: Path, opts: Options, rank: int, device: str, stage: Stage | None = None
) -> Any:
    """The rank's ``SharedWeights``: attached (zero-copy) or loaded privately, per ``attach``;
    one INFO line on vLLM's log says which, and how long it took (Note [one logger]).

    ``stage``: the engine's pipeline stage of the rank (a split of more than one stage, Note [a
    layer range per stage] in docs/FORMAT.md). Attached, from the daemon of that stage or of the
    whole rank (Note [the daemon of a stage] in runtime/protocol.py); a daemon of another stage
    or split is refused whatever ``attach`` says (``StageMismatchError``: it is there, but
    misconfigured; loading privately beside it would hide that and hold the weights twice).
    Loaded privately, that stage's tensors only (Note [a stage's allocation] in
    runtime/allocation.py)."""
    from mpack.runtime import attach, load

    log = logger()
    t0 = time.perf_counter()
    stage = Stage.partial(stage)
    of = Stage.label(stage)
    if opts.attach != "never":
        try:
            w = attach(sidecar, rank=rank, device=device, socket=opts.socket, stage=stage)
            pid = w.daemon_pid if w.daemon_pid is not None else "unknown (another PID namespace)"
            held = f" ({w.stage})" if w.stage is not None else " (the whole rank)" if of else ""
            log.info(
                "mpack: rank %d%s attached zero-copy to daemon pid %s%s: %d bytes (%.2f GiB) "
                "on %s in %.3f s",
                rank,
                of,
                pid,
                held,
                w.nbytes,
                w.nbytes / 2**30,
                device,
                time.perf_counter() - t0,
            )
            return w
        except StageMismatchError:
            raise
        except DaemonError as e:
            if opts.attach == "require":
                raise DaemonError(
                    f"attach: require, but {e.message}",
                    hint="start it: " + serve_command(sidecar, rank, stage, device),
                ) from None
            log.warning("mpack: rank %d%s loads privately: %s", rank, of, e.message)
    t0 = time.perf_counter()
    w = load(sidecar, rank=rank, device=device, stage=stage)
    log.info(
        "mpack: rank %d%s loaded privately (verified, no daemon): %d bytes (%.2f GiB) on %s "
        "in %.3f s",
        rank,
        of,
        w.nbytes,
        w.nbytes / 2**30,
        device,
        time.perf_counter() - t0,
    )
    return w


__all__ = ["not_a_sidecar", "rank_weights", "sidecar_dir"]
