"""The ``mpack`` command line: one thin function per command, errors mapped in one place.

Library code never prints; commands hand results to :mod:`mpack.ui`. Every ``MpackError``
becomes one message (plus a hint) and its exit code (:data:`EXIT_CODES`); any other exception
is a bug and exits 1. ``MPACK_DEBUG=1`` shows tracebacks. SIGINT and SIGTERM stop a command the
same way (Note [interrupts]); a closed stdout is not an error (Note [closed stdout] in
:mod:`mpack.ui`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core

from mpack import __version__, env, target
from mpack.errors import (
    Interrupted,
    MpackError,
    UsageError,
    as_mpack_error,
    escaped,
    exit_code_for,
    worded,
)

if TYPE_CHECKING:
    from mpack.convert.options import ConvertOptions

#: The environment variables mpack reads, shown at the end of ``mpack --help``: derived from the
#: one table of them, :data:`mpack.env.VARIABLES` (the README's table says the same).
ENVIRONMENT = env.help_entries()
#: What each exit status means (shown at the end of ``mpack --help``; README, "Exit codes").
EXIT_CODES = {
    0: "done (or already up to date)",
    1: "internal error, a bug (MPACK_DEBUG=1 shows the traceback)",
    2: "bad input or usage; nothing written",
    3: "the environment refused (permissions, read-only or full disk, open files)",
    130: "interrupted by SIGINT (Ctrl-C); nothing left half-written",
    143: "stopped by SIGTERM, as by SIGINT",
}
_EPILOG = (
    "\b\nEnvironment:\n"
    + "\n".join(f"  {k:27} {v}" for k, v in ENVIRONMENT.items())
    + "\n\n\b\nExit codes:\n"
    + "\n".join(f"  {k:<4} {v}" for k, v in EXIT_CODES.items())
    + "\n  A closed stdout (`mpack inspect SC | head`) does not change the code."
)


# Note [CLI habits]: every command takes -v/--verbose and -q/--quiet (as ``mpack -v CMD`` and
# ``mpack -q CMD`` do), in one place: :class:`_Command` adds the two to each command that does not
# declare them itself and applies them before the command runs (:func:`_set_habits`), so a new
# command has them without a word. -q is the output sink's (:func:`mpack.ui.set_quiet`): nothing
# but errors, no progress. --json and -q, and -v and -q, contradict each other: refused (exit 2).
# Every --json document is one object with a top-level ``ok``, the manifest digest is
# ``manifest_digest`` wherever it appears, and floats carry no noise (:func:`mpack.ui.print_json`):
# ``status`` prints ``{"ok": true, "daemons": [...]}``, ``serve`` one such object per event line
# (:func:`mpack.ui.event_doc`). A command that fails prints one document, the error's
# (:func:`error_document`), holding what it found before it failed (``MpackError.facts``:
# verify's), never a result and an error.
# Library errors name the library's arguments; here they read as flags (:data:`FLAGS`).

#: -v and -q: name -> (flags, help) (Note [CLI habits]).
_HABITS = {
    "verbose": (
        ("--verbose", "-v"),
        "Show other libraries' logs and progress bars (transformers, compressed-tensors, the "
        "Hub), and mpack's debug log.",
    ),
    "quiet": (("--quiet", "-q"), "Print nothing but errors."),
}


class _Command(typer.core.TyperCommand):
    """Usage lines show positionals as ``SOURCE``, the way every CLI does (not ``{SOURCE}``);
    -v and -q on every command (Note [CLI habits])."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        declared = {p.name for p in self.params}
        self.habits = [name for name in _HABITS if name not in declared]  # added here
        self.params += [p for p in _habit_options() if p.name in self.habits]

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [
            p[1:-1] if p.startswith("{") and p.endswith("}") else p
            for p in super().collect_usage_pieces(ctx)
        ]

    def invoke(self, ctx: Any) -> Any:
        root = ctx.find_root().params  # ``mpack -v CMD``, ``mpack -q CMD``
        said = {
            name: bool(ctx.params.pop(name) if name in self.habits else ctx.params.get(name))
            or bool(root.get(name))
            for name in _HABITS
        }
        if "quiet" not in self.habits:  # the command reads its own --quiet: -q before it counts
            ctx.params["quiet"] = said["quiet"]
        _set_habits(**said, as_json=bool(ctx.params.get("json_out")))
        try:
            return super().invoke(ctx)
        finally:  # -q is this command's: never the next one's in the same process (main())
            from mpack import ui

            ui.set_quiet(False)


@functools.cache
def _habit_options() -> list[Any]:
    """-v and -q as typer makes options, from a function that declares them (typer's own
    option class needs what only its ``Annotated`` parsing builds)."""
    template = typer.Typer()

    @template.command()
    def habits(
        verbose: Annotated[
            bool, typer.Option(*_HABITS["verbose"][0], help=_HABITS["verbose"][1])
        ] = False,
        quiet: Annotated[
            bool, typer.Option(*_HABITS["quiet"][0], help=_HABITS["quiet"][1])
        ] = False,
    ) -> None:
        pass

    return list(typer.main.get_command(template).params)


def _set_habits(*, verbose: bool, quiet: bool, as_json: bool) -> None:
    """Apply -v and -q to the output sink, refusing the pairs that contradict each other."""
    if verbose and quiet:
        raise UsageError("-v (--verbose) and -q (--quiet) contradict each other; pick one")
    if as_json and quiet:
        raise UsageError("--json and --quiet contradict each other; pick one")
    from mpack import ui

    ui.set_verbose(verbose)
    ui.set_quiet(quiet)


