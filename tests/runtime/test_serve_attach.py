"""serve/attach with real processes and sockets, on the host backend and (marked gpu) on CUDA.

Every test runs once per device: ``cpu`` (memfd backend, always) and ``cuda:0`` (VMM backend,
``gpu`` marker: skipped without a GPU). Daemons are ``python -m mpack.cli serve`` processes and
clients are ``probe_client.py`` processes; both are killed in the fixtures' finalizers. The
measurements (attach time, how writes failed) are printed at the end of the module.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mpack.errors import DaemonError, UsageError
from mpack.runtime import attach
from mpack.runtime import protocol as P
from mpack.runtime.spawn import DaemonHandle, spawn
from tests.conftest import flip_byte
from tests.runtime.rt_helpers import (
    DaemonProc,
    Probe,
    child_env,
    fd_count,
    frame,
    holders_of,
    memfd_inodes_of,
    raw_connect,
    raw_exchange,
    rss,
    status,
    wait_for,
)
from tests.runtime.sidecar_factory import digest_of_tensors, expected_tensors, make_sidecar

HERE = Path(__file__).resolve().parent
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda:0", id="cuda", marks=pytest.mark.gpu),
]
# cpu: ~6 MiB per rank; cuda: ~84 MiB, so a copy would show in the device's free memory.
SIZES = {
    "cpu": {"layers": 2, "hidden": 512, "inter": 1024},
    "cuda:0": {"layers": 2, "hidden": 2048, "inter": 4096},
}


class World:
    """One module's daemons, clients and sidecars for one device; cleaned up at the end."""

    def __init__(self, root: Path, device: str) -> None:
        self.root, self.device = root, device
        self.xdg = root / "xdg"
        self.xdg.mkdir(mode=0o700)
        self.env = child_env(self.xdg)
        self.daemons: list[DaemonProc] = []
        self.probes: list[Probe] = []
        self.sidecars: dict[int, Path] = {}
        self.measured: dict[str, object] = {}

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def sidecar(self, seed: int = 0) -> Path:
        if seed not in self.sidecars:
            self.sidecars[seed] = make_sidecar(
                self.root / f"sidecar-{seed}", seed=seed, **SIZES[self.device]
            )
        return self.sidecars[seed]

    def daemon(self, sidecar: Path, *extra: str) -> DaemonProc:
        d = DaemonProc(sidecar, self.device, self.env, self.root, *extra)
        self.daemons.append(d)
        return d

    def probe(self, sidecar: Path, *extra: str) -> Probe:
        p = Probe(sidecar, self.device, self.env, self.root, *extra)
        self.probes.append(p)
        return p

    def cleanup(self) -> None:
        for p in self.probes:
            p.kill()
        for d in self.daemons:
            d.stop(signal.SIGKILL, 10)


@pytest.fixture(scope="module", params=DEVICES)
def world(request, tmp_path_factory):
    w = World(tmp_path_factory.mktemp(f"rt-{request.param.replace(':', '')}"), request.param)
    yield w
    w.cleanup()
    if w.measured:
        plugins = request.config.pluginmanager
        tr, capman = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        line = ", ".join(f"{k}={v}" for k, v in w.measured.items())
        if tr is not None and capman is not None:
            with capman.global_and_fixture_disabled():
                tr.write_line(f"\nmpack runtime [{w.device}]: {line}")
        out = os.environ.get("OUT")
        if out and os.path.isdir(out):
            name = f"runtime-{w.device.replace(':', '')}.json"
            Path(out, name).write_text(json.dumps(w.measured, indent=2) + "\n")


@pytest.fixture(scope="module")
def served(world):
    """The module's shared daemon: sidecar seed 0, READY."""
    sc = world.sidecar(0)
    d = world.daemon(sc)
    d.wait_ready()
    return sc, d


def _expected(sc: Path) -> str:
    return digest_of_tensors(expected_tensors(sc))


