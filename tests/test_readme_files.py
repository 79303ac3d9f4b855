"""README's "What is here" (issue 42, item 8): every file and folder it names is there, and it
names every entry of the repository's root, every folder of ``tests/`` and every module of
``mpack/``, so a newcomer finds the Makefile, the pins and the real-model tests from it. Every
module with its owner and allowed imports is docs/ARCHITECTURE.md's map
(tests/test_architecture_doc.py); this is the README's overview of it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A file name the block writes: ``sidecar.py``, ``_repack.c``, ``device_*.sh``.
FILE = re.compile(r"(?<![\w/.*-])([\w*+-]+(?:\.[\w-]+)*\.(?:py|c|cu|sh|md|yml|yaml|txt|toml|in))\b")
#: A path it writes: ``backends/``, ``bench_rt/``, ``tests/data/golden``, ``ci/prebake.sh``.
PATH = re.compile(r"(?<![\w.-])((?:[\w-]+/)+[\w.*+-]*)")


def block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## What is here\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^```text\n(.*?)^```$", section, re.M | re.S)
    assert found, "README's 'What is here' has no ```text block"
    return found[1]


def lines_by_folder() -> list[tuple[str, str]]:
    """``(top folder, line)`` of each line of the block; ``.`` for the root's files."""
    out, folder = [], "."
    for line in block().splitlines():
        if line and not line[0].isspace():
            head = line.split()[0]
            folder = head.rstrip("/") if head.endswith("/") else "."
        out.append((folder, line))
    return out


def named(name: str) -> bool:
    return re.search(r"(?<![\w.-])" + re.escape(name) + r"(?![\w-])", block()) is not None


def tracked_root() -> list[str]:
    """The repository root's entries under version control, hidden ones left out."""
    try:
        r = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist): which root entries are the project's is git's")
    tops = {p.split("/", 1)[0] + ("/" if "/" in p else "") for p in r.stdout.splitlines()}
    return sorted(t for t in tops if not t.startswith(".") and t != "README.md")


def test_every_name_in_the_block_is_there() -> None:
    """A file name is somewhere in its line's folder; a path is in that folder, or the root's."""
    missing = []
    for folder, line in lines_by_folder():
        base = ROOT / folder
        for name in FILE.findall(line):
            if not any(base.rglob(name)):
                missing.append(f"{folder}: {name}")
        for path in PATH.findall(line):
            if not any(base.glob(path.rstrip("/"))) and not any(ROOT.glob(path.rstrip("/"))):
                missing.append(f"{folder}: {path}")
    assert missing == [], missing


def test_it_names_every_root_entry() -> None:
    assert [e for e in tracked_root() if not named(e)] == []


def test_it_names_every_folder_of_the_tests() -> None:
    folders = sorted(
        p.parent.relative_to(ROOT / "tests").as_posix() + "/"
        for p in (ROOT / "tests").glob("*/test_*.py")
    )
    assert folders, "no tests in folders?"
    assert [f for f in dict.fromkeys(folders) if not named(f)] == []


def test_it_names_every_module_of_the_core() -> None:
    modules = sorted(p.name for p in (ROOT / "mpack").glob("*.py") if not p.name.startswith("_"))
    assert [m for m in modules if not named(m)] == []
