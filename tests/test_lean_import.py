"""`import mpack` must stay cheap and must never initialise CUDA (torchao's test_lean_import)."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_mpack_does_not_import_torch():
    assert _run("import sys, mpack, mpack.errors; print('torch' in sys.modules)") == "False"


def test_importing_every_module_does_not_initialise_cuda():
    code = (
        "import mpack, mpack.cli, mpack.errors, mpack.ui, mpack.convert, mpack.convert.marlin\n"
        "import mpack.runtime\n"
        "import torch\n"
        "print(torch.cuda.is_initialized())\n"
    )
    assert _run(code) == "False"


def test_convert_pipeline_imports_torch_only_when_it_streams():
    """Note [torch off the critical path]: planning a conversion needs no torch, so the CLI
    starts the pass-through copy and the hashing before the interpreter imports it."""
    code = (
        "import sys\n"
        "import mpack.convert.pipeline, mpack.convert.checkpoint, mpack.convert.plan\n"
        "import mpack.convert.staging, mpack.convert.source, mpack.convert.scheme_check\n"
        "print('torch' in sys.modules)\n"
    )
    assert _run(code) == "False"
