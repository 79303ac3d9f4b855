"""The repository's ``cuda/`` (the kernel sources) must not hide the cuda-bindings package.

cuda-bindings installs ``cuda/bindings/`` with no ``cuda/__init__.py``: ``cuda`` is a namespace
package. Whenever the repository root is on ``sys.path`` (``python -m mpack.cli`` run from a
checkout, pytest's rootdir), a ``cuda/__init__.py`` there would make ``cuda`` a regular package
that wins over every namespace portion, and ``import cuda.bindings`` would fail with
cuda-bindings installed (``serve --device cuda`` then reported it missing). ``cuda/`` holds no
``__init__.py`` so that it is at most one more portion of that namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

FIND = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import cuda.bindings
print(json.dumps({"bindings": cuda.bindings.__file__, "where": cuda.bindings.WHERE,
                  "cuda": list(cuda.__path__)}))
"""


def test_cuda_bindings_is_found_with_the_repo_root_first_on_sys_path(tmp_path: Path) -> None:
    site = tmp_path / "site"  # an installed cuda-bindings, as its wheel lays it out
    (site / "cuda" / "bindings").mkdir(parents=True)
    (site / "cuda" / "bindings" / "__init__.py").write_text("WHERE = 'installed'\n")
    r = subprocess.run(
        # -S: this interpreter's own site-packages (a real cuda-bindings, if any) stays out
        [sys.executable, "-S", "-c", FIND, str(REPO), str(site)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["where"] == "installed", found
    assert Path(found["bindings"]).is_relative_to(site), found
    assert str(REPO / "cuda") in found["cuda"], found  # the kernel sources: one more portion


def test_the_kernel_source_is_where_the_converter_reads_it(monkeypatch) -> None:
    monkeypatch.delenv("MPACK_REPACK_SOURCE", raising=False)
    assert not (REPO / "cuda" / "__init__.py").exists()
    from mpack.convert.cuda_repack import kernel_source_path

    src = kernel_source_path()  # the checkout's cuda/, or an installed wheel's mpack/cuda/
    assert src.is_file() and src.parent.name == "cuda", src
