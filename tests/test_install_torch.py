"""scripts/install_torch.sh: torch first, the CPU build where the index can give it, whatever build
it is afterwards.

The script runs against a stand-in `python` that records each pip call and plays an index that
answers or not, so no test here installs anything or needs the network. One test runs it for real
against this venv, which already has the torch that constraints.txt names.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install_torch.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# A stand-in interpreter: `-c` (the "is torch there" check, and the closing report) fails or
# prints; `-m pip ...` is logged, and fails when it names an index listed in $FAKE_DOWN.
FAKE_PY = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then
  case "$2" in *importlib.metadata*) echo "torch 9.9.9+fake installed"; exit 0;; esac
  exit 1
fi
echo "$*" >> "$FAKE_LOG"
for down in $FAKE_DOWN; do
  case " $* " in *" --index-url $down "*) echo "ERROR: unreachable $down"; exit 1;; esac
done
exit 0
"""


def _run(tmp_path: Path, torch_index: str | None, down: str = "") -> tuple[int, list[str], str]:
    py = tmp_path / "python"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    log = tmp_path / "pip.log"
    log.write_text("")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# pins\nnumpy==1.0\ntorch==2.13.0  # the CPU build on CI\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    env.update(FAKE_LOG=str(log), FAKE_DOWN=down)
    if torch_index is not None:
        env["TORCH_INDEX"] = torch_index
    r = subprocess.run(
        ["bash", str(SCRIPT), str(py), str(constraints)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.returncode, log.read_text().splitlines(), r.stdout + r.stderr


def test_cpu_index_first(tmp_path: Path) -> None:
    rc, calls, out = _run(tmp_path, None)
    assert rc == 0, out
    assert len(calls) == 1, calls
    assert f"--index-url {CPU_INDEX} torch==2.13.0" in calls[0]
    assert re.search(r"--timeout \d+ --retries [01] ", calls[0]), calls[
        0
    ]  # an unreachable index is cheap
    assert "torch 9.9.9+fake installed" in out  # whatever build came, it is reported, not judged


def test_unreachable_index_falls_back_to_the_configured_one(tmp_path: Path) -> None:
    rc, calls, out = _run(tmp_path, None, down=CPU_INDEX)
    assert rc == 0, out
    assert len(calls) == 2, calls
    assert "--index-url" in calls[0]
    assert calls[1] == "-m pip install -q torch==2.13.0"
    assert f"unreachable {CPU_INDEX}" in out  # the first attempt's failure is shown


def test_torch_index_names_another_index_or_none(tmp_path: Path) -> None:
    rc, calls, _ = _run(tmp_path, "https://mirror.example/torch-cpu")
    assert rc == 0 and len(calls) == 1
    assert "--index-url https://mirror.example/torch-cpu torch==2.13.0" in calls[0]
    rc, calls, _ = _run(tmp_path, "")
    assert rc == 0 and calls == ["-m pip install -q torch==2.13.0"]


def test_no_torch_pin_is_a_usage_error(tmp_path: Path) -> None:
    constraints = tmp_path / "c.txt"
    constraints.write_text("numpy==1.0\n")
    r = subprocess.run(
        ["bash", str(SCRIPT), sys.executable, str(constraints)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "no torch==VERSION line" in r.stderr


def test_skips_when_that_torch_is_importable() -> None:
    """This venv has constraints.txt's torch: nothing is installed (no pip call at all)."""
    pytest.importorskip("torch")
    r = subprocess.run(
        ["bash", str(SCRIPT), sys.executable, str(REPO / "constraints.txt")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_INDEX": "http://127.0.0.1:9/unused"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("already installed")


def test_the_makefile_installs_torch_only_through_the_script() -> None:
    """No target pins torch with a plain pip call (the public index's CUDA build on Linux), and
    none asserts which build it got."""
    make = (REPO / "Makefile").read_text()
    assert "torch.version.cuda" not in make
    plain = [
        line
        for line in make.splitlines()
        if "pip install" in line and re.search(r"\btorch==", line)
    ]
    assert not plain, plain
    assert make.count("scripts/install_torch.sh $(") == 3  # .venv, .venv-vllm and .venv-real
