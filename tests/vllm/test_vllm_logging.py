"""The loader's log lines go through vLLM's logger (Note [one logger] in runtime/vllm/__init__.py).

A child process starts as every vLLM process does (the CPU stand-ins, then vLLM's
``configure_logging`` with the engine's default ``LoggingConfig``), and loads one rank the way
``--load-format mpack`` does (``rank_weights``): attached to a real ``mpack serve`` daemon, and
privately. Its log must carry one INFO line per load in vLLM's own format (process, pid,
level, time, file and line), naming attached or private, the daemon's pid, the bytes and the
time; and the pass-through line of the loader goes the same way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.rt_helpers import DaemonProc, child_env
from tests.runtime.sidecar_factory import make_sidecar

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent

CHILD = r"""
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[3])
import cpu_standins

cpu_standins.install()
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

configure_logging(LoggingConfig())  # what the engine core and each worker do first

from mpack.runtime.vllm.checks import Options
from mpack.runtime.vllm.loader import _log_passthrough
from mpack.runtime.vllm.source import rank_weights

sc, sock = Path(sys.argv[1]), sys.argv[2]
rank_weights(sc, Options(attach="require", socket=sock), 0, "cpu").close()
rank_weights(sc, Options(attach="never"), 0, "cpu").close()
rank_weights(sc, Options(attach="auto", socket=sock + ".none"), 0, "cpu").close()
report = {"in_place": 3, "in_place_bytes": 3 << 20, "copied": ["lm_head.weight"]}
_log_passthrough({**report, "copied_bytes": 1 << 20})
"""

#: vLLM 0.33.0's format (vllm/logger.py, ``_FORMAT`` and ``_DATE_FORMAT``).
VLLM_LINE = re.compile(
    r"^\((?P<proc>[^ ]+) pid=(?P<pid>\d+)\) (?P<level>INFO|WARNING) (?P<when>\d\d-\d\d "
    r"\d\d:\d\d:\d\d) \[(?P<file>[\w.]+):(?P<line>\d+)\] (?P<msg>mpack.*)$"
)


def test_one_info_line_per_rank_load_through_vllms_logger(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = child_env(xdg)
    sc = make_sidecar(tmp_path / "sc", layers=2, hidden=256, inter=512)
    d = DaemonProc(sc, "cpu", env, tmp_path)
    try:
        ready = d.wait_ready()
        r = subprocess.run(
            [sys.executable, "-c", CHILD, str(sc), str(ready.socket), str(HERE)],
            capture_output=True,
            text=True,
            env={**env, "VLLM_TARGET_DEVICE": "cpu", "NO_COLOR": "1"},
            cwd=tmp_path,
            timeout=600,
        )
    finally:
        d.stop()
        d.close()
    assert r.returncode == 0, r.stderr[-3000:]
    # vLLM's handler writes where VLLM_LOGGING_STREAM says (stdout by default in 0.33.0)
    out = r.stdout + r.stderr
    lines = [m for line in out.splitlines() if (m := VLLM_LINE.match(line))]
    msgs = [(m["level"], m["file"], m["msg"]) for m in lines]
    assert all(int(m["pid"]) != os.getpid() for m in lines)
    attached = f"mpack: rank 0 attached zero-copy to daemon pid {d.pid}: {ready.bytes} bytes ("
    private = f"mpack: rank 0 loaded privately (verified, no daemon): {ready.bytes} bytes ("
    assert [m for m in msgs if m[0] == "INFO" and m[2].startswith("mpack: rank 0")] == [
        ("INFO", "source.py", msgs[0][2]),
        ("INFO", "source.py", msgs[1][2]),
        ("INFO", "source.py", msgs[3][2]),
    ], msgs
    assert msgs[0][2].startswith(attached) and re.search(r" on cpu in \d+\.\d{3} s$", msgs[0][2])
    assert msgs[1][2].startswith(private) and re.search(r" on cpu in \d+\.\d{3} s$", msgs[1][2])
    assert msgs[2][0] == "WARNING" and "rank 0 loads privately: no daemon" in msgs[2][2]
    assert msgs[3][2].startswith(private)
    assert msgs[4] == (
        "INFO",
        "loader.py",
        "mpack pass-through: 3 tensors (3.0 MiB) used in place, 1 copied (1.0 MiB): lm_head.weight",
    )
    assert len(msgs) == 5, msgs
