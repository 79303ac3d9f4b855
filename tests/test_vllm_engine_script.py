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
    got = {
        (c["arch"], c["strategy"], c["dtype"], c["profile"])
        for c in script.cases()
        if c["arch"] in ("llama", "qwen2") and c["scheme"] in script.SCHEMES
    }
    assert len(got) == 16  # the full product, as before issue 38
    assert {g[0] for g in got} == {"llama", "qwen2"}
    assert {g[3] for g in got} == {"w8a16", "w8a8-marlin"}
    assert {g[2] for g in got} == {"bfloat16", "float16"}


def test_every_family_runs_both_scales_and_profiles_in_a_few_cases(script: Any) -> None:
    names = [c["name"] for c in script.cases()]
    assert len(names) == len(set(names)), "case names are the keys of the results"
    # compressed-tensors, the causal LMs
    cs = [
        c
        for c in script.cases()
        if c["scheme"] in script.SCHEMES and "wrapper" not in c and not c.get("moe")
    ]
    assert (
        {c["arch"] for c in cs}
        == set(script.FAMILIES)
        == {
            "llama",
            "qwen2",
            "gemma2",
            "granite",
            "phi3",
        }
    )
    from mpack.fixtures import ARCHS

    assert set(script.FAMILIES) <= set(ARCHS)
    for f in ("gemma2", "granite", "phi3"):
        mine = [c for c in cs if c["arch"] == f]
        assert 2 <= len(mine) <= 4, f  # a covering set, not the product: device time
        assert {c["strategy"] for c in mine} == {"tensor", "channel"}, f
        assert {c["profile"] for c in mine} == set(script.PROFILES), f
        assert all(c["name"].startswith(f + "-") for c in mine)
    # vLLM refuses Gemma 2 in float16; the others run it somewhere
    assert {c["dtype"] for c in cs if c["arch"] == "gemma2"} == {"bfloat16"}
    for f in ("granite", "phi3"):
        assert {c["dtype"] for c in cs if c["arch"] == f} == set(script.DTYPES), f


def test_wrappers_run_both_scales_profiles_and_layouts_text_only(script: Any) -> None:
    from mpack.fixtures import LAYOUTS, WRAPPERS

    ws = [c for c in script.cases() if "wrapper" in c]
    assert {c["wrapper"] for c in ws} == set(WRAPPERS)
    assert {c["strategy"] for c in ws} == {"tensor", "channel"}
    assert {c["profile"] for c in ws} == set(script.PROFILES)
    assert {c["layout"] for c in ws} == set(LAYOUTS)
    assert script.selected("llava,mistral3,qwen2_5_vl,gemma3") == ws
    for c in ws:
        space = script._prompt_space(c)
        assert space["text_only"] and space["vocab"] < 1000  # below the special tokens
        run = {"model": "m", "dtype": c["dtype"], "mode": "private", "sidecar": "s", **space}
        assert script.engine_kwargs(run)["language_model_only"] is True
        args = script.fixture_args(c, 1)
        assert args["wrapper"] == c["wrapper"] and args["seed"] == 1
        assert (args["layout"], args["scheme"]) == (c["layout"], c["scheme"])
    dense = next(c for c in script.cases() if "wrapper" not in c)
    run = {"model": "m", "dtype": "bfloat16", "mode": "ordinary", **script._prompt_space(dense)}
    assert "language_model_only" not in script.engine_kwargs(run)


def test_moe_cases_run_both_scales_on_marlin_moe(script: Any) -> None:
    from mpack.fixtures_moe import MOE_ARCHS

    ms = [c for c in script.cases() if c.get("moe")]
    assert {c["arch"] for c in ms} == set(MOE_ARCHS)
    assert {"tensor", "channel"} <= {c["strategy"] for c in ms}
    # no weight-only compressed-tensors FP8 MoE in vLLM; AutoFP8 is w8a16 on Marlin
    assert {c["profile"] for c in ms if c["scheme"] in script.SCHEMES} == {"w8a8-marlin"}
    assert {c["profile"] for c in ms if c["scheme"] in script.AUTOFP8} == {"w8a16"}
    for c in ms:
        run = {"model": "m", "dtype": c["dtype"], "mode": "ordinary", **script._prompt_space(c)}
        assert script.engine_kwargs(run)["moe_backend"] == "marlin"
        args = script.fixture_args(c, 1)
        assert {"arch", "scheme", "dtype", "seed"} <= set(args)
        assert args.get("autofp8") == script.AUTOFP8.get(c["scheme"])