def _flag(flag: str) -> Callable[[Any, bool], str]:
    """The words of an option: ``--device`` alone, ``--device cuda:0`` with a value, and the
    flag alone for a switch that is on (``--force``)."""

    def words(value: Any, given: bool) -> str:
        return flag if not given or value is True else f"{flag} {value}"

    return words


def _on_off(flag: str) -> Callable[[Any, bool], str]:
    """An option the library takes as a bool and the command line as ``off``/``on`` (``--ep``)."""
    return lambda value, given: f"{flag} {'on' if value else 'off'}" if given else flag


#: How the command line spells the library's arguments, for its errors (Note [API wording] in
#: mpack/errors.py): argument name -> ``words(value, given)``.
FLAGS: dict[str, Callable[[Any, bool], str]] = {
    "device": _flag("--device"),
    "rederive_device": _flag("--rederive-device"),
    "backend": _flag("--backend"),
    "source": _flag("--source"),
    "revision": _flag("--revision"),
    "forward": _flag("--forward"),
    "require_source": _flag("--require-source"),
    "tp": _flag("--tp"),
    "profile": _flag("--profile"),
    "act_dtype": _flag("--act-dtype"),
    "fuse": _flag("--fuse"),
    "ep": _on_off("--ep"),
    "force": _flag("--force"),
    "skip_invalid": _flag("--skip-invalid"),
    "passthrough": lambda value, given: "--no-passthrough",
    "rank": _flag("--rank"),
    "socket": _flag("--socket"),
    "verify": _flag("--verify"),
    "out": _flag("-o"),
    "layout": _flag("--layout"),
}


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
    """``mpack --version``: the version, then a short report of the environment, as ``vllm
    collect-env`` gives one (:func:`mpack.env.report`): fast, no torch, no CUDA."""
    if value:
        lines = [f"mpack {__version__}"] + [f"  {k + ':':15} {v}" for k, v in env.report()]
        _say(sys.stdout, escaped("\n".join(lines), keep="\n"))
        raise typer.Exit()


