"""The ``mpack`` command line: one thin function per command, errors mapped in one place.

Library code never prints; commands hand results to :mod:`mpack.ui`. Every ``MpackError``
becomes one message (plus a hint) and its exit code (2 bad input, 1 internal); any other
exception is a bug and exits 1. ``MPACK_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from mpack import __version__
from mpack.errors import (
    ENVIRONMENT_ERRNOS,
    MpackError,
    UsageError,
    VerificationError,
    environment_failure,
    exit_code_for,
)

app = typer.Typer(
    name="mpack",
    help="Marlin FP8 sidecars for compressed-tensors checkpoints: convert once, share zero-copy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]


def _version_cb(value: bool) -> None:
    if value:
        print(f"mpack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_cb, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Marlin FP8 sidecars for compressed-tensors checkpoints.

    Examples:
      mpack convert ./fp8-checkpoint -o ./sidecar --tp 2     # pack once, offline
      mpack inspect ./sidecar                               # what is in it
      mpack verify ./sidecar                                # checksums + re-derivation
      mpack layout 4096 14336                               # one [N, K] layer's layout
    """


@app.command()
def layout(
    n: Annotated[
        int, typer.Argument(help="Output channels N of the layer (rows of the checkpoint weight).")
    ],
    k: Annotated[int, typer.Argument(help="Input channels K (columns of the checkpoint weight).")],
    act_dtype: Annotated[
        str, typer.Option("--act-dtype", help="bfloat16 or float16.")
    ] = "bfloat16",
    json_out: JsonOpt = False,
) -> None:
    """Show what the Marlin FP8 kernel stores for one [N, K] fp8 linear layer.

    Example: mpack layout 6144 4096
    """
    from mpack import ui
    from mpack.convert.marlin import ACT_DTYPES, marlin_padded_nk

    if act_dtype not in ACT_DTYPES:
        raise UsageError(f"--act-dtype must be one of {', '.join(ACT_DTYPES)}, got {act_dtype!r}")
    if n <= 0 or k <= 0 or k % 4:
        raise UsageError(f"N and K must be positive and K a multiple of 4, got N={n}, K={k}")
    np_, kp = marlin_padded_nk(n, k)
    ui.emit_layout(n=n, k=k, np_=np_, kp=kp, act_dtype=act_dtype, as_json=json_out)


