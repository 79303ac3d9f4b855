"""The test suite, one package: a helper is imported by its full name
(``from tests.convert.helpers import cli``), never by putting its folder on ``sys.path``.

pytest runs with ``--import-mode=importlib`` (pyproject.toml): it imports ``tests`` and its
subpackages from their files and adds no folder to ``sys.path``. So ``import mpack`` in a test
finds what it finds outside pytest: under ``python -P -m pytest`` (the GPU box), the installed
package, not the checkout's ``mpack/``, which alone is not the whole package (Note [checkout on
sys.path] in mpack/_checkout.py). The scripts a test starts as processes
(``tests/runtime/probe_client.py``, ``tests/vllm/vllm_worker.py``, ...) import mpack and, at
most, a file beside them.
"""
