"""The ``mpack`` command line: one thin function per command, errors mapped in one place.

Library code never prints; commands hand results to :mod:`mpack.ui`. Every ``MpackError``
becomes one message (plus a hint) and its exit code (2 bad input, 1 internal); any other
exception is a bug and exits 1. ``MPACK_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from mpack import __version__, target
from mpack.errors import (
    MpackError,
    UsageError,
    as_mpack_error,
    exit_code_for,
)

#: The environment variables mpack reads (shown at the end of ``mpack --help``; README too).
ENVIRONMENT = {
    "MPACK_DEBUG=1": "show the traceback of an error",
    "MPACK_PROGRESS_EVERY=S": "seconds between progress lines when stderr is not a terminal (5)",
    "MPACK_SCHEME_CHECK=inline": "parse the quantization config in-process, not in a child",
    "MPACK_NO_CUDA_KERNEL=1": "convert on CUDA with torch ops instead of the fused kernel",
    "MPACK_NO_DRIVER_PATH=1": "convert on CUDA through torch, not cuda-bindings alone",
    "MPACK_REPACK_SOURCE=PATH": "another copy of the fused kernel's marlin_repack.cu",
    "MPACK_NO_VERDICT_CACHE=1": "check the quantization config every time (no cached verdict)",
    "MPACK_CACHE_DIR=DIR": "mpack's cache of kernels and scheme verdicts (~/.cache/mpack)",
    "MPACK_GOLDEN=DIR": "the golden test data, for the test suite (../shared/golden)",
}
_EPILOG = "\b\nEnvironment:\n" + "\n".join(f"  {k:27} {v}" for k, v in ENVIRONMENT.items())


class _Command(typer.core.TyperCommand):
    """Usage lines show positionals as ``SOURCE``, the way every CLI does (not ``{SOURCE}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [
            p[1:-1] if p.startswith("{") and p.endswith("}") else p
            for p in super().collect_usage_pieces(ctx)
        ]


app = typer.Typer(
    name="mpack",
    no_args_is_help=True,  # the root help is _root's docstring (its examples included)
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: "[default: ...]" in a help string is text, not markup
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
command = app.command(cls=_Command)

#: Metavars that list the choices of an option; the names come from :mod:`mpack.target`.
ACT_DTYPE_CHOICES = f"[{'|'.join(target.ACT_DTYPES)}]"
PROFILE_CHOICES = f"[{'|'.join(target.PROFILES)}]"
FUSION_CHOICES = f"[{'|'.join(target.FUSIONS)}]"
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document (also for errors) instead of text.")
]


def _version_cb(value: bool) -> None:
    if value:
        print(f"mpack {__version__}")
        raise typer.Exit()


@app.callback(epilog=_EPILOG)
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_cb, is_eager=True, help="Print the version."),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Show other libraries' logs and progress bars (transformers, compressed-tensors, "
            "the Hub), and mpack's debug log.",
        ),
    ] = False,
) -> None:
    """Marlin FP8 sidecars for compressed-tensors checkpoints: convert once, share zero-copy.

    \b
    Examples:
      mpack convert ./fp8-checkpoint -o ./sidecar --tp 2     # pack once, offline
      mpack inspect ./sidecar                               # what is in it
      mpack verify ./sidecar                                # checksums + re-derivation
      mpack serve ./sidecar --rank 0 --device cuda:0        # share rank 0 on GPU 0
      mpack status                                          # what is served
      mpack layout 4096 14336                               # one [N, K] layer's layout
    """
    from mpack import ui

    ui.set_verbose(verbose)


