"""The design Notes: every pointer to one leads to it.

A Note is defined once, outside the tests, where a comment or docstring paragraph starts with
its name in brackets and a colon (``Note [``, the name, ``]:``). Elsewhere the bracketed name
refers to it, often with a place: ``in convert/plan.py``, ``in `mpack/iokit.py```, ``in
:mod:`mpack.convert.backends```, ``(runtime/weights.py)``, or a path relative to the referring
file's folder (``in weights.py``). Checked here, over the tree's code and docs:

* every Note is defined once (a test's docstring that opens with a Note's name cites it);
* every Note referred to is defined somewhere;
* every place a reference names is a file, and the Note is defined in that file.

A name in backquotes (the syntax shown in a doc, not a reference) is not a reference. A doc's
table row that opens with a bracketed name (docs/BENCHMARKS.md, "Figures moved from the source
Notes": ``| [name] (`path`) |``) refers to that Note, and to the place beside it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What is searched: source, scripts and docs; not folders a build or a venv makes.
SUFFIXES = {".py", ".md", ".c", ".cu", ".sh", ".toml", ".yml", ".yaml"}
SKIP_DIRS = {"__pycache__", "build", "dist", "data", "node_modules"}
#: Where a line's prose starts: after a comment marker, a docstring's quotes, a C comment's star.
PROSE = re.compile(r"""^\s*(?:#:?|//|/\*+|\*|[rbuRBU]?(?:\"\"\"|''')|>)?\s*""")
NAME = r"\[(?P<name>[^\]\[]+)\]"
#: A definition: a paragraph's first words (the line's prose), the name, then a colon.
DEFINITION = re.compile(r"Note " + NAME + r":")
#: A reference, and the place it names, if any. Not preceded by a backquote: `Note [x]` in a
#: doc shows the syntax.
REFERENCE = re.compile(
    r"(?<!`)Note " + NAME + r"(?:(?:\s+in\s+|\s*\()"
    r"(?P<place>:mod:`[\w.]+`|`[\w./-]+`|[\w./-]*\w))?"
)
#: A doc's table row that opens with a Note's name, and maybe its place.
TABLE_ROW = re.compile(r"^\| " + NAME + r"(?: \((?P<place>`[\w./-]+`)\))? \|", re.M)
#: Extensions that make a word a file's name.
FILE_SUFFIXES = (".py", ".md", ".c", ".cu", ".sh", ".toml")
#: Top-level folders pyproject.toml maps into the package (``mpack/convert/x.py`` is convert/).
MAPPED = ("convert", "runtime", "verify", "cuda")


def tree_files() -> list[Path]:
    """The files searched: every one with a suffix of ``SUFFIXES``, outside hidden folders (but
    ``.github``), build outputs, venvs and test data."""
    out = []
    for p in sorted(ROOT.rglob("*")):
        rel = p.relative_to(ROOT).parts
        hidden = any(part.startswith(".") and part != ".github" for part in rel[:-1])
        if hidden or any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel[:-1]):
            continue
        if p.suffix in SUFFIXES and p.is_file():
            out.append(p)
    return out


def prose_lines(path: Path) -> list[str]:
    """``path``'s lines, each less its comment marker or docstring quotes."""
    return [PROSE.sub("", line, count=1) for line in path.read_text(encoding="utf-8").splitlines()]


def flat(lines: list[str]) -> str:
    """The lines as one text, whitespace collapsed: a Note's name may wrap across lines."""
    return re.sub(r"\s+", " ", " ".join(lines))


def definitions(path: Path, lines: list[str]) -> list[tuple[str, int]]:
    """``(name, line)`` of each Note ``path`` defines: a line whose prose starts with one (its
    name may go on on the next line)."""
    out = []
    for i, line in enumerate(lines):
        if line.startswith("Note ["):
            m = DEFINITION.match(flat(lines[i : i + 2]))
            if m:
                out.append((m.group("name"), i + 1))
    return out


def resolve(place: str, referrer: Path) -> Path | None:
    """The file a reference's place names, or None where it names no file there is."""
    if place.startswith(":mod:`"):
        parts = place[len(":mod:`") : -1].split(".")
        if parts[0] != "mpack":
            return None
        if len(parts) > 1 and parts[1] in MAPPED:
            parts = parts[1:]
        base = ROOT.joinpath(*parts)
        for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None
    path = place.strip("`")
    first, _, rest = path.partition("/")
    if first == "mpack" and rest.split("/", 1)[0] in MAPPED:
        path = rest
    for folder in (ROOT, *referrer.parents):  # the root, else relative to the referrer
        if folder != ROOT and ROOT not in folder.parents:
            break
        if (folder / path).is_file():
            return folder / path
    return None


def is_place(place: str | None) -> bool:
    """Whether what follows a reference names a file (``in the module docstring`` does not)."""
    return place is not None and (
        place.startswith(":mod:`") or place.strip("`").endswith(FILE_SUFFIXES)
    )


def scan() -> tuple[dict[str, list[str]], list[tuple[str, str, str | None]]]:
    """``({name: [where it is defined]}, [(where, name, place)])`` over the tree."""
    defined: dict[str, list[str]] = defaultdict(list)
    refs: list[tuple[str, str, str | None]] = []
    for path in tree_files():
        lines = prose_lines(path)
        rel = path.relative_to(ROOT).as_posix()
        in_tests = rel.startswith("tests/")
        defs = [] if in_tests else definitions(path, lines)
        for name, line in defs:
            defined[name].append(f"{rel}:{line}")
        found = list(REFERENCE.finditer(flat(lines)))
        if path.suffix == ".md":
            found += TABLE_ROW.finditer(path.read_text(encoding="utf-8"))
        for m in found:
            place = m.group("place")
            refs.append((rel, m.group("name"), place if is_place(place) else None))
    return dict(defined), refs


def test_the_scan_finds_notes_and_their_places() -> None:
    defined, refs = scan()
    assert len(defined) > 40, sorted(defined)
    assert "checkout on sys.path" in defined, sorted(defined)  # a name that wraps across lines
    assert sum(place is not None for _, _, place in refs) > 100, refs


def test_every_note_is_defined_once() -> None:
    defined, _ = scan()
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, twice


def test_every_note_referred_to_is_defined() -> None:
    defined, refs = scan()
    missing = sorted({(rel, name) for rel, name, _ in refs if name not in defined})
    assert not missing, missing


def test_every_place_a_reference_names_defines_the_note() -> None:
    defined, refs = scan()
    wrong = []
    for rel, name, place in refs:
        if place is None or name not in defined:
            continue
        target = resolve(place, ROOT / rel)
        homes = {where.rsplit(":", 1)[0] for where in defined[name]}
        if target is None or target.relative_to(ROOT).as_posix() not in homes:
            wrong.append(f"{rel}: {name!r} in {place}, defined in {sorted(homes)}")
    assert not wrong, "\n".join(sorted(set(wrong)))
