"""SIGINT and SIGTERM stop a command the same way (Note [interrupts] in mpack/cli.py): the
cleanup runs (a convert leaves no work directory and no lock), one line is printed (one JSON
document under --json), and the exit code is 130 or 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpack import cli
from mpack.convert.output import work_dirs
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import cli_env, cli_popen, default_signals

#: ``mpack layout``, with the one call it makes replaced by one that sends this process
#: ``sys.argv[1]`` and then waits for it to act (``sys.argv[2:]``: more arguments)
SELF_SIGNAL = """
import os, signal, sys, time
from mpack import cli, target

def hit(n, k):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(0.5)  # a signal that stays ignored lets the command go on
    return n, k

target.padded_nk = hit
if sys.argv[1] == "SIGTERM" and "--ignored" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.exit(cli.main(["layout", "64", "128", *[a for a in sys.argv[2:] if a != "--ignored"]]))
"""


def _self_signal(name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SELF_SIGNAL, name, *extra],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
        preexec_fn=default_signals,
    )


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_is_one_line_and_its_exit_code(name: str, code: int) -> None:
    r = _self_signal(name)
    assert (r.returncode, r.stdout, r.stderr) == (code, "", f"mpack: interrupted ({name})\n")


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupt_under_json_is_one_error_document(name: str, code: int) -> None:
    r = _self_signal(name, "--json")
    assert r.returncode == code, r.stderr
    assert json.loads(r.stdout) == {
        "ok": False,
        "error": {
            "code": "Interrupted",
            "exit_code": code,
            "file": None,
            "hint": None,
            "message": f"interrupted ({name})",
        },
    }
    assert r.stderr == f"mpack: interrupted ({name})\n"


def test_an_ignored_sigterm_stays_ignored() -> None:
    """nohup and the like start mpack with a signal ignored: it must not stop mpack then."""
    r = _self_signal("SIGTERM", "--ignored", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["Np"] == 64


def test_the_handlers_are_put_back(capsys) -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["layout", "64", "128", "--json"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    capsys.readouterr()


# --- a convert stopped mid-write ------------------------------------------------------------

#: large enough that writing takes a while (~130 MB of fp8 weights): tests/convert/test_atomic.py
BIG = dict(hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=4, vocab=2048)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("big") / "big", **BIG)


def _writing(out: Path) -> bool:
    """True once a work directory of ``out`` holds a rank file past its first MiB."""
    return any(f.stat().st_size > 1 << 20 for d in work_dirs(out) for f in d.glob("rank-*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, extra", [(signal.SIGTERM, ()), (signal.SIGINT, ()), (signal.SIGTERM, ("--json",))]
)
def test_a_convert_stopped_mid_write_leaves_nothing(big, tmp_path, sig, extra) -> None:
    out = tmp_path / "out"
    proc = cli_popen("convert", big, "-o", out, "--device", "cpu", *extra)
    deadline = time.monotonic() + 120
    while not _writing(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    caught = _writing(out)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert caught, f"the conversion ended (exit {proc.returncode}) before it was caught writing"
    code = 128 + sig
    line = f"mpack: interrupted ({sig.name}); nothing was written to {out}"
    assert proc.returncode == code, stderr
    assert stderr.splitlines()[-1] == line and "Traceback" not in stderr, stderr
    if extra:
        err = json.loads(stdout)["error"]
        assert (err["code"], err["exit_code"], err["message"]) == (
            "Interrupted",
            code,
            line.removeprefix("mpack: "),
        )
    else:
        assert stdout == ""
    assert os.listdir(tmp_path) == []  # no OUT, no work directory, no lock


@pytest.mark.slow
def test_an_interrupt_leaves_an_existing_sidecar_as_it_was(big, tmp_path) -> None:
    out = tmp_path / "out"
    first = cli_popen("convert", big, "-o", out, "--device", "cpu")
    assert first.wait(timeout=300) == 0, first.communicate()[1]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    proc = cli_popen("convert", big, "-o", out, "--device", "cpu", "--force")
    deadline = time.monotonic() + 120
    while not _writing(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert stderr.splitlines()[-1] == f"mpack: interrupted (SIGTERM); {out} was left as it was"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert os.listdir(tmp_path) == ["out"]
