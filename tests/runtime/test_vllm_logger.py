"""The loader's one logger (Note [one logger] in runtime/vllm/__init__.py), without vLLM: its
name is under ``vllm.``, it is made in one place, and a rank's load logs one INFO line naming
attached or private, the daemon's pid, the bytes and the time. (Through vLLM's own handler, in
its format: tests/vllm/test_vllm_logging.py.)"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

from mpack.runtime.vllm import LOGGER_NAME, logger
from mpack.runtime.vllm.checks import Options
from mpack.runtime.vllm.source import rank_weights
from tests.runtime.rt_helpers import DaemonProc, child_env
from tests.runtime.sidecar_factory import make_sidecar

VLLM_PKG = Path(__file__).resolve().parents[2] / "runtime" / "vllm"


def test_the_logger_is_vllms_and_made_in_one_place():
    assert LOGGER_NAME.startswith("vllm.") and logger().name == LOGGER_NAME
    makers = []
    for path in sorted(VLLM_PKG.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("getLogger", "init_logger"):
                    makers.append(f"{path.name}:{node.lineno}")
    assert makers and all(m.startswith("__init__.py:") for m in makers), makers


def test_a_load_logs_one_info_line(tmp_path, caplog):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = child_env(xdg)
    sc = make_sidecar(tmp_path / "sc", layers=2, hidden=256, inter=512)
    d = DaemonProc(sc, "cpu", env, tmp_path)
    try:
        ready = d.wait_ready()
        with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
            rank_weights(sc, Options(attach="require", socket=str(ready.socket)), 0, "cpu").close()
            rank_weights(sc, Options(attach="never"), 0, "cpu").close()
    finally:
        d.stop()
        d.close()
    recs = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert [r.levelname for r in recs] == ["INFO", "INFO"], caplog.text
    attached, private = (r.getMessage() for r in recs)
    assert re.fullmatch(
        rf"mpack: rank 0 attached zero-copy to daemon pid {d.pid}: {ready.bytes} bytes "
        r"\(0\.00 GiB\) on cpu in \d+\.\d{3} s",
        attached,
    ), attached
    assert re.fullmatch(
        rf"mpack: rank 0 loaded privately \(verified, no daemon\): {ready.bytes} bytes "
        r"\(0\.00 GiB\) on cpu in \d+\.\d{3} s",
        private,
    ), private
