"""The daemon and its peers against hostile ones (issue 24, items 4 to 7): a log reader that
stops reading, a wedged or hostile process of our own uid on the socket, bad sockets beside a
healthy daemon in `mpack status`, and a daemon started with `--socket` under a custom name.

Real daemons (``python -m mpack.cli serve``), real sockets, real memfds and pipes. A fake peer
is a thread of this process listening on a real Unix socket and speaking the wire protocol (or
not): the client checks the peer's uid, and ours passes, as a hostile program of the same user
would.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mpack.errors import DaemonError, ProtocolError
from mpack.runtime import attach
from mpack.runtime import protocol as P
from mpack.runtime.client import status_of
from mpack.runtime.memfd import SEALS
from mpack.sidecar import load_manifest
from tests.runtime.rt_helpers import DaemonProc, child_env, wait_for
from tests.runtime.sidecar_factory import make_sidecar

PAGE = 4096


@pytest.fixture(scope="module")
def sc(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("peers-sc") / "sidecar")


@pytest.fixture(scope="module")
def digest(sc) -> str:
    return load_manifest(sc)[1]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    return child_env(xdg)


@pytest.fixture
def rdir(env, monkeypatch) -> Path:
    """The per-user runtime directory of ``env`` (made, 0700), also for this process."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    d = Path(env["XDG_RUNTIME_DIR"]) / P.RUNTIME_SUBDIR
    d.mkdir(mode=0o700)
    return d


