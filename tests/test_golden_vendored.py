"""tests/data/golden: the vendored golden data is what PROVENANCE.md says it is, equals
../shared/golden where that exists, and lets a plain clone (no ../shared beside it) collect and
run the golden tests."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SHARED, VENDORED_GOLDEN, _golden_dir

NOTE = "PROVENANCE.md"


def _files(root: Path) -> dict[str, Path]:
    """Every file under ``root`` by its relative POSIX path, except the provenance note."""
    found = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}
    found.pop(NOTE, None)
    return found


def _listed_digests() -> dict[str, str]:
    text = (VENDORED_GOLDEN / NOTE).read_text()
    (block,) = re.findall(r"^```sha256\n(.*?)^```$", text, re.M | re.S)
    rows = [line.split("  ", 1) for line in block.splitlines()]
    assert all(len(r) == 2 and re.fullmatch(r"[0-9a-f]{64}", r[0]) for r in rows), rows
    return {path: digest for digest, path in rows}


def test_vendored_files_are_the_ones_provenance_lists_with_their_digests() -> None:
    listed = _listed_digests()
    have = _files(VENDORED_GOLDEN)
    assert sorted(have) == sorted(listed), "tests/data/golden and PROVENANCE.md disagree"
    for rel, path in have.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == listed[rel], rel
    # The cases and vectors every golden test reads (a short list would pass the checks above).
    cases = {rel.split("/")[1] for rel in have if rel.startswith("cases/")}
    assert len(cases) == 3, cases
    assert {"vectors/layers.safetensors", "vectors/requant.safetensors"} <= set(have)


def test_vendored_copy_equals_shared_golden() -> None:
    shared = SHARED / "golden"
    if not shared.is_dir():
        pytest.skip(f"no original to compare with: {shared} is absent (a plain clone)")
    ours, theirs = _files(VENDORED_GOLDEN), _files(shared)
    assert sorted(ours) == sorted(theirs), "not the same set of files"
    for rel, path in ours.items():
        assert path.read_bytes() == theirs[rel].read_bytes(), f"{rel} differs from {shared}"


def test_tests_read_the_vendored_copy_unless_mpack_golden_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MPACK_GOLDEN", raising=False)
    assert _golden_dir() == REPO / "tests" / "data" / "golden"
    monkeypatch.setenv("MPACK_GOLDEN", str(tmp_path))
    assert _golden_dir() == tmp_path


def _pytest(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "MPACK_GOLDEN"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_bad_mpack_golden_stops_the_session_with_one_message(tmp_path: Path) -> None:
    r = _pytest(
        ["--collect-only", "-q", "tests/test_golden_vendored.py"],
        REPO,
        MPACK_GOLDEN=str(tmp_path / "nowhere"),
    )
    out = r.stdout + r.stderr
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert f"golden data not found in {tmp_path / 'nowhere'}" in out, out
    assert "fix or unset MPACK_GOLDEN" in out, out


#: Not copied into the plain clone: venvs, build outputs, caches and the device carry (all
#: git-ignored), and .git (a clone has its own).
_NOT_IN_A_CLONE = {
    ".git",
    ".vllmdev",
    ".device",
    ".whl",
    ".golden",
    "build",
    "dist",
    "out",
    "demo-out",
    "bench-out",
}


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n in {"__pycache__", ".pytest_cache", ".ruff_cache"}}
    skip |= {n for n in names if n.endswith(".egg-info")}
    if Path(directory) == REPO:
        skip |= {n for n in names if n in _NOT_IN_A_CLONE or n.startswith(".venv")}
    return skip


@pytest.mark.slow
def test_a_plain_clone_collects_every_test_and_reads_its_own_golden_copy(tmp_path: Path) -> None:
    clone = tmp_path / "plain" / "mpack"  # nothing named shared beside it
    shutil.copytree(REPO, clone, ignore=_ignore, symlinks=True)
    assert not (clone.parent / "shared").exists()

    r = _pytest(["--collect-only"], clone)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"^=+ \d+ tests collected in ", out, re.M), out  # ", N errors" otherwise
    assert f"golden data: {clone / 'tests' / 'data' / 'golden'}" in out, out
    assert "test_golden_case_cli[tiny-llama-channel-w8a16-fp16-tp2]" in out, out

    r = _pytest(["-q", "-rs", "tests/test_golden_vendored.py", "-k", "not plain_clone"], clone)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"^3 passed, 1 skipped", out, re.M), out
    assert "no original to compare with" in out and "is absent (a plain clone)" in out, out
