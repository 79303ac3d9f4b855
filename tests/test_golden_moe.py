"""tests/data/golden-moe: MoE sidecars against vLLM 0.33.0's own Marlin MoE tensors, computed on
a GPU (an H100, sm 90) with vLLM's compiled ops (``gptq_marlin_repack``, its CUDA requantization) by
scripts/vllm_gpu.py ``--cases golden`` (README.md there says how and when).

Each case is the checkpoint vLLM loaded and every Marlin tensor its load +
``process_weights_after_loading`` left (``moe_backend="marlin"``): the experts' stacked ``w13`` /
``w2`` weights and scales, and the attention's and a shared expert's dense Marlin layers.
``mpack convert`` of that checkpoint on this CPU must write exactly those tensors, bit for bit:
no more, no fewer. An expert-parallel target's experts are slices of these
(tests/convert/test_moe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

GOLDEN_MOE = REPO / "tests" / "data" / "golden-moe"
CASES = sorted(p for p in (GOLDEN_MOE / "cases").iterdir() if (p / "case.json").is_file())
#: The families the golden data must cover (a lost case fails here, not silently).
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "llama4")


def test_every_family_has_a_golden_case() -> None:
    archs = {json.loads((c / "case.json").read_text())["make"]["arch"] for c in CASES}
    assert archs == set(FAMILIES), archs
    strategies = {json.loads((c / "case.json").read_text())["make"]["scheme"] for c in CASES}
    assert strategies == {"FP8", "FP8_DYNAMIC"}


@pytest.mark.parametrize("case_dir", CASES, ids=lambda p: p.name)
def test_moe_golden_case(case_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.convert.helpers import same_bytes, tensors

    case = json.loads((case_dir / "case.json").read_text())
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "mpack", "convert", str(case_dir / "input"), "-o", str(out),
         "--profile", case["profile"], "--act-dtype", case["act_dtype"], "--tp", str(case["tp"]),
         "--device", "cpu", "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    name = "rank-00-of-01.safetensors"
    got, want = tensors(out / name), tensors(case_dir / "expected" / name)
    assert sorted(got) == sorted(want)
    assert any(".experts.routed_experts.w" in n for n in want), "a MoE golden case holds experts"
    for t in want:
        assert same_bytes(got[t], want[t]), f"{case_dir.name}: {t} differs from vLLM's"
