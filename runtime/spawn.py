"""Start ``mpack serve`` as a child process and hold it by a handle (tests, demo, benchmarks).

    from mpack.runtime.spawn import spawn

    with spawn("llama-marlin/", rank=0, device="cuda:0") as d:  # returns once READY
        d.ready.socket, d.ready.digest, d.ready.load_s           # the READY line's fields
        w = attach("llama-marlin/", device="cuda:0", socket=d.socket)
    # leaving the block: SIGTERM, and SIGKILL if it has not stopped within STOP_TIMEOUT_S

The child is ``python -m mpack.cli serve SIDECAR ...``: the process a user starts by hand. Its
stdout (the READY line, nothing else; with ``serve --json``, one JSON line per event, the
``ready`` one among them) and stderr (the event log, or the error that stopped it) go to files,
never to a pipe it could fill: named files in ``log_dir``, else unnamed temporary ones, read
through the handle (``stdout()``, ``stderr()``). The READY line's format is defined here
(``READY_KEYS``, ``format_ready``) and parsed here only (``parse_ready``), in both forms.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from mpack.errors import DaemonError

READY = "READY"
#: The fields of ``READY key=value ...``, in the order ``mpack serve`` prints them.
READY_KEYS = ("socket", "pid", "device", "backend", "bytes", "load_s", "rank", "digest")
#: Printed after them when the daemon has one: ``metrics``, the URL of its Prometheus endpoint.
READY_OPTIONAL_KEYS = ("metrics",)
#: Printed last by the daemon of one pipeline stage (``serve --pp-rank``; Note [the daemon of a
#: stage] in protocol.py): which stage of how many. A daemon of the whole rank prints neither.
READY_STAGE_KEYS = ("pp_rank", "pp_size")
READY_TIMEOUT_S = 900.0  # a cold 8B load from a slow disk, after a cold torch and CUDA start
STOP_TIMEOUT_S = 30.0
POLL_S = 0.005  # how often the stdout file is read while waiting for READY
TAIL_CHARS = 2000  # how much of the child's stderr an error message quotes

_seq = itertools.count(1)


@dataclass(frozen=True)
class Ready:
    """The fields of the READY line, typed; ``fields`` holds every ``key=value`` as printed."""

    socket: Path  # the Unix socket clients attach through
    pid: int  # the daemon's process id
    device: str  # the device key: ``cpu`` or ``cuda:GPU-<uuid>``
    backend: str  # ``host`` (memfd) or ``cuda`` (VMM)
    bytes: int  # size of the exported allocation
    load_s: float  # the verified fill alone (no interpreter, torch or CUDA start-up)
    rank: int
    digest: str  # the sidecar's manifest digest
    fields: dict[str, str]
    metrics: str | None = None  # ``serve --metrics-port``: http://ADDR:PORT/metrics
    pp_rank: int = 0  # the pipeline stage served (``serve --pp-rank``); 0 of 1: the whole rank
    pp_size: int = 1


def format_ready(info: Mapping[str, Any]) -> str:
    """The READY line for the daemon's ``on_ready`` fields (the ``READY_KEYS`` it has)."""
    keys = READY_KEYS + READY_OPTIONAL_KEYS
    if info.get("pp_size", 1) != 1:
        keys += READY_STAGE_KEYS
    return " ".join([READY, *(f"{k}={info[k]}" for k in keys if k in info)])


def parse_ready(line: str) -> Ready | None:
    """The fields of a READY line, or of the ``ready`` event line of ``serve --json`` (a JSON
    object with ``"event": "ready"``); None for any other line.

    Raises:
        DaemonError: a READY line that lacks one of ``READY_KEYS`` or has a malformed number.
    """
    text = line.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        if not (isinstance(doc, dict) and doc.get("event") == "ready"):
            return None
        doc["digest"] = doc.get("manifest_digest")  # its name in every --json document
        keys = READY_KEYS + READY_OPTIONAL_KEYS + READY_STAGE_KEYS
        fields = {k: str(doc[k]) for k in keys if k in doc and doc[k] is not None}
    else:
        head, _, rest = text.partition(" ")
        if head != READY:
            return None
        fields = dict(kv.split("=", 1) for kv in rest.split() if "=" in kv)
    try:
        return Ready(
            socket=Path(fields["socket"]),
            pid=int(fields["pid"]),
            device=fields["device"],
            backend=fields["backend"],
            bytes=int(fields["bytes"]),
            load_s=float(fields["load_s"]),
            rank=int(fields["rank"]),
            digest=fields["digest"],
            fields=fields,
            metrics=fields.get("metrics"),
            pp_rank=int(fields.get("pp_rank", 0)),
            pp_size=int(fields.get("pp_size", 1)),
        )
    except (KeyError, ValueError) as e:
        raise DaemonError(
            f"malformed READY line from mpack serve ({e}): {line.strip()!r}"
        ) from None


