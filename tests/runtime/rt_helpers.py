"""Helpers for the runtime tests: real daemon and client processes, raw protocol, /proc probes."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mpack.runtime import protocol as P
from mpack.runtime.client import status_of
from mpack.runtime.spawn import DaemonHandle

HERE = Path(__file__).resolve().parent
PROBE = HERE / "probe_client.py"
READY_TIMEOUT_S = 120.0  # a CUDA daemon initialises the driver and torch first


def child_env(runtime_root: Path) -> dict[str, str]:
    """The environment of every daemon/client: a private XDG_RUNTIME_DIR, unbuffered output."""
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime_root), "PYTHONUNBUFFERED": "1"}


def private_runtime(root: Path) -> dict[str, str]:
    """:func:`child_env` with a new private runtime directory, ``root/xdg`` (0700)."""
    xdg = root / "xdg"
    xdg.mkdir(mode=0o700)
    return child_env(xdg)


class DaemonProc(DaemonHandle):
    """``python -m mpack.cli serve SIDECAR --device D *extra`` (``mpack.runtime.spawn``'s
    handle), not waited for: ``wait_ready()`` waits up to ``READY_TIMEOUT_S``.

    Its stdout and stderr stay in ``workdir`` (``out_path``, ``err_path``), which is also its
    working directory: never the repo root, whose ./mpack would shadow an installed package.
    ``python``: the interpreter (another environment's, where mpack is installed there only).
    """

    def __init__(
        self,
        sidecar: Path,
        device: str,
        env: dict,
        workdir: Path,
        *extra: str,
        python: str = sys.executable,
    ) -> None:
        super().__init__(
            sidecar,
            device=device,
            args=extra,
            python=python,
            env=env,
            cwd=workdir,
            log_dir=workdir,
            timeout=READY_TIMEOUT_S,
        )


class Probe:
    """A ``probe_client.py`` process: JSON lines out, commands in."""

    def __init__(self, sidecar: Path, device: str, env: dict, workdir: Path, *extra: str) -> None:
        cmd = [sys.executable, str(PROBE), str(sidecar), "--device", device, *extra]
        self.err = workdir / f"probe-{id(self)}.err"
        with open(self.err, "w") as e:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=e,
                text=True,
                env=env,
                cwd=workdir,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self, timeout: float = 120) -> dict[str, Any] | None:
        """The next JSON line, or None when the process ended without one."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"probe {self.pid} silent for {timeout} s: {self.err.read_text()}"
            ) from None
        return None if line is None else json.loads(line)

    def cmd(self, command: str, timeout: float = 120) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        return self.read(timeout)

    def finish(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.cmd_nowait("exit")
        return self.proc.wait(timeout)

    def cmd_nowait(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# --- raw protocol ----------------------------------------------------------------------------


def raw_connect(path: Path, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def frame(body: bytes, *, length: int | None = None) -> bytes:
    return P.HEADER.pack(P.MAGIC, len(body) if length is None else length) + body


def raw_exchange(
    path: Path, data: bytes, timeout: float = 10
) -> tuple[dict | None, list[int], bool]:
    """Send ``data``; return (reply or None, fds received, whether the daemon then closed)."""
    with raw_connect(path, timeout) as s:
        s.sendall(data)
        try:
            reply, fds = P.recv_message(s)
        except (P.WireError, ConnectionResetError):
            return None, [], True
        try:
            closed = s.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            closed = True
        return reply, fds, closed


status = status_of


# --- /proc -----------------------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def memfd_inodes_of(pid: int) -> set[int]:
    """Inodes of the mpack memfds a process holds open."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:mpack:" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def holders_of(inode: int) -> list[int]:
    """Pids that map or hold open an mpack memfd with this inode (the kernel frees it at none)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            maps = Path(f"/proc/{d}/maps").read_text()
            held = any(
                f" {inode} " in line and "memfd:mpack:" in line for line in maps.splitlines()
            ) or inode in memfd_inodes_of(int(d))
        except OSError:
            continue
        if held:
            pids.append(int(d))
    return pids


def wait_for(pred, timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
