"""`mpack serve` against a hostile environment (red-team report, issue 11): a vanished output
reader, SIGHUP, planted lock and socket files, unsafe socket directories, a status connection
left open, and a CUDA device that is not there.

Real daemons (``python -m mpack.cli serve``), real sockets, real files. A daemon that should have
refused to start but printed READY is stopped at once, so a regression fails fast.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpack.errors import DaemonError, UsageError
from mpack.runtime import attach, load
from mpack.runtime import protocol as P
from mpack.runtime.client import status_of
from tests.runtime.rt_helpers import DaemonProc, child_env, fd_count, raw_connect, wait_for
from tests.runtime.sidecar_factory import make_sidecar

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")


@pytest.fixture(scope="module")
def sc(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("hostile-sc") / "sidecar")


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    return child_env(xdg)


def _serve_cmd(sc: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mpack.cli", "serve", str(sc), "--device", "cpu", *extra]


def _lock_of(sock: Path) -> Path:
    return sock.with_name(sock.name + P.LOCK_SUFFIX)


def _serve_expecting_refusal(sc: Path, sock: Path, env: dict, cwd: Path) -> tuple[int, str]:
    """Run ``serve --socket sock``; (exit code, stderr). A daemon that serves is stopped at once
    and the test fails."""
    d = DaemonProc(sc, "cpu", env, cwd, "--socket", str(sock))
    try:
        d.wait_ready()
    except DaemonError:  # it exited first (or hangs, which the exit code shows)
        return d.stop(signal.SIGKILL), d.stderr()
    d.stop(signal.SIGKILL)
    pytest.fail(f"serve started serving at {sock} instead of refusing")


def _assert_clean_refusal(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, (rc, err)
    said = "".join(x for x in err.splitlines(True) if " mpack serve: " not in x)  # its log
    assert said.startswith("error: ") and "Traceback" not in err and "internal error" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def _read_line(f, timeout: float = 120) -> bytes:
    """One line from a pipe, without blocking past ``timeout``."""
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(f, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"no line within {timeout} s (got {buf!r})")
            chunk = os.read(f.fileno(), 1)
            if not chunk:
                raise AssertionError(f"pipe closed after {buf!r}")
            buf += chunk
    return buf


def _attach_twice(sc: Path, sock: Path) -> None:
    for _ in range(2):
        with attach(sc, socket=sock) as w:
            assert len(w) > 0


# --- issue 11.2: the daemon outlives the reader of its output; SIGHUP stops it cleanly ---------


def test_the_daemon_outlives_the_reader_of_its_output(sc, env, tmp_path):
    """`mpack serve S 2>&1 | head -1`: READY read, then the reader goes away."""
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen(
        _serve_cmd(sc, "--socket", str(sock)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    try:
        while not (line := _read_line(proc.stdout)).startswith(b"READY "):
            assert b" mpack serve: " in line, line  # the log (2>&1) before READY: loading
        proc.stdout.close()  # what `head` does after its line
        _attach_twice(sc, sock)  # each attach and detach writes a log line into the dead pipe
        assert proc.poll() is None, "the daemon died writing a log line"
        assert status_of(sock)["pid"] == proc.pid
        _attach_twice(sc, sock)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # a clean stop stays clean with nowhere to log "stopped"
        assert not sock.exists() and not _lock_of(sock).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_reader_gone_before_ready_neither_kills_the_daemon_nor_fails_its_exit(sc, env, tmp_path):
    """`mpack serve S | true`: READY itself hits EPIPE; the line is dropped, the daemon serves,
    and the interpreter's final flush of stdout does not turn the clean stop into exit 120."""
    sock = tmp_path / "s.sock"
    err = tmp_path / "serve.err"
    with open(err, "w") as e:
        proc = subprocess.Popen(
            _serve_cmd(sc, "--socket", str(sock)),
            stdout=subprocess.PIPE,
            stderr=e,
            env=env,
            cwd=tmp_path,
        )
    proc.stdout.close()
    try:
        wait_for(lambda: sock.exists() or proc.poll() is not None, 120, "the socket")
        assert proc.poll() is None, err.read_text()
        _attach_twice(sc, sock)
        assert proc.poll() is None, err.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err.read_text()
        assert "Traceback" not in err.read_text() and "BrokenPipe" not in err.read_text()
        assert "stopped" in err.read_text()  # stderr was fine: only stdout's lines were dropped
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sighup_stops_the_daemon_cleanly(sc, env, tmp_path):
    d = DaemonProc(sc, "cpu", env, tmp_path, "--socket", str(tmp_path / "s.sock"))
    try:
        d.wait_ready()
        sock = d.socket
        assert sock.exists() and _lock_of(sock).exists()
        assert d.stop(signal.SIGHUP) == 0
        assert not sock.exists(), "SIGHUP left a stale socket"
        assert not _lock_of(sock).exists()
        assert "stopped" in d.stderr() and "Traceback" not in d.stderr()
    finally:
        d.stop(signal.SIGKILL)