class DaemonHandle:
    """One ``mpack serve`` child process, started by the constructor; ``spawn`` also waits for
    its READY line.

    ``args``: more ``serve`` arguments, appended as they are. ``python``: the interpreter (one
    of another environment where mpack is installed). ``env``: the child's whole environment
    (default: this one); its ``XDG_RUNTIME_DIR`` picks the directory of the default socket.
    ``cwd``: the child's working directory (a relative ``sidecar`` or ``socket`` is then made
    absolute first). ``log_dir``: keep stdout and stderr there as ``serve-*.out`` and
    ``serve-*.err`` (``out_path``, ``err_path``). ``new_session``: run it in a session of its
    own (a terminal's Ctrl-C does not reach it; ``kill`` ends the whole group). ``timeout``:
    the default of ``wait_ready``.

    ``ready`` is None until ``wait_ready`` has seen the READY line; ``ready_s`` is then the time
    from starting the process to seeing it (interpreter, imports, device start-up and the load).
    """

    def __init__(
        self,
        sidecar: str | os.PathLike,
        *,
        rank: int = 0,
        device: str = "cpu",
        socket: str | os.PathLike | None = None,
        args: Sequence[str] = (),
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
        new_session: bool = False,
        timeout: float = READY_TIMEOUT_S,
    ) -> None:
        cmd = [python, "-m", "mpack.cli", "serve", _path_arg(sidecar, cwd), "--device", device]
        if rank:
            cmd += ["--rank", str(rank)]
        if socket is not None:
            cmd += ["--socket", _path_arg(socket, cwd)]
        (self._out, self._err), paths = _log_files(log_dir)
        self.out_path, self.err_path = paths if paths is not None else (None, None)
        self.timeout, self.new_session = timeout, new_session
        self.ready: Ready | None = None
        self.ready_s: float | None = None
        try:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                [*cmd, *args],
                stdin=subprocess.DEVNULL,
                stdout=self._out,
                stderr=self._err,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=new_session,
            )
        except BaseException:
            self.close()
            raise

    # --- READY ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> Ready:
        """Wait for the READY line (``timeout`` seconds; default: the handle's ``timeout``).

        Raises:
            DaemonError: the process exited first, or is still not READY at the deadline (it is
                left running: ``stop`` or ``kill`` it). The message ends with its stderr.
        """
        if self.ready is not None:
            return self.ready
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            exited = self.proc.poll() is not None  # before the scan: a READY then exit counts
            ready = self._scan_ready()
            if ready is not None:
                self.ready, self.ready_s = ready, time.monotonic() - self.started
                return ready
            if exited:
                code = self.proc.returncode
                raise DaemonError(self._why(f"{_exit_text(code)} before READY"))
            if time.monotonic() >= deadline:
                raise DaemonError(
                    self._why(f"not READY within {limit:g} s"),
                    hint="a large sidecar on a cold disk may need a longer timeout",
                )
            time.sleep(POLL_S)

    def _why(self, what: str) -> str:
        """``mpack serve (pid N) <what>``, then the end of its stderr."""
        tail = self.stderr_tail().rstrip()
        said = f"; its stderr ends:\n{tail}" if tail else "; it wrote nothing to stderr"
        return f"mpack serve (pid {self.pid}) {what}{said}"

    def _scan_ready(self) -> Ready | None:
        """The READY line among the complete lines written to stdout so far, if any."""
        text = self.stdout()
        for line in text[: text.rfind("\n") + 1].splitlines():
            ready = parse_ready(line)
            if ready is not None:
                return ready
        return None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> Path:
        return self._need_ready().socket

    @property
    def digest(self) -> str:
        return self._need_ready().digest

    def _need_ready(self) -> Ready:
        if self.ready is None:
            raise DaemonError(f"mpack serve (pid {self.pid}) is not READY: call wait_ready()")
        return self.ready

    # --- output --------------------------------------------------------------------------

    def stdout(self) -> str:
        """Everything the child wrote to stdout so far."""
        return _read(self._out, self.out_path)

    def stderr(self) -> str:
        """Everything the child wrote to stderr so far: its event log, or why it stopped.
        After ``close`` only files in a ``log_dir`` can still be read ("" otherwise)."""
        return _read(self._err, self.err_path)

    def stderr_tail(self, chars: int = TAIL_CHARS) -> str:
        """About the last ``chars`` characters of ``stderr()``."""
        return _read(self._err, self.err_path, chars)

    # --- the process ---------------------------------------------------------------------

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit; its exit code (``subprocess.TimeoutExpired`` on timeout)."""
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig`` (unless the child has exited) and wait up to ``timeout`` seconds, then
        SIGKILL it if it still runs. Its exit code: 0 for a clean stop (SIGTERM, SIGINT, SIGHUP),
        negative for the signal that killed it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def kill(self) -> int:
        """SIGKILL the child (its whole session with ``new_session``) and reap it."""
        if self.proc.poll() is None:
            try:
                if self.new_session:  # the leader is not reaped yet: its group id is still ours
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            except ProcessLookupError:
                pass
        return self.proc.wait()

    def close(self) -> None:
        """Close this side of the log files (the child keeps writing to its own)."""
        self._out.close()
        self._err.close()

    def __enter__(self) -> DaemonHandle:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop()
        finally:
            self.close()


def spawn(
    sidecar: str | os.PathLike,
    *,
    rank: int = 0,
    device: str = "cpu",
    socket: str | os.PathLike | None = None,
    timeout: float = READY_TIMEOUT_S,
    **kw: Any,
) -> DaemonHandle:
    """Start ``mpack serve`` and wait for its READY line; the handle, ``ready`` filled in.
    Further keywords as for ``DaemonHandle``.

    Raises:
        DaemonError: it exited before READY (the message ends with its stderr: the reason, e.g.
            another daemon serving the same rank), or was not READY within ``timeout`` seconds.
            Either way it is no longer running.
    """
    d = DaemonHandle(sidecar, rank=rank, device=device, socket=socket, timeout=timeout, **kw)
    try:
        d.wait_ready()
    except BaseException:
        d.kill()
        d.close()
        raise
    return d


def _path_arg(p: str | os.PathLike, cwd: str | os.PathLike | None) -> str:
    """``p`` as an argument for a child started in ``cwd``: absolute when the directory differs."""
    return os.fspath(p) if cwd is None else os.fspath(Path(p).absolute())


def _log_files(
    log_dir: str | os.PathLike | None,
) -> tuple[tuple[IO[bytes], IO[bytes]], tuple[Path, Path] | None]:
    """The child's stdout and stderr files: new ones in ``log_dir``, else unnamed temporary."""
    if log_dir is None:
        return (tempfile.TemporaryFile(), tempfile.TemporaryFile()), None  # noqa: SIM115
    stem = Path(log_dir) / f"serve-{os.getpid()}-{next(_seq)}"
    paths = (stem.with_suffix(".out"), stem.with_suffix(".err"))
    out = open(paths[0], "x+b")  # noqa: SIM115 - the handle owns it and closes it
    try:
        err = open(paths[1], "x+b")  # noqa: SIM115
    except BaseException:
        out.close()
        raise
    return (out, err), paths


def _read(f: IO[bytes], path: Path | None, last: int | None = None) -> str:
    """The text the child wrote to ``f`` (through its own descriptor; ``path`` once ``f`` is
    closed): all of it, or about its last ``last`` characters. The file offset is left alone."""
    if f.closed:
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as g:
            return _read(g, None, last)
    fd = f.fileno()
    size = os.fstat(fd).st_size
    start = 0 if last is None else max(0, size - last)
    return os.pread(fd, size - start, start).decode(errors="replace")


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
