"""runtime/vllm/source.py without vLLM: the sidecar ``--load-format mpack`` reads, found from
the model argument or the ``"sidecar"`` key, for the engine's target. A real multi-target
``mpack convert`` output, in-process (the module imports neither vLLM nor torch); the engine's
own run of the same refusal is in tests/hostile/test_vllm_hostile.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from mpack.errors import InputError
from mpack.runtime.vllm.checks import Options
from mpack.runtime.vllm.source import sidecar_dir
from mpack.sidecar import load_manifest

TP4 = {"tp_size": 4, "profile": "w8a16", "act_dtype": "bfloat16", "fusion": "vllm"}


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mpack.convert import convert
    from mpack.fixtures import make_checkpoint

    root = tmp_path_factory.mktemp("vllm-source")
    out = root / "multi"
    convert(make_checkpoint(root / "ck"), out, device="cpu", tp=[1, 2])
    return out


def _ways(d: Path) -> list[tuple[Options, str]]:
    """The directory as the ``"sidecar"`` key and as the model."""
    return [(Options(sidecar=str(d)), "unused-model"), (Options(), str(d))]


def test_the_engines_target_is_taken_from_a_directory_of_targets(multi: Path) -> None:
    for sub in sorted(multi.iterdir()):
        target: dict[str, Any] = load_manifest(sub)[0]["target"]
        for opts, model in _ways(multi):
            assert sidecar_dir(opts, model, target=target) == sub


def test_a_directory_without_the_engines_target_names_it_and_the_targets_it_has(
    multi: Path,
) -> None:
    """Before, the ``"sidecar"`` key's directory got the reader's bare "no mpack.json"."""
    for opts, model in _ways(multi):
        with pytest.raises(InputError) as e:
            sidecar_dir(opts, model, target=TP4)
        msg = e.value.message
        assert msg.startswith(f"{multi}: not an mpack sidecar (no mpack.json"), msg
        assert "nor a folder tp4-w8a16-bfloat16 (the engine's target)" in msg, msg
        assert "it holds the targets tp1-w8a16-bfloat16, tp2-w8a16-bfloat16" in msg, msg
        assert "--tp 4 --profile w8a16 --act-dtype bfloat16" in (e.value.hint or "")
        assert e.value.exit_code == 2


def test_a_renamed_target_folder_is_found_by_its_manifest(multi: Path, tmp_path: Path) -> None:
    """Note [target layout]: the engine's target is found by the manifests, not only by the
    folder's name (a directory holding one target, as ``--layout targets`` writes it)."""
    import shutil

    tp2 = multi / "tp2-w8a16-bfloat16"
    target: dict[str, Any] = load_manifest(tp2)[0]["target"]
    renamed = tmp_path / "renamed"
    shutil.copytree(tp2, renamed / "production")
    for opts, model in _ways(renamed):
        assert sidecar_dir(opts, model, target=target) == renamed / "production"


def test_a_missing_sidecar_directory_is_left_to_the_reader(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    assert sidecar_dir(Options(sidecar=str(gone)), "unused", target=TP4) == gone
