"""`mpack serve` against a hostile environment (red-team report, issue 11): a vanished output
reader, SIGHUP, planted lock and socket files, unsafe socket directories, a status connection
left open, and a CUDA device that is not there.

Real daemons (``python -m mpack.cli serve``), real sockets, real files. A daemon that should have
refused to start but printed READY is stopped at once, so a regression fails fast.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from rt_helpers import DaemonProc, child_env  # noqa: E402
from sidecar_factory import make_sidecar  # noqa: E402

from mpack.errors import UsageError  # noqa: E402
from mpack.runtime import attach, load  # noqa: E402
from mpack.runtime import protocol as P  # noqa: E402

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")


@pytest.fixture(scope="module")
def sc(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("hostile-sc") / "sidecar")


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    return child_env(xdg)


def _serve_cmd(sc: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mpack.cli", "serve", str(sc), "--device", "cpu", *extra]


def _lock_of(sock: Path) -> Path:
    return sock.with_name(sock.name + P.LOCK_SUFFIX)


def _serve_expecting_refusal(sc: Path, sock: Path, env: dict, cwd: Path) -> tuple[int, str]:
    """Run ``serve --socket sock``; (exit code, stderr). A daemon that serves is stopped at once
    and the test fails."""
    d = DaemonProc(sc, "cpu", env, cwd, "--socket", str(sock))
    deadline = time.monotonic() + 120
    while d.proc.poll() is None and time.monotonic() < deadline:
        if "READY" in d.out.read_text():
            d.stop(signal.SIGKILL)
            pytest.fail(f"serve started serving at {sock} instead of refusing")
        time.sleep(0.05)
    rc = d.stop(signal.SIGKILL)
    return rc, d.stderr()


def _assert_clean_refusal(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, (rc, err)
    assert err.startswith("error: ") and "Traceback" not in err and "internal error" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def _read_line(f, timeout: float = 120) -> bytes:
    """One line from a pipe, without blocking past ``timeout``."""
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(f, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"no line within {timeout} s (got {buf!r})")
            chunk = os.read(f.fileno(), 1)
            if not chunk:
                raise AssertionError(f"pipe closed after {buf!r}")
            buf += chunk
    return buf


def _attach_twice(sc: Path, sock: Path) -> None:
    for _ in range(2):
        with attach(sc, socket=sock) as w:
            assert len(w) > 0


# --- issue 11.13: a CUDA device this machine does not have --------------------------------------


def _no_cuda() -> bool:
    import torch

    return torch.cuda.device_count() == 0


no_cuda_here = pytest.mark.skipif(not _no_cuda(), reason="this machine has a CUDA device")
NO_CUDA = "--device cuda:0: no CUDA device here (torch reports none)"


@no_cuda_here
def test_serve_on_a_missing_cuda_device_is_a_usage_error(sc, env, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "serve", str(sc), "--device", "cuda:0"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    _assert_clean_refusal(r.returncode, r.stderr, NO_CUDA, "hint: use --device cpu")
    assert "READY" not in r.stdout


@no_cuda_here
@pytest.mark.parametrize("how", ["load", "attach"])
def test_load_and_attach_on_a_missing_cuda_device_are_usage_errors(sc, env, how, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    with pytest.raises(UsageError, match=NO_CUDA.replace("(", r"\(").replace(")", r"\)")) as e:
        (load if how == "load" else attach)(sc, device="cuda:0")
    assert "--device cpu" in (e.value.hint or "")
    with pytest.raises(UsageError, match="--device cuda: no CUDA device here"):
        (load if how == "load" else attach)(sc, device="cuda")
