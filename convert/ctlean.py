"""compressed-tensors' config models without its package-wide imports (Note [lean import]).

Used only inside the scheme check's child process (:mod:`mpack.convert.scheme_check`), never in a
process that goes on to use compressed-tensors for anything else.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = "compressed_tensors"
#: Modules the lean import stands in for (Note [deferred transformers]).
DEFERRED = ("transformers",)

# Note [lean import]: `import compressed_tensors` runs every package's __init__, which re-exports
# everything: its model-offloading helpers import transformers and torch.distributed.tensor. That
# takes longer than the stream of an 8B model, so the scheme check's verdict was the last thing a
# warm `mpack convert` waited for (figures: docs/BENCHMARKS.md, sections 2 and 9). The check needs
# three pydantic models (QuantizationConfig, QuantizationScheme, QuantizationArgs) and `match_name`.
# So the child installs a finder under which each package of compressed_tensors is created without
# running its __init__: a name looked up on the package is found, on first use, in the submodules
# that __init__ imports from, in its order (what its `from .x import *` lines would have bound). The
# models and validators are compressed-tensors' own code, imported from their own files; only the
# package-wide re-exports that the parse never touches are left out. A refusal or a failure under
# the lean import is not trusted: the child then runs the check again with the full import
# (scheme_check._scheme_child), so a good checkpoint can only get faster and a bad one gets the same
# error. tests/convert/test_ctlean.py checks that both imports reach the same verdict on good and
# bad configs, and that the lean one leaves transformers' model code and torch.distributed.tensor
# unimported.
#
# Note [deferred transformers]: the models' base class (`Aliasable`) lives in
# compressed_tensors/utils/helpers.py, which imports `AutoConfig` and `PretrainedConfig` from
# transformers at its top for helpers the parse never calls. `import transformers` is a large part
# of the check after torch (figures: docs/BENCHMARKS.md, sections 6.1 and 9). Under the lean import,
# the child therefore gets a stand-in `transformers` module whose names are placeholders
# (:class:`_Deferred`): using one (calling it, reading an attribute) imports the real transformers
# and forwards to it. A use the placeholder cannot forward (isinstance, a base class, a pydantic
# field type) raises, which makes the lean verdict a crash and the child runs the full import: as
# for the packages, the stand-in can only speed up a good check.
#
# Note [deferred compile]: compressed-tensors 0.17.0 (the version vLLM 0.33.0 pins) decorates an FP4
# helper in quantization/quant_args.py, the models' own file, with `@torch.compile`. That imports
# torch._dynamo (and torch.distributed.tensor) when the file runs: most of the lean check's time
# (figures: docs/BENCHMARKS.md, section 9), for a function an FP8 parse never calls. So while the
# lean import runs a compressed_tensors module, `torch.compile` is :func:`_deferred_compile`: a
# function compiles on its first call, with the real `torch.compile` and the same options. The real
# one is back as soon as the module has run, and a lean verdict that is not `ok` is checked again by
# the full import, as above.


def _reexport_sources(init: Path) -> list[str]:
    """The submodules a package's ``__init__.py`` imports from (``from .x import ...``), in
    order."""
    tree = ast.parse(init.read_text(encoding="utf-8"), filename=str(init))
    return [
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    ]


class _LazyPackageLoader(importlib.abc.Loader):
    """Creates a package whose names resolve on first use from its re-export sources."""

    def __init__(self, init: Path) -> None:
        self.init = init

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        name, sources = module.__name__, _reexport_sources(self.init)

        def lookup(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            for sub in sources:
                mod = importlib.import_module(f"{name}.{sub}")
                if hasattr(mod, attr):
                    value = getattr(mod, attr)
                    setattr(module, attr, value)
                    return value
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")

        module.__getattr__ = lookup  # type: ignore[method-assign]


def _deferred_compile(compile: Any) -> Any:
    """``torch.compile`` that compiles a function on its first call (Note [deferred compile])."""

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(options...)
            return lambda m: deferred(m, **options)
        if not inspect.isfunction(model):  # a module or other callable: compiled now, as usual
            return compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    deferred.mpack_deferred = True  # type: ignore[attr-defined]
    return deferred


class _CompileDeferred(importlib.abc.Loader):
    """A module's own loader, run with ``torch.compile`` deferred (Note [deferred compile])."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch  # every module the parse reaches imports it anyway

        real = torch.compile
        if not getattr(real, "mpack_deferred", False):  # not already inside another module's run
            torch.compile = _deferred_compile(real)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real

    def __getattr__(self, attr: str) -> Any:  # get_source, get_code, ... for tracebacks
        if attr == "loader":
            raise AttributeError(attr)
        return getattr(self.loader, attr)


class _LazyPackages(importlib.abc.MetaPathFinder):
    """Every package under ``compressed_tensors`` is made by :class:`_LazyPackageLoader`; its
    plain modules are found and run as usual, with ``torch.compile`` deferred."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or real.origin is None:
            return real
        if real.submodule_search_locations is None:  # a module: run as usual, compile deferred
            if real.loader is not None:
                real.loader = _CompileDeferred(real.loader)
            return real
        spec = importlib.machinery.ModuleSpec(
            fullname, _LazyPackageLoader(Path(real.origin)), origin=real.origin, is_package=True
        )
        spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


class _Deferred:
    """A name imported from a deferred module: the real one is imported on first use."""

    def __init__(self, module: str, attr: str) -> None:
        self._where = (module, attr)

    def _real(self) -> Any:
        module, attr = self._where
        _FINDER.released.add(module)  # from now on the real module
        if isinstance(sys.modules.get(module), _StandIn):
            del sys.modules[module]
        return getattr(importlib.import_module(module), attr)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self._real(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)


class _StandIn(ModuleType):
    """A deferred module: every public name is a :class:`_Deferred` placeholder."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Deferred(self.__name__, attr)


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _StandIn(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        pass


class _LeanFinder(_LazyPackages):
    """:class:`_LazyPackages`, and a stand-in for each of :data:`DEFERRED` until one of its
    names is used (``released``)."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in DEFERRED and fullname not in self.released:
            return importlib.machinery.ModuleSpec(fullname, _StandInLoader())
        return super().find_spec(fullname, path, target)


_FINDER = _LeanFinder()


def install() -> bool:
    """Import compressed-tensors lean from now on in this process; False (nothing done) when it
    is already imported."""
    if any(m == ROOT or m.startswith(ROOT + ".") for m in sys.modules):
        return False
    if any(m in sys.modules for m in DEFERRED):  # imported for real already: nothing to defer
        return False
    if _FINDER not in sys.meta_path:
        _FINDER.released.clear()
        sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    """Back to the normal import: the finder removed, and every compressed_tensors module
    imported under it (and every stand-in) forgotten, so that the next import runs the package
    __init__ files and imports the real modules."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for m in [m for m in sys.modules if m == ROOT or m.startswith(ROOT + ".")]:
        del sys.modules[m]
    for m in DEFERRED:
        if isinstance(sys.modules.get(m), _StandIn):
            del sys.modules[m]