def test_only_selects_by_name_and_by_family_list(script: Any) -> None:
    assert script.selected("") == script.cases()
    gemma = script.selected("gemma2")
    assert gemma and {c["arch"] for c in gemma} == {"gemma2"}
    new = script.selected("gemma2,granite,phi3")
    assert {c["arch"] for c in new} == {"gemma2", "granite", "phi3"}
    assert new == [c for c in script.cases() if c["arch"] in ("gemma2", "granite", "phi3")]
    autofp8 = {c["arch"] for c in script.selected("autofp8")}
    assert autofp8 == {"llama", "gemma2", "mixtral", "qwen2_moe"}
    (padded,) = script.selected("qwen2_moe-tensor-bfloat16-w8a8-marlin-i160")
    assert script.fixture_args(padded, 0)["moe_intermediate"] == 160
    assert script.checkpoint_dir(Path("w"), padded).name.endswith("-i160-s0")
    assert script.selected("gemma2,") == gemma  # an empty part selects nothing more
    one = script.cases()[-1]["name"]
    assert [c["name"] for c in script.selected(one)] == [one]
    assert script.selected("no-such-case") == []


def test_fixture_args_carry_each_family_quirk(script: Any) -> None:
    by = {
        c["arch"]: c for c in script.cases() if c["scheme"] in script.SCHEMES and "wrapper" not in c
    }
    for arch, c in by.items():
        args = script.fixture_args(c, 1)
        assert args["arch"] == arch and args["seed"] == 1
        assert (args["scheme"], args["dtype"]) == (c["scheme"], c["dtype"])
    assert script.fixture_args(by["gemma2"], 0)["head_dim"] == 32
    assert script.fixture_args(by["phi3"], 0)["kv_heads"] == 1
    for arch in ("llama", "qwen2", "granite"):
        assert "head_dim" not in script.fixture_args(by[arch], 0)
        assert "kv_heads" not in script.fixture_args(by[arch], 0)


def test_fixture_args_make_the_families_checkpoints(script: Any, tmp_path: Path) -> None:
    """The arguments are ones ``make_checkpoint`` takes, and give each family its quirk."""
    from mpack.fixtures import make_checkpoint

    cs = [c for c in script.selected("gemma2,granite,phi3") if c["scheme"] in script.SCHEMES]
    for c in cs[::2]:  # one case per family
        ck = make_checkpoint(tmp_path / c["name"], **{**script.fixture_args(c, 0), "layers": 1})
        cfg = json.loads((ck / "config.json").read_text())
        assert cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] == c["dtype"]
        if c["arch"] == "gemma2":
            assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"]
            assert cfg["tie_word_embeddings"] is True
        if c["arch"] == "phi3":
            assert cfg["num_key_value_heads"] == 1


