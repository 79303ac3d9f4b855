"""What `mpack serve` says (Note [the daemon's events] in runtime/daemon.py): `--json` event lines
on stdout, the log on stderr (RFC 3339 UTC times and levels, `--log-format json`), and the
progress of a load.

The daemons are real ``mpack serve`` processes; the progress of a load is shown on a real fill
of a real sidecar into a destination slowed down between pieces (a fast disk on a small test
sidecar loads in milliseconds, before any progress line is due).
"""

from __future__ import annotations

import datetime
import json
import re
import signal
import subprocess
import sys
import time

import pytest

from mpack import ui
from mpack.runtime import attach
from mpack.runtime.allocation import plan_rank
from mpack.runtime.daemon import _LoadProgress, level_of
from mpack.runtime.loader import HostDest, fill
from mpack.runtime.sdnotify import Notifier
from mpack.runtime.spawn import parse_ready
from tests.runtime.rt_helpers import (
    DaemonProc,
    frame,
    private_runtime,
    raw_exchange,
    wait_for,
)
from tests.runtime.sidecar_factory import make_sidecar

TEXT_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<level>INFO|WARNING|ERROR) "
    r"mpack serve: (?P<event>[a-z-]+)(?: (?P<rest>.*))?$"
)


@pytest.fixture
def world(tmp_path):
    sc = make_sidecar(tmp_path / "sc", layers=2, hidden=256, inter=512)
    return tmp_path, private_runtime(tmp_path), sc


def utc(ts: str) -> datetime.datetime:
    """An RFC 3339 time with a ``Z``, parsed (and so proven to be one)."""
    assert ts.endswith("Z"), ts
    when = datetime.datetime.fromisoformat(ts[:-1] + "+00:00")
    assert when.utcoffset() == datetime.timedelta(0)
    return when


def _session(world, *args: str) -> DaemonProc:
    """A daemon that serves, is attached to twice, gets a bad request, and is stopped."""
    root, env, sc = world
    d = DaemonProc(sc, "cpu", env, root, *args)
    try:
        ready = d.wait_ready()
        with attach(sc, device="cpu", socket=ready.socket):
            pass
        with attach(sc, device="cpu", socket=ready.socket):
            pass
        raw_exchange(ready.socket, frame(b"not json"))
        wait_for(lambda: d.stderr().count(" detached ") + d.stderr().count('"detached"') >= 2)
        assert d.stop(signal.SIGTERM) == 0
    except BaseException:
        d.stop(signal.SIGKILL, 10)
        d.close()
        raise
    return d


def test_json_puts_one_event_per_line_on_stdout(world):
    t0 = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    d = _session(world, "--json")
    try:
        lines = d.stdout().splitlines()
        docs = [json.loads(line) for line in lines]  # every line is one JSON object
        events = [doc["event"] for doc in docs]
        assert events[0] == "loading" and events[-2:] == ["stopping", "stopped"], events
        order = [e for e in events if e in ("loading", "ready", "attached", "detached")]
        assert order == ["loading", "ready", "attached", "detached", "attached", "detached"]
        assert "bad-request" in events and "READY" not in d.stdout()
        for doc in docs:
            assert t0 <= utc(doc["ts"]) <= datetime.datetime.now(datetime.timezone.utc)
            assert doc["level"] == level_of(doc)
        (bad,) = [doc for doc in docs if doc["event"] == "bad-request"]
        assert bad["level"] == "WARNING" and bad["code"] == "bad-message"
        (ready,) = [doc for doc in docs if doc["event"] == "ready"]
        assert ready["pid"] == d.pid and ready["engine_version"] == "0.33.0"
        # the ready line is what mpack.runtime.spawn waits for, in both forms
        parsed = parse_ready(lines[events.index("ready")])
        assert parsed is not None and parsed.pid == d.pid and parsed.socket == d.ready.socket
        assert [doc["clients"] for doc in docs if doc["event"] == "attached"] == [1, 1]
        stopping = docs[events.index("stopping")]
        assert stopping["signal"] == "SIGTERM" and stopping["clients"] == 0
        # the log on stderr says the same, in text
        assert [m["event"] for m in map(TEXT_LINE.match, d.stderr().splitlines())] == events
    finally:
        d.close()


def test_the_text_log_has_utc_times_and_levels(world):
    d = _session(world)
    try:
        assert d.stdout().startswith("READY socket=")  # stdout is the READY line alone
        lines = d.stderr().splitlines()
        matches = [TEXT_LINE.match(line) for line in lines]
        assert all(matches), [line for line, m in zip(lines, matches, strict=True) if not m]
        for m in matches:
            utc(m["ts"])
        levels = {m["event"]: m["level"] for m in matches}
        assert levels["loading"] == levels["ready"] == levels["attached"] == "INFO"
        assert levels["bad-request"] == "WARNING"
        stamps = [utc(m["ts"]) for m in matches]
        assert stamps == sorted(stamps)  # each stamped when it happened
    finally:
        d.close()


