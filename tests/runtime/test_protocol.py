"""The wire format and the rendezvous rules, in-process (the daemon tests use them for real)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mpack import ui
from mpack.errors import DaemonError, UsageError
from mpack.runtime import protocol as P
from mpack.runtime import spawn as S


def test_frame_round_trip_and_version_is_added():
    raw = P.encode({"type": P.STATUS})
    assert raw[:4] == P.MAGIC and int.from_bytes(raw[4:8], "little") == len(raw) - 8
    buf = bytearray(raw + b"extra")
    assert P.take_message(buf, P.MAX_REQUEST_BYTES) == {"v": P.PROTOCOL_VERSION, "type": P.STATUS}
    assert buf == b"extra"


def test_incomplete_frames_wait_for_more():
    raw = P.encode({"type": P.STATUS})
    for cut in (0, 3, 8, len(raw) - 1):
        assert P.take_message(bytearray(raw[:cut]), P.MAX_REQUEST_BYTES) is None


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"HTTP/1.1", P.BAD_MESSAGE),
        (P.HEADER.pack(P.MAGIC, 0), P.BAD_MESSAGE),
        (P.HEADER.pack(P.MAGIC, P.MAX_REQUEST_BYTES + 1), P.TOO_LARGE),
    ],
)
def test_bad_headers_are_rejected_before_the_body_arrives(data, code):
    with pytest.raises(P.WireError) as e:
        P.take_message(bytearray(data), P.MAX_REQUEST_BYTES)
    assert e.value.code == code


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"\xff", P.BAD_MESSAGE),
        (b"[]", P.BAD_MESSAGE),
        (b"[" * 100000 + b"]" * 100000, P.BAD_MESSAGE),
        (b'{"type": "status"}', P.BAD_MESSAGE),
        (b'{"v": true, "type": "status"}', P.BAD_MESSAGE),
        (b'{"v": 2, "type": "status"}', P.VERSION),
        (b'{"v": 1, "type": 7}', P.BAD_MESSAGE),
    ],
)
def test_bad_bodies(body, code):
    with pytest.raises(P.WireError) as e:
        P.decode(body)
    assert e.value.code == code


def test_request_schema():
    ok = {"v": 1, "type": P.ATTACH, "digest": "a" * 64, "rank": 0, "device": "cpu"}
    assert P.check_request(ok) is ok
    assert P.check_request({"v": 1, "type": P.STATUS})
    for bad in ({"digest": "A" * 64}, {"rank": True}, {"rank": 1.0}, {"device": ""}, {"device": 3}):
        with pytest.raises(P.WireError) as e:
            P.check_request({**ok, **bad})
        assert e.value.code == P.BAD_MESSAGE
    with pytest.raises(P.WireError) as e:
        P.check_request({"v": 1, "type": "attached"})  # a reply type is not a request
    assert e.value.code == P.UNKNOWN_TYPE


def test_recv_message_collects_fds_and_caps_replies():
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        socket.send_fds(a, [P.encode({"type": P.ATTACHED})], [r])
        msg, fds = P.recv_message(b)
        assert msg["type"] == P.ATTACHED and len(fds) == 1
        os.close(fds[0])
        a.sendall(P.HEADER.pack(P.MAGIC, 1000))
        with pytest.raises(P.WireError, match="exceeds"):
            P.recv_message(b, cap=100)
        a.close()
        with pytest.raises(P.WireError, match="closed"):
            P.recv_message(b)
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()


def test_peer_credentials_are_the_kernel_s():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert P.peer_credentials(a) == (os.getpid(), os.getuid(), os.getgid())


def test_device_parsing():
    assert (P.checked_device("cpu").kind, P.checked_device("CPU").kind) == ("cpu", "cpu")
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0"):
        with pytest.raises(UsageError, match="^device must be"):  # the API's words
            P.checked_device(bad)
    with pytest.raises(UsageError, match="device='cuda:9999': no .*CUDA device here"):
        P.checked_device("cuda:9999")  # past the last device, or none at all
    assert P.resolve_device("cpu") == P.Device("cpu", None, "cpu")


def test_socket_names_come_from_digest_rank_and_device(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = P.socket_path("ab" * 32, 3, "cuda:GPU-1234", create=True)
    assert path == tmp_path / "mpack" / f"{'ab' * 8}-r3-gpu-1234.sock"
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert P.runtime_dir() == Path(f"/tmp/mpack-{os.getuid()}")


def test_a_runtime_dir_others_can_enter_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "mpack").mkdir(mode=0o755)
    os.chmod(tmp_path / "mpack", 0o755)
    with pytest.raises(DaemonError, match="mode 0700"):
        P.runtime_dir()
    (tmp_path / "mpack").rmdir()
    (tmp_path / "mpack").symlink_to(tmp_path)  # a symlink is not a directory we own
    with pytest.raises(DaemonError):
        P.runtime_dir()


def test_too_long_socket_paths_are_refused():
    with pytest.raises(DaemonError, match="longer than 107"):
        P.check_socket_path(Path("/tmp/" + "x" * 120))


READY_INFO = {
    "socket": "/run/user/1000/mpack/3f0c-r0-cpu.sock",
    "pid": 4242,
    "device": "cpu",
    "backend": "host",
    "bytes": 1625472,
    "load_s": 0.008,
    "rank": 0,
    "digest": "ab" * 32,
    "tp_size": 1,
}


def test_the_ready_line_round_trips(capsys):
    line = S.format_ready(READY_INFO)
    assert line.startswith("READY socket=/run/user/1000/mpack/3f0c-r0-cpu.sock pid=4242 ")
    assert "tp_size" not in line  # only READY_KEYS
    r = S.parse_ready(line + "\n")
    assert r == S.Ready(
        Path(READY_INFO["socket"]),
        4242,
        "cpu",
        "host",
        1625472,
        0.008,
        0,
        "ab" * 32,
        {k: str(READY_INFO[k]) for k in S.READY_KEYS},
    )
    ui.emit_ready(READY_INFO)  # what `mpack serve` prints
    assert capsys.readouterr().out == line + "\n"


def test_other_lines_are_not_ready_and_a_broken_ready_line_is_an_error():
    for other in ("", "READYsocket=/x", "2026-12-01T12:00:00 mpack serve: attached"):
        assert S.parse_ready(other) is None
    with pytest.raises(DaemonError, match="malformed READY line"):
        S.parse_ready("READY")
    broken = S.format_ready({**READY_INFO, "pid": "x"})
    with pytest.raises(DaemonError, match="malformed READY line"):
        S.parse_ready(broken)
    with pytest.raises(DaemonError, match="'digest'"):
        S.parse_ready(S.format_ready({k: v for k, v in READY_INFO.items() if k != "digest"}))


def test_importing_the_runtime_loads_neither_torch_nor_cuda_bindings(tmp_path):
    code = (
        "import sys\n"
        "import mpack.runtime, mpack.runtime.protocol, mpack.runtime.allocation\n"
        "import mpack.runtime.loader\n"
        "import mpack.runtime.memfd, mpack.runtime.cuda_vmm, mpack.runtime.daemon\n"
        "import mpack.runtime.client, mpack.runtime.weights, mpack.runtime.spawn\n"
        "mods = ('torch', 'cuda.bindings', 'numpy')\n"
        "print(json.dumps(sorted(m for m in mods if m in sys.modules)))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