@app.callback(epilog=_EPILOG)
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version_cb,
            is_eager=True,
            help="Print the version, the vLLM version it targets, and what this install has "
            "(native repack, cuda-bindings, torch, Python).",
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option(*_HABITS["verbose"][0], help=_HABITS["verbose"][1])
    ] = False,
    quiet: Annotated[bool, typer.Option(*_HABITS["quiet"][0], help=_HABITS["quiet"][1])] = False,
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

    -v and -q work before the command or after it (mpack convert SRC -o OUT -q).
    """


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
    typer.Argument(
        metavar="SIDECAR",
        help="Sidecar directory (written by `mpack convert`), or Hub repo id "
        "org/name[/<target>][@revision] (docs/HUB.md).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]

# --- choosing targets of a directory of sidecars (Note [target layout] in mpack/target_dirs.py)

SelectTpOpt = Annotated[
    int | None,
    typer.Option(
        "--tp",
        metavar="N",
        help="Of a directory of targets (OUT/<target>/): the target(s) of this TP size.",
    ),
]
SelectProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile", metavar=PROFILE_CHOICES, help="Of a directory of targets: this profile's."
    ),
]
SelectActDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--act-dtype",
        metavar=ACT_DTYPE_CHOICES,
        help="Of a directory of targets: this activation dtype's.",
    ),
]
SelectEpOpt = Annotated[
    str | None,
    typer.Option(
        "--ep", metavar="off|on", help="Of a directory of targets: with expert parallelism or not."
    ),
]


def _selection(tp: int | None, profile: str | None, act_dtype: str | None, ep: str | None) -> Any:
    """The :class:`mpack.target_dirs.Selection` the target options make (checked)."""
    from mpack.target_dirs import Selection

    return Selection(tp, profile, act_dtype, None if ep is None else _ep_value(ep))


def _targets_of(sidecar: Path, select: Any) -> list[Any] | None:
    """The targets of ``sidecar`` that ``select`` names, where it is a local directory of
    targets and the command is to take each of them (none or several named, or one with no
    selection); None where the command takes ``sidecar`` as one sidecar (a sidecar, a Hub repo
    id, one target named: ``resolve_sidecar(..., select=)`` takes it)."""
    from mpack.target_dirs import holds_targets, matching

    root = Path(sidecar).expanduser()
    if not holds_targets(root):
        return None
    found = matching(root, select)  # names none: refused, listing them
    if not found or (select and len(found) == 1):
        return None
    return found


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
        "Marlin, per-tensor shards requantized to their max scale. A comma list: a target each.",
    ),
]
ConvertActDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--act-dtype",
        metavar=ACT_DTYPE_CHOICES,
        help="Activation dtype the kernel runs in; scales and bias are stored in it. "
        "A comma list: a target each. [default: the checkpoint's dtype]",
    ),
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
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        metavar="[auto|host|driver|torch]",
        help="Which code converts the layers (identical bytes on each); auto: the first that "
        "can, as --device orders them. -v says which ran and why the others did not.",
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
ConvertTpOpt = Annotated[
    str,
    typer.Option(
        "--tp",
        metavar="N[,N...]",
        help="Tensor-parallel size: one rank file per rank. A comma list (1,2,4,8) makes one "
        "sidecar per target, OUT/<target>/.",
    ),
]
ConvertEpOpt = Annotated[
    str,
    typer.Option(
        "--ep",
        metavar="off|on[,...]",
        help="Expert parallelism for a MoE model (vLLM's --enable-expert-parallel): on splits "
        "the experts whole across the TP ranks, target tp<N>ep. off,on makes both.",
    ),
]
SkipInvalidOpt = Annotated[
    bool,
    typer.Option(
        "--skip-invalid",
        help="With several targets, leave out those this checkpoint cannot have (e.g. a TP "
        "that does not divide the heads) instead of refusing the run.",
    ),
]
LayoutOpt = Annotated[
    str,
    typer.Option(
        "--layout",
        metavar="[auto|targets]",
        help="targets: every target in OUT/<target>/, however many (stable paths for CI and "
        "the Hub); auto: one target at OUT itself unless OUT already holds targets.",
    ),
]
PushOpt = Annotated[
    str | None,
    typer.Option(
        "--push",
        metavar="REPO_ID",
        help="Then push the sidecar to this Hub repo, as `mpack push OUT REPO_ID` does.",
    ),
]


@command
def convert(
    source: Source,
    out: OutOpt,
    revision: RevisionOpt = None,
    profile: ProfileOpt = "w8a16",
    act_dtype: ConvertActDtypeOpt = None,
    tp: ConvertTpOpt = "1",
    ep: ConvertEpOpt = "off",
    fuse: FuseOpt = "vllm",
    device: ConvertDeviceOpt = "auto",
    backend: BackendOpt = "auto",
    no_passthrough: NoPassthroughOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    push_to: PushOpt = None,
    skip_invalid: SkipInvalidOpt = False,
    layout: LayoutOpt = "auto",
) -> None:
    """Convert a compressed-tensors FP8 checkpoint into a Marlin FP8 sidecar.

    --tp, --ep, --profile and --act-dtype take comma lists: their cross product is the set
    of targets, all made from one read of the source, each a sidecar in OUT/<target>/
    (e.g. OUT/tp2-w8a16-bfloat16/, OUT/tp2ep-w8a16-bfloat16/). One target goes there too
    with --layout targets, or when OUT already holds targets; targets OUT holds that the
    run does not make are kept.

    \b
    Examples:
      mpack convert RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8 -o llama8b-marlin --tp 2
      mpack convert ./my-fp8-model -o out --profile w8a8-marlin --act-dtype float16 --json
      mpack convert ./my-fp8-model -o out --tp 1,2,4,8 --profile w8a16,w8a8-marlin
      mpack convert ./my-fp8-model -o out --tp 2 --layout targets   # out/tp2-w8a16-bfloat16/
      mpack convert ./my-fp8-moe -o out --tp 2,4 --ep off,on
    """
    if push_to is not None:  # --json with --quiet: refused before (Note [CLI habits])
        _check_push_options(push_to, json_out, out)
    from mpack.convert.options import ConvertOptions

    options = ConvertOptions(
        revision=revision,
        profile=_comma_list(profile, "--profile"),
        act_dtype=None if act_dtype is None else _comma_list(act_dtype, "--act-dtype"),
        tp=[_tp_value(v) for v in _comma_list(tp, "--tp")],
        ep=[_ep_value(v) for v in _comma_list(ep, "--ep")],
        fuse=fuse,
        device=device,
        backend=backend,
        passthrough=not no_passthrough,
        force=force,
        skip_invalid=skip_invalid,
        layout=layout,
    )
    _at_stake.append(_output_note(out))  # what an interrupt did to OUT, said if one comes
    result = _run_convert(source, out, options, show_progress=not (json_out or quiet))
    _report_convert(result, push_to=push_to, json_out=json_out, quiet=quiet)


def _report_convert(result: Any, *, push_to: str | None, json_out: bool, quiet: bool) -> None:
    """Print a finished conversion (one sidecar, or a directory of them: ``results``), then
    push it to ``push_to``: the targets this run made, not those it kept."""
    from mpack import ui

    many = hasattr(result, "results")
    if many:
        ui.emit_convert_many(result, as_json=json_out, quiet=quiet)
    else:
        ui.emit_convert(result, as_json=json_out, quiet=quiet)
    if push_to is not None:  # the sidecar is finished and checked again before it is sent
        from mpack.hub import plan_push, push

        with ui.bytes_progress(not quiet, "push", {"check": "checking"}) as progress:
            plan = plan_push(
                result.out,
                push_to,
                progress=None if progress is None else lambda d, t: progress("check", d, t),
                only=[r.out.name for r in result.results] if many else None,
            )
        pushed = push(plan, show_progress=not quiet)
        if not quiet:
            _emit_push(pushed.report(), dry_run=False, as_json=False)


def _comma_list(value: str, option: str) -> list[str]:
    """``a,b,c`` -> ``["a", "b", "c"]``; an empty item is refused, naming ``option``."""
    items = [v.strip() for v in value.split(",")]
    if not all(items):
        raise UsageError(
            f"{option} {value!r}: an empty item in the list", hint=f"e.g. {option} 1,2,4,8"
        )
    return items


def _tp_value(v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"--tp takes whole numbers, got {v!r}", hint="e.g. --tp 1,2,4,8") from None


def _ep_value(v: str) -> bool:
    if v not in ("off", "on"):
        raise UsageError(f"--ep takes off or on, got {v!r}", hint="e.g. --ep off,on")
    return v == "on"


def _run_convert(source: str, out: str, options: ConvertOptions, *, show_progress: bool) -> Any:
    """:func:`mpack.convert.start` (the early scheme check and read-ahead, then the conversion)
    with progress lines; ``mpack.ui`` is imported once the early work has started."""
    from mpack.convert import start

    def progress() -> Any:
        from mpack import ui

        return ui.convert_progress(enabled=show_progress)

    return start(source, out, options, progress=progress)


@command
def inspect(
    sidecar: Sidecar,
    tp: SelectTpOpt = None,
    profile: SelectProfileOpt = None,
    act_dtype: SelectActDtypeOpt = None,
    ep: SelectEpOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a sidecar: target, source provenance, files, and every layer's shapes.

    A directory of targets (OUT/<target>/): one line per target; --tp, --profile,
    --act-dtype and --ep narrow the list, and show the one target they name in full.

    \b
    Example:
      mpack inspect llama8b-marlin
      mpack inspect out                  # out/tp1-w8a16-bfloat16/, out/tp2-...: the targets
      mpack inspect out --tp 2           # the one TP-2 target in full
      mpack inspect my-org/llama8b-marlin/tp2-w8a16-bfloat16   # fetches mpack.json alone
    """
    from mpack import ui
    from mpack.hub_sidecar import resolve_sidecar
    from mpack.sidecar import COMMON_NAME, load_manifest, read_file_map

    select = _selection(tp, profile, act_dtype, ep)
    found = _targets_of(sidecar, select)
    if found is not None:
        ui.emit_targets(sidecar, found, as_json=json_out)
        return
    sidecar = resolve_sidecar(sidecar, fetch="manifest", select=select)  # a repo id: mpack.json
    manifest, digest = load_manifest(sidecar)
    listed = COMMON_NAME in {f["name"] for f in manifest["files"]}
    common = None  # its tensor names, where the file is here (a wrapper's parts count them)
    if listed and (sidecar / COMMON_NAME).is_file() and ui.model_parts(manifest, None):
        common = [e.name for e in read_file_map(sidecar / COMMON_NAME, follow=False).entries]
    ui.emit_inspect(sidecar, manifest, digest, as_json=json_out, common=common)