# --- issue 11.3: planted lock and socket files, unsafe socket directories ----------------------


@pytest.fixture
def sticky(tmp_path) -> Path:
    """A world-writable sticky directory, as /tmp is."""
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(sc, env, tmp_path, sticky):
    victim = tmp_path / "root-owned-file"
    victim.write_bytes(b"precious\n")
    sock = sticky / "x.sock"
    _lock_of(sock).symlink_to(victim)
    rc, err = _serve_expecting_refusal(sc, sock, env, tmp_path)
    _assert_clean_refusal(rc, err, str(_lock_of(sock)), "symbolic link")
    assert victim.read_bytes() == b"precious\n"
    assert _lock_of(sock).is_symlink() and not sock.exists()


def test_a_lock_file_with_another_mode_is_refused(sc, env, tmp_path, sticky):
    sock = sticky / "x.sock"
    _lock_of(sock).write_bytes(b"somebody's\n")
    os.chmod(_lock_of(sock), 0o644)
    rc, err = _serve_expecting_refusal(sc, sock, env, tmp_path)
    _assert_clean_refusal(rc, err, str(_lock_of(sock)), "-rw-r--r--", "mode 0600")
    assert _lock_of(sock).read_bytes() == b"somebody's\n" and not sock.exists()


@as_root
def test_a_held_lock_of_another_user_is_refused_without_its_pid(sc, env, tmp_path, sticky):
    """Another user's lock file that names pid 1 and is held: root must not be told to kill 1."""
    sock = sticky / "x.sock"
    lock = _lock_of(sock)
    lock.write_bytes(b"1\n")
    os.chmod(lock, 0o600)
    os.chown(lock, NOBODY, NOBODY)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, err = _serve_expecting_refusal(sc, sock, env, tmp_path)
    finally:
        os.close(fd)
    _assert_clean_refusal(rc, err, str(lock), f"uid {NOBODY}")
    assert "pid 1" not in err and "kill 1" not in err
    assert lock.read_bytes() == b"1\n"


@as_root
def test_a_stale_socket_of_another_user_is_not_removed(sc, env, tmp_path, sticky):
    sock = sticky / "x.sock"
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(str(sock))
    planted.close()  # a stale socket file: nothing listens
    os.lchown(sock, NOBODY, NOBODY)
    ino = os.lstat(sock).st_ino
    rc, err = _serve_expecting_refusal(sc, sock, env, tmp_path)
    _assert_clean_refusal(rc, err, str(sock), f"uid {NOBODY}", "refuses to use or remove it")
    assert os.lstat(sock).st_ino == ino  # still theirs, still there
    assert not _lock_of(sock).exists()  # the lock was released and removed


def test_a_world_writable_socket_directory_is_refused(sc, env, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    rc, err = _serve_expecting_refusal(sc, d / "x.sock", env, tmp_path)
    _assert_clean_refusal(rc, err, str(d), "other users can write this directory")
    assert os.listdir(d) == []  # neither a lock file nor a socket was made there


def test_a_sticky_world_writable_socket_directory_works(sc, env, tmp_path, sticky):
    sock = sticky / "x.sock"
    d = DaemonProc(sc, "cpu", env, tmp_path, "--socket", str(sock))
    try:
        assert d.wait_ready().socket == sock
        st = os.lstat(sock)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
        assert os.lstat(_lock_of(sock)).st_mode & 0o777 == 0o600
        _attach_twice(sc, sock)
        assert d.stop() == 0
        assert os.listdir(sticky) == []
    finally:
        d.stop(signal.SIGKILL)


def test_a_stale_socket_of_our_own_is_replaced(sc, env, tmp_path):
    sock = tmp_path / "s.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(sock))
    old.close()
    d = DaemonProc(sc, "cpu", env, tmp_path, "--socket", str(sock))
    try:
        d.wait_ready()
        assert status_of(sock)["pid"] == d.pid
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)


