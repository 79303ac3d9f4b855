"""``python -m mpack``: the ``mpack`` command."""

from mpack.cli import main

main()
