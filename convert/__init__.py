"""``mpack.convert``: compressed-tensors FP8 checkpoint -> Marlin sidecar (one target or many).

``import mpack.convert`` is cheap: the pipeline (torch, compressed-tensors) loads on first use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.convert.options import ConvertOptions

if TYPE_CHECKING:
    from mpack.convert.pipeline import ConvertResult, MultiConvertResult, Progress
    from mpack.verify import Verification

__all__ = [
    "ConvertOptions",
    "ConvertResult",
    "MultiConvertResult",
    "Verification",
    "convert",
    "start",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in ("ConvertResult", "MultiConvertResult"):  # without the pipeline's imports at
        # ``import mpack.convert``
        from mpack.convert import pipeline

        return getattr(pipeline, name)
    if name == "Verification":  # verify's result, from its layer, on first use (as verify())
        from mpack.verify import Verification

        return Verification
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    revision: str | None = None,
    profile: str | Sequence[str] = "w8a16",
    act_dtype: str | Sequence[str] | None = None,
    tp: int | Sequence[int] = 1,
    ep: bool | Sequence[bool] = False,
    fuse: str = "vllm",
    device: str = "auto",
    passthrough: bool = True,
    force: bool = False,
    skip_invalid: bool = False,
    backend: str = "auto",
    layout: str = "auto",
) -> ConvertResult | MultiConvertResult:
    """Write a Marlin FP8 sidecar for ``source`` at ``out``; return what was done.

    Several targets: give lists, e.g. ``tp=[1, 2, 4, 8]``, ``profile=["w8a16", "w8a8-marlin"]``;
    their cross product is the set of targets. With more than one, ``out`` becomes a directory
    holding one sidecar per target at ``out/<name>`` (``tp{N}-{profile}-{act_dtype}``:
    :func:`mpack.target.dir_name`), the source is read once for all of them, and a
    :class:`MultiConvertResult` comes back (``results``: a ``ConvertResult`` per target;
    ``skipped``; ``kept``: the targets already in ``out`` that this run did not make, left as
    they are). Each sidecar is byte for byte the one a run for that target alone writes. So it
    is with ``layout="targets"`` for any number of targets, and for one target into an ``out``
    that already holds targets (Note [target layout] in mpack/target_dirs.py).

    Args:
        source: a checkpoint directory, or a Hugging Face repo id (resolved with ``revision``).
        out: the sidecar directory to create (atomically; see docs/FORMAT.md).
        profile: ``"w8a16"`` (weight bytes unchanged) or ``"w8a8-marlin"`` (tensor-strategy
            shards requantized to the max scale).
        act_dtype: ``"bfloat16"`` / ``"float16"``; default: the checkpoint's dtype.
        tp: tensor-parallel size; one rank file per rank.
        ep: expert parallelism for a MoE model (vLLM's ``--enable-expert-parallel``): True
            splits the experts whole across the ranks (target ``tp{N}ep-...``); ``[False,
            True]`` makes both kinds. At TP 1 it is the TP-1 target.
        fuse: ``"vllm"`` (qkv_proj / gate_up_proj) or ``"none"`` (checkpoint names, tp 1).
        device: ``"auto"`` (the host path on 8+ cores or without a GPU, else CUDA when
            present: Note [auto device]), ``"cpu"``, ``"cuda"`` or ``"cuda:i"``.
        passthrough: also write ``common.safetensors`` (embeddings, norms, lm_head).
        force: redo the work even if ``out`` is up to date, or replace another sidecar there.
        skip_invalid: with several targets, leave out those that cannot be made (e.g. a TP
            that does not divide the heads) instead of refusing the run; at least one must be.
        backend: ``"auto"`` (the first that can, in ``device``'s order: Note [choosing a
            backend] in :mod:`mpack.convert.backends`), or ``"host"``, ``"driver"`` or
            ``"torch"``: that one, or a ``UsageError`` saying why it cannot. Same bytes on each.
        layout: ``"auto"`` (one target at ``out`` itself, unless ``out`` already holds
            targets; several at ``out/<name>``) or ``"targets"`` (always ``out/<name>``: the
            same paths whatever the number of targets, for a CI job that publishes them).

    Returns:
        A :class:`ConvertResult`, the same facts ``mpack convert --json`` prints: ``out`` (the
        sidecar directory, symlinks resolved), ``manifest`` (``mpack.json`` as a dict),
        ``digest`` (the manifest digest, what ``mpack serve`` and ``attach`` match on),
        ``up_to_date`` (True: ``out`` already held this sidecar and nothing was done),
        ``seconds`` (time per phase, ``"total"`` included when work was done),
        ``bytes_written`` (0 when up to date), ``timeline`` and ``backend`` (which one converted
        the layers, and why those before it did not).

    Raises:
        MpackError: bad input (a subclass with ``exit_code`` 2), with nothing written at ``out``;
            e.g. ``OutputExistsError`` when ``out`` holds another sidecar and ``force`` is off.

    Long for its docstring, the library's reference for every option; the body only builds the
    options and calls :func:`start`.
    """
    return start(
        source,
        out,
        ConvertOptions(
            revision=revision,
            profile=profile,
            act_dtype=act_dtype,
            tp=tp,
            ep=ep,
            fuse=fuse,
            device=device,
            passthrough=passthrough,
            force=force,
            skip_invalid=skip_invalid,
            backend=backend,
            layout=layout,
        ),
    )


def start(
    source: str | os.PathLike,
    out: str | os.PathLike,
    options: ConvertOptions,
    *,
    progress: Callable[[], AbstractContextManager[Progress | None]] | None = None,
) -> ConvertResult | MultiConvertResult:
    """Convert ``source`` into ``out`` as ``options`` ask, one target or several
    (:func:`mpack.convert.pipeline.run_convert`). What :func:`convert` and ``mpack convert`` run.

    For a local source, two things start before this process imports torch, so that they overlap
    its imports: the compressed-tensors check, in a forked child (Note [scheme check in a
    child]), and the kernel's read-ahead of the shards (Note [prefetch] in mpack/iokit.py). The
    check is cancelled at the end, whatever happened.

    ``progress``: a function returning a context manager that yields the progress callback (or
    ``None``), as :func:`mpack.ui.convert_progress` does; it is entered only after the check has
    forked, since a live display runs a thread and no thread may run in the parent before the fork.
    """
    from mpack.convert.scheme_check import SchemeCheck
    from mpack.iokit import prefetch
    from mpack.sidecar import CONFIG_NAME

    early = None
    if (Path(source) / CONFIG_NAME).is_file():
        early = SchemeCheck(source)  # forked first: no thread may run in the parent yet
        from mpack.convert.backends import prefetch_files

        libs = prefetch_files(options.device_spec)  # before the shards: Note [prefetch]
        prefetch(libs + sorted(Path(source).glob("*.safetensors")))
    try:
        from mpack.convert.pipeline import run_convert

        with (progress or contextlib.nullcontext)() as callback:
            return run_convert(source, out, options, progress=callback, scheme_check=early)
    finally:
        if early is not None:
            early.cancel()


def verify(
    sidecar: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    require_source: bool = False,
    revision: str | None = None,
    forward: bool = False,
    device: str | None = None,
    rederive_device: str = "auto",
) -> Verification:
    """Check a sidecar's files against its manifest and (with a source) against the checkpoint,
    as ``mpack verify`` does; raise if anything does not match. The arguments are
    :func:`mpack.verify.verify`'s: ``source`` (default: the one the manifest records, if it is
    here), ``require_source`` (fail when no source is found, rather than pass on the checksums
    alone), ``revision`` (of a Hub ``source``), ``forward`` and ``device`` (the model outputs
    compared, on ``device``), ``rederive_device``.

    This forwards to :func:`mpack.verify.verify` on each call. It is the one place
    ``mpack.convert`` imports ``mpack.verify`` (which itself uses ``mpack.convert``), so the
    import waits for the call.

    Returns:
        A :class:`mpack.verify.Verification`, as :func:`convert` returns a ``ConvertResult``:
        ``ok``, ``digest`` (the manifest digest), ``files_checked``, ``source_checked``,
        ``layers_checked``, ``tensors_compared``, ``source_note``, ``source``, ``forward``,
        ``seconds``; :meth:`~mpack.verify.Verification.report` gives the facts ``mpack verify
        --json`` prints.

    Raises:
        VerificationError: listing every problem, if anything does not match.
        SourceNotFoundError: with ``require_source``, no source found; a source that lacks a
            file the manifest records.
        UsageError: ``device`` without ``forward``, ``revision`` without ``source``.
    """
    from mpack.verify import verify as verify_sidecar

    result = verify_sidecar(
        sidecar,
        source=source,
        require_source=require_source,
        revision=revision,
        forward=forward,
        device=device,
        rederive_device=rederive_device,
    )
    result.raise_for_failure()
    return result