def _cli(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


# --- fake peers ---------------------------------------------------------------------------------

Reply = Callable[[socket.socket, threading.Event], None]


class FakePeer:
    """A listener at ``path`` that reads each connection's request and then runs ``reply`` on
    it (in a thread of its own), as a process of our uid can."""

    def __init__(self, path: Path, reply: Reply) -> None:
        self.path, self.reply = path, reply
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                P.recv_message(conn, P.MAX_REQUEST_BYTES)
                self.reply(conn, self.stop)
            except OSError:  # the client gave up and closed: what a refusal looks like here
                pass

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(5)


def _send_frame(conn: socket.socket, frame: bytes, fds: list[int] = ()) -> None:
    n = socket.send_fds(conn, [frame], list(fds)) if fds else 0
    conn.sendall(frame[n:])


def _memfd(size: int, *, sealed: bool = True) -> int:
    fd = os.memfd_create("hostile-peer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _attached(digest: str, *, size: int = PAGE, tensors: object = None) -> dict:
    return {
        "type": P.ATTACHED,
        "digest": digest,
        "rank": 0,
        "device": "cpu",
        "backend": "host",
        "size": size,
        "data_size": PAGE,
        "tensors": [["t", "U8", [16], 0]] if tensors is None else tensors,
    }


def _with_fd(msg: dict, make_fd: Callable[[], tuple[int, list[int]]]) -> Reply:
    """Reply ``msg`` with the descriptor ``make_fd`` returns (and close the ones it lists)."""

    def reply(conn: socket.socket, stop: threading.Event) -> None:
        fd, to_close = make_fd()
        try:
            _send_frame(conn, P.encode(msg), [fd])
        finally:
            for f in to_close:
                os.close(f)
        stop.wait(2)  # keep the lease open while the client looks at the fd

    return reply


def _pipe_fd() -> tuple[int, list[int]]:
    r, w = os.pipe()
    return r, [r, w]


def _one_fd(fd: int) -> tuple[int, list[int]]:
    return fd, [fd]


def hostile_replies(digest: str) -> dict[str, tuple[Reply, str]]:
    """Each hostile peer of item 5 with a fd, and what the client's refusal says."""
    return {
        "size-past-the-memfd": (
            _with_fd(_attached(digest, size=1 << 20), lambda: _one_fd(_memfd(PAGE))),
            f"a file of {PAGE} bytes, not the {1 << 20} bytes announced",
        ),
        "a-pipe-as-the-fd": (_with_fd(_attached(digest), _pipe_fd), "a FIFO, not a memfd"),
        "an-unsealed-memfd": (
            _with_fd(_attached(digest), lambda: _one_fd(_memfd(PAGE, sealed=False))),
            "without the write, shrink and grow seals",
        ),
        "too-many-tensors": (
            _with_fd(
                _attached(digest, tensors=[["t", "U8", [1], i % PAGE] for i in range(70_000)]),
                lambda: _one_fd(_memfd(PAGE)),
            ),
            "lists 70000 tensors; a client accepts at most ",
        ),
    }


HOSTILE = ["size-past-the-memfd", "a-pipe-as-the-fd", "an-unsealed-memfd", "too-many-tensors"]


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- item 5: a wedged or hostile peer on the socket ---------------------------------------------


@pytest.mark.parametrize("kind", HOSTILE)
def test_what_a_hostile_peer_sends_is_checked_before_it_is_mapped(sc, digest, tmp_path, kind):
    reply, says = hostile_replies(digest)[kind]
    path = tmp_path / "peer.sock"
    before = _fd_count()
    with FakePeer(path, reply):
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=says) as e:
            attach(sc, socket=path, timeout=5)
        assert time.monotonic() - t0 < 5
    assert isinstance(e.value, DaemonError)  # what `attach: auto` falls back from
    assert e.value.exit_code == 2 and str(path) in str(e.value)
    wait_for(lambda: _fd_count() <= before, 5, "the peer's descriptors to be closed")


def test_a_reply_dripped_a_byte_at_a_time_meets_one_deadline(sc, digest, tmp_path):
    """The timeout bounds the whole reply, not each recv (the peer would go on for 8 s)."""

    def drip(conn: socket.socket, stop: threading.Event) -> None:
        frame = P.encode(_attached(digest))
        conn.sendall(frame[:9])
        for b in frame[9:50]:
            if stop.wait(0.2):
                return
            conn.sendall(bytes([b]))

    with FakePeer(tmp_path / "drip.sock", drip):
        t0 = time.monotonic()
        with pytest.raises(DaemonError, match="did not answer within 1 s"):
            attach(sc, socket=tmp_path / "drip.sock", timeout=1.0)
        assert time.monotonic() - t0 < 3


def test_a_two_million_entry_tensor_list_is_refused_by_its_length(sc, digest, tmp_path):
    """2,000,000 entries (36 MB): refused from the frame's length, before the body is read
    (it used to cost 55 s and 1.3 GB)."""
    head = P.encode(_attached(digest, tensors=[]))[P.HEADER.size : -2]  # up to `"tensors":[`
    body = head + b'["t","U8",[1],0],' * 1_999_999 + b'["t","U8",[1],0]]}'
    frame = P.HEADER.pack(P.MAGIC, len(body)) + body

    def flood(conn: socket.socket, stop: threading.Event) -> None:
        fd = _memfd(PAGE)
        try:
            _send_frame(conn, frame, [fd])
        finally:
            os.close(fd)

    with FakePeer(tmp_path / "flood.sock", flood):
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=f"exceeds the limit of {P.MAX_REPLY_BYTES}"):
            attach(sc, socket=tmp_path / "flood.sock", timeout=30)
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("kind", HOSTILE)
def test_the_vllm_loader_falls_back_from_a_hostile_peer(sc, digest, tmp_path, kind, caplog):
    """`attach: auto` loads privately; `attach: require` fails with a DaemonError."""
    from mpack.runtime.vllm import LOGGER_NAME
    from mpack.runtime.vllm.checks import Options
    from mpack.runtime.vllm.source import rank_weights

    reply, says = hostile_replies(digest)[kind]
    path = tmp_path / "peer.sock"
    with FakePeer(path, reply):
        with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
            w = rank_weights(sc, Options(attach="auto", socket=str(path)), 0, "cpu")
        with w:
            assert w.backend == "private" and len(w) > 0
        assert says in caplog.text and "loads privately" in caplog.text
        with pytest.raises(DaemonError, match="attach: require"):
            rank_weights(sc, Options(attach="require", socket=str(path)), 0, "cpu")


# --- item 4: a log reader that stops reading ----------------------------------------------------


