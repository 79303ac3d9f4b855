"""``make test-fast`` (``pytest --fast``): the files it leaves out exist, and it leaves them out."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, SLOW_FILES


def test_every_slow_file_exists() -> None:
    missing = sorted(f for f in SLOW_FILES if not (REPO / f).is_file())
    assert not missing, f"tests/conftest.py SLOW_FILES names files that are gone: {missing}"


def test_fast_leaves_out_the_slow_files_and_keeps_the_rest() -> None:
    slow, kept = "tests/test_packaging.py", "tests/test_golden_moe.py"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--fast", slow, kept],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith(kept) for i in ids), r.stdout
    assert "deselected" in r.stdout
