"""scripts/vllm_engine.py, the parts that run before and after the engines (the engines
themselves run on the GPU, docs/VLLM.md "Engines generate"): the weight-only checkpoint its
``w8a16`` cases use, and the comparison that decides whether the run passed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_engine", REPO / "scripts" / "vllm_engine.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tokens: list[list[int]], lp: float = -0.5) -> dict[str, Any]:
    return {"tokens": tokens, "logprobs": [[{str(t): lp} for t in seq] for seq in tokens]}


def test_weight_only_drops_activation_quantization_and_keeps_the_weights(
    script: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from mpack.convert import convert
    from mpack.fixtures import make_checkpoint

    ck = tmp_path / "ck"
    make_checkpoint(ck, arch="qwen2", scheme="FP8", layers=1, seed=3)
    before = {f.name: load_file(f) for f in ck.glob("*.safetensors")}
    assert any(k.endswith(".input_scale") for t in before.values() for k in t)
    convert(ck, tmp_path / "sc-before", profile="w8a16", device="cpu")

    script.weight_only(ck)
    cfg = json.loads((ck / "config.json").read_text())["quantization_config"]
    assert all(g["input_activations"] is None for g in cfg["config_groups"].values())
    after = {f.name: load_file(f) for f in ck.glob("*.safetensors")}
    assert not any(k.endswith(".input_scale") for t in after.values() for k in t)
    for name, tensors in after.items():
        for k, t in tensors.items():
            assert t.equal(before[name][k]), k
    # the w8a16 sidecar never held input_scale: the same bytes from either checkpoint
    convert(ck, tmp_path / "sc-after", profile="w8a16", device="cpu")
    for f in sorted((tmp_path / "sc-before").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "sc-after" / f.name).read_bytes(), f.name


def test_compare_sees_each_kind_of_difference(script: Any) -> None:
    a = _run([[1, 2, 3], [4, 5]])
    assert script.compare(a, _run([[1, 2, 3], [4, 5]])) == {
        "tokens_equal": True,
        "max_logprob_diff": 0.0,
    }
    assert script.compare(a, _run([[1, 2, 3], [4, 5]], lp=-0.25))["max_logprob_diff"] == 0.25
    other = script.compare(a, _run([[1, 2, 9], [4, 5]]))
    assert other["tokens_equal"] is False and other["max_logprob_diff"] == float("inf")
    assert script.compare(a, {"error": "boom"})["tokens_equal"] is False
    with pytest.raises(ValueError):  # a run cut short is not a shorter equal run
        script.compare(a, _run([[1, 2, 3]]))


def test_summary_passes_only_when_every_mode_of_every_case_matches(script: Any) -> None:
    name = script.cases()[0]["name"]
    good = {f"{name}/{m}": _run([[7, 8]]) for m in script.MODES}
    good["control"] = _run([[7, 8]], lp=-2.0)
    s = script.summarize_tokens(good, only=name)
    assert s["all_equal"] is True and s["control_differs"] is True

    drift = {**good, f"{name}/attached": _run([[7, 8]], lp=-0.5000001)}
    assert script.summarize_tokens(drift, only=name)["all_equal"] is False
    same_control = {**good, "control": _run([[7, 8]])}
    assert script.summarize_tokens(same_control, only=name)["control_differs"] is False
    missing = {k: v for k, v in good.items() if not k.endswith("/private")}
    s = script.summarize_tokens(missing, only=name)
    assert s["all_equal"] is False and "private" in s["cases"][name]["errors"]
    # every case counts when none is selected: one case's runs are not a whole run
    assert script.summarize_tokens(good)["all_equal"] is False


def test_cases_cover_both_architectures_profiles_and_dtypes(script: Any) -> None:
    got = {(c["arch"], c["strategy"], c["dtype"], c["profile"]) for c in script.cases()}
    assert len(got) == 16
    assert {g[0] for g in got} == {"llama", "qwen2"}
    assert {g[3] for g in got} == {"w8a16", "w8a8-marlin"}
    assert {g[2] for g in got} == {"bfloat16", "float16"}


def test_tiny_jobs_hold_the_control(script: Any) -> None:
    jobs = script.tiny_jobs()
    assert [(c["name"], s) for c, s in jobs].count((script.cases()[0]["name"], 1)) == 1
    assert len(jobs) == len(script.cases()) + 1
    # the control's checkpoint and sidecar differ from the first case's by seed only
    first, control = jobs[0], jobs[-1]
    assert first[0] == control[0] and (first[1], control[1]) == (0, 1)
    w = Path("/w")
    assert script.checkpoint_dir(w, control[0], 1) != script.checkpoint_dir(w, first[0], 0)
