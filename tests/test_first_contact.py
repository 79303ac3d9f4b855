"""What a new user meets first (issue 12): the Python API's result, the messages for the usual
mistakes, ``verify`` of a Hub-sourced sidecar, and ``status`` finding every daemon.

Real checkpoints (``mpack.fixtures``), real ``python -m mpack.cli`` processes (their runs start
together in ``runs`` so their imports overlap), a real Hugging Face cache read offline, real
daemons on CPU sidecars and real sockets.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("huggingface_hub")

from mpack.errors import UnsupportedSchemeError
from mpack.fixtures import make_checkpoint, make_int_checkpoint
from mpack.runtime import protocol as P
from mpack.runtime.client import query_status
from tests.convert.helpers import CliPool, assert_refused, cli, explain, manifest, sha256, snapshot
from tests.convert.hf_cache import add_repo
from tests.convert.test_hub_source import COMMIT
from tests.runtime.rt_helpers import DaemonProc, child_env
from tests.runtime.sidecar_factory import make_sidecar

REPO = "org/tiny"
CPU = ("--device", "cpu")


class Recorder(http.server.BaseHTTPRequestHandler):
    """A stand-in Hub (``HF_ENDPOINT``) that records every request and serves none."""

    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._refuse()

    def do_HEAD(self) -> None:  # noqa: N802
        self._refuse()

    def _refuse(self) -> None:
        Recorder.seen.append(f"{self.command} {self.path}")
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def hub_endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, hub_endpoint: str) -> Iterator[dict[str, Any]]:
    """Checkpoints, an HF cache holding one as org/tiny, and every CLI run of this module,
    started at once (each test waits for its own)."""
    root = tmp_path_factory.mktemp("first-contact").resolve()
    ck = make_checkpoint(root / "ckpt")
    ck2 = Path(shutil.copytree(ck, root / "ckpt-edited"))  # the same model, one file edited
    gen = ck2 / "generation_config.json"
    gen.write_text(gen.read_text().replace("{", '{\n  "temperature": 0.5,', 1))
    w4 = make_int_checkpoint(root / "w4a16", scheme="W4A16")
    cache = root / "hf-cache"
    add_repo(cache, REPO, {p.name: p.read_bytes() for p in sorted(ck.iterdir())}, COMMIT, ["main"])
    (root / "empty-cache").mkdir()
    hf = {"HF_HUB_CACHE": str(cache), "HF_HOME": str(root / "hf-home")}
    online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub_endpoint}  # any request is recorded
    out = {n: root / n for n in ("tp2", "hub", "refused", "w4-out", "again")}
    pool = CliPool()
    try:
        runs: dict[str, Any] = {
            "tp2": pool.submit("convert", ck, "-o", out["tp2"], "--tp", "2", *CPU)
        }
        runs["hub"] = pool.submit("convert", REPO, "-o", out["hub"], *CPU, env=hf)
        runs["w4a16"] = pool.submit("convert", w4, "-o", out["w4-out"], *CPU)

        def after(first: str, *args: Any, env: dict[str, str] | None = None, rc: int = 0) -> Any:
            """Run ``mpack ARGS`` once run ``first`` has ended with exit code ``rc``."""

            def run() -> Any:
                r = runs[first].result()
                assert r.returncode == rc, explain(r)
                return cli(*args, env=env)

            return pool.then(run)

        runs["other-target"] = after(
            "tp2",
            "convert",
            ck,
            "-o",
            out["tp2"],
            *CPU,
            "--profile",
            "w8a8-marlin",
            "--no-passthrough",
        )
        runs["other-source"] = after(  # the same -o: after the other run, never beside it
            "other-target", "convert", ck2, "-o", out["tp2"], "--tp", "2", *CPU, rc=2
        )
        runs["sidecar-as-source"] = after("tp2", "convert", out["tp2"], "-o", out["refused"], *CPU)
        runs["hub-sidecar-as-source"] = after(
            "hub", "convert", out["hub"], "-o", out["again"], *CPU
        )
        runs["verify-cached"] = after("hub", "verify", out["hub"], "--json", env={**hf, **online})
        runs["verify-not-cached"] = after(
            "hub",
            "verify",
            out["hub"],
            "--json",
            env={**hf, **online, "HF_HUB_CACHE": str(root / "empty-cache")},
        )
        yield {"root": root, "ck": ck, "ck2": ck2, "w4": w4, "out": out, "runs": runs}
    finally:
        pool.close()


def _result(world: dict[str, Any], name: str) -> subprocess.CompletedProcess:
    return world["runs"][name].result()


# --- 1. the Python API returns what the CLI's --json reports -----------------------------------


def test_convert_returns_the_result_not_just_the_manifest(world, tmp_path) -> None:
    from mpack.convert import ConvertResult, convert

    out = tmp_path / "out"
    r = convert(world["ck"], out, device="cpu")
    assert isinstance(r, ConvertResult)
    assert r.out == out.resolve() and r.up_to_date is False
    assert r.manifest == manifest(out)
    assert r.digest == sha256(out / "mpack.json")
    written = [f["size"] for f in r.manifest["files"] if f["name"].endswith(".safetensors")]
    assert r.bytes_written == sum(written) > 0
    assert r.seconds["total"] > 0

    again = convert(world["ck"], out, device="cpu")
    assert again.up_to_date is True and again.bytes_written == 0
    assert (again.digest, again.manifest) == (r.digest, r.manifest)

    p = cli("convert", world["ck"], "-o", out, *CPU, "--json")
    assert p.returncode == 0, explain(p)
    doc = json.loads(p.stdout)
    assert (doc["out"], doc["manifest_digest"], doc["up_to_date"]) == (str(r.out), r.digest, True)


# --- 2. a sidecar given as the source ------------------------------------------------------------


def test_a_sidecar_as_the_source_is_refused_naming_its_source(world) -> None:
    sc, ck = world["out"]["tp2"], world["ck"]
    r = _result(world, "sidecar-as-source")
    assert_refused(
        r,
        world["out"]["refused"],
        f"error: {sc} is already an mpack sidecar (made from {ck})",
        f"hint: convert the original checkpoint (mpack convert {ck} -o OUT)",
        f"mpack serve {sc}",
    )
    assert "also appears" not in r.stderr


def test_a_hub_made_sidecar_as_the_source_names_repo_and_commit(world) -> None:
    r = _result(world, "hub-sidecar-as-source")
    assert_refused(
        r,
        world["out"]["again"],
        f"is already an mpack sidecar (made from {REPO}@{COMMIT[:12]})",
        f"mpack convert {REPO} --revision {COMMIT} -o OUT",
    )


# --- 3. an int4 weight-only checkpoint -----------------------------------------------------------


def test_a_w4a16_checkpoint_is_refused_naming_its_scheme(world) -> None:
    r = _result(world, "w4a16")
    assert_refused(
        r,
        world["out"]["w4-out"],
        f"error: {world['w4']}/config.json: quantization scheme W4A16 (int4 weights, group size "
        "128) is not FP8; mpack converts compressed-tensors FP8 (float8_e4m3fn) checkpoints",
        "hint: use the model's FP8 checkpoint (llm-compressor preset FP8 or FP8_DYNAMIC",
    )
    assert "weight_packed" not in r.stderr and "weight_scale" not in r.stderr


@pytest.mark.parametrize(
    "scheme, label",
    [
        ("W8A16", "W8A16 (int8 weights, group size 128)"),
        ("W4A16_ASYM", "W4A16 (int4 weights, group size 128, asymmetric)"),
    ],
)
def test_the_library_names_integer_schemes_too(tmp_path, scheme: str, label: str) -> None:
    from mpack.convert import convert

    ck = make_int_checkpoint(tmp_path / "ckpt", scheme=scheme, layers=1)
    with pytest.raises(UnsupportedSchemeError) as e:
        convert(ck, tmp_path / "out", device="cpu")
    assert e.value.message.startswith(f"{ck}/config.json: quantization scheme {label} is not FP8")
    assert not (tmp_path / "out").exists()


# --- 4. another sidecar at -o: what differs ------------------------------------------------------


def test_another_sidecar_at_out_lists_the_target_differences(world) -> None:
    out = world["out"]["tp2"]
    before = snapshot(out)
    assert_refused(
        _result(world, "other-target"),
        out,
        f"error: {out} already holds a different sidecar (tp_size 2 -> 1, profile w8a16 -> "
        "w8a8-marlin, pass-through with common.safetensors -> without common.safetensors)\n",
        "--force",
        exists=True,
    )
    assert snapshot(out) == before


def test_another_sidecar_at_out_lists_the_source_differences(world) -> None:
    out, ck, ck2 = world["out"]["tp2"], world["ck"], world["ck2"]
    assert_refused(
        _result(world, "other-source"),
        out,
        f"error: {out} already holds a different sidecar (source path {ck.name} -> {ck2.name}, "
        "source file generation_config.json changed)\n",  # names only: Note [source path]
        exists=True,
    )


# --- 5. verify of a Hub-sourced sidecar: from the local cache, never the network -----------------


def test_verify_rederives_a_hub_sidecar_from_the_cache_offline(world) -> None:
    r = _result(world, "verify-cached")
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert doc["source_checked"] is True and doc["source_note"] is None
    assert doc["source"] == f"{REPO}@{COMMIT[:12]}"
    assert doc["tensors_compared"] > 0 and doc["layers_checked"] > 0
    assert Recorder.seen == []  # HF_HUB_OFFLINE=0 and a reachable endpoint: still no request


def test_verify_says_plainly_when_the_hub_source_is_not_cached(world) -> None:
    r = _result(world, "verify-not-cached")
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert doc["source_checked"] is False and doc["files_checked"] > 0
    note = doc["source_note"]
    assert f"{REPO}@{COMMIT}: not in the local Hugging Face cache" in note, note
    assert "only the files were checked" in note
    assert f"hf download {REPO} --revision {COMMIT}" in note and "--source DIR" in note
    assert Recorder.seen == []


# --- 6. status finds daemons started with --socket -----------------------------------------------


@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A CPU sidecar, a private XDG_RUNTIME_DIR (here and for the daemons), a socket directory."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    (tmp_path / "socks").mkdir(mode=0o700)
    return {
        "sc": make_sidecar(tmp_path / "sidecar"),
        "env": child_env(xdg),
        "sock": tmp_path / "socks" / "s.sock",
        "rdir": xdg / P.RUNTIME_SUBDIR,
        "tmp": tmp_path,
    }


def _status_cli(rt: dict[str, Any], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", "status", *args],
        capture_output=True,
        text=True,
        env={**rt["env"], "COLUMNS": "250"},
        cwd=rt["tmp"],
        timeout=120,
    )


def _serve(rt: dict[str, Any], *extra: str) -> DaemonProc:
    d = DaemonProc(rt["sc"], "cpu", rt["env"], rt["tmp"], *extra)
    try:
        d.wait_ready()
    except BaseException:
        d.stop(signal.SIGKILL)
        raise
    return d


def test_status_finds_a_daemon_started_with_socket(rt) -> None:
    d = _serve(rt, "--socket", str(rt["sock"]))
    try:
        r = _status_cli(rt, "--json")
        assert r.returncode == 0, r.stderr
        (doc,) = json.loads(r.stdout)["daemons"]
        assert doc["state"] == "serving" and doc["pid"] == d.pid
        assert doc["socket"] == str(rt["sock"])
        (ptr,) = rt["rdir"].glob(f"*{P.POINTER_SUFFIX}")
        assert doc["pointer"] == str(ptr)
        st = os.lstat(ptr)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
        assert json.loads(ptr.read_text())["socket"] == str(rt["sock"])
        r = _status_cli(rt, str(rt["sc"]))
        assert r.returncode == 0 and str(d.pid) in r.stdout, r.stdout + r.stderr
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)
    assert list(rt["rdir"].iterdir()) == []  # the pointer went with the daemon
    assert query_status() == []
    assert _status_cli(rt, str(rt["sc"])).returncode == 2


def test_a_killed_socket_daemon_is_stale_and_its_successor_replaces_the_pointer(rt) -> None:
    d = _serve(rt, "--socket", str(rt["sock"]))
    d.stop(signal.SIGKILL)
    (ptr,) = rt["rdir"].glob(f"*{P.POINTER_SUFFIX}")
    (doc,) = query_status()
    assert doc["state"] == "stale" and doc["socket"] == str(rt["sock"])
    assert doc["pointer"] == str(ptr) and "no daemon answers there" in doc["reason"]
    assert _status_cli(rt, str(rt["sc"])).returncode == 2

    d = _serve(rt, "--socket", str(rt["sock"]))
    try:
        (doc,) = query_status(sidecar=rt["sc"])
        assert doc["state"] == "serving" and doc["pid"] == d.pid
        assert [p.name for p in rt["rdir"].glob(f"*{P.POINTER_SUFFIX}")] == [ptr.name]
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)


def test_status_follows_only_pointers_that_are_ours_and_true(rt) -> None:
    d = _serve(rt)  # the default socket, in the runtime directory
    try:
        sock = d.socket
        assert sock.parent == rt["rdir"]
        assert not list(rt["rdir"].glob(f"*{P.POINTER_SUFFIX}"))  # status finds it without one
        doc = {"socket": str(sock), "pid": d.pid}
        lying = rt["rdir"] / f"aaaa-r0-cpu-at-1{P.POINTER_SUFFIX}"  # a pid that is not there
        lying.write_text(json.dumps({**doc, "pid": 1}))
        os.chmod(lying, 0o600)
        loose = rt["rdir"] / f"aaaa-r0-cpu-at-2{P.POINTER_SUFFIX}"  # mode 0644
        loose.write_text(json.dumps(doc))
        os.chmod(loose, 0o644)
        target = rt["tmp"] / "elsewhere.json"
        target.write_text(json.dumps(doc))
        os.chmod(target, 0o600)
        link = rt["rdir"] / f"aaaa-r0-cpu-at-3{P.POINTER_SUFFIX}"  # a symlink
        link.symlink_to(target)
        docs = {x.get("pointer", x["socket"]): x for x in query_status()}
        assert docs[str(sock)]["state"] == "serving" and docs[str(sock)]["pid"] == d.pid
        assert "pointer" not in docs[str(sock)]
        assert docs[str(lying)]["state"] == "stale"
        assert docs[str(lying)]["reason"] == f"the daemon there is pid {d.pid}, not 1"
        assert docs[str(loose)]["state"] == "stale" and "mode 0600" in docs[str(loose)]["reason"]
        assert docs[str(link)]["state"] == "stale" and "symbolic link" in docs[str(link)]["reason"]
        assert len(docs) == 4
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)


def test_a_socket_daemon_serves_even_where_it_cannot_leave_a_pointer(rt) -> None:
    rt["rdir"].mkdir(mode=0o755)  # not private: status refuses it, so no pointer goes there
    os.chmod(rt["rdir"], 0o755)
    d = _serve(rt, "--socket", str(rt["sock"]))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(rt["sock"]))
        assert list(rt["rdir"].iterdir()) == []
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)
    assert "no-pointer" in d.stderr() and str(rt["rdir"]) in d.stderr()


def test_the_public_verify_survives_its_own_import(tmp_path: Path) -> None:
    """``mpack.convert.verify`` is the function on every call, not the submodule that implements
    it (a submodule of the same name replaced the package attribute on first import)."""
    import mpack.convert as mc
    from mpack.fixtures import make_checkpoint

    ck = make_checkpoint(tmp_path / "ck", arch="llama", scheme="FP8", layers=1)
    mc.convert(ck, tmp_path / "sc", device="cpu")
    for _ in range(2):
        report = mc.verify(tmp_path / "sc", source=ck)
        assert report.source_checked is True and callable(mc.verify)
