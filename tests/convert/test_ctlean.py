"""The scheme check's lean import of compressed-tensors (Note [lean import] in convert/ctlean.py).

Each check runs in a fresh interpreter (a real child process): one that has not imported
compressed-tensors, as the forked check of `mpack convert` has not. Real checkpoints from
``make_checkpoint``, good and bad.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from mpack.convert import ctlean
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import edit_config, python_c, weight_args

# In a fresh interpreter: the verdict with the lean import, then with the full import, and
# which heavy modules the lean import left out.
_BOTH = """
import json, sys
from pathlib import Path
from mpack.convert import ctlean
from mpack.convert.scheme_check import _scheme_verdict, child_verdict
root = Path(sys.argv[1])
assert ctlean.install()
lean = _scheme_verdict(root)
heavy = sorted(m for m in ("torch.distributed.tensor", "compressed_tensors.offload",
                           "transformers.modeling_utils") if m in sys.modules)
heavy += [f"transformers as {type(sys.modules['transformers']).__name__}"]
ctlean.uninstall()
full = _scheme_verdict(root)
print(json.dumps({"lean": lean, "full": full, "heavy": heavy,
                  "child": child_verdict(root)}))
"""


def _verdicts(root: Path) -> dict:
    return json.loads(python_c(_BOTH, root).strip().splitlines()[-1])


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ctlean") / "ck", arch="qwen2")


def test_lean_import_reaches_the_full_verdict_without_the_heavy_modules(good: Path) -> None:
    v = _verdicts(good)
    assert v["lean"][0] == "ok", v
    assert v["lean"] == v["full"] == v["child"]
    assert v["heavy"] == ["transformers as _StandIn"]  # Note [deferred transformers]


def test_lean_import_per_channel(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ch", scheme="FP8_DYNAMIC")
    v = _verdicts(ck)
    assert v["lean"][0] == "ok" and v["lean"] == v["full"], v
    assert {s for s, *_ in v["lean"][1].values()} == {"channel"}


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda c: weight_args(c).update(strategy="group", group_size=128), "strategy 'group'"),
        (lambda c: c["quantization_config"].update(ignore=["re:.*up_proj"]), "ignore lists"),
        (lambda c: weight_args(c).update(num_bits="eight"), "num_bits"),
        (lambda c: weight_args(c).update(strategy="diagonal"), "strategy"),
    ],
    ids=["group", "ignored", "pydantic-type", "pydantic-enum"],
)
def test_lean_import_refuses_what_the_full_import_refuses(
    good: Path, tmp_path: Path, edit, expect
) -> None:
    """Bad configs: the lean parse gives the full parse's error, word for word; the child
    reports the full import's verdict (a refusal is always confirmed by it)."""
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    edit_config(bad, edit)
    v = _verdicts(bad)
    assert v["full"][0] == "error", v
    assert v["lean"] == v["full"] == v["child"]
    assert expect in v["full"][1][2]


def test_child_falls_back_to_the_full_import(good: Path) -> None:
    """A lean import that cannot resolve a name (here: a finder refusing every compressed_tensors
    module) is not the verdict: the full import's is."""
    code = (
        "import sys, json\nfrom pathlib import Path\n"
        "from mpack.convert import ctlean\n"
        "from mpack.convert.scheme_check import child_verdict\n"
        "class Broken(ctlean._LeanFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.startswith('compressed_tensors.quantization'):\n"
        "            raise ImportError('refused by the test')\n"
        "        return super().find_spec(name, path, target)\n"
        "ctlean._FINDER = Broken()\n"
        "print(json.dumps(child_verdict(Path(sys.argv[1]))))\n"
        "print('compressed_tensors.offload' in sys.modules)\n"
    )
    verdict, full_import = python_c(code, good).strip().splitlines()[-2:]
    assert json.loads(verdict)[0] == "ok"
    assert full_import == "True"  # the verdict came from the full import


def test_deferred_transformers_forwards_to_the_real_module() -> None:
    """Note [deferred transformers]: under the lean import `transformers` is a stand-in; using a
    name imported from it imports the real module and forwards; uninstall forgets the stand-in."""
    code = (
        "import sys\nfrom mpack.convert import ctlean\nassert ctlean.install()\n"
        "from transformers import PretrainedConfig\n"
        "assert type(sys.modules['transformers']).__name__ == '_StandIn'\n"
        "cfg = PretrainedConfig(mpack_probe=3)\n"
        "import transformers\n"
        "real = type(transformers).__name__ != '_StandIn'\n"
        "print(real, cfg.mpack_probe, hasattr(transformers, 'AutoConfig'))\n"
        "ctlean.uninstall()\n"
        "print(sys.modules['transformers'] is transformers)\n"
    )
    assert python_c(code).split() == ["True", "3", "True", "True"]


def test_deferred_compile_compiles_on_first_call() -> None:
    """Note [deferred compile]: a function is compiled on its first call, once, with the
    decorator's options; the wrapper keeps the function's name."""
    calls: list[dict] = []

    def compile_(model, **options):
        calls.append(options)
        return lambda *args: ("compiled", model(*args))

    deferred = ctlean._deferred_compile(compile_)

    @deferred
    def inc(x):
        return x + 1

    @deferred(mode="max-autotune")
    def double(x):
        return 2 * x

    assert calls == []
    assert inc(1) == ("compiled", 2) and inc(2) == ("compiled", 3)
    assert double(3) == ("compiled", 6)
    assert calls == [{}, {"mode": "max-autotune"}]
    assert inc.__name__ == "inc"


def test_deferred_compile_only_while_a_module_runs(tmp_path: Path) -> None:
    """A module run through the lean import's loader sees the deferred `torch.compile`; the real
    one is back when it has run."""
    import importlib.util

    import torch

    src = tmp_path / "probe_mod.py"
    src.write_text("import torch\nDEFERRED = getattr(torch.compile, 'mpack_deferred', False)\n")
    real = torch.compile
    spec = importlib.util.spec_from_file_location("probe_mod", src)
    spec.loader = ctlean._CompileDeferred(spec.loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.DEFERRED is True
    assert torch.compile is real
