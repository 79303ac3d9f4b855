"""The one output sink: rich tables and progress for people, one JSON document for CI, or nothing.

Library code never prints; it returns results (or calls a progress callback), and the CLI hands
them to the functions here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mpack import arch, target
from mpack.env import progress_every
from mpack.errors import shown
from mpack.periodic import Periodic

#: How much of a sentence that may quote a manifest's strings is shown (:func:`emit_verify`).
NOTE_LIMIT = 2000
#: How much of a path from a manifest or a peer is shown (PATH_MAX on Linux).
PATH_LIMIT = 4096
#: Width of output that goes to a pipe or a file: wide enough that no digest or path is broken
#: across lines (a table still takes only the width its cells need).
PIPE_WIDTH = 4096


# Note [closed stdout]: ``mpack inspect SC | head -1`` closes the pipe while mpack still
# writes. That is the reader's choice, not a failure of the command: the rest of the output is
# dropped, the command finishes its work (a sidecar is never left half-written because of it)
# and exits with the status it would have had anyway (0 when the work succeeded), so a CI job
# under ``set -o pipefail`` does not fail on ``| head``. With the descriptor on /dev/null, the
# later writes, and Python's flush of the stream at exit, succeed: no "Exception ignored"
# message, no exit status 120.
def silence(stream: Any) -> None:
    """Point ``stream``'s descriptor at /dev/null: its reader went away (EPIPE) or it failed
    (Note [closed stdout])."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)


class _Console(Console):
    """A rich console whose stream may be closed by its reader (Note [closed stdout])."""

    def on_broken_pipe(self) -> None:
        # rich's own exits with status 1, and points stdout (whichever stream broke) at /dev/null
        self.quiet = True
        silence(self.file)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        try:
            super().print(*objects, **kwargs)
        except BrokenPipeError:  # rich < 13.8 has no on_broken_pipe and lets it through
            self.on_broken_pipe()


def _console(stderr: bool) -> Console:
    """markup=False: paths, layer and tensor names are data, printed as they are ("out[/]x" or
    "[red]" in a path must neither crash nor vanish); colour comes only from explicit styles.
    Not on a terminal: no wrapping at 80 columns (``PIPE_WIDTH``), no colour codes."""
    c = _Console(stderr=stderr, markup=False)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c.width = PIPE_WIDTH
    return c


console = _console(stderr=False)
err_console = _console(stderr=True)
_verbose = False
_quiet = False


def set_quiet(quiet: bool) -> None:
    """``-q``: nothing but errors for the rest of the command (Note [CLI habits] in
    mpack/cli.py): both consoles silent, :func:`write_line` drops what goes to stdout and
    stderr, and no progress display starts. Errors are printed by the CLI itself, not here;
    the daemon's log (:func:`write_line_direct`) is the daemon's to level."""
    global _quiet
    _quiet = quiet
    console.quiet = err_console.quiet = quiet