@pytest.fixture
def runtime_env(world, monkeypatch):
    """This (pytest) process finds daemons the way the children do."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(world.xdg))


# --- sharing ---------------------------------------------------------------------------------


def test_four_clients_attach_at_once_and_share_the_bytes(world, served):
    sc, d = served
    probes = [world.probe(sc) for _ in range(4)]
    docs = [p.read() for p in probes]
    for doc in docs:
        assert doc["event"] == "attached", doc
        assert doc["digest"] == _expected(sc)
    st = status(d.socket)
    assert sorted(c["pid"] for c in st["clients"]) == sorted(p.pid for p in probes)
    model = docs[0]["nbytes"]
    if world.cuda:
        for doc in docs:  # the views are not torch allocations: nothing was copied
            assert doc["torch_allocated"] == 0
    else:
        (inode,) = memfd_inodes_of(d.pid)
        for doc in docs:
            (m,) = doc["mappings"]
            assert m["inode"] == inode, "every client maps the daemon's memfd"
            assert m["perms"] == "r--s", m  # read-only, shared
            assert m["Anonymous"] == 0, m  # no copy-on-write copy
            assert m["Rss"] >= model // 2, m  # the hash really read the mapped pages
            assert doc["rss_anon_delta"] < model // 4, doc  # and did not copy them
        for p in probes:  # with all four attached, the same physical pages are in each of them
            (m,) = p.cmd("maps")["mappings"]
            assert m["Shared_Clean"] + m["Shared_Dirty"] >= model // 2, m
    for p in probes:
        closed = p.cmd("close")
        assert closed["event"] == "closed"
        assert closed["mappings"] == []  # close() + dropping the views unmaps
        assert p.finish() == 0
    wait_for(lambda: status(d.socket)["clients"] == [], what="all clients detached")
    world.measured["attach_ms_4_at_once_max"] = round(max(doc["attach_ms"] for doc in docs), 1)


def test_a_write_fails_in_the_writer_only(world, served):
    sc, d = served
    reader = world.probe(sc)
    assert reader.read()["digest"] == _expected(sc)
    kinds = ["write", "copy-write"] if world.cuda else ["write"]
    for kind in kinds:
        writer = world.probe(sc)
        assert writer.read()["event"] == "attached"
        doc = writer.cmd(kind)
        rc = writer.proc.wait(60)
        assert doc is None or doc["event"] == "write-failed", doc  # never "wrote"
        assert rc != 0
        if not world.cuda:
            assert rc in (-signal.SIGSEGV, -signal.SIGBUS), rc  # a store to a PROT_READ page
        world.measured[f"{kind}_refused_by"] = doc["error"] if doc else f"signal {-rc}"
        assert reader.cmd("check")["digest"] == _expected(sc)
    assert d.alive()
    late = world.probe(sc)
    assert late.read()["digest"] == _expected(sc)
    for p in (reader, late):
        assert p.finish() == 0


def test_the_host_memfd_is_sealed(world, served):
    if world.cuda:
        pytest.skip("memfd seals are a host-backend property")
    sc, d = served
    from mpack.sidecar import load_manifest

    _, digest = load_manifest(sc)
    hello = P.encode({"type": P.ATTACH, "digest": digest, "rank": 0, "device": "cpu"})
    with raw_connect(d.socket) as s:
        s.sendall(hello)
        reply, fds = P.recv_message(s)
        (fd,) = fds
        try:
            size = reply["size"]
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            shared = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            before = shared[:16]
            private = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            private[:16] = b"\xff" * 16  # a private copy-on-write page, seen by nobody else
            assert shared[:16] == before
            private.close()
            shared.close()
        finally:
            os.close(fd)


# --- hostile or broken peers -----------------------------------------------------------------


def _bad_frames(digest: str, device_key: str) -> list[tuple[str, bytes, str]]:
    def j(obj) -> bytes:
        return frame(json.dumps(obj).encode())

    attach = {"v": 1, "type": "attach", "digest": digest, "rank": 0, "device": device_key}
    return [
        ("not a frame", b"GET / HTTP/1.0\r\n\r\n", P.BAD_MESSAGE),
        ("oversized", frame(b"", length=P.MAX_REQUEST_BYTES + 1), P.TOO_LARGE),
        ("4 GiB length", frame(b"", length=2**32 - 1), P.TOO_LARGE),
        ("empty", frame(b""), P.BAD_MESSAGE),
        ("not utf-8", frame(b"\xff\xfe{}"), P.BAD_MESSAGE),
        ("not json", frame(b"{'v': 1}"), P.BAD_MESSAGE),
        ("json array", j([1, 2]), P.BAD_MESSAGE),
        ("deeply nested", frame(b"[" * 30000 + b"]" * 30000), P.BAD_MESSAGE),
        ("huge integer", frame(b'{"v": 1' + b"0" * 5000 + b', "type": "status"}'), P.BAD_MESSAGE),
        ("no version", j({"type": "status"}), P.BAD_MESSAGE),
        ("version as string", j({"v": "1", "type": "status"}), P.BAD_MESSAGE),
        ("wrong version", j({**attach, "v": 2}), P.VERSION),
        ("no type", j({"v": 1}), P.BAD_MESSAGE),
        ("unknown type", j({"v": 1, "type": "frobnicate"}), P.UNKNOWN_TYPE),
        ("attach without fields", j({"v": 1, "type": "attach"}), P.BAD_MESSAGE),
        ("rank as string", j({**attach, "rank": "0"}), P.BAD_MESSAGE),
        ("negative rank", j({**attach, "rank": -1}), P.BAD_MESSAGE),
        ("rank as bool", j({**attach, "rank": False}), P.BAD_MESSAGE),
        ("digest not hex", j({**attach, "digest": "z" * 64}), P.BAD_MESSAGE),
        ("other digest", j({**attach, "digest": "0" * 64}), P.MISMATCH),
        ("other rank", j({**attach, "rank": 3}), P.MISMATCH),
        ("other device", j({**attach, "device": "cuda:GPU-0"}), P.MISMATCH),
    ]


def test_bad_messages_and_hanging_clients_do_not_hurt_the_daemon(world, served, runtime_env):
    sc, d = served
    from mpack.sidecar import load_manifest

    _, digest = load_manifest(sc)
    key = "cpu" if not world.cuda else P.resolve_device(world.device).key
    # Clients that connect and hang: silent, half a header, half a message.
    hangers = [raw_connect(d.socket) for _ in range(3)] + [raw_connect(d.socket) for _ in range(20)]
    hangers[1].sendall(P.MAGIC[:2])
    hangers[2].sendall(frame(b'{"v": 1', length=100))
    t0 = time.monotonic()
    assert status(d.socket)["pid"] == d.pid  # answered after the hangers were accepted (FIFO)
    time.sleep(0.1)
    fds_before = fd_count(d.pid)
    for name, data, code in _bad_frames(digest, key):
        reply, fds, closed = raw_exchange(d.socket, data)
        assert reply is not None and reply["type"] == P.ERROR, name
        assert reply["code"] == code, (name, reply)
        assert fds == [] and closed, name
    # File descriptors sent *to* the daemon are dropped by the kernel, not leaked.
    with raw_connect(d.socket) as s, open(os.devnull) as junk:
        os.set_inheritable(junk.fileno(), False)
        import socket as socket_mod

        socket_mod.send_fds(s, [P.encode({"type": P.STATUS})], [junk.fileno()] * 3)
        reply, _ = P.recv_message(s)
        assert reply["type"] == P.STATUS
    # While all that hangs, real requests are served at once.
    t1 = time.monotonic()
    with attach(sc, device=world.device) as w:
        assert len(w) > 0
    assert status(d.socket)["pid"] == d.pid
    assert time.monotonic() - t1 < 5.0
    wait_for(lambda: fd_count(d.pid) <= fds_before, 5, f"daemon fds back to {fds_before}")
    # The hanging connections are closed after HELLO_TIMEOUT_S (with a "timeout" error).
    for h in hangers[:3]:
        h.settimeout(P.HELLO_TIMEOUT_S + 10)
        try:
            reply, _ = P.recv_message(h)
            assert reply["code"] == P.TIMEOUT
        except (P.WireError, ConnectionResetError):
            pass  # closed without a reply is fine too
        h.close()
    assert time.monotonic() - t0 < P.HELLO_TIMEOUT_S + 5
    for h in hangers[3:]:
        h.close()
    assert d.alive()
    assert status(d.socket)["clients"] == []


def _python_for(uid: int) -> str | None:
    """An interpreter the given user may execute (the venv's may live under /root)."""
    for exe in (
        sys.executable,
        getattr(sys, "_base_executable", None),
        "/usr/bin/python3",
        shutil.which("python3"),
    ):
        if not exe:
            continue
        try:
            r = subprocess.run(
                [exe, "-I", "-S", "-c", "pass"],
                user=uid,
                group=uid,
                timeout=30,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0:
            return exe
    return None


# A stdlib-only client speaking the protocol from docs/RUNTIME.md (it runs as another user,
# who cannot import this checkout).
RAW_CLIENT = r"""
import json, os, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"uid": os.getuid(), "connect_error": e.errno})); sys.exit(0)
msg = {"v": 1, "type": "attach", "digest": sys.argv[2], "rank": 0, "device": sys.argv[3]}
body = json.dumps(msg).encode()
try:
    s.sendall(b"MPAK" + struct.pack("<I", len(body)) + body)
except OSError:
    pass  # a refused peer may find the connection closed already; the reply is still queued
buf, fds = b"", []
while len(buf) < 8 or len(buf) < 8 + struct.unpack("<I", buf[4:8])[0]:
    data, got, _, _ = socket.recv_fds(s, 1 << 16, 4)
    fds += got
    if not data:
        break
    buf += data
print(json.dumps({"uid": os.getuid(), "fds": len(fds), "reply": json.loads(buf[8:])}))
"""


def test_a_peer_with_another_uid_is_refused(world):
    if os.getuid() != 0:
        pytest.skip("running a client as another user needs root; see the peer_seam test")
    nobody = 65534
    exe = _python_for(nobody)
    if exe is None:
        pytest.skip("no interpreter that uid 65534 may run")
    sc = world.sidecar(17)  # its own: one daemon per sidecar, rank and device, whatever socket
    from mpack.sidecar import load_manifest

    _, digest = load_manifest(sc)
    key = "cpu" if not world.cuda else P.resolve_device(world.device).key
    sockdir = Path(tempfile.mkdtemp(prefix="mpack-uid-", dir="/tmp"))
    try:
        os.chmod(sockdir, 0o755)  # world-traversable: only the socket's own mode protects it
        d = world.daemon(sc, "--socket", str(sockdir / "s.sock"))
        d.wait_ready()
        assert (os.stat(d.socket).st_mode & 0o777) == 0o600

        def as_nobody() -> dict:
            r = subprocess.run(
                [exe, "-I", "-S", "-c", RAW_CLIENT, str(d.socket), digest, key],
                user=nobody,
                group=nobody,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)

        first = as_nobody()  # wall 1: the 0600 socket
        assert first["uid"] == nobody and first["connect_error"] == 13  # EACCES
        os.chmod(d.socket, 0o666)  # a misconfigured deployment: wall 2 must still hold
        second = as_nobody()
        assert second["fds"] == 0
        assert second["reply"]["type"] == "error" and second["reply"]["code"] == P.REFUSED
        assert "65534" in second["reply"]["message"]
        assert status(d.socket)["pid"] == d.pid  # still serving its own user
        assert "refused" in d.stderr() and "uid=65534" in d.stderr()
        assert d.stop() == 0
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_peer_uid_check_seam(world, tmp_path):
    """Any machine: a daemon that admits only another uid refuses us, from SO_PEERCRED."""
    if world.cuda:
        pytest.skip("the check is backend-independent; covered by the cpu run")
    sc = world.sidecar(19)  # its own, as above
    sock = tmp_path / "seam.sock"
    out = tmp_path / "seam.out"
    with open(out, "w") as o:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "peer_seam.py"), str(sc), str(sock)],
            stdout=o,
            stderr=subprocess.STDOUT,
            env=world.env,
            cwd=tmp_path,
        )
    try:
        wait_for(lambda: "READY" in out.read_text() or proc.poll() is not None, 60, "seam READY")
        assert proc.poll() is None, out.read_text()
        with pytest.raises(DaemonError, match=f"refused: uid {os.getuid()} may not"):
            attach(sc, socket=sock)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "'event': 'refused'" in out.read_text()
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --- corrupted sidecars ----------------------------------------------------------------------


