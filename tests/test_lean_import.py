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
        "import mpack.convert.output, mpack.convert.source, mpack.convert.scheme_check\n"
        "print('torch' in sys.modules)\n"
    )
    assert _run(code) == "False"


def test_the_vllm_entry_point_imports_neither_vllm_nor_torch():
    """vLLM imports ``mpack.runtime.vllm`` (the ``vllm.general_plugins`` entry point) in every
    process it starts; only ``register()`` imports the loader, and with it vLLM and torch. The
    loader's checks and its sources of weights need neither."""
    code = (
        "import sys\n"
        "import mpack.runtime.vllm, mpack.runtime.vllm.checks, mpack.runtime.vllm.source\n"
        "print([m for m in ('torch', 'vllm', 'mpack.runtime.vllm.loader') if m in sys.modules])\n"
    )
    assert _run(code) == "[]"