def set_verbose(verbose: bool) -> None:
    """``mpack -v``: let other libraries log and draw progress bars. Without it, transformers,
    compressed-tensors and the Hub are kept quiet (their progress bars and advisory logs would
    bury mpack's own output, ``--json`` included). Call before those libraries are imported."""
    global _verbose
    _verbose = verbose
    if verbose:
        # mpack's debug log (``logging.getLogger("mpack.<module>")``), one line each on stderr:
        # what the library chose to skip and why (a cache entry it does not trust, ...).
        import logging

        log = logging.getLogger("mpack")
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("mpack: %(message)s"))
            log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        return
    for key, value in (
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(key, value)


def quiet_libraries() -> None:
    """No progress bars and no info logs from other libraries for the rest of this process
    (unless ``-v``): for work that loads models with transformers (``verify --forward``)."""
    if _verbose:
        return
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(ImportError):
        import tqdm.std  # every tqdm bar, whatever ``disable=`` its caller passes

        if not getattr(tqdm.std.tqdm.__init__, "_mpack_quiet", False):
            shown = tqdm.std.tqdm.__init__

            def hidden(self: Any, *args: Any, **kwargs: Any) -> None:
                kwargs["disable"] = True
                shown(self, *args, **kwargs)

            hidden._mpack_quiet = True  # type: ignore[attr-defined]
            tqdm.std.tqdm.__init__ = hidden
    for name in ("transformers", "compressed_tensors", "huggingface_hub", "accelerate", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module="mpack")
    with contextlib.suppress(ImportError):
        from loguru import logger  # compressed-tensors logs through loguru

        logger.disable("compressed_tensors")


def _styled(word: str, style: str, rest: str = "") -> Text:
    """``word`` in ``style``, then ``rest`` as plain text."""
    return Text.assemble((word, style), rest)


#: Decimal places of a time in a JSON document: a millisecond (``0.004``, not ``0.00412317``).
TIME_DECIMALS = 3
#: Significant digits of any other float in a JSON document (a logit difference, a ratio).
FLOAT_DIGITS = 6


def plain_floats(value: Any, timing: bool = False) -> Any:
    """``value`` with its floats as a document shows them: a time (under a key ``seconds``,
    ``*_s`` or ``*_seconds``) to :data:`TIME_DECIMALS` places, any other to
    :data:`FLOAT_DIGITS` significant digits; no float noise in any ``--json`` output."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return value
        return round(value, TIME_DECIMALS) if timing else float(f"{value:.{FLOAT_DIGITS}g}")
    if isinstance(value, dict):
        return {
            k: plain_floats(
                v,
                timing
                or (isinstance(k, str) and (k == "seconds" or k.endswith(("_s", "_seconds")))),
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [plain_floats(v, timing) for v in value]
    return value


def one_name(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the manifest digest under its one ``--json`` name, ``manifest_digest``
    (Note [CLI habits] in mpack/cli.py): the daemon's status reply and events call it ``digest``,
    as the protocol and the READY line do."""
    return {("manifest_digest" if k == "digest" else k): v for k, v in doc.items()}


def print_json(doc: Any) -> None:
    """Exactly one JSON document on stdout (for ``--json``); none once its reader went away
    (Note [closed stdout]). Every command's document is an object with a top-level ``ok``
    (Note [CLI habits] in mpack/cli.py); its floats are rounded here, once
    (:func:`plain_floats`)."""
    write_line(sys.stdout, json.dumps(plain_floats(doc), indent=2, sort_keys=True))


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def emit_layout(*, n: int, k: int, np_: int, kp: int, act_dtype: str, as_json: bool) -> None:
    from mpack.sidecar import TensorSpec

    doc: dict[str, Any] = {
        "ok": True,
        "N": n,
        "K": k,
        "Np": np_,
        "Kp": kp,
        "padded": (np_, kp) != (n, k),
    }
    for name, st, shape in target.packed_specs("", np_, kp, act_dtype, bias=True):
        dtype = "int32" if st == "I32" else act_dtype
        nbytes = TensorSpec(name, st, shape).nbytes
        doc[name.lstrip(".")] = {"dtype": dtype, "shape": list(shape), "bytes": nbytes}
    if as_json:
        print_json(doc)
        return
    t = Table(title=f"Marlin FP8 layout of a [N={n}, K={k}] fp8 layer")
    for col in ("tensor", "dtype", "shape", "bytes"):
        t.add_column(col)
    for name in ("weight", "weight_scale", "bias"):
        d = doc[name]
        t.add_row(name, d["dtype"], str(d["shape"]), human_bytes(d["bytes"]))
    console.print(t)
    pad = f"padded to Np={np_}, Kp={kp}" if doc["padded"] else "no padding needed"
    console.print(f"{pad}; bias only if the checkpoint has one")


class _Progress:
    """A rich progress display fed by the pipeline's ``progress(stage, done, total)`` callback.

    Three rows: what happens before the first byte is written (reading headers, validating
    every layer, hashing the source: seconds on a large model), bytes written (with speed and
    ETA) and layers done.
    """

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        self.display = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:13}"),
            BarColumn(),
            TextColumn("{task.fields[detail]:>22}"),
            TextColumn("{task.fields[rate]:>12}"),
            TimeRemainingColumn(),
            console=err_console,
        )
        self._prep = self.display.add_task(
            "preparing", total=None, detail="headers, validation", rate=""
        )
        self._tasks: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self._tasks:
            if self._prep is not None:
                self.display.update(self._prep, total=1, completed=1, detail="done")
                self._prep = None
            label = "writing" if stage == "bytes" else "linear layers"
            self._tasks[stage] = self.display.add_task(label, total=total, detail="", rate="")
        rate = ""
        if stage == "bytes":
            detail = f"{human_bytes(done)} / {human_bytes(total)}"
            rate = f"{human_bytes(int(done / max(time.perf_counter() - self._t0, 1e-6)))}/s"
        else:
            detail = f"{done} / {total}"
        self.display.update(
            self._tasks[stage], completed=done, total=total, detail=detail, rate=rate
        )


