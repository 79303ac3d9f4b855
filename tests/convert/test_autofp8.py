"""AutoFP8 checkpoints (``quant_method: fp8``) convert to what vLLM's Fp8LinearMethod leaves on
Marlin: the ``w8a16`` layout of the same weights and per-tensor scales, byte for byte.

The compressed-tensors checkpoint and the AutoFP8 one below hold the same FP8 weights and the
same scale values (the AutoFP8 fixture rewrites the compressed-tensors one: float32 scalar
scales, its own config). The compressed-tensors conversion is checked against vLLM's kernels by
the golden data; vLLM's own load of the AutoFP8 one is compared in tests/vllm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from mpack.convert import convert  # noqa: E402
from mpack.convert.checkpoint import find_layers, open_checkpoint  # noqa: E402
from mpack.fixtures import make_autofp8_checkpoint, make_checkpoint  # noqa: E402
from mpack.sidecar import read_file_map  # noqa: E402

DIMS = {"arch": "phi3", "kv_heads": 1, "layers": 1, "seed": 3}  # fused on disk, K/V replicated


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("autofp8")
    return {
        "ct": make_checkpoint(root / "ct", scheme="FP8", **DIMS),
        "static": make_autofp8_checkpoint(root / "static", activation="static", **DIMS),
        "dynamic": make_autofp8_checkpoint(root / "dynamic", activation="dynamic", **DIMS),
    }


def test_fixture_is_autofp8(pair: dict[str, Path]) -> None:
    """What the fixture writes is AutoFP8's form: its config, scalar float32 scales, and input
    scales only for static activations."""
    for kind in ("static", "dynamic"):
        cfg = json.loads((pair[kind] / "config.json").read_text())["quantization_config"]
        assert cfg == {
            "quant_method": "fp8",
            "activation_scheme": kind,
            "ignored_layers": ["lm_head"],
        }
        entries = {e.name: e for e in read_file_map(pair[kind] / "model.safetensors").entries}
        scales = [e for n, e in entries.items() if n.endswith("_scale")]
        assert scales and all(e.shape == () and e.dtype == "F32" for e in scales)
        has_input = any(n.endswith(".input_scale") for n in entries)
        assert has_input == (kind == "static")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_same_bytes_as_compressed_tensors_w8a16(
    pair: dict[str, Path], tmp_path: Path, kind: str, tp: int
) -> None:
    ct, af = tmp_path / "ct", tmp_path / kind
    convert(pair["ct"], ct, tp=tp, profile="w8a16", device="cpu")
    convert(pair[kind], af, tp=tp, profile="w8a16", device="cpu")
    names = sorted(p.name for p in ct.glob("*.safetensors"))
    assert names == sorted(p.name for p in af.glob("*.safetensors"))
    assert len(names) == tp + 1  # the rank files and common.safetensors
    for name in names:
        assert (af / name).read_bytes() == (ct / name).read_bytes(), name


def test_layers_are_per_tensor(pair: dict[str, Path]) -> None:
    ck = open_checkpoint(pair["static"])
    layers = find_layers(ck)
    assert ck.quant_method == "fp8"
    assert layers and {ly.strategy for ly in layers.values()} == {"tensor"}
    assert set(layers) == set(find_layers(open_checkpoint(pair["ct"])))
