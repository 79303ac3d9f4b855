"""The allowed imports between mpack's layers (docs/ARCHITECTURE.md, "Layers and imports").

Every ``import`` and ``from ... import`` statement of every library module is read from its
source, those inside functions (the lazy ones) included, and checked against the rules:

* core (``mpack/``, less the command line) imports neither convert, runtime, verify nor the CLI;
* convert imports only core (its public ``verify()`` forwards to ``mpack.verify``: the one
  exception, listed below);
* runtime imports only core;
* verify imports core, convert and runtime;
* no library module imports the CLI (``mpack.cli``, ``mpack.ui``, ``mpack.__main__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package -> the folder it lives in (pyproject.toml's package-dir)
FOLDERS = {
    "mpack": "mpack",
    "mpack.convert": "convert",
    "mpack.runtime": "runtime",
    "mpack.verify": "verify",
}
CLI = {"mpack.cli", "mpack.ui", "mpack.__main__"}
ALLOWED = {
    "core": {"core"},
    "convert": {"core", "convert"},
    "runtime": {"core", "runtime"},
    "verify": {"core", "convert", "runtime", "verify"},
    "cli": {"core", "convert", "runtime", "verify", "cli"},
}
#: (importing module, imported module): the documented exceptions.
EXCEPTIONS = {("mpack.convert", "mpack.verify")}  # mpack.convert.verify(), kept for compatibility


def layer_of(module: str) -> str | None:
    """The layer of an mpack module name; None for anything outside mpack."""
    if module in CLI:
        return "cli"
    for pkg, layer in (
        ("mpack.convert", "convert"),
        ("mpack.runtime", "runtime"),
        ("mpack.verify", "verify"),
    ):
        if module == pkg or module.startswith(pkg + "."):
            return layer
    if module == "mpack" or module.startswith("mpack."):
        return "core"
    return None


def library_modules() -> dict[str, Path]:
    """``{module name: source}`` of every module, those of subpackages (``mpack.runtime.vllm``)
    included."""
    out = {}
    for pkg, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import statement in ``path``, lazy ones included;
    ``from mpack import x`` counts as importing ``mpack.x`` when that is a module."""
    pkg = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return found


MODULES = library_modules()


def test_every_layer_has_modules() -> None:
    layers = {layer_of(m) for m in MODULES}
    assert layers == {"core", "convert", "runtime", "verify", "cli"}, layers
    assert {"mpack.runtime.vllm", "mpack.runtime.vllm.loader"} <= set(MODULES)  # subpackages too


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layer_rules(module: str) -> None:
    mine = layer_of(module)
    assert mine is not None
    bad = [
        f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} ({layer_of(target)})"
        for line, target in imports_of(module, MODULES[module])
        if layer_of(target) is not None
        and layer_of(target) not in ALLOWED[mine]
        and (module, target) not in EXCEPTIONS
    ]
    assert not bad, f"{module} ({mine}) may import only {sorted(ALLOWED[mine])}:\n" + "\n".join(bad)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The reader itself: a function-level import and a relative one are found and mapped."""
    src = tmp_path / "x.py"
    src.write_text(
        "def f():\n    from mpack.convert import plan\n    import mpack.cli\n"
        "from ..runtime import loader\n"
    )
    got = {t for _, t in imports_of("mpack.verify.x", src)}
    assert {"mpack.convert.plan", "mpack.cli", "mpack.runtime.loader"} <= got
    assert layer_of("mpack.cli") == "cli" and layer_of("mpack.sidecar") == "core"
    assert layer_of("torch") is None
