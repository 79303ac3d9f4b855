"""runtime/sdnotify.py, and `mpack serve` under a service manager's ``$NOTIFY_SOCKET``.

The manager is stood in for by what systemd itself is on the wire: an ``AF_UNIX`` datagram socket
bound here (at a path, and in the abstract namespace), with ``SO_PASSCRED`` so that each
datagram carries its sender's pid as the kernel reports it (systemd's ``NotifyAccess=main``
check). The daemons are real ``mpack serve`` processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import time
import uuid
from pathlib import Path

import pytest

from mpack.runtime import sdnotify
from mpack.runtime.client import status_of
from tests.conftest import flip_byte
from tests.runtime.rt_helpers import DaemonProc, private_runtime
from tests.runtime.sidecar_factory import make_sidecar


class Manager:
    """A stand-in service manager: a bound datagram socket that records (pid, message)."""

    def __init__(self, where: str) -> None:
        self.value = where  # what $NOTIFY_SOCKET says
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(sdnotify.address(where))
        self.got: list[tuple[int, str]] = []

    def receive(self, timeout: float) -> tuple[int, str] | None:
        """The next datagram (sender pid, text), or None after ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(12))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("3i", payload[:12])[0]
        self.got.append((pid, data.decode()))
        return self.got[-1]

    def until(self, pred, timeout: float = 120) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.receive(max(0.01, deadline - time.monotonic()))
            if msg is not None and pred(msg[1]):
                return msg
        raise AssertionError(f"no such message within {timeout} s; got {self.got}")

    def close(self) -> None:
        self.sock.close()
        if not self.value.startswith("@"):
            Path(self.value).unlink(missing_ok=True)


@pytest.fixture
def world(tmp_path):
    return tmp_path, private_runtime(tmp_path)


# --- the protocol ------------------------------------------------------------------------------


def test_addresses_path_and_abstract_and_nothing_else():
    assert sdnotify.address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.address("@/org/freedesktop/systemd1/notify") == (
        "\0/org/freedesktop/systemd1/notify"
    )
    for bad in ("", "@", "relative/path", "vsock:2:1234"):
        with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
            sdnotify.address(bad)


def test_without_notify_socket_nothing_is_sent():
    assert sdnotify.notify("READY=1", environ={}) is False
    assert not sdnotify.Notifier(environ={}).enabled


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_one_datagram_reaches_the_manager(tmp_path, kind):
    where = str(tmp_path / "notify") if kind == "path" else f"@mpack-test-{uuid.uuid4().hex}"
    m = Manager(where)
    try:
        assert sdnotify.notify("READY=1\nSTATUS=x", environ={"NOTIFY_SOCKET": where})
        pid, text = m.until(lambda t: True, 5)
        assert text == "READY=1\nSTATUS=x" and pid == os.getpid()
    finally:
        m.close()


def test_a_failed_send_is_reported_once_not_raised(tmp_path):
    said = []
    gone = str(tmp_path / "nobody-listens")
    n = sdnotify.Notifier(said.append, environ={"NOTIFY_SOCKET": gone})
    assert n.enabled and n.send("READY=1") is False and n.send("STATUS=x") is False
    assert len(said) == 1 and gone in said[0], said
    bad = sdnotify.Notifier(said.append, environ={"NOTIFY_SOCKET": "vsock:2:9"})
    assert bad.send("READY=1") is False and "AF_UNIX" in said[-1]


def test_a_status_line_stays_one_line():
    assert sdnotify.status_line("loading\nREADY=1  now") == "STATUS=loading READY=1 now"


# --- mpack serve under Type=notify ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_serve_says_ready_once_the_socket_answers_and_stopping_on_sigterm(world, kind):
    root, env = world
    sc = make_sidecar(root / "sc", layers=2, hidden=256, inter=512)
    where = str(root / "notify.sock") if kind == "path" else f"@mpack-test-{uuid.uuid4().hex}"
    m = Manager(where)
    d = DaemonProc(sc, "cpu", {**env, "NOTIFY_SOCKET": where}, root)
    try:
        pid, text = m.until(lambda t: "READY=1" in t.splitlines())
        # the sender is the daemon itself (NotifyAccess=main), and it answers on its socket by
        # the time the manager hears READY=1: the load is done and verified
        assert pid == d.pid, (pid, d.pid)
        ready = d.wait_ready(30)
        assert status_of(ready.socket)["pid"] == d.pid
        status = [t for _, t in m.got if t.startswith("STATUS=")]
        assert any("loading rank 0" in t for t in status), m.got
        assert "STATUS=serving rank 0" in text and f"{ready.bytes} bytes" in text, text
        # READY=1 came after the loading status, once
        assert [t for _, t in m.got].index(text) > 0
        d.proc.send_signal(signal.SIGTERM)
        _, stopping = m.until(lambda t: "STOPPING=1" in t.splitlines(), 30)
        assert "SIGTERM" in stopping
        assert d.wait(30) == 0
        assert sum("READY=1" in t.splitlines() for _, t in m.got) == 1
    finally:
        d.stop(signal.SIGKILL, 10)
        d.close()
        m.close()


def test_serve_never_says_ready_for_a_sidecar_it_refuses(world):
    root, env = world
    sc = make_sidecar(root / "sc", layers=2, hidden=256, inter=512)
    bad = root / "bad"
    shutil.copytree(sc, bad)
    rank_file = next(bad.glob("rank-*.safetensors"))
    flip_byte(rank_file, rank_file.stat().st_size - 10)
    where = str(root / "notify.sock")
    m = Manager(where)
    d = DaemonProc(bad, "cpu", {**env, "NOTIFY_SOCKET": where}, root)
    try:
        assert d.wait(60) == 2, d.stderr()
        while m.receive(0.2) is not None:
            pass
        assert not any("READY=1" in t.splitlines() for _, t in m.got), m.got
        assert any("loading" in t for _, t in m.got), m.got  # it did talk to the manager
    finally:
        d.stop(signal.SIGKILL, 10)
        d.close()
        m.close()


def test_a_manager_that_is_gone_is_logged_and_serving_goes_on(world):
    root, env = world
    sc = make_sidecar(root / "sc", layers=2, hidden=256, inter=512)
    gone = str(root / "no-manager.sock")
    d = DaemonProc(sc, "cpu", {**env, "NOTIFY_SOCKET": gone}, root)
    try:
        ready = d.wait_ready(120)
        assert status_of(ready.socket)["pid"] == d.pid
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait(30) == 0
        err = d.stderr()
        assert err.count("notify-failed") == 1 and "WARNING" in err and gone in err, err
    finally:
        d.stop(signal.SIGKILL, 10)
        d.close()
