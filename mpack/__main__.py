"""``python -m mpack``: the ``mpack`` command.

A directory named ``mpack`` without an ``__init__.py`` in the current directory (the root of a
clone named ``mpack``, when mpack is run from the directory above it) is a namespace package to
Python, and ``mpack`` is then that directory: ``from mpack import __version__`` fails. This file
is found all the same (an editable install maps it; the clone's root ``__main__.py`` runs it), so
it puts this package back under the name before the command imports it (Note [checkout on
sys.path] in mpack/_checkout.py).
"""

import importlib.util
import os
import sys


def _this_package() -> None:
    """Load the package beside this file as ``mpack``, where ``mpack`` is a namespace package."""
    found = sys.modules.get("mpack")
    if found is not None and getattr(found, "__file__", None) is not None:
        return  # the real package (or the one it settled on)
    for name in [n for n in sys.modules if n == "mpack" or n.startswith("mpack.")]:
        del sys.modules[name]
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "mpack", os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mpack"] = module
    spec.loader.exec_module(module)  # it may put an installed mpack in its place


_this_package()

from mpack.cli import main  # noqa: E402 - after the package is in place

main()
