"""Every error mpack raises on purpose, and the one table that turns them into exit codes.

An ``MpackError`` carries a message that names the file, layer and value at fault, and a
``hint``: the next thing to do (often a command). The CLI prints both and exits with
``exit_code``: 2 for bad input or usage (the user can fix it), 3 for the environment (permission
denied, read-only file system, disk full: nothing wrong with the input or with mpack), 1 for an
internal error, 128 + the signal's number for a command stopped by SIGINT or SIGTERM (130, 143:
:class:`Interrupted`).
Anything that is *not* an ``MpackError`` is a bug in mpack and exits 1. Tracebacks are shown
only with ``MPACK_DEBUG=1``.

Subclasses also derive from the closest builtin, so library users can catch ``ValueError`` or
``FileNotFoundError`` as they are used to.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any


class MpackError(Exception):
    """Base class. ``exit_code`` 1 unless a subclass says the input is at fault."""

    exit_code = 1
    #: What the command had found when it failed (a verification's facts), for the one JSON
    #: document ``--json`` prints: the error document then holds them beside ``error``.
    facts: dict[str, Any] | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


# --- the user can fix these: exit code 2 -------------------------------------------------


class UsageError(MpackError, ValueError):
    """Options that contradict each other or are out of range."""

    exit_code = 2


class InputError(MpackError, ValueError):
    """A source checkpoint or sidecar that mpack must not (or cannot) use as it is."""

    exit_code = 2


class SourceNotFoundError(InputError, FileNotFoundError):
    """A directory, file, repo or revision that does not exist or cannot be reached."""


class UnsupportedSchemeError(InputError):
    """A quantization scheme, architecture or TP size outside what the Marlin FP8 path supports."""


class CorruptFileError(InputError):
    """A truncated or malformed safetensors/JSON file, or bytes that fail their checksum."""


class OutputExistsError(InputError, FileExistsError):
    """The output path holds something that is not the sidecar we would write."""


class FormatVersionError(InputError):
    """A sidecar written with a format version this mpack does not read."""


class VerificationError(InputError):
    """A sidecar whose bytes do not match its manifest or its source."""


class DaemonError(MpackError, ConnectionError):
    """No daemon where one was expected, one already running, or one that refused us."""

    exit_code = 2


class BusyError(InputError):
    """Another mpack process holds the lock on the same output (a convert to the same ``-o``)."""


class EnvironmentFailure(MpackError, OSError):
    """The machine refused an operation that the input asked for correctly: permission denied,
    read-only file system, disk full, too many open files. Exit code 3."""

    exit_code = 3


class Interrupted(MpackError):
    """SIGINT or SIGTERM stopped the command (Note [interrupts] in mpack/cli.py). Only the CLI
    makes one, to report it; ``exit_code`` is 128 + the signal's number, as a shell reports a
    process the signal killed: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signum: int, message: str, *, file: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
        self.file = file


class CudaError(MpackError, RuntimeError):
    """The CUDA driver or NVRTC refused a call: building, loading or launching a kernel, or
    allocating, exporting or mapping device memory (mpack/cudadrv.py)."""


class ProtocolError(DaemonError):
    """A peer that broke the serve/attach protocol (bad size, version, schema, descriptor).

    A ``DaemonError``: the peer's fault, not mpack's (exit 2), and what the vLLM loader's
    ``attach: auto`` falls back from like any other daemon that cannot serve us."""


class StageMismatchError(DaemonError):
    """A daemon that serves another pipeline stage, or another split of the decoder layers,
    than the one asked for (Note [the daemon of a stage] in runtime/protocol.py). Not a daemon
    that is missing: the vLLM loader's ``attach: auto`` refuses it rather than loading
    privately."""


# Note [API wording]: an error raised by the library names its arguments as the Python API
# takes them (``device='cuda:9': no CUDA device here``, hint ``use device='cpu'``); the same
# error under the command line names the flags (``--device cuda:9``, ``use --device cpu``). A
# message builds each such name with :func:`arg`; the CLI sets, around each command, how its
# options are spelt (:func:`worded`, from ``FLAGS`` in mpack/cli.py), and the text comes out
# in the user's own words either way. The wording is process-wide, not per thread: errors are
# raised on worker threads (hashing, the pass) and in a forked child (the scheme check), and
# each must speak as the command that started it. A whole command line in a hint (``mpack
# convert SRC -o OUT --force``) is a command to run, and stays one.
_NO_VALUE = object()
#: argument name -> its words on the command line (:func:`arg`); None: the API's.
_wording: dict[str, Any] | None = None


def arg(name: str, value: object = _NO_VALUE) -> str:
    """Argument ``name`` (given ``value``), as the running interface spells it (Note [API
    wording]): ``device`` / ``device='cuda:9'`` from Python, ``--device`` / ``--device cuda:9``
    under ``mpack``. A name the command line has no words for keeps the API's."""
    words = _wording.get(name) if _wording else None
    if words is not None:
        return words(None if value is _NO_VALUE else value, value is not _NO_VALUE)
    return name if value is _NO_VALUE else f"{name}={value!r}"


