"""docs/ARCHITECTURE.md maps every library module, and only modules there are.

A library module is a ``.py`` file under ``mpack/``, ``convert/``, ``runtime/`` or ``verify/``,
subpackages (``convert/backends/``, ``runtime/vllm/``) included. The page names one by its path
from the repository root (``convert/plan.py``), or, in the part of the page about its folder (the
paragraph that opens with the folder in bold, ``**`convert/` ...**``, up to the next bold
opening), by its path inside that folder (``plan.py``, ``backends/host.py``). A package's
``__init__.py`` is named by its folder (``convert/``, ``backends/``). A bare file name does not
name a module of a subpackage: ``loader.py`` in the runtime part is ``runtime/loader.py``, and
``runtime/vllm/loader.py`` is ``vllm/loader.py`` there.

The other way round, every ``.py`` path the page writes in backquotes is a file there is (a
bare file name, some file's name): a module moved or removed leaves no stale name on the map.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
#: The folders of the library (pyproject.toml's package-dir; ``cuda/`` holds no Python).
FOLDERS = ("mpack", "convert", "runtime", "verify")


def library_modules() -> list[str]:
    """Every library module's path from the repository root, ``convert/backends/host.py``."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def sections(text: str) -> dict[str, tuple[int, int]]:
    """``{folder: (start, end)}`` of the part of the page about it: from the paragraph that opens
    with ``**`folder/``` to the next paragraph that opens in bold."""
    out = {}
    for m in re.finditer(r"^\*\*`(\w+)/`", text, re.M):
        end = re.compile(r"^\*\*", re.M).search(text, m.end())
        out[m.group(1)] = (m.start(), end.start() if end else len(text))
    return out


def parts(text: str) -> dict[str, str]:
    """``{folder: the part of the page about it}``."""
    return {folder: text[a:b] for folder, (a, b) in sections(text).items()}


def names(text: str, name: str) -> bool:
    """Whether ``text`` names ``name`` as a whole path (not the tail of a longer one)."""
    return re.search(r"(?<![\w/.])" + re.escape(name) + r"(?![\w/])", text) is not None


def named(module: str, text: str, found: dict[str, str]) -> bool:
    """Whether the page (``text``; ``found``, its part about each folder) names ``module``."""
    if module.endswith("__init__.py"):  # a package: by its folder
        module = module[: -len("__init__.py")]
    folder, _, inside = module.partition("/")
    return names(text, module) or (bool(inside) and names(found.get(folder, ""), inside))


def test_the_page_has_a_part_for_each_folder() -> None:
    found = parts(DOC.read_text(encoding="utf-8"))
    assert set(FOLDERS) <= set(found), sorted(found)
    assert all(found[f].strip() for f in FOLDERS)


def test_every_library_module_is_named_in_the_architecture_doc() -> None:
    text = DOC.read_text(encoding="utf-8")
    found = parts(text)
    modules = library_modules()
    assert "convert/backends/host.py" in modules and "mpack/cli.py" in modules, modules
    missing = [m for m in modules if not named(m, text, found)]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_every_python_path_the_architecture_doc_names_exists() -> None:
    """A path is from the root, or, in the part about a folder, from that folder; a bare file
    name in prose (``iokit.py`` in the part about convert) is some file's name."""
    text = DOC.read_text(encoding="utf-8")
    spans = sections(text)
    tree = [p for d in (*FOLDERS, "scripts", "tests") for p in (ROOT / d).rglob("*.py")]
    basenames = {p.name for p in tree} | {p.name for p in ROOT.glob("*.py")}
    stale = []
    for m in re.finditer(r"`([\w/.-]+\.py)`", text):
        path = m.group(1)
        folders = [f for f, (a, b) in spans.items() if a <= m.start() < b]
        there = any((ROOT / f / path).is_file() for f in ["", *folders])
        if not there and ("/" in path or path not in basenames):
            stale.append(path)
    assert not stale, f"docs/ARCHITECTURE.md names files that are not there: {sorted(set(stale))}"
