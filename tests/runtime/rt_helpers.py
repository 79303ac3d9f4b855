"""Helpers for the runtime tests: real daemon and client processes, raw protocol, /proc probes."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROBE = HERE / "probe_client.py"
READY_TIMEOUT_S = 120.0  # a CUDA daemon initialises the driver and torch first


def child_env(runtime_root: Path) -> dict[str, str]:
    """The environment of every daemon/client: a private XDG_RUNTIME_DIR, unbuffered output."""
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime_root), "PYTHONUNBUFFERED": "1"}


class DaemonProc:
    """``python -m mpack.cli serve ...`` with stdout/stderr in files (never a pipe it could fill).

    ``python``: the interpreter (another environment's, where mpack is installed there only).
    """

    _n = 0

    def __init__(
        self,
        sidecar: Path,
        device: str,
        env: dict,
        workdir: Path,
        *extra: str,
        python: str = sys.executable,
    ) -> None:
        DaemonProc._n += 1
        self.out = workdir / f"daemon-{DaemonProc._n}.out"
        self.err = workdir / f"daemon-{DaemonProc._n}.err"
        cmd = [python, "-m", "mpack.cli", "serve", str(sidecar), "--device", device, *extra]
        with open(self.out, "w") as o, open(self.err, "w") as e:
            # cwd=workdir: never the repo root, whose ./mpack would shadow the installed package.
            self.proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=workdir)
        self.ready: dict[str, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> Path:
        return Path(self.ready["socket"])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                if line.startswith("READY "):
                    self.ready = dict(kv.split("=", 1) for kv in line.split()[1:])
                    return self.ready
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.stderr()}")
            time.sleep(0.02)
        raise AssertionError(f"serve not READY within {timeout} s: {self.stderr()}")

    def stderr(self) -> str:
        return self.err.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None


class Probe:
    """A ``probe_client.py`` process: JSON lines out, commands in."""

    def __init__(self, sidecar: Path, device: str, env: dict, workdir: Path, *extra: str) -> None:
        cmd = [sys.executable, str(PROBE), str(sidecar), "--device", device, *extra]
        self.err = workdir / f"probe-{id(self)}.err"
        with open(self.err, "w") as e:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=e, text=True, env=env, cwd=workdir
            )  # fmt: skip
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
# mpack's protocol is imported where used: scripts/vllm_gpu.py uses DaemonProc in a process
# without mpack.


def raw_connect(path: Path, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def frame(body: bytes, *, magic: bytes | None = None, length: int | None = None) -> bytes:
    from mpack.runtime import protocol as P

    magic = P.MAGIC if magic is None else magic
    return P.HEADER.pack(magic, len(body) if length is None else length) + body


def raw_exchange(
    path: Path, data: bytes, timeout: float = 10
) -> tuple[dict | None, list[int], bool]:
    """Send ``data``; return (reply or None, fds received, whether the daemon then closed)."""
    from mpack.runtime import protocol as P

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


def status(path: Path) -> dict[str, Any]:
    from mpack.runtime.client import status_of

    return status_of(path)


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