class _LogProgress(Periodic):
    """Progress for a log (stderr is not a terminal: CI): one plain line when the run starts and
    one every ``every`` seconds after, with bytes, rate, ETA and layers; never a bar."""

    FIRST_LINE_S = 1.0

    def __init__(self, every: float) -> None:
        super().__init__(every, self.FIRST_LINE_S, name="mpack-progress")
        self.state: dict[str, tuple[int, int]] = {}
        self._t0 = time.perf_counter()
        self._first: float | None = None  # when the first byte was reported
        self._last = 0.0  # when the latest byte count was reported
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            if stage == "bytes":
                self._last = time.perf_counter()
                if self._first is None:
                    self._first = self._last
            self.state[stage] = (done, total)

    def line(self) -> str:
        with self._lock:
            state, first, last = dict(self.state), self._first, self._last
        now = time.perf_counter()
        if "bytes" not in state:
            return f"convert: preparing: headers, validation ({now - self._t0:.0f} s)"
        done, total = state["bytes"]
        if done >= total:
            return (
                f"convert: {human_bytes(total)} written; finishing: fsync, source digests, "
                f"manifest ({now - last:.0f} s)"
            )
        span = last - (first if first is not None else last)  # writing, so far
        rate = done / span if span > 0 else 0.0
        speed = f"{human_bytes(int(rate))}/s, ETA {(total - done) / rate:.0f} s" if rate else "-"
        out = (
            f"convert: {human_bytes(done)} / {human_bytes(total)} "
            f"({100 * done / max(total, 1):.0f}%), {speed}"
        )
        if "layers" in state:
            out += f", {state['layers'][0]} / {state['layers'][1]} linear layers"
        return out

    def tick(self) -> None:
        # the first line after FIRST_LINE_S (a run refused at once prints only its error)
        write_line(sys.stderr, self.line())  # a reader that went away is not an error


@contextlib.contextmanager
def convert_progress(enabled: bool):
    """Yield a progress callback: a live display on a terminal, plain periodic lines otherwise
    (every ``$MPACK_PROGRESS_EVERY`` seconds: :func:`mpack.env.progress_every`), or ``None`` when
    disabled.

    Raises:
        UsageError: a ``$MPACK_PROGRESS_EVERY`` outside :data:`mpack.env.PROGRESS_EVERY_RANGE`, or
            not a number (:func:`mpack.env.progress_every`).
    """
    if not enabled or _quiet:
        yield None
        return
    if not err_console.is_terminal:
        with _LogProgress(progress_every()) as lp:
            yield lp
        return
    p = _Progress()
    with p.display:
        yield p


class _BytesLog(Periodic):
    """:func:`bytes_progress` for a log: ``<command>: <label> <done> / <total> (<pct>%)`` after
    the first second and every ``every`` seconds after, then once at the end of each stage."""

    def __init__(self, command: str, labels: dict[str, str], every: float) -> None:
        super().__init__(every, _LogProgress.FIRST_LINE_S, name="mpack-progress")
        self.command, self.labels = command, labels
        self.state: tuple[str, int, int] | None = None
        self._shown: tuple[str, int, int] | None = None
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            self.state = (stage, done, total)
        if done >= total:
            self._write()

    def _write(self) -> None:
        with self._lock:
            state = self.state
            if state is None or state == self._shown:
                return
            self._shown = state
        stage, done, total = state
        write_line(
            sys.stderr,
            f"{self.command}: {self.labels.get(stage, stage)} {human_bytes(done)} / "
            f"{human_bytes(total)} ({100 * done / max(total, 1):.0f}%)",
        )

    def tick(self) -> None:
        self._write()


