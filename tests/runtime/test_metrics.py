"""`mpack serve --metrics-port`: the Prometheus endpoint of a real daemon, scraped over HTTP.

Each test starts a real ``mpack serve`` process, reads the endpoint's URL from its READY line
(port 0: the kernel picks a free one, so tests never race for a port) and scrapes it with a
plain HTTP GET; the text is parsed with prometheus_client's own parser, as Prometheus would.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mpack.runtime import attach
from mpack.sidecar import load_manifest
from tests.runtime.rt_helpers import (
    DaemonProc,
    frame,
    private_runtime,
    raw_exchange,
    wait_for,
)
from tests.runtime.sidecar_factory import make_sidecar


@pytest.fixture
def world(tmp_path):
    sc = make_sidecar(tmp_path / "sc", layers=2, hidden=256, inter=512)
    return tmp_path, private_runtime(tmp_path), sc


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at ``url``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_off_by_default(world):
    root, env, sc = world
    d = DaemonProc(sc, "cpu", env, root)
    try:
        ready = d.wait_ready()
        assert ready.metrics is None and "metrics=" not in d.stdout()
    finally:
        d.stop()
        d.close()


def test_the_endpoint_counts_attaches_clients_bytes_and_failures(world):
    root, env, sc = world
    d = DaemonProc(sc, "cpu", env, root, "--metrics-port", "0")
    try:
        ready = d.wait_ready()
        assert ready.metrics is not None and ready.metrics.startswith("http://127.0.0.1:")
        m = scrape(ready.metrics)
        assert value(m, "mpack_ready") == 1
        assert value(m, "mpack_served_bytes") == ready.bytes
        assert value(m, "mpack_load_seconds") == pytest.approx(ready.load_s, abs=1e-3)
        assert value(m, "mpack_attached_clients") == 0
        assert value(m, "mpack_attaches_total") == 0
        assert value(m, "mpack_attach_failures_total", reason="mismatch") == 0
        _, digest = load_manifest(sc)
        info = {dict(k[1]).get("digest"): v for k, v in m.items() if k[0] == "mpack_serve_info"}
        assert info == {digest: 1.0}
        (labels,) = [dict(k[1]) for k in m if k[0] == "mpack_serve_info"]
        assert labels["rank"] == "0" and labels["engine_version"] == "0.33.0"
        assert labels["backend"] == "host" and labels["sidecar"] == str(sc.resolve())
        assert ("process_resident_memory_bytes", ()) in m  # prometheus_client's own

        with attach(sc, device="cpu", socket=ready.socket) as w1:
            w2 = attach(sc, device="cpu", socket=ready.socket)
            wait_for(lambda: value(scrape(ready.metrics), "mpack_attached_clients") == 2)
            m = scrape(ready.metrics)
            assert value(m, "mpack_attaches_total") == 2
            w2.close()
            assert w1.daemon_pid == d.pid
        wait_for(lambda: value(scrape(ready.metrics), "mpack_attached_clients") == 0)

        other = {"type": "attach", "digest": "0" * 64, "rank": 0, "device": "cpu", "v": 1}
        reply, _, _ = raw_exchange(ready.socket, frame(json.dumps(other).encode()))
        assert reply is not None and reply["code"] == "mismatch"
        reply, _, _ = raw_exchange(ready.socket, frame(b"not json"))
        assert reply is not None and reply["code"] == "bad-message"
        m = scrape(ready.metrics)
        assert value(m, "mpack_attach_failures_total", reason="mismatch") == 1
        assert value(m, "mpack_attach_failures_total", reason="bad-message") == 1
        assert value(m, "mpack_attaches_total") == 2  # failures are not attaches
        url = ready.metrics
        assert d.stop(signal.SIGTERM) == 0
        with pytest.raises(OSError):  # the endpoint goes with the daemon
            urllib.request.urlopen(url, timeout=5)
    finally:
        d.stop()
        d.close()


def _serve(env, root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=120,
    )


def test_a_port_in_use_is_refused_before_the_load(world):
    root, env, sc = world
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = _serve(env, root, str(sc), "--metrics-port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}: in use" in r.stderr, r.stderr
    assert "loading" not in r.stderr and "READY" not in r.stdout  # refused before the fill


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--metrics-port", "70000"], "--metrics-port 70000: not a TCP port"),
        (["--metrics-port", "-1"], "--metrics-port -1: not a TCP port"),
        (["--metrics-addr", "0.0.0.0"], "without --metrics-port"),
        (["--metrics-port", "0", "--metrics-addr", "203.0.113.7"], "cannot serve metrics on"),
    ],
)
def test_bad_metrics_options_exit_2(world, args, says):
    root, env, sc = world
    r = _serve(env, root, str(sc), *args)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