# --- mpack verify's options ----------------------------------------------------------------

VerifySourceOpt = Annotated[
    str | None,
    typer.Option(
        "--source",
        metavar="SOURCE",
        help="Re-derive every tensor from this checkpoint (directory or Hub repo id). "
        "[default: the recorded local path, or the recorded Hub repo and commit if it is in "
        "the local cache]",
    ),
]
ForwardOpt = Annotated[
    bool,
    typer.Option(
        "--forward",
        help="Also run token ids through the model from the sidecar and from the source "
        "(transformers) and compare greedy tokens and logits.",
    ),
]
ForwardDeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        metavar="[cpu|cuda|cuda:N]",
        help="Where --forward runs (only with --forward). [default: cpu]",
    ),
]
RederiveDeviceOpt = Annotated[
    str,
    typer.Option(
        "--rederive-device",
        metavar="[auto|cpu|cuda|cuda:N]",
        help="Where the tensors are re-derived from the source (the same result on each); "
        "auto: as convert's --device auto.",
    ),
]
RequireSourceOpt = Annotated[
    bool,
    typer.Option(
        "--require-source",
        help="Fail (exit 2) when the source cannot be found, instead of passing on the "
        "checksums alone: for CI.",
    ),
]


@command
def verify(
    sidecar: Sidecar,
    source: VerifySourceOpt = None,
    forward: ForwardOpt = False,
    device: ForwardDeviceOpt = None,
    rederive_device: RederiveDeviceOpt = "auto",
    require_source: RequireSourceOpt = False,
    tp: SelectTpOpt = None,
    profile: SelectProfileOpt = None,
    act_dtype: SelectActDtypeOpt = None,
    ep: SelectEpOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check every file's sha256, and re-derive every tensor from the source checkpoint.

    A directory of targets (OUT/<target>/): every target (or those --tp, --profile,
    --act-dtype and --ep name), all re-derived from one read of the source.
    Shows progress on stderr as convert does (not with --json or -q).

    \b
    Examples:
      mpack verify llama8b-marlin
      mpack verify llama8b-marlin --source RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8
      mpack verify llama8b-marlin --require-source --json    # in CI
      mpack verify out --source ./my-fp8-model    # out/tp1-w8a16-bfloat16/, out/tp2-...: all
      mpack verify tiny-marlin --source ./tiny-fp8 --forward
    """
    from mpack import ui
    from mpack.hub_sidecar import resolve_sidecar
    from mpack.verify import check_arguments
    from mpack.verify import verify as verify_sidecar

    check_arguments(source, None, forward, device)  # before a repo id is fetched
    select = _selection(tp, profile, act_dtype, ep)
    found = _targets_of(sidecar, select)
    if forward:
        ui.quiet_libraries()  # transformers' and compressed-tensors' bars and logs (unless -v)
    if found is not None:
        from mpack.verify.check import targets_error, verify_targets

        with ui.verify_progress(not json_out) as progress:
            results = verify_targets(
                [t.path for t in found],
                source=source,
                forward=forward,
                device=device,
                rederive_device=rederive_device,
                require_source=require_source,
                progress=progress,
            )
        err = targets_error(sidecar, results)
        if json_out and err is not None:  # one document: the error's, with what was checked
            err.facts = ui.verify_many_doc(sidecar, results)
        elif not any(r.problems for r in results):  # as for one: shown when outputs differ
            ui.emit_verify_many(sidecar, results, as_json=json_out)
        if err is not None:
            raise err
        return
    sidecar = resolve_sidecar(sidecar, fetch="all", select=select)  # a repo id: every file
    with ui.verify_progress(not json_out) as progress:
        result = verify_sidecar(
            sidecar,
            source=source,
            forward=forward,
            device=device,
            rederive_device=rederive_device,
            require_source=require_source,
            progress=progress,
        )
    err = result.error()
    if json_out and err is not None:  # one document: the error's, with what was checked
        err.facts = ui.verify_doc(result)
    elif not result.problems:  # what matched; also shown when the model outputs differ
        ui.emit_verify(result, as_json=json_out)
    if err is not None:
        raise err


# --- mpack push (mpack/hub.py, docs/HUB.md) -------------------------------------------------


@command
def push(
    sidecar: Annotated[
        Path,
        typer.Argument(
            metavar="SIDECAR",
            help="Sidecar directory, or a directory of sidecars (one per target: each goes to "
            "its own folder of the repo).",
        ),
    ],
    repo_id: Annotated[
        str, typer.Argument(metavar="REPO_ID", help="Hub model repo, namespace/name.")
    ],
    revision: Annotated[
        str | None,
        typer.Option(
            "--revision",
            metavar="BRANCH",
            help="Commit to this branch, created from main if missing. [default: main]",
        ),
    ] = None,
    private: Annotated[
        bool, typer.Option("--private", help="Make the repo private, if the push creates it.")
    ] = False,
    base_model: Annotated[
        str | None,
        typer.Option(
            "--base-model",
            metavar="REPO",
            help="The source checkpoint's Hub repo, for the card's base_model: for a local "
            "source outside the HF cache, or instead of the repo the sidecar records.",
        ),
    ] = None,
    commit_message: Annotated[
        str | None,
        typer.Option(
            "--commit-message",
            metavar="TEXT",
            help="The commit's summary. [default: mpack push: <targets> from <source>]",
        ),
    ] = None,
    create_pr: Annotated[
        bool,
        typer.Option(
            "--create-pr",
            help="Open a pull request with the commit (against --revision, or main) instead "
            "of committing to the branch.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check the sidecar and print the files, sizes and model card; send nothing.",
        ),
    ] = False,
    tp: SelectTpOpt = None,
    profile: SelectProfileOpt = None,
    act_dtype: SelectActDtypeOpt = None,
    ep: SelectEpOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Publish a sidecar to the Hugging Face Hub in one commit, with a model card.

    Checks every file against the manifest first (nothing is sent if one fails). Uses
    huggingface_hub's login (`hf auth login` or HF_TOKEN) and HF_ENDPOINT. Shows progress
    (the checks, then huggingface_hub's uploads) unless --json or --quiet. A directory of
    targets goes a folder per target, also when it holds one; --tp, --profile, --act-dtype
    and --ep send only the targets they name (the revision then holds those alone).

    \b
    Examples:
      mpack push llama8b-marlin my-org/llama8b-marlin --dry-run
      mpack push llama8b-marlin my-org/llama8b-marlin --private
      mpack push out/ my-org/llama8b-marlin --json      # out/tp2-w8a16-bfloat16/, ...
      mpack push ./sc my-org/llama8b-marlin --base-model org/Llama-FP8 --create-pr
    """
    from mpack import ui
    from mpack.hub import plan_push
    from mpack.hub import push as push_plan

    shown = not (json_out or quiet)
    with ui.bytes_progress(shown, "push", {"check": "checking"}) as progress:
        plan = plan_push(
            sidecar,
            repo_id,
            revision=revision,
            private=private,
            base_model=base_model,
            commit_message=commit_message,
            create_pr=create_pr,
            progress=None if progress is None else lambda d, t: progress("check", d, t),
            select=_selection(tp, profile, act_dtype, ep),
        )
    if dry_run:
        if not quiet:  # (--json with --quiet is refused: Note [CLI habits])
            _emit_push(plan.report(), dry_run=True, as_json=json_out)
        return
    result = push_plan(plan, show_progress=shown)
    if not quiet:
        _emit_push(result.report(), dry_run=False, as_json=json_out)


def _check_push_options(repo_id: str, json_out: bool, out: str) -> None:
    """``convert --push``: refuse what would fail only after the conversion."""
    from mpack.hub import check_repo_id

    check_repo_id(repo_id)
    if json_out:
        raise UsageError(
            "--push with --json would print two documents",
            hint=f"convert with --json, then push: mpack push {out} {repo_id} --json",
        )


def _emit_push(report: dict[str, Any], *, dry_run: bool, as_json: bool) -> None:
    """``mpack push``'s output: one JSON document, or the files (and for a dry run the card)."""
    from mpack import ui

    if as_json:
        ui.print_json({"ok": True, "dry_run": dry_run, **report})
        return
    files = report["files"]
    where = report["repo_id"] + (f" (branch {report['revision']})" if report["revision"] else "")
    n = len(report["targets"])
    shared = report["bytes"] - report["unique_bytes"]
    lines = [
        f"{where}: {n} target{'s' if n > 1 else ''}, {len(files)} files, "
        f"{ui.human_bytes(report['bytes'])}"
        + (f" ({ui.human_bytes(shared)} of them shared, sent once)" if shared else "")
    ]
    width = max(len(f["path"]) for f in files)
    lines += [
        f"  {f['path']:<{width}}  {ui.human_bytes(f['size']):>11}  {f['local'] or '(model card)'}"
        + (f"  (same bytes as {f['same_as']})" if f.get("same_as") else "")
        for f in files
    ]
    if report["skipped"]:
        lines.append(f"not pushed (not sidecars): {', '.join(report['skipped'])}")
    if dry_run:
        lines += ["dry run: nothing was sent. The model card (README.md):", "", report["card"]]
    else:
        lines += [f"deleted (not in this push): {p}" for p in report["deleted"]]
        lines.append(f"pushed: commit {report['commit']} {report['url'] or ''}".rstrip())
        if report.get("pr_url"):
            lines.append(f"pull request: {report['pr_url']}")
    # paths of a directory listing, the card's manifest strings: Note [quoting untrusted text]
    ui.write_line(sys.stdout, escaped("\n".join(lines), keep="\n"))


# --- mpack serve / mpack status (runtime; mpack/runtime/daemon.py, docs/RUNTIME.md) ---------

DeviceOpt = Annotated[
    str, typer.Option("--device", metavar="[cpu|cuda|cuda:N]", help="Where the rank is loaded.")
]
PpSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--pp-size",
        metavar="N",
        help="Pipeline-parallel size of the engine (vLLM's --pipeline-parallel-size): its "
        "decoder layers split as vLLM splits them, VLLM_PP_LAYER_PARTITION included.",
    ),
]


