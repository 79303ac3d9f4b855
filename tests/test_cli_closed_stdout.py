"""A closed stdout (`mpack inspect SC | head -1`) is not an error (Note [closed stdout] in
mpack/ui.py): the command finishes its work and exits with the code it would have had, quietly.

Every run gets a pipe whose reading end is closed before mpack starts, so each of its writes to
stdout fails with EPIPE: the harshest `| head` (one that has read what it wanted already).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpack.convert as mc
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import cli, cli_env


def _closed_pipe_run(*args: str | os.PathLike, stderr_too: bool = False) -> tuple[int, str]:
    """Run ``python -m mpack ARGS`` with stdout (and stderr, with ``stderr_too``) on a pipe
    nobody reads; return the exit code and what reached stderr."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "mpack", *map(str, args)],
            stdout=w,
            stderr=w if stderr_too else subprocess.PIPE,
            text=True,
            env=cli_env(),
            timeout=300,
        )
    finally:
        os.close(w)
    return p.returncode, p.stderr or ""


@pytest.fixture(scope="module")
def ck_sc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("closed-stdout")
    ck = make_checkpoint(root / "ck", arch="llama", scheme="FP8", layers=2)
    mc.convert(ck, root / "sc", device="cpu")
    return ck, root / "sc"


@pytest.mark.parametrize("args", [("inspect",), ("inspect", "--json"), ("verify",)])
def test_reading_commands_exit_0_quietly(ck_sc, args) -> None:
    _, sc = ck_sc
    code, err = _closed_pipe_run(args[0], sc, *args[1:])
    assert code == 0, err
    # no traceback, no "Exception ignored", no "Broken pipe"; verify's progress lines only
    assert [line for line in err.splitlines() if not line.startswith("verify: ")] == [], err


@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_convert_writes_the_whole_sidecar_and_exits_0(ck_sc, tmp_path, extra) -> None:
    ck, _ = ck_sc
    out = tmp_path / "out"
    code, err = _closed_pipe_run("convert", ck, "-o", out, "--device", "cpu", *extra)
    assert code == 0, err
    assert not [line for line in err.splitlines() if not line.startswith("convert: ")], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work dir, no lock
    r = cli("verify", out, "--source", ck, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["source_checked"] is True


def test_stdout_and_stderr_both_closed(ck_sc, tmp_path) -> None:
    """`mpack convert ... 2>&1 | head -1`: the progress lines go nowhere either."""
    ck, _ = ck_sc
    code, _ = _closed_pipe_run("convert", ck, "-o", tmp_path / "out", stderr_too=True)
    assert code == 0
    assert (tmp_path / "out" / "mpack.json").is_file()


def test_a_failure_keeps_its_own_code(tmp_path) -> None:
    code, err = _closed_pipe_run("inspect", tmp_path / "missing", "--json")
    assert code == 2
    assert err.startswith(f"error: {tmp_path / 'missing'}: no such sidecar directory"), err


def test_version_and_layout(tmp_path) -> None:
    for args in (("--version",), ("layout", "4096", "4096"), ("layout", "64", "128", "--json")):
        code, err = _closed_pipe_run(*args)
        assert (code, err) == (0, ""), args