@command
def layout(
    n: Annotated[
        int,
        typer.Argument(
            metavar="N", help="Output channels N of the layer (rows of the checkpoint weight)."
        ),
    ],
    k: Annotated[
        int,
        typer.Argument(metavar="K", help="Input channels K (columns of the checkpoint weight)."),
    ],
    act_dtype: Annotated[
        str, typer.Option("--act-dtype", metavar=ACT_DTYPE_CHOICES, help="Activation dtype.")
    ] = "bfloat16",
    json_out: JsonOpt = False,
) -> None:
    """Show what the Marlin FP8 kernel stores for one [N, K] fp8 linear layer.

    \b
    Example:
      mpack layout 6144 4096
    """
    from mpack import ui

    if act_dtype not in target.ACT_DTYPES:
        raise UsageError(
            f"--act-dtype must be one of {', '.join(target.ACT_DTYPES)}, got {act_dtype!r}"
        )
    if n <= 0 or k <= 0 or k % 4:
        raise UsageError(f"N and K must be positive and K a multiple of 4, got N={n}, K={k}")
    np_, kp = target.padded_nk(n, k)
    ui.emit_layout(n=n, k=k, np_=np_, kp=kp, act_dtype=act_dtype, as_json=json_out)


Source = Annotated[
    str,
    typer.Argument(
        metavar="SOURCE", help="Checkpoint directory, or Hugging Face repo id (org/name)."
    ),
]
Sidecar = Annotated[
    Path,
    typer.Argument(metavar="SIDECAR", help="Sidecar directory (written by `mpack convert`)."),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]

# --- mpack convert's options ---------------------------------------------------------------