def _pp_options(pp_rank: int | None, pp_size: int | None, *, rank_needed: bool) -> None:
    """Refuse a ``--pp-rank`` / ``--pp-size`` pair that names no stage, before any work."""
    if pp_size is not None and pp_size < 1:
        raise UsageError(f"--pp-size must be >= 1, got {pp_size}")
    if pp_rank is not None and pp_size is None:
        raise UsageError(
            f"--pp-rank {pp_rank} without --pp-size: a stage is one of a split",
            hint=f"add --pp-size N (the engine's --pipeline-parallel-size), e.g. --pp-rank "
            f"{pp_rank} --pp-size {max(2, pp_rank + 1)}",
        )
    if rank_needed and pp_size is not None and pp_rank is None:
        raise UsageError(
            f"--pp-size {pp_size} without --pp-rank: a daemon serves one stage",
            hint=f"add --pp-rank P (0..{pp_size - 1}), one daemon per stage; or leave out "
            "--pp-size to serve the whole rank",
        )
    if pp_rank is not None and pp_size is not None and not 0 <= pp_rank < pp_size:
        raise UsageError(
            f"--pp-rank {pp_rank} is out of range: --pp-size {pp_size} has stages 0..{pp_size - 1}"
        )


@command
def serve(
    sidecar: Sidecar,
    rank: Annotated[int, typer.Option("--rank", help="Tensor-parallel rank to serve.")] = 0,
    pp_rank: Annotated[
        int | None,
        typer.Option(
            "--pp-rank",
            metavar="P",
            help="Serve pipeline stage P of --pp-size only: its decoder layers and the "
            "pass-through tensors it builds. [default: the whole rank]",
        ),
    ] = None,
    pp_size: PpSizeOpt = None,
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
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON line per event on stdout (loading, progress, ready, attached, "
            "detached, stopping, ...) instead of the READY line.",
        ),
    ] = False,
    log_format: Annotated[
        str,
        typer.Option(
            "--log-format",
            metavar="[text|json]",
            help="The log on stderr: text lines (RFC 3339 UTC time, level, event) or JSON lines.",
        ),
    ] = "text",
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            metavar="PORT",
            help="Serve Prometheus metrics at http://ADDR:PORT/metrics (0: any free port, named "
            "in the READY line). [default: off]",
        ),
    ] = None,
    metrics_addr: Annotated[
        str,
        typer.Option(
            "--metrics-addr",
            metavar="ADDR",
            help="The address the metrics endpoint listens on (0.0.0.0: every interface).",
        ),
    ] = "127.0.0.1",
    verify: Annotated[
        str,
        typer.Option(
            "--verify",
            metavar="[auto|always]",
            help="auto: hash only the files an earlier start did not verify as they are now "
            "(same inode, size, mtime and ctime); always: hash every file. See docs/RUNTIME.md.",
        ),
    ] = "auto",
    tp: SelectTpOpt = None,
    profile: SelectProfileOpt = None,
    act_dtype: SelectActDtypeOpt = None,
    ep: SelectEpOpt = None,
) -> None:
    """Load one rank of a sidecar once and share it read-only with local processes.

    A directory of targets (OUT/<target>/) serves its one target, or the one --tp,
    --profile, --act-dtype and --ep name (refused, listing them, when several are left).

    Checks every checksum while loading (a progress line every $MPACK_PROGRESS_EVERY seconds),
    except of files an earlier start verified that are unchanged since (--verify always: all);
    prints a READY line once serving. Under systemd (Type=notify) it sends READY=1 then too.
    Stops cleanly on SIGTERM, SIGINT or SIGHUP. Attach with
    mpack.runtime.attach(SIDECAR, rank=R, device=D).

    With --pp-rank P --pp-size N it holds only pipeline stage P of an engine at
    --pipeline-parallel-size N (vLLM's split of the decoder layers; VLLM_PP_LAYER_PARTITION
    is read as vLLM reads it): an engine whose split differs is refused on attach.

    \b
    Examples:
      mpack serve llama8b-marlin --rank 0 --device cuda:0
      mpack serve llama8b-marlin --rank 0 --pp-rank 1 --pp-size 2 --device cuda:2
      mpack serve llama8b-marlin --device cpu --json --log-format json
      mpack serve llama8b-marlin --rank 1 --device cuda:1 --metrics-port 9400
      mpack serve my-org/llama8b-marlin@main --rank 1 --device cuda:1   # from the Hub
      mpack serve out --tp 2 --rank 1 --device cuda:1   # out/tp2-w8a16-bfloat16/
    """
    from mpack import ui
    from mpack.runtime.daemon import serve as run_daemon

    if rank < 0:
        raise UsageError(f"--rank must be >= 0, got {rank}")
    _pp_options(pp_rank, pp_size, rank_needed=True)
    select = _selection(tp, profile, act_dtype, ep)
    if log_format not in ui.LOG_FORMATS:
        raise UsageError(
            f"--log-format {log_format!r}: not one of {', '.join(ui.LOG_FORMATS)}",
            hint="--log-format text (the default) or --log-format json",
        )
    from mpack.runtime.daemon import check_verify

    check_verify(verify)  # before the sidecar is resolved (a repo id: a download)
    if metrics_port is None and metrics_addr != "127.0.0.1":
        raise UsageError(
            f"--metrics-addr {metrics_addr} without --metrics-port: the endpoint is off",
            hint="add --metrics-port PORT",
        )
    if metrics_port is not None:
        from mpack.runtime.metrics import check_port

        check_port(metrics_port)  # before the sidecar is resolved (a repo id: a download)
    every = env.progress_every()
    from mpack.hub_sidecar import resolve_sidecar

    sidecar = resolve_sidecar(sidecar, rank=rank, select=select)  # a repo id: this rank's files
    stage = None
    if pp_rank is not None and pp_size is not None:
        from mpack import arch
        from mpack.runtime.allocation import sidecar_stage
        from mpack.sidecar import load_manifest

        manifest, _ = load_manifest(sidecar)
        partition = arch.pp_partition_spec(os.environ)
        stage = sidecar_stage(manifest, sidecar, pp_rank, pp_size, partition)
    out = ui.ServeOutput(log_format=log_format, json_events=json_out)
    run_daemon(
        sidecar,
        rank=rank,
        stage=stage,
        device=device,
        socket_path=socket,
        on_ready=out.ready,
        on_event=out.event,
        progress_every=every,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
        verify=verify,
    )


