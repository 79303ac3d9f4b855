"""How a checkout's own ``mpack/`` becomes the whole package. ``mpack/__init__.py`` calls
:func:`settle` when it is imported; for an installed package it does nothing.

Note [checkout on sys.path]: the package is assembled from a checkout's ``mpack/``,
``convert/``, ``runtime/``, ``verify/`` and ``cuda/`` (pyproject.toml, package-dir). Python
puts the current directory first on ``sys.path`` for ``python -m`` and ``python -c``, so in a
checkout's root ``import mpack`` finds the checkout's ``mpack/`` alone, whatever is installed,
and ``mpack.convert`` is then not found (an editable install of this checkout maps it; nothing
else does). So when this package is loaded from a checkout whose ``convert/`` is not what
``mpack.convert`` resolves to, :func:`settle` picks one whole mpack:

1. an mpack installed elsewhere (a wheel, or an editable install of another checkout): it is
   loaded in place of this one, so ``python -m mpack`` runs what the ``mpack`` command runs
   (with its native repack), wherever it is started;
2. else none is installed: the checkout's own ``convert/``, ``runtime/``, ``verify/`` and
   ``cuda/`` are made ``mpack.*`` (:class:`_CheckoutFinder`), so the checkout runs as itself.

From the directory above a clone named ``mpack``, Python takes the clone for a namespace
package ``mpack``; ``mpack/__main__.py`` (and the clone's root ``__main__.py``) load this
package instead. An installed wheel has no ``pyproject.toml`` beside it: none of this runs.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `import mpack` stays cheap
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

#: The packages pyproject.toml maps from a checkout's top-level directories (besides ``mpack``).
_CHECKOUT_PACKAGES = ("convert", "runtime", "verify", "cuda")


def _checkout_root(init: str) -> str | None:
    """The checkout whose ``mpack/__init__.py`` is ``init``: the directory above ``mpack/``, when
    its ``pyproject.toml`` names mpack-marlin and it has ``convert/__init__.py``; else None (an
    installed package)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(init)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            ours = 'name = "mpack-marlin"' in f.read()
    except (OSError, UnicodeDecodeError):
        return None
    return root if ours and os.path.isfile(os.path.join(root, "convert", "__init__.py")) else None


def _inside(spec: ModuleSpec, root: str) -> bool:
    """Whether ``spec`` loads from under the directory ``root``."""
    import os

    where = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    return bool(where) and os.path.realpath(where).startswith(os.path.realpath(root) + os.sep)


class _CheckoutFinder:
    """Finds ``mpack.convert`` (``runtime``, ``verify``, ``cuda``) in a checkout's top-level
    directories, as pyproject.toml's package-dir maps them (Note [checkout on sys.path])."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        import importlib.machinery
        import importlib.util
        import os

        head, _, sub = name.partition(".")
        if head != "mpack" or sub not in _CHECKOUT_PACKAGES:
            return None
        where = os.path.join(self.root, sub)
        init = os.path.join(where, "__init__.py")
        if os.path.isfile(init):
            return importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[where]
            )
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)  # cuda/: data only
        spec.submodule_search_locations = [where]
        return spec


def _installed(root: str) -> ModuleSpec | None:
    """An mpack installed outside the checkout ``root``: a wheel's, or an editable install's
    (of another checkout). Not a bare checkout that is merely on ``sys.path``: that one would
    look for an install in turn, and might find this checkout."""
    import importlib.machinery
    import os
    import sys

    here = os.path.realpath(root)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    for finder in sys.meta_path:
        on_path = finder is importlib.machinery.PathFinder
        try:
            spec = finder.find_spec("mpack", path if on_path else None)
        except Exception:  # noqa: BLE001 - someone else's finder: not the one we look for
            continue
        if spec is None or spec.loader is None or not os.path.isfile(spec.origin or ""):
            continue  # nothing, or a namespace package (a directory named mpack)
        if _inside(spec, root) or (on_path and _checkout_root(spec.origin) is not None):
            continue
        return spec
    return None


def _settle(root: str) -> None:
    """Make ``mpack`` one whole package when it is loaded from the checkout ``root`` (Note
    [checkout on sys.path])."""
    import importlib.util
    import sys

    found = importlib.util.find_spec("mpack.convert")  # through this package's __path__
    if found is not None and _inside(found, root):
        return  # an editable install of this checkout: consistent already
    spec = _installed(root)
    if spec is not None:
        installed = importlib.util.module_from_spec(spec)
        this = sys.modules["mpack"]
        ours = sys.modules.pop(__name__, None)  # the installed mpack imports its own of this
        sys.modules["mpack"] = installed  # what `import mpack` returns, once __init__.py has run
        try:
            spec.loader.exec_module(installed)  # type: ignore[union-attr]
        except BaseException:
            sys.modules["mpack"] = this
            if ours is not None:
                sys.modules[__name__] = ours
            raise
    elif not any(isinstance(f, _CheckoutFinder) and f.root == root for f in sys.meta_path):
        sys.meta_path.append(_CheckoutFinder(root))


def settle(init: str) -> None:
    """Make ``mpack``, whose ``__init__.py`` is ``init``, one whole package where it is a
    checkout's ``mpack/`` (Note [checkout on sys.path]); an installed package is left as it is."""
    root = _checkout_root(init)
    if root is not None:
        _settle(root)