def test_log_format_json(world):
    d = _session(world, "--log-format", "json")
    try:
        docs = [json.loads(line) for line in d.stderr().splitlines()]
        assert [doc["event"] for doc in docs][:2] == ["loading", "ready"]
        assert {doc["level"] for doc in docs} == {"INFO", "WARNING"}
        for doc in docs:
            utc(doc["ts"])
        # the objects of serve --json: ``ok``, the digest under its one --json name
        assert all(doc["ok"] is True and "digest" not in doc for doc in docs), docs
        ready = parse_ready(d.stdout())
        assert ready is not None and docs[1]["manifest_digest"] == ready.digest
        assert d.stdout().startswith("READY ")
    finally:
        d.close()


def _serve(world, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    root, base, sc = world
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", str(sc), *args],
        capture_output=True,
        text=True,
        env=env or base,
        cwd=root,
        timeout=120,
    )


def test_bad_log_format_and_progress_interval_exit_2(world):
    r = _serve(world, "--log-format", "xml")
    assert r.returncode == 2 and "--log-format 'xml': not one of text, json" in r.stderr
    r = _serve(world, env={**world[1], "MPACK_PROGRESS_EVERY": "0"})
    assert r.returncode == 2 and "MPACK_PROGRESS_EVERY" in r.stderr, r.stderr
    assert "loading" not in r.stderr


def test_an_error_before_ready_under_json_is_one_document(world):
    root, env, sc = world
    (sc / "mpack.json").write_text("{")
    r = _serve(world, "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error"]["exit_code"] == 2


# --- the progress of a load --------------------------------------------------------------------


class SlowDest(HostDest):
    """Host memory that takes ``delay`` seconds to accept each piece."""

    def __init__(self, buf, delay: float) -> None:
        super().__init__(buf)
        self.delay = delay

    def submit(self, i: int, offset: int, n: int) -> None:
        time.sleep(self.delay)


@pytest.mark.parametrize("chunk", [None, 4096], ids=["chunk-per-read", "pieces-of-a-chunk"])
def test_fill_reports_every_byte_it_loads(world, chunk):
    root, env, sc = world
    plan = plan_rank(sc, 0)
    got: list[int] = []
    kw = {} if chunk is None else {"chunk": chunk}
    fill(plan, HostDest(memoryview(bytearray(plan.size))), progress=got.append, **kw)
    assert sum(got) == sum(r.size for r in plan.regions) and len(got) >= len(plan.regions)


def test_a_long_load_reports_progress(world, monkeypatch):
    root, env, sc = world
    plan = plan_rank(sc, 0)
    monkeypatch.setattr("mpack.runtime.daemon.FIRST_PROGRESS_S", 0.1)
    events: list[dict] = []
    said: list[str] = []

    class Manager(Notifier):  # what a service manager would hear
        def send(self, *lines: str) -> bool:
            said.extend(lines)
            return True

    chunk = 16384  # about 70 pieces of 20 ms: 1.4 s
    with _LoadProgress(plan.size, 0.2, events.append, Manager(environ={})) as progress:
        fill(plan, SlowDest(memoryview(bytearray(plan.size)), 0.02), chunk=chunk, progress=progress)
    assert progress.done == sum(r.size for r in plan.regions)
    assert len(events) >= 3, events
    done = [e["bytes"] for e in events]
    assert done == sorted(done) and 0 < done[-1] <= plan.size
    assert all(e["event"] == "progress" and e["total"] == plan.size for e in events)
    assert all(0 <= e["percent"] <= 100 for e in events)
    assert any(line.startswith("STATUS=loading: ") for line in said), said
    line = ui.event_line({**events[0], "ts": time.time()})
    assert TEXT_LINE.match(line) and " progress bytes=" in line and " percent=" in line


def test_a_fast_load_reports_no_progress(world):
    root, env, sc = world
    plan = plan_rank(sc, 0)
    events: list[dict] = []
    with _LoadProgress(plan.size, 0.1, events.append, Notifier(environ={})) as progress:
        fill(plan, HostDest(memoryview(bytearray(plan.size))), progress=progress)
    assert events == []  # under FIRST_PROGRESS_S: loading, then ready, nothing between


def test_a_nested_field_reads_as_dotted_keys_in_the_text_log() -> None:
    event = {"event": "ready", "ts": time.time(), "startup": {"fill_s": 0.91, "verify": "auto"}}
    line = ui.event_line(event)
    assert TEXT_LINE.match(line), line
    assert " startup.fill_s=0.91" in line and " startup.verify=auto" in line, line
    assert "{" not in line  # no Python dict repr in the log
    doc = json.loads(ui.event_line(event, "json"))
    assert doc["startup"] == {"fill_s": 0.91, "verify": "auto"}  # JSON keeps the structure