@command
def status(
    sidecar: Annotated[
        Path | None,
        typer.Argument(
            metavar="SIDECAR",
            help="Only daemons serving this sidecar (directory or Hub repo id). "
            "[default: all of this user's]",
        ),
    ] = None,
    socket: Annotated[
        Path | None,
        typer.Option("--socket", metavar="PATH", help="Only the daemon listening at PATH."),
    ] = None,
    devices: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            metavar="[cpu|cuda|cuda:N]",
            help="With SIDECAR: ready only when served on this device. Once for the whole "
            "model, or once per TP shard in order (cuda:0 then cuda:1). [default: any]",
        ),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank",
            metavar="R",
            help="With SIDECAR: only rank R (its daemons; ready once it is served). "
            "[default: every rank]",
        ),
    ] = None,
    pp_size: PpSizeOpt = None,
    pp_rank: Annotated[
        int | None,
        typer.Option(
            "--pp-rank",
            metavar="P",
            help="With --pp-size: only stage P (ready once it is served). [default: every stage]",
        ),
    ] = None,
    tp: SelectTpOpt = None,
    profile: SelectProfileOpt = None,
    act_dtype: SelectActDtypeOpt = None,
    ep: SelectEpOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show the daemons serving sidecars: rank, device, memory, attached clients, uptime.

    A socket where something answers, but not as a daemon should, is reported with the reason;
    the daemons beside it are listed all the same. With SIDECAR, a readiness probe: exits 0 once
    every rank of SIDECAR is served (until mpack status SIDECAR; do sleep 0.5; done), 2 while
    one is not, naming each missing rank; with --rank R, once rank R is. A directory of
    targets (OUT/<target>/) is probed for its one target, or the one --tp, --profile,
    --act-dtype and --ep name (refused, listing them, when several are left).

    With --pp-size N, ready once every (rank, stage) of the engine's grid is served: by the
    daemon of that stage (the same split) or of the whole rank; --device then once, or once
    per GPU in vLLM's rank order (stage 0's ranks, then stage 1's).

    \b
    Examples:
      mpack status
      mpack status llama8b-marlin --json
      mpack status llama8b-marlin --device cuda:0 --device cuda:1   # TP 2, ready?
      mpack status llama8b-marlin --rank 1 --device cuda:1          # rank 1's probe
      mpack status llama8b-marlin --pp-size 2                       # TP x PP 2, ready?
      mpack status llama8b-marlin --rank 0 --pp-rank 1 --pp-size 2  # one stage's probe
      mpack status out --tp 2                                       # out/tp2-w8a16-bfloat16/
    """
    from mpack import ui
    from mpack.runtime.client import query_status

    if sidecar is not None and socket is not None:
        raise UsageError("give a SIDECAR or --socket, not both")
    if rank is not None and rank < 0:
        raise UsageError(f"--rank must be >= 0, got {rank}")
    _pp_options(pp_rank, pp_size, rank_needed=False)
    select = _selection(tp, profile, act_dtype, ep)
    if select and sidecar is None:
        raise UsageError(
            f"{select.words()} names a target of SIDECAR, and none is given",
            hint="give the directory of targets: mpack status OUT " + select.words(),
        )
    if sidecar is not None:  # a repo id: its mpack.json (daemons are known by its digest)
        from mpack.hub_sidecar import resolve_sidecar

        sidecar = resolve_sidecar(sidecar, fetch="manifest", select=select)
    from mpack import arch

    docs = query_status(
        sidecar=sidecar,
        socket=socket,
        devices=devices or (),
        rank=rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        partition=arch.pp_partition_spec(os.environ),
    )
    ui.emit_status(docs, as_json=json_out)


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
    facts = exc.facts if isinstance(exc, MpackError) and exc.facts else {}
    if facts:  # what the command found before it failed (a verification's), rounded as ever
        from mpack.ui import plain_floats

        facts = plain_floats(facts)
    return {
        **facts,
        "ok": False,
        "error": {
            "code": kind,
            "exit_code": code,
            "message": message,
            "file": _file_of(exc),
            "hint": hint,
        },
    }


def _say(stream: Any, text: str) -> None:
    """Write ``text`` and a newline to ``stream`` and flush; never raises: a stream whose
    reader went away is silenced (Note [closed stdout] in :mod:`mpack.ui`)."""
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):
        from mpack.ui import silence

        silence(stream)


def _print_error(exc: BaseException, code: int, *, as_json: bool) -> None:
    """The message (and hint) on stderr; with ``--json`` also one JSON document on stdout. An
    interrupt is one line, ``mpack: interrupted (SIGTERM); ...``."""
    if as_json:
        import json

        _say(sys.stdout, json.dumps(error_document(exc, code), indent=2, sort_keys=True))
    if isinstance(exc, Interrupted):
        text = f"mpack: {exc.message}"
    elif isinstance(exc, MpackError):
        text = f"error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else "")
    else:
        text = (
            f"internal error: {type(exc).__name__}: {exc}\n"
            "  this is a bug in mpack; rerun with MPACK_DEBUG=1 and report the traceback"
        )
    _say(sys.stderr, escaped(text, keep="\n"))  # Note [quoting untrusted text]


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


# --- interrupts -----------------------------------------------------------------------------

# Note [interrupts]: SIGTERM (systemd, Kubernetes, `timeout`, a CI job cancelled) is handled as
# SIGINT is: the handler raises KeyboardInterrupt in the main thread, so the cleanup written for
# Ctrl-C runs for both (convert removes its work directory and its lock: Note [atomic output]
# in convert/output/swap.py; the scheme check's child is stopped). Python's default for SIGTERM is
# to die at once, leaving both behind. The first signal is remembered and main() reports it:
# one line on stderr (and one JSON document under --json), exit 128 + its number (130, 143),
# as a shell reports a process the signal killed. The handlers are put back as soon as one
# fires, so a second signal acts at once (SIGTERM kills, SIGINT raises again). A signal that
# was ignored where mpack started (nohup, a background job) stays ignored; `mpack serve` sets
# its own handlers while it serves (runtime/daemon.py).

#: What a command has at stake, said after an interrupt ("nothing was written to OUT"): one
#: function per running command (convert adds one), emptied by each main().
_at_stake: list[Callable[[], str]] = []


@contextlib.contextmanager
def _interrupts(caught: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (Note [interrupts]); the one
    that fired first is appended to ``caught``."""
    old: dict[int, Any] = {}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)
        old.clear()

    def on_signal(signum: int, frame: Any) -> None:
        caught.append(signum)
        restore()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # only it may set handlers
        for s in (signal.SIGINT, signal.SIGTERM):
            h = signal.getsignal(s)
            if h is not None and h is not signal.SIG_IGN:
                old[s] = signal.signal(s, on_signal)
    try:
        yield
    finally:
        restore()


