"""mpack's table of multimodal wrappers (``mpack.arch.WRAPPERS``) against vLLM 0.33.0's own
classes: each wrapper's name mapping is its class's ``hf_to_vllm_mapper`` prefixes (Llama 4's
class has none: its ``load_weights`` renames with ``_rename_weight_for_modelopt_checkpoint``,
which every name is put through instead), and each architecture resolves to that class in
vLLM's registry.

The classes are imported in a child process with the CPU stand-ins (tests/vllm/cpu_standins.py,
stand-in 7 puts torchvision and mistral_common on the path), as the loader tests' workers do.
Whether the sidecars of these wrappers load as vLLM's own loader does is
tests/vllm/test_vllm_loader.py's (the wrapper cases there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpack import arch

HERE = Path(__file__).resolve().parent

#: Checkpoint names of both layouts, and of every part, that each class's mapper is asked about.
NAMES = (
    "model.language_model.layers.0.self_attn.q_proj.weight",
    "language_model.model.layers.1.mlp.down_proj.weight_scale",
    "model.layers.0.input_layernorm.weight",
    "model.embed_tokens.weight",
    "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
    "vision_tower.vision_model.embeddings.patch_embedding.weight",
    "model.visual.blocks.0.attn.qkv.weight",
    "visual.merger.mlp.0.weight",
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.multi_modal_projector.linear_1.weight",
    "multi_modal_projector.linear_1.weight",
    "language_model.model.layers.1.feed_forward.experts.3.down_proj.weight",
    "vision_model.model.layers.0.mlp.fc1.weight",
)
#: Wrappers whose vLLM class renames the checkpoint's names in a method of its own, without a
#: ``hf_to_vllm_mapper``: the method (it reads nothing of the instance).
RENAMED_BY = {"Llama4ForConditionalGeneration": "_rename_weight_for_modelopt_checkpoint"}
PROBE = """
import json, sys
sys.path[:0] = [sys.argv[1]]
import cpu_standins
cpu_standins.install()
from vllm.model_executor.models.registry import ModelRegistry
out = {}
renamed_by = json.loads(sys.argv[4])
for a in json.loads(sys.argv[2]):
    cls = ModelRegistry.models[a].load_model_cls()
    if a in renamed_by:
        rename = getattr(cls, renamed_by[a])
        out[a] = {"class": cls.__name__, "prefixes": None,
                  "has_mapper": hasattr(cls, "hf_to_vllm_mapper"),
                  "names": {n: rename(None, n) for n in json.loads(sys.argv[3])}}
        continue
    m = cls.hf_to_vllm_mapper
    out[a] = {"class": cls.__name__, "prefixes": list(m.orig_to_new_prefix.items()),
              "names": {n: m.map_name(n) for n in json.loads(sys.argv[3])}}
print("PROBE" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_mappers() -> dict[str, dict]:
    archs = list(arch.WRAPPER_ARCHITECTURES)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            str(HERE),
            json.dumps(archs),
            json.dumps(NAMES),
            json.dumps(RENAMED_BY),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE")), None)
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[len("PROBE") :])


@pytest.mark.parametrize("architecture", arch.WRAPPER_ARCHITECTURES)
def test_wrapper_prefixes_are_vllms_mapper(vllm_mappers: dict, architecture: str) -> None:
    got = vllm_mappers[architecture]
    assert got["class"] == architecture
    wrapper = arch.wrapper_of(architecture)
    assert wrapper is not None
    if architecture in RENAMED_BY:  # no mapper: the names test below is the whole check
        assert got["has_mapper"] is False
        return
    # In vLLM's order: each prefix applies to what the ones before left (WeightsMapper).
    assert [tuple(p) for p in got["prefixes"]] == list(wrapper.prefixes)


@pytest.mark.parametrize("architecture", arch.WRAPPER_ARCHITECTURES)
def test_vllm_name_is_what_vllms_mapper_makes(vllm_mappers: dict, architecture: str) -> None:
    """Every name, of both layouts and every part, comes out as vLLM's own mapper makes it."""
    lay = arch.layout_of(architecture, "LlamaForCausalLM")
    for name, want in vllm_mappers[architecture]["names"].items():
        assert want is not None, f"vLLM's {architecture} drops {name}"
        assert lay.vllm_name(name) == want, name