@contextlib.contextmanager
def bytes_progress(enabled: bool, command: str, labels: dict[str, str]):
    """Yield a ``progress(stage, done, total)`` callback over bytes for work other than a
    conversion (``mpack push``'s checks): a rich bar per stage on a terminal, plain lines in a
    log as :func:`convert_progress` writes them, ``None`` when disabled (``--json``,
    ``--quiet``). ``labels``: what each stage is called (``{"check": "checking"}``)."""
    if not enabled or _quiet:
        yield None
        return
    if not err_console.is_terminal:
        with _BytesLog(command, labels, progress_every()) as log:
            yield log
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    display = Progress(
        TextColumn("{task.description:13}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=False,
    )
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = display.add_task(labels.get(stage, stage), total=total)
        display.update(tasks[stage], completed=done, total=total)

    with display:
        yield update


#: What ``mpack verify``'s progress calls its stages (:data:`mpack.verify.check.Progress`).
VERIFY_STAGES = {"files": "checksums", "bytes": "comparing"}


class _Deferred:
    """A progress callback whose display starts at its first call, from whichever thread makes
    it: verify forks its scheme check (Note [scheme check in a child] in
    convert/scheme_check.py) before the pass that reports progress, and no thread may run in
    the parent before that fork. Stages outside ``stages`` are dropped."""

    def __init__(self, start: Any, stages: dict[str, str]) -> None:
        self._start, self._stages = start, stages
        self._lock = threading.Lock()
        self._cm: Any = None
        self._callback: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self._stages:
            return
        with self._lock:
            if self._cm is None:
                self._cm = self._start()
                self._callback = self._cm.__enter__()
        if self._callback is not None:
            self._callback(stage, done, total)

    def close(self) -> None:
        with self._lock:
            if self._cm is not None:
                self._cm.__exit__(None, None, None)


@contextlib.contextmanager
def verify_progress(enabled: bool):
    """Yield ``mpack verify``'s progress callback: its checksums and its comparison with the
    re-derived bytes, shown as :func:`bytes_progress` shows a push's checks (a bar on a
    terminal, ``verify: comparing ...`` lines in a log), from the first byte on; ``None`` when
    disabled (``--json``, ``-q``).

    Raises:
        UsageError: a bad ``$MPACK_PROGRESS_EVERY``, now rather than on a worker thread.
    """
    if not enabled or _quiet:
        yield None
        return
    if not err_console.is_terminal:
        progress_every()  # checked now, not on the thread that starts the display
    deferred = _Deferred(lambda: bytes_progress(True, "verify", VERIFY_STAGES), VERIFY_STAGES)
    try:
        yield deferred
    finally:
        deferred.close()


def decoder_layers(m: dict[str, Any]) -> int | None:
    """The model's decoder layers, as its config records them (None if it does not)."""
    n = (m.get("model", {}).get("config") or {}).get("num_hidden_layers")
    return n if isinstance(n, int) else None


def layer_count(m: dict[str, Any]) -> str:
    """``"64 linear layers (16 decoder layers)"``: what a sidecar's ``layers`` counts, said."""
    n, d = len(m["layers"]), decoder_layers(m)
    return f"{n} linear layers" + (f" ({d} decoder layers)" if d is not None else "")


def convert_doc(result: Any) -> dict[str, Any]:
    """``mpack convert --json``'s document for one target (a ``ConvertResult``)."""
    m = result.manifest
    files = {f["name"]: f["size"] for f in m["files"]}
    return {
        "out": str(result.out),
        "up_to_date": result.up_to_date,
        "manifest_digest": result.digest,
        "target": m["target"],
        "source": {k: v for k, v in m["source"].items() if k != "files"},
        "files": files,
        "bytes": sum(files.values()),
        "seconds": dict(result.seconds),  # rounded by print_json, as every time
        "layers": len(m["layers"]),  # linear layers (per rank), as before
        "linear_layers": len(m["layers"]),
        "decoder_layers": decoder_layers(m),
        "backend": result.backend or None,  # None: up to date, nothing converted
    }


def emit_convert(result: Any, *, as_json: bool, quiet: bool) -> None:
    m = result.manifest
    files = {f["name"]: f["size"] for f in m["files"]}
    if as_json:
        print_json({"ok": True, **convert_doc(result)})
        return
    if quiet:
        return
    if result.up_to_date:
        console.print(
            _styled(
                "up to date",
                "green",
                f": {shown(str(result.out), PATH_LIMIT)} already holds this sidecar (use --force "
                "to redo it)",
            )
        )
        return
    t = m["target"]
    console.print(
        _styled(
            "wrote",
            "green",
            f" {shown(str(result.out), PATH_LIMIT)}: {layer_count(m)} x {t['tp_size']} rank(s), "
            f"{human_bytes(sum(files.values()))} in {result.seconds.get('total', 0):.2f} s "
            f"({t['profile']}, {t['act_dtype']}, fusion {t['fusion']})",
        )
    )
    console.print(f"manifest digest {result.digest}")


def emit_convert_many(result: Any, *, as_json: bool, quiet: bool) -> None:
    """A run into a directory of sidecars (:class:`mpack.convert.pipeline.MultiConvertResult`):
    under ``--json`` one document, ``targets`` holding each target as a single run reports it
    (plus its ``name`` and ``bytes_written``), ``skipped``, and ``kept`` (the targets already
    there that the run did not make, left as they are); else a line per target."""
    if as_json:
        targets = [
            {"name": r.out.name, **convert_doc(r), "bytes_written": r.bytes_written}
            for r in result.results
        ]
        print_json(
            {
                "ok": True,
                "out": str(result.out),
                "up_to_date": result.up_to_date,
                "targets": targets,
                "skipped": [{"name": n, "reason": why} for n, why in result.skipped],
                "kept": list(result.kept),
            }
        )
        return
    if quiet:
        return
    for r in result.results:
        emit_convert(r, as_json=False, quiet=False)
    for name, why in result.skipped:
        console.print(_styled("skipped", "yellow", f" {shown(name)}: {shown(why, NOTE_LIMIT)}"))
    for name in result.kept:
        console.print(
            _styled(
                "kept",
                "yellow",
                f" {shown(name)}: already in {shown(str(result.out), PATH_LIMIT)}, not made by "
                "this run; left as it is (remove it yourself if it is stale)",
            )
        )


def emit_targets(root: Any, found: list[Any], *, as_json: bool) -> None:
    """``mpack inspect`` of a directory of sidecars (Note [target layout] in
    mpack/target_dirs.py): one line per target (``found``: :class:`mpack.target_dirs.TargetDir`);
    ``--json``: ``sidecar`` (the directory) and ``targets``, each with its ``name``, ``path``,
    ``target``, ``manifest_digest``, ``files`` and ``bytes``."""
    rows = []
    for t in found:
        files = (t.manifest or {}).get("files") or []
        rows.append(
            {
                "name": t.name,
                "path": str(t.path),
                "target": dict(t.target),
                "manifest_digest": t.digest,
                "files": len(files),
                "bytes": sum(f["size"] for f in files),
            }
        )
    if as_json:
        print_json({"ok": True, "sidecar": str(root), "targets": rows})
        return
    console.print(
        _styled(
            shown(str(root), PATH_LIMIT),
            "bold",
            f"  a directory of {len(found)} sidecar target(s), OUT/<target>/",
        )
    )
    tt = Table()
    for col in ("folder", "tp", "profile", "act dtype", "fusion", "files", "size", "digest"):
        tt.add_column(col)
    for t, row in zip(found, rows, strict=True):
        x = t.target
        ep = " ep" if x.get(target.EXPERT_PARALLEL) else ""
        tt.add_row(
            shown(t.name),
            f"{x.get('tp_size', '?')}{ep}",
            shown(x.get("profile", "?")),
            shown(x.get("act_dtype", "?")),
            shown(x.get("fusion", "?")),
            str(row["files"]),
            human_bytes(row["bytes"]),
            (t.digest or "")[:16],
        )
    console.print(tt)
    console.print(
        "one target in full: mpack inspect DIR --tp N [--profile P --act-dtype D --ep on|off], "
        "or mpack inspect DIR/<folder>"
    )


def file_digest_cells(f: dict[str, Any]) -> tuple[str, str]:
    """The ``sha256`` and ``chunk digests`` cells of a files entry. A file of one chunk has
    that chunk's digest as its whole-file sha256; chunks are counted with their real sizes."""
    ch = f.get("chunks") or {}
    digests, size = ch.get("sha256") or [], f["size"]
    whole = f.get("sha256") or (digests[0] if len(digests) == 1 else None)
    sha = whole[:16] + "..." if whole else f"per chunk ({len(digests)})"
    if not digests:
        return sha, "-"
    if len(digests) == 1:
        return sha, f"1 x {human_bytes(size)}"
    last = size - (len(digests) - 1) * ch["bytes"]
    tail = f" + 1 x {human_bytes(last)}" if last != ch["bytes"] else ""
    full = len(digests) - (1 if tail else 0)
    return sha, f"{full} x {human_bytes(ch['bytes'])}{tail}"


def model_parts(m: dict[str, Any], common: list[str] | None) -> dict[str, dict[str, Any]] | None:
    """A multimodal wrapper's sidecar (:data:`mpack.arch.WRAPPERS`), part by part (language
    model, vision tower, projector): its Marlin layers and, when ``common`` (the tensor names of
    ``common.safetensors``) is known, its pass-through tensors; None for any other model."""
    model = m.get("model") or {}
    text = model.get("text_architecture")
    lay = arch.layout_of(model.get("architecture"), text if isinstance(text, str) else None)
    if lay.wrapper is None:
        return None
    names = dict.fromkeys(p for _, p in lay.wrapper.parts)
    parts: dict[str, dict[str, Any]] = {p: {"marlin_layers": 0} for p in names}
    for name in m["layers"]:
        parts[lay.part_of(name)]["marlin_layers"] += 1
    for name in common if common is not None else ():
        part = parts[lay.part_of(lay.vllm_name(name))]
        part["passthrough_tensors"] = part.get("passthrough_tensors", 0) + 1
    return parts


def emit_inspect(
    sidecar: Any,
    m: dict[str, Any],
    digest: str,
    *,
    as_json: bool,
    common: list[str] | None = None,
) -> None:
    """The manifest for people. Every string the manifest holds is shown through
    :func:`mpack.errors.shown` (Note [quoting untrusted text]): escaped, capped; ``--json``
    prints it as it is (JSON escapes control characters itself). A multimodal wrapper's
    sidecar also gets its parts (:func:`model_parts`; ``common``: the tensor names of its
    ``common.safetensors`` where it is at hand)."""
    parts = model_parts(m, common)
    if as_json:
        extra = {"parts": parts} if parts is not None else {}
        doc = {"sidecar": str(sidecar), "manifest_digest": digest, **m, **extra}
        print_json({"ok": True, **doc})
        return
    t, src = m["target"], m["source"]
    origin = (
        f"{shown(src.get('repo'))} @ {shown(src.get('revision'))}"
        if src.get("kind") == "hub"
        else shown(src.get("path"), PATH_LIMIT)
    )
    console.print(
        _styled(
            shown(str(sidecar), PATH_LIMIT),  # a path may hold ESC: Note [quoting untrusted text]
            "bold",
            f"  format {m['format']} v{m['format_version']}, {shown(m.get('created_by', ''))}",
        )
    )
    console.print(
        f"target: {t['kernel']} for {shown(t['engine'])} {shown(t['engine_version'])}, "
        f"profile {t['profile']}, {t['act_dtype']}, tp {t['tp_size']}, fusion {t['fusion']}"
        + (", expert parallel (whole experts per rank)" if t.get(target.EXPERT_PARALLEL) else "")
    )
    console.print(f"source: {origin} ({len(src.get('files', []))} files)")
    console.print(f"manifest digest: {digest}")
    if parts is not None:
        model = m["model"]
        console.print(
            f"model: {shown(model.get('architecture'))}, language model "
            f"{shown(model.get('text_architecture'))}"
        )
        for part, n in parts.items():
            tensors = n.get("passthrough_tensors")
            kept = "" if common is None else f", {tensors or 0} pass-through tensors"
            console.print(f"  {part}: {n['marlin_layers']} Marlin linear layers{kept}")
    ft = Table(title="files")
    for col in ("file", "size", "sha256", "chunk digests"):
        ft.add_column(col)
    for f in m["files"]:
        sha, chunks = file_digest_cells(f)
        ft.add_row(shown(f["name"]), human_bytes(f["size"]), sha, chunks)
    console.print(ft)
    lt = Table(title=f"{layer_count(m)}, per rank; {t['tp_size']} rank(s)")
    per_rank = "experts per rank" if t.get(target.EXPERT_PARALLEL) else "experts"
    for col in ("layer", "N x K", "padded", "strategy", "parallel", "bias", per_rank):
        lt.add_column(col)
    for name, ly in sorted(m["layers"].items(), key=_layer_order):
        # check_manifest checks the dims and bias; the rest is shown as it is, escaped
        lt.add_row(
            shown(name),
            f"{ly['n']} x {ly['k']}",
            f"{ly['np']} x {ly['kp']}",
            shown(ly.get("strategy", "?")) + (" requant" if ly.get("requantized") else ""),
            shown(ly.get("parallel", "?")),
            "yes" if ly["bias"] else "",
            str(ly["experts"]) if "experts" in ly else "",
        )
    console.print(lt)


def _layer_order(item: tuple[str, dict[str, Any]]) -> tuple[int, int, str]:
    """Layers by ``index`` (an entry without an integer one last, by name)."""
    name, ly = item
    index = ly.get("index")
    return (0, index, name) if type(index) is int else (1, 0, name)


def verify_doc(result: Any) -> dict[str, Any]:
    """``mpack verify --json``'s document for a :class:`mpack.verify.Verification`: ``ok``, its
    :meth:`~mpack.verify.Verification.report` and the seconds of each phase."""
    return {"ok": result.ok, **result.report(), "seconds": dict(result.seconds)}


def verify_many_doc(root: Any, results: list[Any]) -> dict[str, Any]:
    """``mpack verify --json``'s document for a directory of sidecars: ``ok``, ``sidecar`` (the
    directory) and ``targets``, each as :func:`verify_doc` with its folder's ``name``."""
    docs = [{"name": os.path.basename(r.sidecar), **verify_doc(r)} for r in results]
    return {"ok": all(d["ok"] for d in docs), "sidecar": str(root), "targets": docs}


def emit_verify_many(root: Any, results: list[Any], *, as_json: bool) -> None:
    """``mpack verify`` of a directory of sidecars, every target passed: ``--json`` one
    document, ``sidecar`` (the directory), ``ok`` and ``targets`` (each as :func:`verify_doc`,
    with its folder's ``name``); else each target's lines."""
    if as_json:
        print_json(verify_many_doc(root, results))
        return
    for r in results:
        emit_verify(r, as_json=False)


def emit_verify(result: Any, *, as_json: bool) -> None:
    """A :class:`mpack.verify.Verification` without problems (its error, if the model outputs
    differ, is raised after: the table says where)."""
    if as_json:
        print_json(verify_doc(result))
        return
    report = result.report()
    fwd = report.get("forward")
    console.print(
        _styled(
            "ok",
            "green",
            f": {shown(str(report['sidecar']), PATH_LIMIT)}: {report['files_checked']} files "
            "match the manifest "
            f"(digest {result.digest[:16]}...)",
        )
    )
    if report["source_checked"]:
        console.print(
            _styled(
                "ok",
                "green",
                f": {report['tensors_compared']} tensors re-derived from {shown(report['source'])} "
                f"(on {report.get('rederive_device', 'cpu')}) are byte-identical; "
                f"{report['layers_checked']} layers unpack to the source bytes",
            )
        )
    else:
        # the note says why and what to do; "source not checked" is said here, once
        # the note may quote the manifest's source path or repo: escaped, capped
        note = report.get("source_note") or "no --source, and the manifest records no local path"
        console.print("source not checked: " + shown(note, NOTE_LIMIT))
    if fwd:
        t = Table(
            title=f"forward: sidecar vs transformers reference ({fwd['device']}, tp {fwd['tp']})"
        )
        for col in (
            "compute",
            "greedy tokens",
            "max |logit diff|",
            "tolerance",
            "decisive steps agree",
        ):
            t.add_column(col)
        for r in fwd["runs"]:
            same = "identical" if r["tokens_identical"] else "differ"
            t.add_row(
                r["dtype"],
                same,
                f"{r['max_logit_diff']:.3g}",
                f"{r['tolerance']:.3g}",
                f"{r['decisive_steps_agree']} ({r['decisive_steps']})",
            )
        console.print(t)
        first = fwd["runs"][0]
        console.print(f"greedy next tokens (reference): {[row[:8] for row in first['ref_tokens']]}")
        console.print(
            _styled("ok", "green", ": model outputs match")
            if fwd["ok"]
            else _styled("outputs differ", "red")
        )


# --- mpack serve / mpack status (runtime) ------------------------------------------------------


def emit_ready(info: dict[str, Any]) -> None:
    """The one ``READY key=value ...`` line ``mpack serve`` prints on stdout when it serves
    (its format: :func:`mpack.runtime.spawn.format_ready`)."""
    from mpack.runtime.spawn import format_ready

    write_line(sys.stdout, format_ready(info))


def write_line(stream: Any, line: str) -> None:
    """Write and flush one line of output (a JSON document, the daemon's log, convert's
    progress); never raises. A write that fails (the pipe's reader went away: EPIPE; a full
    disk) drops the line and silences the stream (:func:`silence`): later lines are dropped too,
    and the flush at interpreter exit cannot turn a clean stop into an error (Python exits 120
    when it fails). Under ``-q`` (:func:`set_quiet`), a line for stdout or stderr is dropped."""
    if stream is None or (_quiet and stream in (sys.stdout, sys.stderr)):
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        silence(stream)


def write_line_direct(stream: Any, line: str) -> None:
    """:func:`write_line`, but straight to the stream's descriptor, past its buffer and the
    buffer's lock: the daemon's log thread may block in ``write(2)`` for good (a stalled reader),
    and the interpreter's exit must not wait for that lock (Note [logging never blocks serving]
    in runtime/daemon.py). A stream without a descriptor (a test's capture) gets ``write_line``."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        write_line(stream, line)
        return
    data = (line + "\n").encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        silence(stream)


#: ``mpack serve --log-format``: the daemon's log lines on stderr.
LOG_FORMATS = ("text", "json")


def rfc3339(ts: float) -> str:
    """``ts`` (seconds since the epoch) as an RFC 3339 UTC time to the millisecond:
    ``2026-12-05T12:00:00.123Z``."""
    import datetime

    when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_doc(event: dict[str, Any]) -> dict[str, Any]:
    """A daemon event (Note [the daemon's events] in runtime/daemon.py) as the JSON object of
    ``--log-format json`` and ``serve --json``: ``ts`` (RFC 3339, UTC), ``level``, ``event``,
    ``ok`` (true: every ``--json`` document has it; a failure that stops the daemon is the error
    document, ``ok`` false), then its fields, as every ``--json`` document names and rounds them
    (``manifest_digest``, floats without noise); a string from a peer capped at ``NOTE_LIMIT``
    characters (``json`` escapes what it holds)."""
    from mpack.runtime.daemon import level_of

    rest = {
        k: v[:NOTE_LIMIT] if isinstance(v, str) else v
        for k, v in event.items()
        if k not in ("event", "ts")
    }
    when = event.get("ts")
    return {
        "ts": rfc3339(when if isinstance(when, (int, float)) else time.time()),
        "level": level_of(event),
        "event": str(event.get("event")),
        "ok": True,  # the daemon runs; a failure that stops it is the error document
        **plain_floats(one_name(rest)),
    }


def event_line(event: dict[str, Any], log_format: str = "text") -> str:
    """One log line for a daemon event: ``<RFC 3339 UTC time> <LEVEL> mpack serve: <event>
    key=value ...`` (a value may hold what a peer sent: escaped and capped, Note [quoting
    untrusted text]), or with ``log_format="json"`` its :func:`event_doc` on one line."""
    doc = event_doc(event)
    if log_format == "json":
        return json.dumps(doc, separators=(",", ":"), default=str)
    pairs = ((k, v) for k, v in doc.items() if k not in ("ts", "level", "event", "ok"))
    rest = " ".join(f"{k}={shown(str(v), NOTE_LIMIT)}" for k, v in _flat(pairs))
    return f"{doc['ts']} {doc['level']} mpack serve: {shown(doc['event'])} {rest}".rstrip()


def _flat(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A nested mapping's entries as dotted keys (``startup.fill_s=0.91``), for text lines."""
    for k, v in pairs:
        if isinstance(v, dict):
            yield from _flat((f"{k}.{kk}", vv) for kk, vv in v.items())
        else:
            yield k, v


def emit_event(event: dict[str, Any], log_format: str = "text") -> None:
    """One log line on stderr per daemon event (:func:`event_line`)."""
    write_line_direct(sys.stderr, event_line(event, log_format))


class ServeOutput:
    """What ``mpack serve`` prints: the log on stderr (``log_format``: ``text`` or ``json``, one
    line per event) and on stdout either the one READY line (:func:`emit_ready`) or, with
    ``json_events`` (``serve --json``), every event as one JSON line (:func:`event_doc`), the
    ``ready`` one carrying the READY line's fields. ``ready`` and ``event`` are the daemon's
    ``on_ready`` and ``on_event``."""

    def __init__(self, *, log_format: str = "text", json_events: bool = False) -> None:
        self.log_format, self.json_events = log_format, json_events

    def ready(self, info: dict[str, Any]) -> None:
        if not self.json_events:  # under --json the ``ready`` event says it
            emit_ready(info)

    def event(self, event: dict[str, Any]) -> None:
        emit_event(event, self.log_format)
        if self.json_events:
            line = json.dumps(event_doc(event), separators=(",", ":"), default=str)
            write_line_direct(sys.stdout, line)


def _uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def emit_status(docs: list[dict[str, Any]], *, as_json: bool) -> None:
    """``mpack status``: a table of the daemons, then the sockets where none answers as one
    should; ``--json``: ``{"ok": true, "daemons": [...]}``, each daemon's status document with
    the digest as ``manifest_digest`` (:func:`one_name`)."""
    if as_json:
        print_json({"ok": True, "daemons": [one_name(d) for d in docs]})
        return
    live = [d for d in docs if d.get("state") == "serving"]
    stale = [d for d in docs if d.get("state") != "serving"]
    if not live:
        console.print("no mpack daemon is serving")
    else:
        t = Table(title="mpack daemons")
        t.add_column("sidecar", overflow="fold")
        for col in ("rank", "stage", "device", "memory", "clients (pid)", "uptime", "daemon pid"):
            t.add_column(col)
        for d in live:
            pids = ", ".join(str(c["pid"]) for c in d["clients"]) or "-"
            uuid = _key_uuid(d["device"])
            dev = d["device_label"] + (f" ({uuid})" if uuid else "")
            t.add_row(
                shown(d["sidecar"], PATH_LIMIT),
                f"{d['rank']}/{d['tp_size']}",
                _stage_cell(d),
                shown(dev),
                human_bytes(d["bytes"]),
                f"{len(d['clients'])}: {pids}",
                _uptime(d["uptime_s"]),
                str(d["pid"]),
            )
        console.print(t)
    for d in stale:  # names from a directory listing and a peer's words: escaped
        sock = shown(d["socket"], PATH_LIMIT)
        if d.get("state") == "error":  # something answers there, not as a daemon should
            console.print(
                f"no usable answer at {sock}: {shown(d.get('reason', '?'), NOTE_LIMIT)}",
                markup=False,
                highlight=False,
            )
        elif d.get("pointer"):  # a daemon started with --socket left a pointer behind
            console.print(
                f"stale pointer {shown(d['pointer'], PATH_LIMIT)} to {sock}: "
                f"{shown(d.get('reason', 'no daemon'), NOTE_LIMIT)}"
            )
        else:
            console.print(f"stale socket (its daemon died): {sock}")


def _stage_cell(d: dict[str, Any]) -> str:
    """``P/N (layers a..b)`` of a daemon of pipeline stage P of N (``serve --pp-rank``); ``all``
    for a daemon of the whole rank."""
    size, layers = d.get("pp_size", 1), d.get("layers")
    if size == 1 or not isinstance(layers, list) or len(layers) != 2:
        return "all"
    held = f"layers {layers[0]}..{layers[1] - 1}" if layers[1] > layers[0] else "no layers"
    return f"{d.get('pp_rank')}/{size} ({held})"


def _key_uuid(key: str) -> str | None:
    """``GPU-<uuid>`` of a daemon's device key ``cuda:GPU-<uuid>`` (None for ``cpu`` or a key
    that is not one: a status line is shown whatever a daemon reports)."""
    from mpack.device import KEY, DeviceSpec
    from mpack.errors import UsageError

    try:
        return DeviceSpec.parse(key, KEY).uuid
    except UsageError:
        return None
