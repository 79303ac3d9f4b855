"""scripts/synth_checkpoint.py's Qwen3-30B-A3B shape (the MoE benchmark's checkpoint, issue 39),
made small: a checkpoint mpack converts and verifies, whose experts' gate and up share their
input scale (vLLM refuses a checkpoint where they differ) and whose weights hold no NaN code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.convert.helpers import cli, explain, read_tensor  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "synth_checkpoint.py"
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim",
         "128", "--vocab", "512", "--experts", "4", "--moe-intermediate", "96"]  # fmt: skip


def test_moe_shape_converts_and_verifies(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(ck), "--model", "qwen3-30b-a3b", *SMALL],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["moe_intermediate_size"], cfg["head_dim"]) == (4, 96, 128)
    x = "model.layers.1.mlp.experts.3"
    gate, up = (read_tensor(ck, f"{x}.{m}.input_scale") for m in ("gate_proj", "up_proj"))
    assert torch.equal(gate, up)
    w = read_tensor(ck, f"{x}.down_proj.weight").view(torch.uint8)
    assert w.shape == (256, 96) and not ((w & 0x7F) == 0x7F).any()
    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, "--quiet")
    assert r.returncode == 0, explain(r)
    layers = json.loads((out / "mpack.json").read_text())["layers"]
    w13 = layers["model.layers.0.mlp.experts.routed_experts.w13"]
    assert (w13["experts"], w13["n"], w13["np"]) == (4, 192, 256)  # 96 padded to 128 per shard
    r = cli("verify", out, "--source", ck)
    assert r.returncode == 0, explain(r)


LLAMA_SMALL = ["--layers", "1", "--hidden", "256", "--heads", "2", "--kv-heads", "1",
               "--intermediate", "256", "--vocab", "512"]  # fmt: skip


def test_autofp8_form_is_the_same_checkpoint(tmp_path: Path) -> None:
    """``--quant autofp8`` (vLLM's weight-cache daemon's format, issue 40's side-by-side) writes
    the compressed-tensors checkpoint's weights and scale values in AutoFP8's form, which mpack
    converts to the same ``w8a16`` bytes."""
    made = {}
    for quant in ("compressed-tensors", "autofp8"):
        ck = tmp_path / quant
        r = subprocess.run(
            [sys.executable, str(SCRIPT), str(ck), "--quant", quant, *LLAMA_SMALL],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        made[quant] = ck
    af = made["autofp8"]
    assert json.loads((af / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "static",
        "ignored_layers": ["lm_head"],
    }
    p = "model.layers.0.mlp.down_proj"
    for name in ("weight_scale", "input_scale"):
        ct, fp8 = (read_tensor(made[q], f"{p}.{name}") for q in made)
        assert (ct.dtype, tuple(ct.shape)) == (torch.bfloat16, (1,))
        assert (fp8.dtype, tuple(fp8.shape)) == (torch.float32, ())
        assert torch.equal(ct.float().reshape(()), fp8)
    ct_w, fp8_w = (read_tensor(made[q], f"{p}.weight").view(torch.uint8) for q in made)
    assert torch.equal(ct_w, fp8_w)
    outs = {}
    for quant, ck in made.items():
        outs[quant] = tmp_path / f"sc-{quant}"
        r = cli("convert", ck, "-o", outs[quant], "--profile", "w8a16", "--quiet")
        assert r.returncode == 0, explain(r)
    files = sorted(f.name for f in outs["autofp8"].glob("*.safetensors"))
    assert files == sorted(f.name for f in outs["compressed-tensors"].glob("*.safetensors"))
    for name in files:
        assert (outs["autofp8"] / name).read_bytes() == (
            outs["compressed-tensors"] / name
        ).read_bytes(), name
    r = cli("verify", outs["autofp8"], "--source", af)
    assert r.returncode == 0, explain(r)