CORRUPTIONS = ["data byte", "header byte", "common byte", "truncated", "format version"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupted_sidecar_is_refused(world, kind):
    sc = world.root / f"corrupt-{kind.replace(' ', '-')}"
    shutil.copytree(world.sidecar(5), sc)  # not the shared daemon's sidecar (same socket name)
    from mpack.sidecar import load_manifest

    prefix = load_manifest(sc)[1][:16]
    rank_file = sc / "rank-00-of-01.safetensors"
    if kind == "data byte":
        flip_byte(rank_file, rank_file.stat().st_size // 2, 0x01)
        expect = ["rank-00-of-01.safetensors", "sha256", "does not match", "refusing to serve"]
    elif kind == "header byte":
        flip_byte(rank_file, 12, 0x01)  # inside the JSON header
        expect = ["rank-00-of-01.safetensors"]
    elif kind == "common byte":
        flip_byte(sc / "common.safetensors", (sc / "common.safetensors").stat().st_size - 1, 0x01)
        expect = ["common.safetensors", "does not match"]
    elif kind == "truncated":
        os.truncate(rank_file, rank_file.stat().st_size - 1)
        expect = ["rank-00-of-01.safetensors", "truncated"]
    else:
        m = json.loads((sc / "mpack.json").read_text())
        m["format_version"] = 99
        (sc / "mpack.json").write_text(json.dumps(m))
        expect = ["format version 99", "mpack convert"]
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", str(sc), "--device", world.device],
        capture_output=True,
        text=True,
        env=world.env,
        cwd=world.root,
        timeout=300,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "READY" not in r.stdout
    said = "".join(x for x in r.stderr.splitlines(True) if " mpack serve: " not in x)  # its log
    assert "Traceback" not in r.stderr and said.startswith("error: ")
    for text in expect:
        assert text in r.stderr, (text, r.stderr)
    assert not list((world.xdg / "mpack").glob(prefix + "*.sock"))  # nothing left behind


# --- lifecycle -------------------------------------------------------------------------------


def test_daemon_sigkill_leaves_clients_working_and_a_new_daemon_starts(world):
    sc = world.sidecar(7)
    free_base = 0
    if world.cuda:
        import torch

        torch.empty(1, device=world.device)
        free_base = torch.cuda.mem_get_info(world.device)[0]
    d = world.daemon(sc)
    d.wait_ready()
    inodes = memfd_inodes_of(d.pid) if not world.cuda else set()
    p1 = world.probe(sc)
    a1 = p1.read()
    assert a1["digest"] == _expected(sc)
    if world.cuda:  # attached alone: the mapping adds no device memory
        assert a1["free_delta"] < a1["nbytes"] // 2, a1
        world.measured["attach_ms_alone"] = round(a1["attach_ms"], 1)
        world.measured["client_free_delta_MiB"] = round(a1["free_delta"] / 2**20, 1)
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    assert p1.cmd("check")["digest"] == _expected(sc)  # mappings outlive the daemon
    d2 = world.daemon(sc)
    assert d2.wait_ready().socket == d.socket  # the stale socket was replaced
    inodes |= memfd_inodes_of(d2.pid) if not world.cuda else set()
    p2 = world.probe(sc)
    assert p2.read()["digest"] == _expected(sc)
    assert p1.cmd("check")["digest"] == _expected(sc)
    world.measured["survives_daemon_sigkill"] = True
    # The memory is freed once the daemon and every client are gone.
    assert p1.finish() == 0 and p2.finish() == 0
    assert d2.stop() == 0
    if world.cuda:
        import torch

        wait_for(
            lambda: torch.cuda.mem_get_info(world.device)[0] >= free_base - 16 * 2**20,
            30,
            "device memory to come back",
        )
    else:
        assert len(inodes) == 2
        for inode in inodes:
            wait_for(lambda inode=inode: holders_of(inode) == [], 10, f"memfd {inode} freed")


def test_one_daemon_per_sidecar_rank_and_device(world, served):
    sc, d = served
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", str(sc), "--device", world.device],
        capture_output=True,
        text=True,
        env=world.env,
        cwd=world.root,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "already serves" in r.stderr and f"pid {d.pid}" in r.stderr
    assert d.alive() and status(d.socket)["pid"] == d.pid


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_daemon_cleanly(world, sig):
    sc = world.sidecar(11)
    d = world.daemon(sc)
    d.wait_ready()
    sock = d.socket
    assert sock.exists() and (os.stat(sock).st_mode & 0o777) == 0o600
    assert (os.stat(sock.parent).st_mode & 0o777) == 0o700
    assert d.stop(sig) == 0
    assert not sock.exists()
    assert not sock.with_name(sock.name + P.LOCK_SUFFIX).exists()
    assert "Traceback" not in d.stderr()


def test_spawn_hands_back_the_ready_fields_and_stops_the_daemon(world):
    """mpack.runtime.spawn, the harness of the tests, the demo and the benchmarks."""
    sc = world.sidecar(13)
    from mpack.sidecar import load_manifest

    with spawn(sc, device=world.device, env=world.env, cwd=world.root, timeout=120) as d:
        r = d.ready
        assert r is not None and r.pid == d.pid and d.alive()
        assert r.socket == d.socket and r.socket.exists() and r.rank == 0
        assert r.digest == d.digest == load_manifest(sc)[1]
        assert r.backend == ("cuda" if world.cuda else "host") and r.load_s >= 0
        assert r.bytes >= sum(f.stat().st_size for f in sc.glob("*.safetensors"))
        assert d.ready_s is not None and d.ready_s >= r.load_s
        assert status(d.socket)["pid"] == d.pid
    assert d.proc.returncode == 0 and not r.socket.exists()


def test_spawn_says_why_a_daemon_exited_before_ready(world, served):
    sc, d = served
    with pytest.raises(DaemonError, match="exited with code 2 before READY") as e:
        spawn(sc, device=world.device, env=world.env, cwd=world.root, timeout=120)
    assert "already serves" in str(e.value) and f"pid {d.pid}" in str(e.value)
    assert d.alive()


def test_a_daemon_not_ready_in_time_is_left_running(world):
    with DaemonHandle(world.sidecar(13), device=world.device, env=world.env, cwd=world.root) as d:
        with pytest.raises(DaemonError, match="not READY within 0.001 s"):
            d.wait_ready(0.001)  # not even the interpreter is up yet
        assert d.alive() and d.ready is None
        assert d.wait_ready(120).pid == d.pid
        assert d.stop() == 0


def test_100_attach_detach_cycles_leak_nothing(world, served, runtime_env):
    sc, d = served
    name = "model.layers.0.self_attn.qkv_proj.weight"

    def maps() -> int:
        return Path("/proc/self/maps").read_text().count("memfd:mpack:")

    def cycle() -> None:
        with attach(sc, device=world.device) as w:  # the default socket rule
            assert w[name].shape[0] > 0
            int(w[name].view(-1)[0])  # touch the memory

    for _ in range(10):
        cycle()
    gc.collect()
    wait_for(lambda: status(d.socket)["clients"] == [], what="warm-up detached")
    time.sleep(0.2)
    daemon_fds, daemon_rss = fd_count(d.pid), rss(d.pid)
    my_fds, my_maps = fd_count(os.getpid()), maps()
    t0 = time.perf_counter()
    for _ in range(100):
        cycle()
    world.measured["attach_detach_cycle_ms"] = round((time.perf_counter() - t0) * 10, 2)
    gc.collect()
    wait_for(lambda: status(d.socket)["clients"] == [], what="all cycles detached")
    # (the daemon closes a status connection right after its reply, so allow it a moment)
    wait_for(lambda: fd_count(d.pid) <= daemon_fds, 5, f"daemon fds back to {daemon_fds}")
    assert rss(d.pid) - daemon_rss < 2 * 2**20, (rss(d.pid), daemon_rss)
    assert fd_count(os.getpid()) == my_fds
    assert maps() == my_maps
    assert d.alive()


# --- status and errors -----------------------------------------------------------------------


def _cli(world: World, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", *args],
        capture_output=True,
        text=True,
        env={**world.env, "COLUMNS": "250"},
        cwd=world.root,
        timeout=120,
    )


def test_status_shows_what_is_served(world, served):
    sc, d = served
    p = world.probe(sc)
    assert p.read()["event"] == "attached"
    r = _cli(world, "status", "--json")
    assert r.returncode == 0, r.stderr
    (doc,) = [x for x in json.loads(r.stdout)["daemons"] if x.get("socket") == str(d.socket)]
    assert doc["state"] == "serving" and doc["pid"] == d.pid
    assert (
        doc["rank"] == 0
        and doc["tp_size"] == 1
        and doc["backend"] == ("cuda" if world.cuda else "host")
    )
    assert doc["bytes"] >= sum(f.stat().st_size for f in sc.glob("*.safetensors"))
    assert p.pid in [c["pid"] for c in doc["clients"]]
    assert doc["uptime_s"] > 0
    r = _cli(world, "status", str(sc))
    assert r.returncode == 0 and str(p.pid) in r.stdout and str(d.pid) in r.stdout, r.stdout
    r = _cli(world, "status", "--socket", str(d.socket), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["daemons"][0]["pid"] == d.pid
    r = _cli(world, "status", str(world.sidecar(9)))
    assert r.returncode == 2 and "no daemon serves" in r.stderr
    assert p.finish() == 0


def test_attach_errors_are_clear(world, served, runtime_env):
    sc, d = served
    other = world.sidecar(9)
    with pytest.raises(DaemonError, match="no daemon serves") as e:
        attach(other, device=world.device)
    assert "mpack serve" in (e.value.hint or "")
    with pytest.raises(UsageError, match="tp_size=1"):
        attach(sc, rank=1, device=world.device)
    with pytest.raises(DaemonError, match="refused: this daemon serves digest"):
        attach(other, device=world.device, socket=d.socket)
    assert d.alive()


# --- what attaching costs ----------------------------------------------------------------------


def test_views_are_made_on_first_use_and_kept(world, served, runtime_env):
    """Note [views on first use]: attaching makes no tensor view; a lookup makes one, once."""
    sc, d = served
    with attach(sc, device=world.device, socket=d.socket) as w:
        assert len(w) == len(list(w)) > 0 and w._views == {}
        name = next(iter(w))
        first = w[name]
        assert w[name] is first and list(w._views) == [name]
        assert first.untyped_storage().data_ptr() == w._base.untyped_storage().data_ptr()
        assert len(w._views) == 1  # iterating and len made no other view
    with pytest.raises(ValueError, match="closed"):
        w[name]


def test_a_non_canonical_manifest_is_served_under_the_digest_of_its_bytes(world, runtime_env):
    """Note [manifest digest]: the digest is the sha256 of the mpack.json bytes as they are, so
    a hand-edited manifest (same content, another encoding) names its own served sidecar."""
    import hashlib

    import torch

    from mpack.sidecar import MANIFEST_NAME, digest_of, load_manifest

    sc = world.root / "sidecar-reindented"
    if not sc.exists():
        shutil.copytree(world.sidecar(0), sc)
    path = sc / MANIFEST_NAME
    m = json.loads(path.read_text())
    path.write_text(json.dumps(m, indent=4))  # valid, not the canonical encoding
    _, digest = load_manifest(sc)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() != digest_of(m)
    d = world.daemon(sc)
    ready = d.wait_ready()
    assert ready.digest == digest
    with attach(sc, device=world.device, socket=d.socket) as w:
        assert w.digest == digest
        got = {k: w[k].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes() for k in w}
        assert digest_of_tensors(got) == _expected(world.sidecar(0))
    d.stop()
