"""Multimodal wrappers (issue 38 part 3): the language model of a vision-language checkpoint
(Llava, Mistral 3, Qwen2.5-VL, Gemma 3) is converted under the names vLLM 0.33.0's wrapper class
gives it, from either name layout, the vision tower and projector passed through unchanged.

The name rules are checked against the facts of vLLM's ``hf_to_vllm_mapper`` tables; the
conversions use real tiny checkpoints of transformers' own wrapper classes
(:func:`mpack.fixtures.make_wrapper_checkpoint`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mpack import arch

LM = "language_model.model."  # vLLM's prefix of a wrapper's language model
# checkpoint name -> vLLM's name, per wrapper (llava.py / mistral3.py / qwen2_5_vl.py /
# gemma3_mm.py mappers), in both layouts
NAMES = {
    "LlavaForConditionalGeneration": {
        f"{LM}layers.3.self_attn.q_proj": f"{LM}layers.3.self_attn.q_proj",
        "model.language_model.layers.3.mlp.up_proj": f"{LM}layers.3.mlp.up_proj",
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight": "vision_tower.encoder.layers.0."
        "mlp.fc1.weight",
        "model.multi_modal_projector.linear_1.weight": "multi_modal_projector.linear_1.weight",
        "lm_head.weight": "language_model.lm_head.weight",
        "language_model.lm_head.weight": "language_model.lm_head.weight",
    },
    "Mistral3ForConditionalGeneration": {
        "model.layers.0.self_attn.o_proj": f"{LM}layers.0.self_attn.o_proj",
        "model.language_model.norm.weight": f"{LM}norm.weight",
        "model.vision_tower.ln_pre.weight": "vision_tower.ln_pre.weight",
    },
    "Qwen2_5_VLForConditionalGeneration": {
        "model.layers.1.self_attn.q_proj.bias": f"{LM}layers.1.self_attn.q_proj.bias",
        "model.language_model.layers.1.mlp.down_proj": f"{LM}layers.1.mlp.down_proj",
        "model.visual.blocks.0.attn.qkv.weight": "visual.blocks.0.attn.qkv.weight",
        "visual.merger.mlp.0.weight": "visual.merger.mlp.0.weight",
        "model.embed_tokens.weight": f"{LM}embed_tokens.weight",
    },
    "Gemma3ForConditionalGeneration": {
        "model.language_model.layers.0.self_attn.q_norm.weight": f"{LM}layers.0.self_attn.q_norm."
        "weight",
        "model.multi_modal_projector.mm_input_projection_weight": "multi_modal_projector."
        "mm_input_projection_weight",
    },
}


@pytest.mark.parametrize("wrapper", sorted(NAMES))
def test_checkpoint_names_map_to_vllms(wrapper: str) -> None:
    lay = arch.layout_of(wrapper, "LlamaForCausalLM")
    assert lay.wrapper is not None and lay.decoder_prefix == "language_model.model.layers"
    for ck, vllm in NAMES[wrapper].items():
        assert lay.vllm_name(ck) == vllm, ck


def test_a_causal_lm_keeps_its_names() -> None:
    lay = arch.layout_of("LlamaForCausalLM", "ignored")
    assert lay.wrapper is None and lay.text_architecture == "LlamaForCausalLM"
    assert lay.vllm_name("model.layers.0.mlp.up_proj") == "model.layers.0.mlp.up_proj"
    assert lay.decoder_index("model.layers.7.mlp.up_proj") == 7
    assert lay.part_of("model.embed_tokens.weight") == arch.LANGUAGE_MODEL


@pytest.mark.parametrize(
    ("wrapper", "config", "text"),
    [
        # text_config names it; else its model_type (pixtral-12b: "mistral", no architectures)
        (
            "LlavaForConditionalGeneration",
            {"text_config": {"architectures": ["LlamaForCausalLM"]}},
            "LlamaForCausalLM",
        ),
        (
            "LlavaForConditionalGeneration",
            {"text_config": {"model_type": "mistral"}},
            "MistralForCausalLM",
        ),
        (
            "Mistral3ForConditionalGeneration",
            {"text_config": {"model_type": "mistral"}},
            "MistralForCausalLM",
        ),
        ("LlavaForConditionalGeneration", {"text_config": {"model_type": "olmo2"}}, None),
        # vLLM's class fixes it, whatever the config says
        (
            "Qwen2_5_VLForConditionalGeneration",
            {"text_config": {"model_type": "qwen2_5_vl_text"}},
            "Qwen2ForCausalLM",
        ),
        ("Gemma3ForConditionalGeneration", {}, "Gemma3ForCausalLM"),
    ],
)
def test_the_language_model_is_found(wrapper: str, config: dict, text: str | None) -> None:
    assert arch.text_architecture(wrapper, config) == text
    lay = arch.layout_of(wrapper, text)
    assert (lay.family is None) == (text is None)


def test_parts() -> None:
    qwen = arch.layout_of("Qwen2_5_VLForConditionalGeneration", "Qwen2ForCausalLM")
    assert qwen.part_of("visual.merger.mlp.0.weight") == arch.PROJECTOR
    assert qwen.part_of("visual.blocks.0.attn.qkv.weight") == arch.VISION_TOWER
    llava = arch.layout_of("LlavaForConditionalGeneration", "MistralForCausalLM")
    assert llava.part_of("multi_modal_projector.linear_1.weight") == arch.PROJECTOR
    assert llava.part_of("language_model.lm_head.weight") == arch.LANGUAGE_MODEL


# --- conversions of real wrapper checkpoints ------------------------------------------------

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    from mpack.fixtures import make_wrapper_checkpoint

    root = tmp_path_factory.mktemp("wrappers")
    return {
        (w, lay): make_wrapper_checkpoint(
            root / f"{w}-{lay}", wrapper=w, layout=lay, layers=1, scheme="FP8_DYNAMIC"
        )
        for w, lay in (("llava", "legacy"), ("llava", "hf"), ("qwen2_5_vl", "legacy"))
    }


def _convert(ck: Path, out: Path, tp: int = 2) -> dict:
    from mpack.convert.options import ConvertOptions
    from mpack.convert.pipeline import run_convert

    run_convert(ck, out, ConvertOptions(tp=tp))
    return json.loads((out / "mpack.json").read_text())


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from mpack.sidecar import read_file_map

    return {e.name: (e.dtype, tuple(e.shape)) for e in read_file_map(path).entries}


def test_llava_both_layouts_give_vllms_names(ckpts: dict, tmp_path: Path) -> None:
    """Either layout: the Marlin layers under vLLM's names (the same rank files, byte for byte),
    their shards under the checkpoint's, every other tensor passed through as the checkpoint
    names it; the manifest names the language model."""
    made = {lay: _convert(ckpts[("llava", lay)], tmp_path / lay) for lay in ("legacy", "hf")}
    for lay, m in made.items():
        assert m["model"]["architecture"] == "LlavaForConditionalGeneration"
        assert m["model"]["text_architecture"] == "MistralForCausalLM"
        assert sorted(m["layers"]) == sorted(
            f"language_model.model.layers.0.{leaf}"
            for leaf in (
                "self_attn.qkv_proj",
                "self_attn.o_proj",
                "mlp.gate_up_proj",
                "mlp.down_proj",
            )
        )
        first = "model.language_model." if lay == "hf" else "language_model.model."
        shards = m["layers"]["language_model.model.layers.0.self_attn.qkv_proj"]["shards"]
        assert [s["module"] for s in shards] == [
            f"{first}layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")
        ]
        common = _headers(tmp_path / lay / "common.safetensors")
        source = _headers(ckpts[("llava", lay)] / "model.safetensors")
        assert all(source[n] == common[n] for n in common)  # checkpoint names, unchanged
        tower = "model.vision_tower." if lay == "hf" else "vision_tower."
        assert any(n.startswith(tower) for n in common)
        assert not any(n.endswith(("weight_scale", "input_scale")) for n in common)
    for r in range(2):
        name = f"rank-{r:02d}-of-02.safetensors"
        assert (tmp_path / "legacy" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()


def test_qwen2_5_vl_original_layout(ckpts: dict, tmp_path: Path) -> None:
    """Qwen2.5-VL's original checkpoints keep the language model at ``model.layers.*``: vLLM's
    ``language_model.model.layers.*``, with the q/k/v bias."""
    m = _convert(ckpts[("qwen2_5_vl", "legacy")], tmp_path / "sc", tp=1)
    assert m["model"]["text_architecture"] == "Qwen2ForCausalLM"
    qkv = m["layers"]["language_model.model.layers.0.self_attn.qkv_proj"]
    assert (
        qkv["bias"] and [s["module"] for s in qkv["shards"]][0] == "model.layers.0.self_attn.q_proj"
    )
    common = _headers(tmp_path / "sc" / "common.safetensors")
    assert "visual.merger.mlp.0.weight" in common and "model.embed_tokens.weight" in common


def test_inspect_names_the_parts(ckpts: dict, tmp_path: Path) -> None:
    from tests.convert.helpers import cli, explain

    _convert(ckpts[("llava", "hf")], tmp_path / "sc", tp=1)
    r = cli("inspect", tmp_path / "sc", "--json")
    assert r.returncode == 0, explain(r)
    parts = json.loads(r.stdout)["parts"]
    assert parts[arch.LANGUAGE_MODEL]["marlin_layers"] == 4
    assert parts[arch.VISION_TOWER]["marlin_layers"] == 0
    assert parts[arch.VISION_TOWER]["passthrough_tensors"] > 0
    assert parts[arch.PROJECTOR]["passthrough_tensors"] == 4  # linear_1/2, weight and bias
    r = cli("inspect", tmp_path / "sc")
    assert r.returncode == 0, explain(r)
    assert "language model MistralForCausalLM" in r.stdout
    assert "vision tower: 0 Marlin linear layers" in r.stdout


def test_unknown_language_model_is_refused(ckpts: dict, tmp_path: Path) -> None:
    """A wrapper around a language model mpack has no rules for: exit 2, config.json and the
    language model named, nothing written."""
    from tests.convert.helpers import assert_refused, cli, edit_config

    ck = tmp_path / "ck"
    shutil.copytree(ckpts[("llava", "legacy")], ck)

    def olmo(cfg: dict) -> None:
        cfg["text_config"]["model_type"] = "olmo2"
        cfg["text_config"]["architectures"] = ["Olmo2ForCausalLM"]

    edit_config(ck, olmo)
    out = tmp_path / "out"
    r = cli("convert", ck, "-o", out)
    assert_refused(
        r, out, f"{ck / 'config.json'}", "LlavaForConditionalGeneration", "'Olmo2ForCausalLM'"
    )


def test_a_quantized_vision_tower_is_refused(ckpts: dict, tmp_path: Path) -> None:
    """The vision tower is not packed: a checkpoint that quantizes it is refused by name."""
    from mpack.convert.checkpoint import find_layers, open_checkpoint
    from mpack.convert.plan import make_plan
    from mpack.errors import UnsupportedSchemeError

    ck = open_checkpoint(ckpts[("llava", "legacy")])
    find_layers(ck)
    module = "vision_tower.encoder.layers.0.mlp.fc1"
    ck.layers[module] = next(iter(ck.layers.values()))  # as find_layers would list it
    with pytest.raises(UnsupportedSchemeError, match=rf"{module}.*vision tower"):
        make_plan(ck, profile="w8a16", act_dtype="bfloat16", tp=1, fusion="vllm")