Source = Annotated[
    str, typer.Argument(help="Checkpoint directory, or Hugging Face repo id (org/name).")
]
Sidecar = Annotated[Path, typer.Argument(help="Sidecar directory (written by `mpack convert`).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]


@app.command()
def convert(
    source: Source,
    out: Annotated[
        str, typer.Option("--out", "-o", help="Sidecar directory to write (created atomically).")
    ],
    revision: Annotated[
        str | None, typer.Option(help="Hub branch, tag or commit (repo ids only).")
    ] = None,
    profile: Annotated[
        str, typer.Option(help="w8a16 (weights unchanged) or w8a8-marlin (requantized).")
    ] = "w8a16",
    act_dtype: Annotated[
        str | None,
        typer.Option("--act-dtype", help="bfloat16 or float16 [default: the checkpoint's dtype]."),
    ] = None,
    tp: Annotated[
        int, typer.Option("--tp", help="Tensor-parallel size: one rank file per rank.")
    ] = 1,
    fuse: Annotated[
        str, typer.Option(help="vllm (qkv_proj, gate_up_proj) or none (checkpoint names, tp 1).")
    ] = "vllm",
    device: Annotated[
        str, typer.Option(help="auto, cpu, cuda or cuda:<i> (identical bytes on each).")
    ] = "auto",
    no_passthrough: Annotated[
        bool,
        typer.Option(
            "--no-passthrough", help="Leave out common.safetensors (embeddings, norms, lm_head)."
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Redo an up-to-date sidecar, or replace another.")
    ] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a compressed-tensors FP8 checkpoint into a Marlin FP8 sidecar.

    Examples:
      mpack convert RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8 -o llama8b-marlin --tp 2
      mpack convert ./my-fp8-model -o out --profile w8a8-marlin --act-dtype float16 --json
    """
    if json_out and quiet:
        raise UsageError("--json and --quiet contradict each other; pick one")
    from mpack.convert.scheme_check import SchemeCheck

    # A local source's compressed-tensors check starts now, in a forked child, so that its
    # imports overlap this process's torch import (Note [scheme check in a child]).
    early = SchemeCheck(source) if (Path(source) / "config.json").is_file() else None
    try:
        from mpack import ui
        from mpack.convert.pipeline import run_convert

        with ui.convert_progress(enabled=not (json_out or quiet)) as progress:
            result = run_convert(
                source, out, revision=revision, profile=profile, act_dtype=act_dtype, tp=tp,
                fuse=fuse, device=device, passthrough=not no_passthrough, force=force,
                progress=progress, scheme_check=early,
            )  # fmt: skip
    finally:
        if early is not None:
            early.cancel()
    ui.emit_convert(result, as_json=json_out, quiet=quiet)


@app.command()
def inspect(sidecar: Sidecar, json_out: JsonOpt = False) -> None:
    """Show a sidecar: target, source provenance, files, and every layer's shapes.

    Example: mpack inspect llama8b-marlin
    """
    from mpack import ui
    from mpack.sidecar import load_manifest

    manifest, digest = load_manifest(sidecar)
    ui.emit_inspect(sidecar, manifest, digest, as_json=json_out)


@app.command()
def verify(
    sidecar: Sidecar,
    source: Annotated[
        str | None,
        typer.Option(
            help="Re-derive every tensor from this checkpoint [default: the recorded local path]."
        ),
    ] = None,
    forward: Annotated[
        bool,
        typer.Option(
            "--forward",
            help="Also run token ids through the model from the sidecar and from the source (transformers) "
            "and compare greedy tokens and logits.",
        ),
    ] = False,
    device: Annotated[
        str, typer.Option("--device", help="cpu, cuda or cuda:N, for --forward.")
    ] = "cpu",
    json_out: JsonOpt = False,
) -> None:
    """Check every file's sha256, and re-derive every tensor from the source checkpoint.

    Examples:
      mpack verify llama8b-marlin
      mpack verify llama8b-marlin --source RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8
      mpack verify tiny-marlin --source ./tiny-fp8 --forward
    """
    from mpack import ui
    from mpack.convert.verify import run_verify

    report = run_verify(sidecar, source=source)
    if forward:
        if not report["source_checked"]:
            raise UsageError("--forward needs the source checkpoint: pass --source")
        from mpack.runtime.equivalence import forward_check

        report["forward"] = forward_check(sidecar, report["source_path"], device=device)
    ui.emit_verify(report, as_json=json_out)
    if forward and not report["forward"]["ok"]:
        raise VerificationError(
            f"{sidecar}: model outputs from the sidecar differ from the reference beyond the tolerance",
            hint="see the table above; docs/EQUIVALENCE.md explains the tolerance",
        )


# --- mpack serve / mpack status (runtime; mpack/runtime/daemon.py, docs/RUNTIME.md) ---------

DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
SocketOpt = Annotated[
    Path | None,
    typer.Option(
        "--socket", help="Unix socket path (default: named from the sidecar, rank and device)."
    ),
]


@app.command()
def serve(
    sidecar: Sidecar,
    rank: Annotated[int, typer.Option("--rank", help="Tensor-parallel rank to serve.")] = 0,
    device: DeviceOpt = "cpu",
    socket: SocketOpt = None,
) -> None:
    """Load one rank of a sidecar once and share it read-only with local processes.

    Checks every checksum while loading; prints a READY line once serving.
    Stops cleanly on SIGTERM, SIGINT or SIGHUP. Attach with mpack.runtime.attach(SIDECAR, rank=R, device=D).

    Examples:
      mpack serve llama8b-marlin --rank 0 --device cuda:0
      mpack serve llama8b-marlin --device cpu
    """
    from mpack import ui
    from mpack.runtime.daemon import serve as run_daemon

    if rank < 0:
        raise UsageError(f"--rank must be >= 0, got {rank}")
    run_daemon(
        sidecar, rank=rank, device=device, socket_path=socket, on_ready=ui.emit_ready,
        on_event=ui.emit_event,
    )  # fmt: skip


@app.command()
def status(
    sidecar: Annotated[
        Path | None,
        typer.Argument(help="Only daemons serving this sidecar (default: all of this user's)."),
    ] = None,
    socket: SocketOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show the daemons serving sidecars: rank, device, memory, attached clients, uptime.

    Examples:
      mpack status
      mpack status llama8b-marlin --json
    """
    from mpack import ui
    from mpack.runtime.client import query_status

    if sidecar is not None and socket is not None:
        raise UsageError("give a SIDECAR or --socket, not both")
    ui.emit_status(query_status(sidecar=sidecar, socket=socket), as_json=json_out)


# --- end of mpack serve / mpack status ----------------------------------------------------------


def _print_error(exc: BaseException) -> None:
    stream = sys.stderr
    if not isinstance(exc, MpackError) and getattr(exc, "errno", None) in ENVIRONMENT_ERRNOS:
        exc = environment_failure(exc)  # type: ignore[arg-type]  # the machine refused: exit 3
    if isinstance(exc, MpackError):
        print(f"error: {exc.message}", file=stream)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=stream)
    else:
        print(f"internal error: {type(exc).__name__}: {exc}", file=stream)
        print(
            "  this is a bug in mpack; rerun with MPACK_DEBUG=1 and report the traceback",
            file=stream,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mpack`` console script; returns (and exits with) the exit code."""
    debug = os.environ.get("MPACK_DEBUG") == "1"
    try:
        # Standalone mode: typer/click handle --help and usage errors themselves (exit 2)
        # and finish with SystemExit; what reaches the handlers below came from our code.
        app(args=argv, prog_name="mpack")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001 - the one place that maps every error
        if debug:
            import traceback

            traceback.print_exc()
        _print_error(e)
        code = exit_code_for(e)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