def _serve_into_stalled_pipe(sc: Path, sock: Path, env: dict, cwd: Path):
    """`mpack serve S --socket SOCK 2>&1 >/dev/null | sleep 600`, with a one-page pipe (it
    fills after about 35 attach/detach cycles instead of 530). (process, read end)."""
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, PAGE)
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mpack.cli",
                "serve",
                str(sc),
                "--device",
                "cpu",
                "--socket",
                str(sock),
            ],
            stdout=subprocess.DEVNULL,
            stderr=w,
            env=env,
            cwd=cwd,
        )
    finally:
        os.close(w)

    def up() -> bool:
        assert proc.poll() is None, "the daemon exited"
        try:
            return status_of(sock)["pid"] == proc.pid
        except DaemonError:
            return False

    wait_for(up, 120, "the daemon")
    return proc, r


def _cycles(sc: Path, sock: Path, n: int) -> None:
    for i in range(n):
        try:
            with attach(sc, socket=sock, timeout=5) as w:
                assert len(w) > 0
        except DaemonError as e:
            pytest.fail(f"attach/detach cycle {i} failed with the log reader stalled: {e}")


def _drain(r: int) -> str:
    fl = fcntl.fcntl(r, fcntl.F_GETFL)
    fcntl.fcntl(r, fcntl.F_SETFL, fl | os.O_NONBLOCK)
    out = b""
    try:
        while chunk := os.read(r, 65536):
            out += chunk
    except BlockingIOError:
        pass
    fcntl.fcntl(r, fcntl.F_SETFL, fl)
    return out.decode()


def test_a_stalled_log_reader_does_not_stop_serving(sc, env, tmp_path):
    sock = tmp_path / "s.sock"
    proc, r = _serve_into_stalled_pipe(sc, sock, env, tmp_path)
    try:
        _cycles(sc, sock, 700)  # 1,400 events: the pipe and the log queue are full
        assert status_of(sock, timeout=5)["pid"] == proc.pid

        text = [_drain(r)]

        def read_on() -> None:  # the reader comes back, and reads until the daemon exits
            while chunk := os.read(r, 65536):
                text.append(chunk.decode())

        t = threading.Thread(target=read_on, daemon=True)
        t.start()
        cycles = [700]

        def reported() -> bool:  # the next event that finds room reports what was lost
            _cycles(sc, sock, 1)
            cycles[0] += 1
            return "log-dropped lines=" in "".join(text)

        wait_for(reported, 10, "the log-dropped line")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        t.join(10)
        log = "".join(text)
        lines = log.splitlines()
        assert log.endswith("\n") and all(" mpack serve: " in x for x in lines), log[-2000:]
        dropped = sum(int(x.rpartition("lines=")[2]) for x in lines if "log-dropped" in x)
        attached = sum(" attached " in x for x in lines)
        detached = sum(" detached " in x for x in lines)
        assert dropped > 0 and attached + detached + dropped == 2 * cycles[0]
        assert "stopped" in lines[-1] and f"log_dropped={dropped}" in lines[-1]
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(r)


def test_a_daemon_with_a_stalled_log_reader_still_stops_cleanly(sc, env, tmp_path):
    sock = tmp_path / "s.sock"
    proc, r = _serve_into_stalled_pipe(sc, sock, env, tmp_path)
    try:
        _cycles(sc, sock, 100)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0  # no "could not acquire lock ... at interpreter shutdown"
        assert time.monotonic() - t0 < 10
        assert not sock.exists() and not sock.with_name(sock.name + P.LOCK_SUFFIX).exists()
        log = _drain(r)
        assert log.endswith("\n") and "Fatal Python error" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(r)


# --- item 6: bad sockets beside a healthy daemon in `mpack status` ------------------------------


def _status_reply(**over: object) -> Reply:
    doc = {
        "type": P.STATUS,
        "sidecar": "/x",
        "digest": "0" * 64,
        "rank": 0,
        "tp_size": 1,
        "device": "cpu",
        "device_label": "cpu",
        "backend": "host",
        "bytes": 1,
        "socket": "/x",
        "pid": 1,
        "uptime_s": 1.0,
        "clients": [],
    }
    doc.update(over)
    body = {k: v for k, v in doc.items() if v is not None}

    def reply(conn: socket.socket, stop: threading.Event) -> None:
        _send_frame(conn, P.encode(body))

    return reply