def test_prepare_builds_the_selected_cases_and_their_control(
    script: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mpack.convert
    import mpack.fixtures

    made: list[tuple[Path, dict[str, Any]]] = []
    converted: list[tuple[Path, Path, str]] = []

    def fake_make(out: Path, **kw: Any) -> Path:
        made.append((out, kw))
        return out

    monkeypatch.setattr(mpack.fixtures, "make_checkpoint", fake_make)
    monkeypatch.setattr(
        mpack.fixtures, "make_autofp8_checkpoint", lambda out, **kw: fake_make(out, autofp8=1, **kw)
    )

    def fake_convert(ck: Path, sc: Path, *, profile: str, device: str) -> None:
        converted.append((ck, sc, profile))

    monkeypatch.setattr(mpack.convert, "convert", fake_convert)
    monkeypatch.setattr(script, "weight_only", lambda ck: None)
    script.prepare_tiny(tmp_path, "gemma2,phi3")
    sel = script.selected("gemma2,phi3")
    assert len(made) == len(converted) == len(sel) + 1
    for (out, kw), (c, seed) in zip(made, script.tiny_jobs("gemma2,phi3"), strict=True):
        assert out == script.checkpoint_dir(tmp_path, c, seed)
        made_as = {"autofp8": 1} if c["scheme"] in script.AUTOFP8 else {}
        assert kw == {**made_as, **script.fixture_args(c, seed)}
    # the control: the first selected case's config at seed 1, its own sidecar
    assert made[-1][1] == {**made[0][1], "seed": 1}
    assert converted[-1][1] == tmp_path / f"sc-{sel[0]['name']}-s1"
    assert [p for _, _, p in converted] == [c["profile"] for c in sel] + [sel[0]["profile"]]


def test_tiny_jobs_hold_the_control(script: Any) -> None:
    jobs = script.tiny_jobs()
    assert [(c["name"], s) for c, s in jobs].count((script.cases()[0]["name"], 1)) == 1
    assert len(jobs) == len(script.cases()) + 1
    # the control's checkpoint and sidecar differ from the first case's by seed only
    first, control = jobs[0], jobs[-1]
    assert first[0] == control[0] and (first[1], control[1]) == (0, 1)
    w = Path("/w")
    assert script.checkpoint_dir(w, control[0], 1) != script.checkpoint_dir(w, first[0], 0)
    # a selection has its own control: the first selected case at seed 1
    new = script.tiny_jobs("granite")
    assert new[-1] == (script.selected("granite")[0], 1)
    assert script.tiny_jobs("no-such-case") == []


def test_summary_of_a_family_alone_has_its_control(script: Any) -> None:
    sel = script.selected("phi3")
    good = {f"{c['name']}/{m}": _run([[3, 4]]) for c in sel for m in script.MODES}
    good["control"] = _run([[3, 4]], lp=-1.5)
    s = script.summarize_tokens(good, only="phi3")
    assert s["all_equal"] is True and s["control_differs"] is True
    assert set(s["cases"]) == {c["name"] for c in sel}
    # the control is compared with the first selected case's ordinary run
    other = {**good, f"{sel[0]['name']}/ordinary": _run([[3, 4]], lp=-1.5)}
    assert script.summarize_tokens(other, only="phi3")["control_differs"] is False


def test_control_engine_skips_the_binding_check_and_no_other_does(script: Any) -> None:
    run = {"model": "/ck", "dtype": "bfloat16", "sidecar": "/sc", "vocab": 1000}
    private = script.engine_kwargs({**run, "mode": "private"})
    assert "check_source" not in private["model_loader_extra_config"]
    control = script.engine_kwargs({**run, "mode": "private", "check_source": False})
    assert control["model_loader_extra_config"]["check_source"] is False


def test_autofp8_cases_are_weight_only_autofp8_checkpoints(script: Any, tmp_path: Path) -> None:
    """The AutoFP8 cases (quant_method fp8, static and dynamic): profile w8a16 (vLLM's
    Fp8LinearMethod on Marlin), and their fixture arguments make such a checkpoint."""
    from mpack.fixtures import make_autofp8_checkpoint

    cs = [c for c in script.cases() if c["scheme"] in script.AUTOFP8 and not c.get("moe")]
    assert {script.AUTOFP8[c["scheme"]] for c in cs} == {"static", "dynamic"}
    assert {c["profile"] for c in cs} == {"w8a16"}
    for c in cs:
        assert "autofp8-" in c["name"]
        ck = make_autofp8_checkpoint(
            tmp_path / c["name"], **{**script.fixture_args(c, 0), "layers": 1}
        )
        qc = json.loads((ck / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "fp8"
        assert qc["activation_scheme"] == script.AUTOFP8[c["scheme"]]


# --- the real model (scripts/vllm_real.py) ------------------------------------------------------


@pytest.fixture(scope="module")
def real_script() -> Any:
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(
            "vllm_real", REPO / "scripts" / "vllm_real.py"
        )
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(REPO / "scripts"))


def test_real_plan_runs_three_engines_per_checkpoint_the_bf16_model_and_a_control(
    real_script: Any, script: Any, tmp_path: Path
) -> None:
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3], [4, 5]]))
    real = tmp_path / "r"
    (real / "bf16").mkdir(parents=True)
    (real / "bf16" / "config.json").write_text("{}")
    runs = {r["key"]: r for r in real_script.plan(real, tmp_path)}
    assert set(runs) == {
        "fp8-dynamic/ordinary", "fp8-dynamic/private", "fp8-dynamic/attached",
        "fp8-static/ordinary", "fp8-static/private", "fp8-static/attached", "bf16", "control",
    }  # fmt: skip
    assert all(
        r["prompt_ids"] == [[1, 2, 3], [4, 5]] and r["max_tokens"] == 32 for r in runs.values()
    )
    # the control: fp8-dynamic's checkpoint, fp8-static's sidecar, unbound on purpose
    assert runs["control"]["model"] == str(real / "fp8-dynamic")
    assert runs["control"]["sidecar"].endswith("sc-fp8-static")
    assert runs["control"]["check_source"] is False
    kw = {k: script.engine_kwargs(r) for k, r in runs.items()}
    assert "linear_backend" not in kw["bf16"] and "load_format" not in kw["bf16"]
    assert kw["fp8-static/ordinary"]["linear_backend"] == "marlin"
    assert kw["fp8-static/attached"]["model_loader_extra_config"]["attach"] == "require"
    assert kw["fp8-static/private"]["model_loader_extra_config"]["attach"] == "never"


def test_real_summary_needs_every_engine_equal_and_the_control_to_differ(
    real_script: Any,
) -> None:
    def run(lp: float) -> dict[str, Any]:
        return {**_run([[5, 6], [7, 8]], lp), "texts": ["Paris.", "blue"]}

    results = {f"{n}/{m}": run(-0.5) for n in ("fp8-dynamic", "fp8-static")
               for m in ("ordinary", "private", "attached")}  # fmt: skip
    results["bf16"] = run(-0.4)
    results["control"] = run(-0.7)
    s = real_script.summarize(results)
    assert s["all_equal"] and s["control_differs"] and s["bf16_texts"] == ["Paris.", "blue"]
    assert "all three" in real_script.text_table(s)

    off = dict(results)
    off["fp8-static/attached"] = run(-0.5 + 2**-20)  # one logprob, one ulp-ish off
    assert not real_script.summarize(off)["all_equal"]
    same = {**results, "control": run(-0.5)}
    assert not real_script.summarize(same)["control_differs"]
    gone = {k: v for k, v in results.items() if k != "fp8-dynamic/private"}
    s = real_script.summarize(gone)
    assert not s["all_equal"] and s["checkpoints"]["fp8-dynamic"]["errors"]["private"] == "missing"