@contextlib.contextmanager
def worded(words: dict[str, Any]) -> Iterator[None]:
    """Inside the block, :func:`arg` speaks as ``words`` say: name -> ``f(value, given) ->
    str`` (the CLI's flags; Note [API wording])."""
    global _wording
    before, _wording = _wording, words
    try:
        yield
    finally:
        _wording = before


#: errno values that say "the machine refused", not "mpack has a bug" (exit code 3).
ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, n)
    for n in ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EMFILE", "ENFILE", "EIO", "ENOMEM")
    if hasattr(errno, n)
)


#: How many characters of an untrusted value a message quotes (:func:`quote`).
QUOTE_LIMIT = 200


# Note [quoting untrusted text]: layer names, keys and file names come from files anyone can
# write. Printed raw, an escape sequence in a layer name (ESC ``[2J``) clears the user's
# terminal, a bidi override makes a message read backwards, and a 10 MB name puts 10 MB in
# every message that quotes it. So a message quotes such a value through :func:`quote`, and
# output for people quotes paths and names through :func:`shown`. A message also names paths
# the user gave or a directory listing found (a directory named ``ESC[31m``), in f-strings all
# over mpack: the CLI prints every message and hint through :func:`escaped`, the one place
# that escapes what :func:`quote` did not.
# ``--json`` output does not go through it: JSON escapes control characters itself, and the
# document stays faithful to the file.
def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``value`` as a message may quote it: escaped and capped (Note [quoting untrusted text]).

    A string as ``repr`` writes it (C0 and C1 control characters, DEL, bidi overrides and the
    other invisible format characters, line separators and lone surrogates all escaped:
    ``'\\x1b[2J'``), at most ``limit`` of its characters, then ``...`` and its full length when it
    is longer. Anything else by its ``repr``, escaped and capped the same way.
    """
    if isinstance(value, str):
        text, out = value, repr(value[:limit])  # repr escapes every non-printable character
    else:
        text = repr(value)
        out = escaped(text[:limit])
    if len(text) > limit:
        out += f"... ({len(text)} characters)"
    return out


def escaped(text: str, *, keep: str = "") -> str:
    """``text`` with every character that does not print escaped as ``repr`` escapes it
    (``ESC`` as ``\\x1b``, a bidi override as ``\\u202e``), but for those in ``keep``; no quotes
    added, nothing cut. Escaping twice changes nothing more: a backslash prints. For a whole
    line that quotes values from outside, where each value cannot be quoted on its own (an
    error message on a terminal: ``keep="\\n"``; Note [quoting untrusted text])."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)


def shown(value: object, limit: int = QUOTE_LIMIT) -> str:
    """A string as it is when it prints as it reads (every character printable, at most
    ``limit`` of them), else :func:`quote` of it: for a name that leads a line or fills a table
    cell, where quotes around every ordinary name would only be noise."""
    if isinstance(value, str) and len(value) <= limit and value.isprintable():
        return value
    return quote(value, limit)


#: Problems a message lists one by one; the rest are counted.
MAX_LISTED = 20


def listed(problems: list[str], limit: int = 1000) -> str:
    """``problems`` for a message, one per indented line: at most :data:`MAX_LISTED`, each
    escaped and capped at ``limit`` characters (:func:`shown`), then how many more."""
    lines = [shown(p, limit) for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"... and {len(problems) - MAX_LISTED} more")
    return "\n  " + "\n  ".join(lines)


def environment_failure(exc: OSError, doing: str = "") -> EnvironmentFailure:
    """An ``EnvironmentFailure`` for an ``OSError`` whose errno is in ``ENVIRONMENT_ERRNOS``."""
    where = exc.filename if exc.filename is not None else "?"
    what = f" while {doing}" if doing else ""
    hints = {
        "EACCES": "check the file's permissions, or run as a user that may access it",
        "EPERM": "check the file's permissions, or run as a user that may access it",
        "EROFS": f"write the output to a writable file system ({arg('out')})",
        "ENOSPC": f"free some space, or write the output to another disk ({arg('out')})",
        "EDQUOT": f"free some space, or write the output to another disk ({arg('out')})",
        "EMFILE": "raise the open-file limit (ulimit -n)",
        "ENFILE": "raise the open-file limit (ulimit -n)",
    }
    name = errno.errorcode.get(exc.errno or 0, "")
    return EnvironmentFailure(f"{where}: {exc.strerror or exc}{what}", hint=hints.get(name))


def as_mpack_error(exc: BaseException) -> BaseException:
    """``exc``, or for an ``OSError`` the machine caused (``ENVIRONMENT_ERRNOS``) the
    ``EnvironmentFailure`` that says so."""
    environmental = isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS
    return environment_failure(exc) if environmental and not isinstance(exc, MpackError) else exc


def exit_code_for(exc: BaseException) -> int:
    """The process exit code for ``exc``: its ``exit_code`` for an ``MpackError`` (3 for an
    ``OSError`` the environment caused, :func:`as_mpack_error`), else 1."""
    exc = as_mpack_error(exc)
    return exc.exit_code if isinstance(exc, MpackError) else 1