def _raw_reply(data: bytes) -> Reply:
    def reply(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(data)

    return reply


BAD_PEERS = {
    "v2.sock": (_status_reply(v=2), "protocol version 2; this mpack speaks 1"),
    "garbage.sock": (_raw_reply(b"HTTP/1.1 400 Bad Request\r\n\r\n"), "not an mpack frame"),
    "noclients.sock": (_status_reply(clients=None), 'status reply has no "clients"'),
    "badclients.sock": (_status_reply(clients=[{"pid": "x"}]), 'without an integer "pid"'),
}


def test_status_lists_the_healthy_daemon_and_reports_each_bad_socket(sc, env, rdir, tmp_path):
    d = DaemonProc(sc, "cpu", env, tmp_path)
    peers = [FakePeer(rdir / name, reply) for name, (reply, _) in BAD_PEERS.items()]
    try:
        d.wait_ready()
        r = _cli(env, tmp_path, "status", "--json")
        assert r.returncode == 0, r.stderr
        docs = {Path(x["socket"]).name: x for x in json.loads(r.stdout)["daemons"]}
        assert docs[d.socket.name]["state"] == "serving" and docs[d.socket.name]["pid"] == d.pid
        for name, (_, says) in BAD_PEERS.items():
            assert docs[name]["state"] == "error", docs[name]
            assert says in docs[name]["reason"] and str(rdir / name) in docs[name]["reason"]
        assert len(docs) == 1 + len(BAD_PEERS)

        r = _cli(env, tmp_path, "status")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert str(d.pid) in r.stdout
        for name, (_, says) in BAD_PEERS.items():
            assert f"no usable answer at {rdir / name}: " in r.stdout and says in r.stdout

        r = _cli(env, tmp_path, "status", str(sc))
        assert r.returncode == 0 and str(d.pid) in r.stdout, r.stdout + r.stderr
        assert "no usable answer" not in r.stdout  # those sockets are not named after sc

        for name, (_, says) in BAD_PEERS.items():  # a bad peer asked for by name: not a bug
            r = _cli(env, tmp_path, "status", "--socket", str(rdir / name))
            assert r.returncode == 2, (name, r.stderr)
            assert r.stderr.startswith("error: ") and says in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and "internal error" not in r.stderr
        assert d.stop() == 0
    finally:
        for p in peers:
            p.__exit__()
        d.stop(signal.SIGKILL)


# --- item 7: `status SIDECAR` finds a daemon under a custom socket name -------------------------


def test_status_sidecar_finds_a_daemon_with_a_custom_socket_name(sc, env, rdir, tmp_path):
    sock = rdir / "my-model.sock"
    r = _cli(env, tmp_path, "status", str(sc))
    assert r.returncode == 2  # the documented readiness probe: not ready yet
    d = DaemonProc(sc, "cpu", env, tmp_path, "--socket", str(sock))
    try:
        assert d.wait_ready().socket == sock
        assert not list(rdir.glob(f"*{P.POINTER_SUFFIX}"))  # in the runtime directory: no pointer
        r = _cli(env, tmp_path, "status", str(sc))  # `until mpack status SIDECAR; do ...`
        assert r.returncode == 0 and str(d.pid) in r.stdout, r.stdout + r.stderr
        r = _cli(env, tmp_path, "status", str(sc), "--json")
        (doc,) = json.loads(r.stdout)["daemons"]
        assert doc["state"] == "serving" and doc["socket"] == str(sock) and doc["pid"] == d.pid
        other = make_sidecar(tmp_path / "other", seed=1)
        assert load_manifest(other)[1] != doc["manifest_digest"] == load_manifest(sc)[1]
        assert _cli(env, tmp_path, "status", str(other)).returncode == 2  # serves sc, not other
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)
