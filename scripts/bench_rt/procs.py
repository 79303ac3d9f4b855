"""The processes the benchmark starts, and how it ends every one of them.

``Child``: a worker (scripts/bench_runtime.py run with ``--_worker KIND``) or any other
subprocess, in a session of its own, JSON lines out and commands in. ``serve``: ``mpack serve``
through ``mpack.runtime.spawn``'s handle, in a session of its own too. ``kill_all`` ends
whatever is still running (the benchmark calls it on every way out); ``own_groups`` names their
process groups for the memory sampling.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from mpack.runtime.spawn import DaemonHandle, spawn

READY_TIMEOUT_S = 900.0  # a cold 8B load from a slow disk, after a cold torch import
CLIENT_TIMEOUT_S = 300.0  # 8 processes importing torch and initialising CUDA at once
REPLY_TIMEOUT_S = 120.0
#: The ``mpack serve`` processes running now.
DAEMONS: list[DaemonHandle] = []


class BenchError(Exception):
    pass


class Child:
    """A subprocess in a session of its own: lines on stdout (timestamped as they arrive),
    commands on stdin, stderr to a log file. Ending it ends its whole process group (a
    torch.mp producer's consumers too); ``Child.kill_all()`` ends every one still running."""

    live: ClassVar[list[Child]] = []
    _n: ClassVar[int] = 0

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        Child._n += 1
        self.name = name
        self.log = cwd / f"{Child._n:02d}-{name}.log"
        with open(self.log, "w") as err:
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        Child.live.append(self)
        self._lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self._pumper = threading.Thread(target=self._pump, daemon=True)
        self._pumper.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put((time.perf_counter(), line.rstrip("\n")))
        self._lines.put((time.perf_counter(), None))

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""

    def read_line(self, timeout: float, pred: Callable[[str], bool] = bool) -> tuple[float, str]:
        """The next stdout line for which ``pred`` holds, with the time it arrived."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(
                    f"{self.name}: nothing within {timeout:g} s\n{self.tail()}"
                ) from None
            if line is None:
                raise BenchError(f"{self.name} closed its stdout (exited?)\n{self.tail()}")
            if pred(line):
                return t, line

    def read_json(self, key: str, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """The next JSON line (an object) holding ``key``; one holding ``error`` raises."""
        while True:
            _, line = self.read_line(timeout, lambda s: s.startswith("{"))
            doc = json.loads(line)
            if "error" in doc:
                raise BenchError(f"{self.name}: {doc['error']}\n{self.tail()}")
            if key in doc:
                return doc

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise BenchError(f"{self.name} is gone\n{self.tail()}") from None

    def _exited(self) -> bool:
        """Whether the leader exited (left a zombie: its pid, the group's id, stays ours)."""
        try:
            r = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return r is not None

    def _wait_exited(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._exited():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def end(self, sig: int | None = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the leader (``sig``; None: close its stdin) and wait; then SIGKILL the group."""
        if sig is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
        elif not self._exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
        clean = self._wait_exited(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the leader is unreaped: the id is ours
        code = self.proc.wait()
        self._pumper.join(10)  # EOF once the group is gone
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if f is not None:
                    f.close()
        with contextlib.suppress(ValueError):
            Child.live.remove(self)
        return code if clean else None

    @classmethod
    def kill_all(cls) -> None:
        for c in list(cls.live):
            c.end(signal.SIGKILL, 10)


def worker(script: Path, kind: str, args: dict[str, Any], env: dict[str, str], cwd: Path) -> Child:
    """A benchmark's measuring process: ``SCRIPT --_worker KIND --_args JSON``."""
    cmd = [sys.executable, str(script), "--_worker", kind, "--_args", json.dumps(args)]
    return Child(kind, cmd, env, cwd)


def run_worker(
    script: Path,
    kind: str,
    args: dict[str, Any],
    key: str,
    timeout: float,
    env: dict[str, str],
    cwd: Path,
) -> Any:
    """One worker to its first line holding ``key``: that line's ``key``; then its stdin is
    closed (it exits)."""
    c = worker(script, kind, args, env, cwd)
    try:
        return c.read_json(key, timeout)[key]
    finally:
        c.end(None, 60)


@contextlib.contextmanager
def serve(
    sidecar: Path,
    rank: int,
    device: str,
    socket: Path,
    env: dict[str, str],
    cwd: Path,
    args: Sequence[str] = (),
) -> Iterator[DaemonHandle]:
    """``mpack serve SIDECAR --device D --rank R --socket S *args`` in a fresh process, READY
    (its ``ready_s``: process start to READY); stopped with SIGTERM (then SIGKILL) when the
    block ends, unless already stopped. Its stdout and stderr stay in ``cwd``."""
    d = spawn(
        sidecar,
        rank=rank,
        device=device,
        socket=socket,
        args=args,
        env=env,
        cwd=cwd,
        log_dir=cwd,
        new_session=True,
        timeout=READY_TIMEOUT_S,
    )
    DAEMONS.append(d)
    try:
        yield d
    finally:
        d.stop(signal.SIGTERM, 60)
        d.close()
        DAEMONS.remove(d)


def own_groups() -> set[int]:
    """The process groups of every process the benchmark runs now (each leads its own)."""
    return {c.proc.pid for c in Child.live} | {d.pid for d in DAEMONS}


def kill_all() -> None:
    """SIGKILL every child and daemon still running, with their process groups."""
    Child.kill_all()
    for d in list(DAEMONS):
        d.kill()
