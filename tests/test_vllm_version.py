"""Issue 42, item 2: a vLLM other than the one mpack targets, and ``mpack --version``.

The refusal ``--load-format mpack`` gives an engine of another vLLM (runtime/vllm/checks.py,
which imports neither vLLM nor torch, so it is tested here with the engine's facts as the loader
gathers them) must not send the user round the loop of ``--force`` (which writes the same
sidecar for the same vLLM again), must not call the sidecar's version what "mpack targets", and
must name the three real ways out. ``mpack --version`` reports the environment, fast and without
torch or CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpack import __version__, target
from mpack.runtime.vllm.checks import EngineMismatchError, check_target
from mpack.sidecar import load_manifest
from tests.convert.helpers import cli, cli_env


def _engine(manifest: dict, version: str) -> dict:
    """The engine facts the loader gathers (runtime/vllm/loader.py ``_engine_facts``), all but
    the version agreeing with ``manifest``'s target."""
    t = manifest["target"]
    return {
        "version": version,
        "tp_size": t["tp_size"],
        "expert_parallel": False,
        "data_parallel_size": 1,
        "expert_placement": "linear",
        "eplb": False,
        "dtype": t["act_dtype"],
        "profile": t["profile"],
        "profile_why": "vLLM runs this checkpoint with CompressedTensorsW8A16Fp8 on sm 80",
        "quant_method": "compressed-tensors",
        "model": manifest["model"]["config"],
        "tied": False,
        "architecture": manifest["model"]["architecture"],
    }


def test_the_sidecar_as_written_loads_into_the_targeted_vllm(converted) -> None:
    _, sc = converted
    m, _ = load_manifest(sc)
    assert m["target"]["engine_version"] == target.ENGINE_VERSION
    check_target(m, _engine(m, target.ENGINE_VERSION), sc)  # no error: the premise


@pytest.mark.parametrize("version", ["0.34.0", "0.32.1"])
def test_another_vllm_gets_the_three_ways_out(converted, version: str) -> None:
    _, sc = converted
    m, _ = load_manifest(sc)
    with pytest.raises(EngineMismatchError) as e:
        check_target(m, _engine(m, version), sc)
    message, hint = e.value.message, e.value.hint or ""
    assert f"vLLM {version}" in message and f"vLLM {target.ENGINE_VERSION} only" in message
    assert f"mpack {__version__}" in message
    assert "--force" not in hint and "--force" not in message  # converting again changes nothing
    assert "mpack targets" not in message + hint
    assert hint.startswith("three ways out: ")
    assert (
        f"install vLLM {target.ENGINE_VERSION} (pip install vllm=={target.ENGINE_VERSION})" in hint
    )
    assert f"install an mpack-marlin release that targets vLLM {version}" in hint
    assert "serve the model without --load-format mpack" in hint
    assert e.value.exit_code == 2


def test_a_sidecar_of_another_mpack_is_converted_again(converted, tmp_path: Path) -> None:
    """The engine is the targeted vLLM, the sidecar was written for another (by another mpack):
    here converting again with this mpack is the way out, and the hint names its source."""
    ck, sc = converted
    m, _ = load_manifest(sc)
    m["target"]["engine_version"] = "0.32.1"
    with pytest.raises(EngineMismatchError) as e:
        check_target(m, _engine(m, target.ENGINE_VERSION), sc)
    assert "engine version is 0.32.1, the engine's is " + target.ENGINE_VERSION in e.value.message
    hint = e.value.hint or ""
    assert hint.startswith(f"convert it again with this mpack (mpack {__version__}, for vLLM ")
    assert f"-o {sc} --force" in hint and "mpack targets" not in hint


# --- mpack --version ------------------------------------------------------------------------------


def test_version_is_an_environment_report() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    first, *rest = r.stdout.splitlines()
    assert first == f"mpack {__version__}"
    report = dict(line.strip().split(":", 1) for line in rest)
    assert set(report) == {"targets", "vLLM", "native repack", "cuda-bindings", "torch", "python"}
    assert f"vLLM {target.ENGINE_VERSION}" in report["targets"]
    from mpack.convert import host_repack

    assert (
        report["native repack"]
        .strip()
        .startswith("built" if host_repack.available() else "not built")
    )
    import importlib.metadata as md

    assert md.version("torch") in report["torch"]
    assert report["python"].strip().startswith(".".join(map(str, sys.version_info[:3])))
    try:
        bindings = md.version("cuda-bindings")
    except md.PackageNotFoundError:
        bindings = "not installed"
    assert report["cuda-bindings"].strip().startswith(bindings)


def test_version_imports_no_torch_and_no_cuda() -> None:
    """The report reads versions from package metadata: ``--version`` stays fast and CUDA-free
    (tests/test_lean_import.py's rule)."""
    code = (
        "import sys\n"
        "from mpack.cli import main\n"
        "main(['--version'])\n"
        "heavy = ('torch', 'vllm', 'cuda.bindings', 'numpy')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]", r.stdout


def test_the_docs_name_the_ways_out() -> None:
    """docs/VLLM.md's refusal table says what the loader says."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "VLLM.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| engine version |"))
    assert "pip install vllm==" in row and "without `--load-format mpack`" in row, row
    assert json.dumps(target.ENGINE_VERSION).strip('"') in row