# --- issue 11.15: a status connection is closed right after its reply --------------------------


def test_status_connections_close_right_after_the_reply(sc, env, tmp_path):
    sock = tmp_path / "s.sock"
    d = DaemonProc(sc, "cpu", env, tmp_path, "--socket", str(sock))
    try:
        d.wait_ready()
        base = fd_count(d.pid)
        with raw_connect(sock) as s:
            s.sendall(P.encode({"type": P.STATUS}))
            reply, fds = P.recv_message(s)
            assert reply["type"] == P.STATUS and fds == []
            s.settimeout(0.5)
            assert s.recv(1) == b"", "the daemon kept the status connection open"
        t0 = time.monotonic()
        assert status_of(sock)["pid"] == d.pid
        assert time.monotonic() - t0 < 0.5
        wait_for(lambda: fd_count(d.pid) <= base, 0.5, "the daemon to close the status connection")
        r = subprocess.run(
            [sys.executable, "-m", "mpack.cli", "status", "--socket", str(sock), "--json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=60,
        )
        assert r.returncode == 0 and str(d.pid) in r.stdout, r.stderr
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)


# --- issue 11.13: a CUDA device this machine does not have --------------------------------------


def _no_cuda() -> bool:
    import torch

    return torch.cuda.device_count() == 0


no_cuda_here = pytest.mark.skipif(not _no_cuda(), reason="this machine has a CUDA device")
NO_CUDA = "--device cuda:0: no CUDA device here (the CUDA driver reports none)"