OutOpt = Annotated[
    str,
    typer.Option(
        "--out", "-o", metavar="DIR", help="Sidecar directory to write (created atomically)."
    ),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option(
        "--revision",
        metavar="REV",
        help="Hub branch, tag or commit (repo ids only). [default: main]",
    ),
]
ProfileOpt = Annotated[
    str,
    typer.Option(
        "--profile",
        metavar=PROFILE_CHOICES,
        help="w8a16: vLLM's W8A16 path, weight bytes unchanged; w8a8-marlin: W8A8 forced onto "
        "Marlin, per-tensor shards requantized to their max scale.",
    ),
]
ConvertActDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--act-dtype",
        metavar=ACT_DTYPE_CHOICES,
        help="Activation dtype the kernel runs in; scales and bias are stored in it. "
        "[default: the checkpoint's dtype]",
    ),
]
TpOpt = Annotated[
    int, typer.Option("--tp", metavar="N", help="Tensor-parallel size: one rank file per rank.")
]
FuseOpt = Annotated[
    str,
    typer.Option(
        "--fuse",
        metavar=FUSION_CHOICES,
        help="vllm: vLLM's fused qkv_proj / gate_up_proj names; none: checkpoint names (tp 1).",
    ),
]
ConvertDeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="[auto|cpu|cuda|cuda:N]",
        help="Where the transform runs (identical bytes on each); auto: the CPU without torch on "
        "8+ cores or without a GPU (native repack built), else CUDA when present.",
    ),
]
NoPassthroughOpt = Annotated[
    bool,
    typer.Option(
        "--no-passthrough", help="Leave out common.safetensors (embeddings, norms, lm_head)."
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Redo an up-to-date sidecar, or replace another.")
]


@command
def convert(
    source: Source,
    out: OutOpt,
    revision: RevisionOpt = None,
    profile: ProfileOpt = "w8a16",
    act_dtype: ConvertActDtypeOpt = None,
    tp: TpOpt = 1,
    fuse: FuseOpt = "vllm",
    device: ConvertDeviceOpt = "auto",
    no_passthrough: NoPassthroughOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a compressed-tensors FP8 checkpoint into a Marlin FP8 sidecar.

    \b
    Examples:
      mpack convert RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8 -o llama8b-marlin --tp 2
      mpack convert ./my-fp8-model -o out --profile w8a8-marlin --act-dtype float16 --json
    """
    if json_out and quiet:
        raise UsageError("--json and --quiet contradict each other; pick one")
    result = _run_convert(
        source, out, show_progress=not (json_out or quiet), revision=revision, profile=profile,
        act_dtype=act_dtype, tp=tp, fuse=fuse, device=device, passthrough=not no_passthrough,
        force=force,
    )  # fmt: skip
    from mpack import ui

    ui.emit_convert(result, as_json=json_out, quiet=quiet)


def _run_convert(source: str, out: str, *, show_progress: bool, **options: Any) -> Any:
    """:func:`mpack.convert.pipeline.run_convert` with progress lines. For a local source, two
    things start before this process imports torch, so that they overlap its imports: the
    compressed-tensors check, in a forked child (Note [scheme check in a child]), and the kernel's
    read-ahead of the shards (Note [prefetch] in mpack/iokit.py)."""
    from mpack.convert.scheme_check import SchemeCheck
    from mpack.iokit import prefetch
    from mpack.sidecar import CONFIG_NAME

    early = None
    if (Path(source) / CONFIG_NAME).is_file():
        early = SchemeCheck(source)  # forked first: no thread may run in the parent yet
        libs = []
        if str(options.get("device", "")).startswith("cuda"):
            from mpack import cudadrv

            libs = cudadrv.library_files()  # before the shards: Note [prefetch]
        prefetch(libs + sorted(Path(source).glob("*.safetensors")))
    try:
        from mpack import ui
        from mpack.convert.pipeline import run_convert

        with ui.convert_progress(enabled=show_progress) as progress:
            return run_convert(source, out, progress=progress, scheme_check=early, **options)
    finally:
        if early is not None:
            early.cancel()


@command
def inspect(sidecar: Sidecar, json_out: JsonOpt = False) -> None:
    """Show a sidecar: target, source provenance, files, and every layer's shapes.

    \b
    Example:
      mpack inspect llama8b-marlin
    """
    from mpack import ui
    from mpack.sidecar import load_manifest

    manifest, digest = load_manifest(sidecar)
    ui.emit_inspect(sidecar, manifest, digest, as_json=json_out)


@command
def verify(
    sidecar: Sidecar,
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            metavar="SOURCE",
            help="Re-derive every tensor from this checkpoint (directory or Hub repo id). "
            "[default: the recorded local path, or the recorded Hub repo and commit if it is in "
            "the local cache]",
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
        str,
        typer.Option("--device", metavar="[cpu|cuda|cuda:N]", help="Where --forward runs."),
    ] = "cpu",
    rederive_device: Annotated[
        str,
        typer.Option(
            "--rederive-device",
            metavar="[auto|cpu|cuda|cuda:N]",
            help="Where the tensors are re-derived from the source (the same result on each); "
            "auto: as convert's --device auto.",
        ),
    ] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Check every file's sha256, and re-derive every tensor from the source checkpoint.

    \b
    Examples:
      mpack verify llama8b-marlin
      mpack verify llama8b-marlin --source RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8
      mpack verify tiny-marlin --source ./tiny-fp8 --forward
    """
    from mpack import ui
    from mpack.verify import verify as verify_sidecar

    if forward:
        ui.quiet_libraries()  # transformers' and compressed-tensors' bars and logs (unless -v)
    result = verify_sidecar(
        sidecar, source=source, forward=forward, device=device, rederive_device=rederive_device
    )
    if not result.problems:  # what matched; also shown when the model outputs differ
        report = result.report() | ({"seconds": result.seconds} if json_out else {})
        ui.emit_verify(report, as_json=json_out)
    result.raise_for_failure()


# --- mpack serve / mpack status (runtime; mpack/runtime/daemon.py, docs/RUNTIME.md) ---------

DeviceOpt = Annotated[
    str, typer.Option("--device", metavar="[cpu|cuda|cuda:N]", help="Where the rank is loaded.")
]


@command
def serve(
    sidecar: Sidecar,
    rank: Annotated[int, typer.Option("--rank", help="Tensor-parallel rank to serve.")] = 0,
    device: DeviceOpt = "cpu",
    socket: Annotated[
        Path | None,
        typer.Option(
            "--socket",
            metavar="PATH",
            help="Unix socket path. [default: one named from the sidecar, rank and device in "
            "$XDG_RUNTIME_DIR/mpack or /tmp/mpack-$UID]",
        ),
    ] = None,
) -> None:
    """Load one rank of a sidecar once and share it read-only with local processes.

    Checks every checksum while loading; prints a READY line once serving. Stops cleanly on
    SIGTERM, SIGINT or SIGHUP. Attach with mpack.runtime.attach(SIDECAR, rank=R, device=D).

    \b
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


@command
def status(
    sidecar: Annotated[
        Path | None,
        typer.Argument(
            metavar="SIDECAR",
            help="Only daemons serving this sidecar. [default: all of this user's]",
        ),
    ] = None,
    socket: Annotated[
        Path | None,
        typer.Option("--socket", metavar="PATH", help="Only the daemon listening at PATH."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Show the daemons serving sidecars: rank, device, memory, attached clients, uptime.

    \b
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


def _file_of(exc: BaseException) -> str | None:
    """The file an error names: its ``file``, else the path its message starts with."""
    if getattr(exc, "file", None):
        return str(exc.file)  # type: ignore[attr-defined]
    head, sep, _ = str(exc).partition(": ")
    if sep and " " not in head and ("/" in head or os.path.exists(head)):
        return head
    return None


def error_document(exc: BaseException, code: int) -> dict[str, object]:
    """The one JSON document ``--json`` prints for a failure (README: "Errors as JSON")."""
    kind = type(exc).__name__ if isinstance(exc, MpackError) else "InternalError"
    message = exc.message if isinstance(exc, MpackError) else f"{type(exc).__name__}: {exc}"
    hint = (
        exc.hint
        if isinstance(exc, MpackError)
        else "this is a bug in mpack; rerun with MPACK_DEBUG=1"
    )
    return {
        "ok": False,
        "error": {"code": kind, "exit_code": code, "message": message, "file": _file_of(exc),
                  "hint": hint},
    }  # fmt: skip


def _print_error(exc: BaseException, code: int, *, as_json: bool) -> None:
    """The message (and hint) on stderr; with ``--json`` also one JSON document on stdout."""
    if as_json:
        import json

        print(json.dumps(error_document(exc, code), indent=2, sort_keys=True), flush=True)
    stream = sys.stderr
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


#: The click that typer runs on: typer >= 0.2x carries its own copy (``typer._click``), older
#: typers use the ``click`` package.
_CLICK = getattr(typer.core, "_click", None) or importlib.import_module("click")


def _click_error(name: str) -> type[BaseException]:
    """click's exception class ``name`` (``Exit`` and ``Abort`` live in ``typer.exceptions``
    when typer carries its own click)."""
    return getattr(_CLICK.exceptions, name, None) or getattr(typer.exceptions, name)


def _usage_error(e: Any) -> UsageError:
    """A click usage error (unknown option, missing argument, bad value) as mpack's own."""
    name = e.ctx.command_path if e.ctx is not None else "mpack"
    return UsageError(e.format_message(), hint=f"see `{name} -h`")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mpack`` console script; returns (and exits with) the exit code.

    Every failure is one message on stderr (``error: ...`` plus a ``hint:``), or with ``--json``
    one JSON document on stdout, and an exit code: 2 bad input or usage, 3 environment, 1 bug.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    debug = os.environ.get("MPACK_DEBUG") == "1"
    as_json = "--json" in args
    try:
        result = app(args=args, prog_name="mpack", standalone_mode=False)
        code = result if isinstance(result, int) else 0  # --help and --version return 0
    except _click_error("NoArgsIsHelpError") as e:
        print(e.ctx.get_help() if e.ctx is not None else "", file=sys.stderr)  # type: ignore[attr-defined]
        code = 2
    except _click_error("Exit") as e:
        code = e.exit_code  # type: ignore[attr-defined]
    except _click_error("Abort"):
        print("interrupted", file=sys.stderr)
        code = 130
    except _click_error("UsageError") as e:
        code = 2
        _print_error(_usage_error(e), code, as_json=as_json)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001 - the one place that maps every error
        if debug:
            import traceback

            traceback.print_exc()
        err = as_mpack_error(e)
        code = exit_code_for(err)
        _print_error(err, code, as_json=as_json)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