def _identity(path: Path) -> tuple[int, int] | None:
    """The device and inode of what ``path`` names, None if nothing (or nothing we can see)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _output_note(out: str) -> Callable[[], str]:
    """What happened to ``-o out`` when a convert is interrupted, found by comparing what it
    names before and after: a sidecar appears there only by the final rename (Note [atomic
    output]), so an unchanged OUT means the run left nothing behind."""
    path = Path(os.path.expanduser(out))  # Path's raises for ~nosuchuser; output_path says so
    before = _identity(path)

    def note() -> str:
        if _identity(path) != before:
            return f"the sidecar at {out} was finished before the signal came"
        return f"nothing was written to {out}" if before is None else f"{out} was left as it was"

    return note


def _interrupted(signum: int) -> Interrupted:
    name = signal.Signals(signum).name
    notes = [f() for f in _at_stake]
    return Interrupted(signum, "; ".join([f"interrupted ({name})", *notes]))


# --- the entry point ------------------------------------------------------------------------


def _run(args: list[str], *, as_json: bool, debug: bool) -> int:
    """Run the command ``args``; return its exit code, its error (if any) printed. Library
    errors name its options as flags (:data:`FLAGS`, Note [API wording] in mpack/errors.py)."""
    try:
        with worded(FLAGS):
            result = app(args=args, prog_name="mpack", standalone_mode=False)
        return result if isinstance(result, int) else 0  # --help and --version return 0
    except _click_error("NoArgsIsHelpError") as e:
        _say(sys.stderr, e.ctx.get_help() if e.ctx is not None else "")  # type: ignore[attr-defined]
        return 2
    except _click_error("Exit") as e:
        return e.exit_code  # type: ignore[attr-defined]
    except _click_error("Abort"):  # click < typer's own: KeyboardInterrupt, as typer's Exit(130)
        return 130
    except _click_error("UsageError") as e:
        _print_error(_usage_error(e), 2, as_json=as_json)
        return 2
    except Exception as e:  # noqa: BLE001 - the one place that maps every error
        if debug:
            import traceback

            traceback.print_exc()
        err = as_mpack_error(e)
        code = exit_code_for(err)
        _print_error(err, code, as_json=as_json)
        return code


def _flush_at_exit() -> None:
    """Flush stdout and stderr now; one whose reader went away is silenced, so that Python's
    own flush at exit neither prints "Exception ignored" nor exits 120 (Note [closed stdout])."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            from mpack.ui import silence

            silence(stream)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mpack`` console script; returns (and exits with) the exit code.

    Every failure is one message on stderr (``error: ...`` plus a ``hint:``), or with ``--json``
    one JSON document on stdout, and an exit code (:data:`EXIT_CODES`): 2 bad input or usage,
    3 environment, 1 bug, 130 / 143 interrupted by SIGINT / SIGTERM (Note [interrupts]). A
    closed stdout changes nothing (Note [closed stdout] in :mod:`mpack.ui`).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    debug = os.environ.get("MPACK_DEBUG") == "1"
    as_json = "--json" in args
    _at_stake.clear()
    caught: list[int] = []
    try:
        with _interrupts(caught):
            code = _run(args, as_json=as_json, debug=debug)
    except KeyboardInterrupt:  # one outside the command (typer turns those inside into 130)
        code = 130
    if caught or code == 130:
        interrupt = _interrupted(caught[0] if caught else signal.SIGINT)
        code = interrupt.exit_code
        _print_error(interrupt, code, as_json=as_json)
    _flush_at_exit()
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