@no_cuda_here
def test_serve_on_a_missing_cuda_device_is_a_usage_error(sc, env, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", str(sc), "--device", "cuda:0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    _assert_clean_refusal(r.returncode, r.stderr, NO_CUDA, "hint: use --device cpu")
    assert "READY" not in r.stdout


@no_cuda_here
@pytest.mark.parametrize("how", ["load", "attach"])
def test_load_and_attach_on_a_missing_cuda_device_are_usage_errors(sc, env, how, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    who = "torch" if how == "load" else "the CUDA driver"  # attach asks the driver, as serve
    no_device = rf"device='cuda:0': no CUDA device here \({who} reports none\)"  # API words
    with pytest.raises(UsageError, match=no_device) as e:
        (load if how == "load" else attach)(sc, device="cuda:0")
    assert "device='cpu'" in (e.value.hint or "")
    with pytest.raises(UsageError, match="device='cuda': no CUDA device here"):
        (load if how == "load" else attach)(sc, device="cuda")


# --- round 3: readiness, one daemon per rank whatever its socket, --socket that is no socket ----


@pytest.fixture(scope="module")
def sc2(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("hostile-sc2") / "sidecar", tp=2)


def _status(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", "status", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def test_a_sidecar_with_a_rank_unserved_is_not_ready(sc2, env, tmp_path):
    """TP 2, rank 0's daemon alone (rank 1's not started, then killed): `status SIDECAR`, the
    readiness probe, exits 2 naming rank 1 and what serves rank 0; both served: exit 0."""
    r0 = DaemonProc(sc2, "cpu", env, tmp_path)  # starts it; rank 1's is started below
    r1 = None
    try:
        r0.wait_ready()
        r = _status(env, tmp_path, sc2)
        _assert_clean_refusal(
            r.returncode, r.stderr, "not ready: no daemon serves rank 1", f"rank 0 by pid {r0.pid}"
        )
        assert "hint: start it: mpack serve" in r.stderr and "--rank 1 --device cpu" in r.stderr
        r = _status(env, tmp_path, sc2, "--json")
        assert r.returncode == 2 and "rank 1" in json.loads(r.stdout)["error"]["message"]

        r1 = DaemonProc(sc2, "cpu", env, tmp_path, "--rank", "1")
        r1.wait_ready()
        for extra in ([], ["--device", "cpu"], ["--device", "cpu", "--device", "cpu"]):
            r = _status(env, tmp_path, sc2, *extra)
            assert r.returncode == 0, (extra, r.stderr)
            assert str(r0.pid) in r.stdout and str(r1.pid) in r.stdout
        r = _status(env, tmp_path, sc2, "--device", "cpu", "--device", "cpu", "--device", "cpu")
        _assert_clean_refusal(r.returncode, r.stderr, "3 --device values for a sidecar of 2 ranks")

        r1.stop(signal.SIGKILL)  # its socket file stays behind, stale
        r = _status(env, tmp_path, sc2)
        _assert_clean_refusal(r.returncode, r.stderr, "no daemon serves rank 1")
        assert r0.stop() == 0
        r = _status(env, tmp_path, sc2)
        _assert_clean_refusal(r.returncode, r.stderr, "no daemon serves rank 0, rank 1")
    finally:
        for d in (r0, r1):
            if d is not None:
                d.stop(signal.SIGKILL)


def _refused_serve(sc: Path, env: dict, cwd: Path, *extra: str) -> tuple[int, str]:
    """Run ``serve`` that must refuse; (exit code, stderr). One that serves fails the test."""
    d = DaemonProc(sc, "cpu", env, cwd, *extra)
    try:
        d.wait_ready()
    except DaemonError:
        return d.stop(signal.SIGKILL), d.stderr()
    d.stop(signal.SIGKILL)
    pytest.fail(f"a second daemon of the same rank started serving ({extra})")


def test_a_second_daemon_of_the_same_rank_is_refused_whatever_its_socket(sc, env, tmp_path):
    """Two daemons of one (sidecar, rank, device) would map it twice: the second is refused,
    with the first one's pid and socket, at the default socket and at any --socket."""
    a, b = tmp_path / "a.sock", tmp_path / "b.sock"
    first = DaemonProc(sc, "cpu", env, tmp_path)  # the default socket
    try:
        default = first.wait_ready().socket
        rc, err = _refused_serve(sc, env, tmp_path, "--socket", str(a))
        _assert_clean_refusal(rc, err, f"pid {first.pid}, at {default}", "already serves")
        assert not a.exists() and not _lock_of(a).exists()
        assert status_of(default)["pid"] == first.pid
        assert first.stop() == 0
    finally:
        first.stop(signal.SIGKILL)
    first = DaemonProc(sc, "cpu", env, tmp_path, "--socket", str(a))
    try:
        first.wait_ready()
        for extra in ([], ["--socket", str(b)]):  # the default socket, and another path
            rc, err = _refused_serve(sc, env, tmp_path, *extra)
            _assert_clean_refusal(rc, err, f"pid {first.pid}, at {a}", "already serves")
        assert not b.exists() and not default.exists()
        assert status_of(a)["pid"] == first.pid
        assert first.stop() == 0
        assert os.listdir(default.parent) == []  # its locks and pointer went with it
    finally:
        first.stop(signal.SIGKILL)


def _not_a_socket(path: Path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    if kind == "file":
        path.write_bytes(b"not a socket\n")
        return "a regular file"
    path.mkdir()
    return "a directory"


@pytest.mark.parametrize("kind", ["fifo", "file", "dir"])
def test_status_socket_that_is_not_a_socket_says_what_it_is(env, tmp_path, kind):
    path = tmp_path / "x.sock"
    what = _not_a_socket(path, kind)
    r = _status(env, tmp_path, "--socket", path)
    _assert_clean_refusal(r.returncode, r.stderr, f"{path} is {what}, not a socket")
    assert "stale" not in r.stderr and "died" not in r.stderr
    # in the runtime directory, beside the daemons status lists: reported, not "stale"
    rdir = Path(env["XDG_RUNTIME_DIR"]) / P.RUNTIME_SUBDIR
    rdir.mkdir(mode=0o700, exist_ok=True)
    _not_a_socket(rdir / "y.sock", kind)
    r = _status(env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"no usable answer at {rdir / 'y.sock'}: {rdir / 'y.sock'} is {what}" in r.stdout
    assert "stale socket" not in r.stdout


def test_status_escapes_a_socket_name_holding_an_escape(env, tmp_path):
    """A stale socket whose name holds ESC [31m: listed escaped, never raw."""
    rdir = Path(env["XDG_RUNTIME_DIR"]) / P.RUNTIME_SUBDIR
    rdir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(rdir / "red\x1b[31m.sock"))
    stale.close()
    r = _status(env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr and "red\\x1b[31m.sock" in r.stdout, r.stdout
