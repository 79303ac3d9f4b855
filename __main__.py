"""``python -m mpack`` run from the directory above a clone named ``mpack``.

Python takes the clone's root for a namespace package ``mpack`` (it has no ``__init__.py``) and
runs this file. It runs the clone's ``mpack/__main__.py``, which puts the real package in place
(Note [checkout on sys.path] in mpack/_checkout.py). Not part of the installed package.
"""

import os
import runpy

runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpack", "__main__.py"),
    run_name="__main__",
)
