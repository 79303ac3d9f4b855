"""Architecture rules: how vLLM 0.33.0 fuses and splits the linears of the models mpack knows.

The one owner of these rules (SPEC §6): which architectures have them, which checkpoint modules
fuse into which vLLM linear and in what row order, which linears are row-parallel, the order of
the linears in a decoder layer, how the model dimensions are read from a (text) config, which TP
sizes fit them, which rows of the K/V heads each rank holds, and which decoder layers each
pipeline stage runs. ``convert``'s planner, the verification model and the vLLM loader all use
them.

It imports neither torch nor anything else of mpack.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from mpack.errors import UsageError, arg


@dataclass(frozen=True)
class Experts:
    """A family's mixture-of-experts blocks as vLLM 0.33.0 builds them: one ``FusedMoE`` per
    decoder layer, its experts' weights stacked in ``<block>.experts.routed_experts.w13_weight``
    (every expert's gate rows, then its up rows) and ``w2_weight`` (down), with the Marlin MoE
    backend's preparation (mpack/convert/moe.py)."""

    #: The MoE block under ``model.layers.<i>.`` (``block_sparse_moe``, ``mlp``).
    block: str
    #: The checkpoint names of one expert's gate, up and down linears, under
    #: ``<block>.experts.<e>.``.
    linears: tuple[str, str, str]
    #: config.json's keys of the expert count (the first present counts: transformers 5 writes
    #: Qwen3-MoE's ``num_experts`` as ``num_local_experts``) and of one expert's intermediate size.
    count_keys: tuple[str, ...]
    intermediate_key: str
    #: A shared expert beside the routed ones (Qwen2-MoE's, Llama 4's): ``(its module under the
    #: block, config.json's key of its intermediate size)``. It is a dense MLP
    #: (``gate_up_proj``, ``down_proj``) packed as the Llama layout's; a gate it has (Qwen2-MoE's
    #: ``shared_expert_gate``) is a pass-through tensor.
    shared: tuple[str, str] | None = None
    #: config.json's key of the MoE block's period: every ``n``-th decoder layer has one
    #: (Qwen2/3-MoE's ``decoder_sparse_step``, Llama 4's ``interleave_moe_layer_step``; 0: none).
    step_key: str = "decoder_sparse_step"

    def expert_of(self, module: str) -> tuple[str, int, int] | None:
        """``(the MoE block's name, expert index, which linear: 0 gate, 1 up, 2 down)`` of a
        checkpoint module; None: not one of this family's experts."""
        m = _EXPERT.match(module)
        if m is None or m.group(2) != self.block or m.group(4) not in self.linears:
            return None
        return m.group(1) + m.group(2), int(m.group(3)), self.linears.index(m.group(4))

    def is_moe_layer(self, config: Mapping[str, Any], i: int) -> bool:
        """Whether decoder layer ``i`` has a MoE block, by vLLM's rule (qwen2_moe.py,
        qwen3_moe.py, llama4.py): not in ``mlp_only_layers``, and every :attr:`step_key`-th (a
        config without them, Mixtral's: every layer); the others have Llama's MLP."""
        step = config.get(self.step_key)
        step = 1 if step is None else int(step)
        only = config.get("mlp_only_layers") or ()
        return step > 0 and i not in only and (i + 1) % step == 0

    def shared_size(self, config: Mapping[str, Any]) -> int:
        """The shared expert's intermediate size; 0: none."""
        return int(config.get(self.shared[1]) or 0) if self.shared else 0

    def module(self, block: str, expert: int, linear: int) -> str:
        """The checkpoint module of ``linear`` (0 gate, 1 up, 2 down) of expert ``expert``."""
        return f"{block}.experts.{expert}.{self.linears[linear]}"


#: ``model.layers.<i>.<block>.experts.<e>.<linear>``, under a wrapper's prefix (Llama 4's
#: ``language_model.``) or none
_EXPERT = re.compile(r"^((?:\w+\.)*?model\.layers\.\d+\.)(\w+)\.experts\.(\d+)\.(\w+)$")
#: The stacked parameters vLLM gives a MoE block's experts, under ``<block>.experts.``: gate and
#: up together, and down.
EXPERTS_PARAMS = ("routed_experts.w13", "routed_experts.w2")


@dataclass(frozen=True)
class Family:
    """How vLLM 0.33.0 builds the decoder layers of one family of models: the architectures in
    it, and what sets it apart from the Llama layout (fused ``qkv_proj`` and ``gate_up_proj``
    column-parallel, ``o_proj`` and ``down_proj`` row-parallel, under ``model.layers.<i>.``)."""

    architectures: tuple[str, ...]
    #: The checkpoint stores the fused linears themselves (Phi-3's ``qkv_proj`` and
    #: ``gate_up_proj``): vLLM cuts each into its parts (q, k, v; gate, up) by the config's sizes
    #: and slices every part for its rank, as if they had been separate tensors.
    prefused: bool = False
    #: config.json's ``head_dim`` is used; False: vLLM takes ``hidden_size // heads`` (Qwen2).
    reads_head_dim: bool = True
    #: Its mixture-of-experts blocks (None: a dense model). The attention is Llama's.
    experts: Experts | None = None
    #: The module of a decoder layer's MLP (Llama 4's ``feed_forward``) and config.json's key of
    #: a dense MLP's intermediate size (Llama 4's ``intermediate_size_mlp``: its
    #: ``intermediate_size`` is an expert's).
    mlp: str = "mlp"
    intermediate_key: str = "intermediate_size"
    #: vLLM reorders the rows of ``q_proj`` and ``k_proj`` (and their per-channel scales) within
    #: each head as it loads them, for its rotary embedding: a head's even rows, then its odd
    #: ones (Llama 4: ``Llama4ForCausalLM.permute_qk_weight_for_rotary``).
    rotary_permuted: bool = False


#: Every family whose fusion and TP rules mpack knows, by name. A new one is an entry here (and,
#: where it needs one, a module of its own): its vLLM model class's ``packed_modules_mapping``
#: must be :data:`FUSED`.
FAMILIES: dict[str, Family] = {
    "llama": Family(
        (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen3ForCausalLM",
            "Gemma2ForCausalLM",
            "GraniteForCausalLM",
            # Gemma 3's language model (gemma3.py: the Llama packed_modules_mapping; its q/k
            # norms are pass-through tensors, as Qwen3's).
            "Gemma3ForCausalLM",
        )
    ),
    "qwen2": Family(("Qwen2ForCausalLM",), reads_head_dim=False),
    # One weight_scale for a fused per-tensor linear: vLLM gives every part that scale.
    "phi3": Family(("Phi3ForCausalLM",), prefused=True),
    # mixtral.py: the router (block_sparse_moe.gate) is built without a quant config.
    "mixtral": Family(
        ("MixtralForCausalLM",),
        experts=Experts(
            "block_sparse_moe", ("w1", "w3", "w2"), ("num_local_experts",), "intermediate_size"
        ),
    ),
    # qwen2_moe.py: Qwen2's attention (q/k/v biases, head_dim from hidden_size); the router
    # (GateLinear) and shared_expert_gate are built without a quant config.
    "qwen2_moe": Family(
        ("Qwen2MoeForCausalLM",),
        reads_head_dim=False,
        experts=Experts(
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
            ("num_experts",),
            "moe_intermediate_size",
            shared=("shared_expert", "shared_expert_intermediate_size"),
        ),
    ),
    # llama4.py (inside mllama4.py's wrapper): a MoE block (`feed_forward`: a router built
    # without a quant config, 16 or 128 experts and a shared expert of the experts' size) in
    # every interleave_moe_layer_step-th layer, a dense MLP of intermediate_size_mlp elsewhere.
    "llama4": Family(
        ("Llama4ForCausalLM",),
        experts=Experts(
            "feed_forward",
            ("gate_proj", "up_proj", "down_proj"),
            ("num_local_experts",),
            "intermediate_size",
            shared=("shared_expert", "intermediate_size"),
            step_key="interleave_moe_layer_step",
        ),
        mlp="feed_forward",
        intermediate_key="intermediate_size_mlp",
        rotary_permuted=True,
    ),
    # qwen3_moe.py: q/k norms pass through, as Qwen3's.
    "qwen3_moe": Family(
        ("Qwen3MoeForCausalLM",),
        experts=Experts(
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
            ("num_experts", "num_local_experts"),
            "moe_intermediate_size",
        ),
    ),
}
#: Every architecture of :data:`FAMILIES`.
ARCHITECTURES = tuple(a for f in FAMILIES.values() for a in f.architectures)
#: Column-parallel fused linear -> its parts (vLLM's shards, checkpoint modules unless the
#: family is ``prefused``), in row order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Row-parallel linears (input features split across ranks), kept under their own names.
ROW_PARALLEL = ("o_proj", "down_proj")
#: Parts of ``qkv_proj`` that hold K/V heads (replicated when TP exceeds the KV heads).
KV_SHARDS = ("k_proj", "v_proj")
#: A Llama MLP's vLLM linears, under its module (``mlp.``; a shared expert's).
MLP_LINEARS = ("gate_up_proj", "down_proj")
#: Within a decoder layer, the linears in the order the forward pass uses them.
LEAF_ORDER = {"qkv_proj": 0, "o_proj": 1, "gate_up_proj": 2, "down_proj": 3}
#: Where these families keep their decoder layers, in checkpoints and in vLLM's models:
#: ``model.layers.<i>.``, ``i`` from 0 to ``num_hidden_layers - 1``.
DECODER_PREFIX = "model.layers"
DECODER_INDEX = re.compile(re.escape(DECODER_PREFIX) + r"\.(\d+)\.")


def family_of(architecture: str | None) -> Family | None:
    """The family of ``architecture`` (a causal LM's ``architectures[0]``, or a wrapper's text
    model: :func:`text_architecture`); None: unknown."""
    return next((f for f in FAMILIES.values() if architecture in f.architectures), None)


# --- multimodal wrappers ------------------------------------------------------------------


@dataclass(frozen=True)
class Wrapper:
    """A vLLM 0.33.0 vision-language model class around a language model of :data:`FAMILIES`.

    vLLM builds the language model under ``language_model.`` (:data:`TEXT_MODEL_PREFIX`), so its
    decoder linears are ``language_model.model.layers.<i>...``, and maps every checkpoint name
    with the class's ``hf_to_vllm_mapper`` before loading it."""

    architectures: tuple[str, ...]
    #: ``hf_to_vllm_mapper.orig_to_new_prefix``, in order: checkpoint-name prefix -> vLLM-name
    #: prefix. Every entry is tried in turn on the name the previous ones left (WeightsMapper).
    prefixes: tuple[tuple[str, str], ...]
    #: vLLM-name prefix -> the part of the model under it (what ``mpack inspect`` calls it).
    parts: tuple[tuple[str, str], ...]
    #: The language model's architecture where the class fixes it
    #: (``init_vllm_registered_model(architectures=[...])``); None: ``text_config``'s.
    text_architecture: str | None = None


#: Where vLLM builds a wrapper's language model (``maybe_prefix(prefix, "language_model")``).
TEXT_MODEL_PREFIX = "language_model."
LANGUAGE_MODEL, VISION_TOWER, PROJECTOR = "language model", "vision tower", "projector"
#: Llava's mapper (llava.py:505-513); Mistral 3 and Gemma 3 start from it.
_LLAVA_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)
_LLAVA_PARTS = (
    (TEXT_MODEL_PREFIX, LANGUAGE_MODEL),
    ("vision_tower.", VISION_TOWER),
    ("multi_modal_projector.", PROJECTOR),
)
#: Every wrapper mpack knows, by name. A new one is an entry here: its vLLM class's
#: ``hf_to_vllm_mapper`` prefixes, its parts, and how it picks its language model.
WRAPPERS: dict[str, Wrapper] = {
    "llava": Wrapper(("LlavaForConditionalGeneration",), _LLAVA_PREFIXES, _LLAVA_PARTS),
    # mistral3.py:433-451 (text-only names ``model.*`` last; its suffix entries rename
    # AutoFP8's weight_scale_inv / activation_scale, names compressed-tensors does not use).
    "mistral3": Wrapper(
        ("Mistral3ForConditionalGeneration",),
        (*_LLAVA_PREFIXES, ("model.", "language_model.model.")),
        _LLAVA_PARTS,
    ),
    # qwen2_5_vl.py:1313-1322, 1440-1448: the original checkpoints keep the language model at
    # ``model.*`` and the vision tower (with its merger, the projector) at ``visual.*``.
    "qwen2_5_vl": Wrapper(
        ("Qwen2_5_VLForConditionalGeneration",),
        (
            ("model.language_model.", "language_model.model."),
            ("model.visual.", "visual."),
            ("lm_head.", "language_model.lm_head."),
            ("model.", "language_model.model."),
        ),
        (
            (TEXT_MODEL_PREFIX, LANGUAGE_MODEL),
            ("visual.merger.", PROJECTOR),
            ("visual.", VISION_TOWER),
        ),
        text_architecture="Qwen2ForCausalLM",
    ),
    # mllama4.py: the Hub's names are vLLM's (its load_weights renames only ModelOpt's
    # ``model.*`` / ``lm_head.*``); the language model is Llama4ForCausalLM.
    "llama4": Wrapper(
        ("Llama4ForConditionalGeneration",),
        (
            ("language_model.", "language_model."),
            ("vision_model.", "vision_model."),
            ("multi_modal_projector.", "multi_modal_projector."),
            ("model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
        ),
        (
            (TEXT_MODEL_PREFIX, LANGUAGE_MODEL),
            ("vision_model.", VISION_TOWER),
            ("multi_modal_projector.", PROJECTOR),
        ),
        text_architecture="Llama4ForCausalLM",
    ),
    # gemma3_mm.py:515-523, 565-570.
    "gemma3": Wrapper(
        ("Gemma3ForConditionalGeneration",),
        _LLAVA_PREFIXES,
        _LLAVA_PARTS,
        text_architecture="Gemma3ForCausalLM",
    ),
}
#: Every architecture of :data:`WRAPPERS`.
WRAPPER_ARCHITECTURES = tuple(a for w in WRAPPERS.values() for a in w.architectures)
#: ``text_config.model_type`` -> the causal LM vLLM builds for it when ``text_config`` names no
#: architecture (vLLM's ``with_hf_config`` takes transformers' causal-LM mapping), for the
#: model types of :data:`FAMILIES`.
TEXT_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def wrapper_of(architecture: str | None) -> Wrapper | None:
    """The wrapper ``architecture`` is (config.json's ``architectures[0]``); None: not one."""
    return next((w for w in WRAPPERS.values() if architecture in w.architectures), None)


def text_architecture(architecture: str | None, config: Mapping[str, Any]) -> str | None:
    """The architecture of the language model of a model whose config.json is ``config``: the
    architecture itself for a causal LM; for a wrapper, the one its vLLM class fixes, else
    ``text_config.architectures[0]``, else the causal LM of ``text_config.model_type``
    (:data:`TEXT_MODEL_TYPES`; None when it has none there)."""
    w = wrapper_of(architecture)
    if w is None:
        return architecture
    if w.text_architecture:
        return w.text_architecture
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else {}
    archs = text.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    model_type = text.get("model_type")
    return TEXT_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


@dataclass(frozen=True)
class Layout:
    """Where a model keeps its language model, in checkpoint names and in vLLM's: a causal LM
    at the top (``model.layers.<i>.``, names equal), a wrapper's under
    :data:`TEXT_MODEL_PREFIX` in vLLM's names (checkpoint names mapped by its prefixes)."""

    architecture: str | None
    text_architecture: str | None
    family: Family | None  # the language model's; None: mpack has no rules for it
    wrapper: Wrapper | None = None

    @property
    def decoder_prefix(self) -> str:
        """vLLM's name of the decoder layers (``model.layers`` or
        ``language_model.model.layers``)."""
        return (TEXT_MODEL_PREFIX if self.wrapper else "") + DECODER_PREFIX

    @property
    def text_prefix(self) -> str:
        """vLLM's prefix of the language model's ``model.embed_tokens`` / ``lm_head``."""
        return TEXT_MODEL_PREFIX if self.wrapper else ""

    def vllm_name(self, name: str) -> str:
        """The name vLLM's wrapper class gives checkpoint tensor or module ``name`` (its
        ``hf_to_vllm_mapper`` prefixes); a causal LM's names are vLLM's."""
        for old, new in self.wrapper.prefixes if self.wrapper else ():
            if name.startswith(old):
                name = new + name[len(old) :]
        return name

    def decoder_index(self, name: str) -> int | None:
        """The decoder layer a checkpoint tensor or module name is in; None outside them."""
        return decoder_index(self.vllm_name(name), self.decoder_prefix)

    def part_of(self, vllm_name: str) -> str:
        """Which part of the model a vLLM name belongs to: :data:`LANGUAGE_MODEL`,
        :data:`VISION_TOWER` or :data:`PROJECTOR` (a causal LM is all language model)."""
        parts = self.wrapper.parts if self.wrapper else ()
        return next((part for p, part in parts if vllm_name.startswith(p)), LANGUAGE_MODEL)


def layout_of(architecture: str | None, text: str | None = None) -> Layout:
    """The :class:`Layout` of a model of ``architecture`` whose language model is ``text``
    (:func:`text_architecture`; ignored for a causal LM, which is its own)."""
    w = wrapper_of(architecture)
    text = text if w is not None else architecture
    return Layout(architecture, text, family_of(text), w)


#: Architectures vLLM 0.33.0 cannot run at all -> why (an mpack sidecar of one would never load).
NOT_IN_VLLM = {
    "MllamaForConditionalGeneration": "vLLM removed Mllama (Llama 3.2 Vision) in 0.10.2",
}


def unknown_architecture_hint() -> str:
    """What would make an architecture outside :data:`FAMILIES` convert."""
    return (
        "an architecture whose vLLM model class fuses qkv_proj and gate_up_proj as Llama's does "
        "is one entry of mpack.arch.FAMILIES; until then, "
        f"use {arg('fuse', 'none')} {arg('tp', 1)} to pack every layer under its checkpoint "
        "name, for mpack.runtime.attach or your own loader; vLLM's --load-format mpack cannot "
        f"load such a sidecar (it needs {arg('fuse', 'vllm')})"
    )


def fused_name(module: str) -> str | None:
    """The vLLM linear a checkpoint module belongs to (``...self_attn.q_proj`` ->
    ``...self_attn.qkv_proj``; a row-parallel or already fused module is its own); None: not
    one of these families' linears."""
    parent, _, leaf = module.rpartition(".")
    if leaf in ROW_PARALLEL or leaf in FUSED:
        return module
    fused = next((f for f, shards in FUSED.items() if leaf in shards), None)
    return None if fused is None else f"{parent}.{fused}"


def part_modules(name: str, family: Family) -> list[str]:
    """The checkpoint module of each part of vLLM linear ``name``, in row order: each part's
    own module, or the fused linear itself once per part (``prefused``)."""
    parent, _, leaf = name.rpartition(".")
    if leaf not in FUSED:
        return [name]
    return [name] * len(FUSED[leaf]) if family.prefused else [f"{parent}.{s}" for s in FUSED[leaf]]


def shard_modules(name: str, family: Family) -> list[str]:
    """The checkpoint modules of vLLM linear ``name``, each once, in row order."""
    return list(dict.fromkeys(part_modules(name, family)))


def part_offsets(family: Family, dims: Dims, name: str) -> list[int]:
    """Where each part of column-parallel linear ``name`` starts in its checkpoint module's
    rows: 0 for separate modules; q, k, v (gate, up) one after another when ``prefused``."""
    leaf = name.rpartition(".")[2]
    if not family.prefused:
        return [0] * len(FUSED[leaf])
    sizes = [expected_rows(dims)[s] for s in FUSED[leaf]]
    return [sum(sizes[:i]) for i in range(len(sizes))]


def rotary_head(family: Family, dims: Dims, part: str) -> int:
    """The rows of a head whose rows vLLM reorders for its rotary embedding in part ``part``
    (:attr:`Family.rotary_permuted`); 0: none."""
    return dims.head_dim if family.rotary_permuted and part in ("q_proj", "k_proj") else 0


def parallel_style(name: str) -> str:
    """``column`` | ``row`` for a vLLM linear of the Llama family."""
    return "row" if name.rpartition(".")[2] in ROW_PARALLEL else "column"


def decoder_index(name: str, prefix: str = DECODER_PREFIX) -> int | None:
    """The decoder layer a tensor or module name is in (``model.layers.7.mlp.up_proj`` -> 7);
    None outside the decoder layers. ``prefix``: where they are (:attr:`Layout.decoder_prefix`)."""
    m = (DECODER_INDEX if prefix == DECODER_PREFIX else _decoder_index(prefix)).match(name)
    return int(m.group(1)) if m else None


def _decoder_index(prefix: str) -> re.Pattern[str]:
    return re.compile(re.escape(prefix) + r"\.(\d+)\.")


_NUM = re.compile(r"(\d+)")


def natural_key(name: str) -> list[Any]:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(p) if p.isdigit() else p for p in _NUM.split(name)]


def layer_order(name: str) -> tuple[Any, ...]:
    """Sort key of a linear: by decoder layer, then as the forward pass uses them."""
    parent, _, leaf = name.rpartition(".")
    block = parent.rpartition(".")[0] if leaf in LEAF_ORDER else parent
    return (natural_key(block), LEAF_ORDER.get(leaf, len(LEAF_ORDER)), natural_key(name))


@dataclass(frozen=True)
class Dims:
    """The model dimensions the fusion and TP rules use."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    #: Other MLPs' intermediate sizes, by the module that holds their linears (a shared
    #: expert's: :attr:`Experts.shared`); see :func:`linear_dims`.
    mlps: tuple[tuple[str, int], ...] = ()


def dims_of(architecture: str | None, config: Mapping[str, Any]) -> Dims:
    """Read :class:`Dims` from a (text) config. Qwen2 ignores ``head_dim`` (vLLM's rule:
    :attr:`Family.reads_head_dim`).

    Raises:
        KeyError, TypeError, ValueError: a dimension is missing or not a number.
    """
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    family = family_of(architecture)
    inter = int(config[family.intermediate_key if family is not None else "intermediate_size"])
    head_dim = hidden // heads
    if (family is None or family.reads_head_dim) and config.get("head_dim"):
        head_dim = int(config["head_dim"])
    ex = family.experts if family is not None else None
    mlps = ()
    if ex is not None and ex.shared is not None and ex.shared_size(config):
        mlps = ((ex.shared[0], ex.shared_size(config)),)
    return Dims(heads, kv, head_dim, inter, mlps)


def mlp_linears(family: Family | None, config: Mapping[str, Any], i: int) -> list[str]:
    """The dense vLLM linears of decoder layer ``i``'s MLP, under ``model.layers.<i>.``:
    Llama's ``mlp.gate_up_proj`` and ``mlp.down_proj``; for a MoE block (whose experts are
    stacked layers), its shared expert's, or none."""
    ex = family.experts if family is not None else None
    if ex is None or not ex.is_moe_layer(config, i):
        mlp = family.mlp if family is not None else "mlp"
        return [f"{mlp}.{leaf}" for leaf in MLP_LINEARS]
    if not ex.shared_size(config):
        return []
    assert ex.shared is not None
    return [f"{ex.block}.{ex.shared[0]}.{leaf}" for leaf in MLP_LINEARS]


def linear_dims(dims: Dims, name: str) -> Dims:
    """The dims vLLM linear ``name`` (or checkpoint module) is sized by: ``dims``, with the
    intermediate size of the MLP it is in (:attr:`Dims.mlps`, by the module holding it)."""
    holder = name.rpartition(".")[0].rpartition(".")[2]
    inter = dict(dims.mlps).get(holder)
    return dims if inter is None else replace(dims, intermediate=inter, mlps=())


def tp_problem(dims: Dims, tp: int) -> str | None:
    """Why ``tp`` does not fit the model (SPEC §1: H % T == 0, I % T == 0, and Hkv % T == 0
    when T <= Hkv, else T % Hkv == 0); None when it fits."""
    if dims.heads % tp:
        return f"{arg('tp', tp)} does not divide num_attention_heads={dims.heads}"
    if dims.intermediate % tp:
        return f"{arg('tp', tp)} does not divide intermediate_size={dims.intermediate}"
    for holder, inter in dims.mlps:
        if inter % tp:
            return f"{arg('tp', tp)} does not divide the {holder}'s intermediate size {inter}"
    kv = dims.kv_heads
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        return (
            f"{arg('tp', tp)} does not fit num_key_value_heads={kv} "
            "(it must divide the KV heads, or be a multiple of them)"
        )
    return None


def kv_split(dims: Dims, tp: int) -> tuple[int, int]:
    """``(KV heads per rank, ranks sharing one KV group)``: ranks replicate K/V heads when TP
    exceeds the KV heads."""
    if tp >= dims.kv_heads:
        return 1, tp // dims.kv_heads
    return dims.kv_heads // tp, 1


def shard_rows(dims: Dims, name: str, tp: int, rank: int) -> list[tuple[int, int]] | None:
    """Rows ``[r0, r1)`` of each shard of column-parallel linear ``name`` that ``rank`` holds
    (SPEC §6); None for a row-parallel linear (it splits its input features instead)."""
    leaf = name.rpartition(".")[2]
    d = dims.head_dim
    if leaf == "qkv_proj":
        nq = dims.heads // tp
        nkv, rep = kv_split(dims, tp)
        kv = ((rank // rep) * nkv * d, (rank // rep + 1) * nkv * d)
        return [(rank * nq * d, (rank + 1) * nq * d), kv, kv]
    if leaf == "gate_up_proj":
        per = dims.intermediate // tp
        return [(rank * per, (rank + 1) * per)] * 2
    return None


def distinct_ranks(shard: str, dims: Dims, tp: int) -> list[int]:
    """Ranks whose rows of ``shard`` are distinct: one per KV group for K/V shards (the others
    replicate them), every rank otherwise. Concatenated in this order they give the full rows."""
    if shard in KV_SHARDS:
        return list(range(0, tp, kv_split(dims, tp)[1]))
    return list(range(tp))


def expected_rows(dims: Dims) -> dict[str, int]:
    """Output channels (N) of each part, and of each fused linear, of the whole (TP 1) model."""
    d = dims.head_dim
    parts = {
        "q_proj": dims.heads * d,
        "k_proj": dims.kv_heads * d,
        "v_proj": dims.kv_heads * d,
        "gate_proj": dims.intermediate,
        "up_proj": dims.intermediate,
    }
    return parts | {f: sum(parts[s] for s in shards) for f, shards in FUSED.items()}


def expected_cols(dims: Dims) -> dict[str, int]:
    """Input channels (K) of each row-parallel linear of the whole (TP 1) model."""
    return {"o_proj": dims.heads * dims.head_dim, "down_proj": dims.intermediate}


# --- pipeline parallelism ------------------------------------------------------------------------

#: vLLM's variable that gives each pipeline stage's layer count by hand (``"17,15"``), which
#: :func:`pp_partition` reads as vLLM 0.33.0's ``get_pp_indices`` does.
PP_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def pp_partition(num_layers: int, pp_size: int, spec: str | None = None) -> list[int]:
    """How many decoder layers each of ``pp_size`` pipeline stages runs, by vLLM 0.33.0's rule
    (``vllm.distributed.utils.get_pp_indices``, which ``make_layers`` asks while it builds a
    model): ``spec``, the value of :data:`PP_PARTITION_ENV`, when set; else ``num_layers //
    pp_size`` each, and the remainder one more each to the stages before the last, from the
    second-to-last backwards (32 layers over 3 stages: ``[11, 11, 10]``; 3 over 2: ``[2, 1]``).

    Raises:
        UsageError: a ``spec`` that is not ``pp_size`` integers adding up to ``num_layers``
            (vLLM refuses it too, with a ``ValueError``).
    """
    if spec is None:
        per, extra = divmod(num_layers, pp_size)
        counts = [per] * pp_size
        for i in range(2, extra + 2):
            counts[-i] += 1
        return counts
    example = f"e.g. {PP_PARTITION_ENV}={','.join(map(str, pp_partition(num_layers, pp_size)))}"
    try:
        counts = [int(n) for n in spec.split(",")]
    except ValueError:
        raise UsageError(
            f"{PP_PARTITION_ENV}={spec!r} is not a comma-separated list of layer counts",
            hint=example,
        ) from None
    if len(counts) != pp_size or sum(counts) != num_layers:
        raise UsageError(
            f"{PP_PARTITION_ENV}={spec!r} gives {len(counts)} stages of {sum(counts)} layers; "
            f"the engine has {pp_size} stages and the model {num_layers} decoder layers",
            hint=example,
        )
    return counts


def pp_layers(num_layers: int, pp_rank: int, pp_size: int, spec: str | None = None) -> range:
    """The decoder layers pipeline stage ``pp_rank`` of ``pp_size`` runs (:func:`pp_partition`):
    vLLM 0.33.0's ``range(*get_pp_indices(num_layers, pp_rank, pp_size))``.

    Raises:
        UsageError: ``pp_rank`` outside ``0..pp_size-1``, or a bad ``spec``.
    """
    return Stage.of(num_layers, pp_rank, pp_size, spec).layers


def stage_layers(layers: Mapping[str, Any], span: range, prefix: str = DECODER_PREFIX) -> dict:
    """The entries of ``layers`` (by vLLM name: a manifest's ``layers``) that a stage running
    decoder layers ``span`` holds: those in its decoder layers, and any outside the decoder
    layers (every stage builds those)."""
    out = {}
    for name, value in layers.items():
        i = decoder_index(name, prefix)
        if i is None or i in span:
            out[name] = value
    return out


def pp_partition_spec(environ: Mapping[str, str]) -> str | None:
    """The value of :data:`PP_PARTITION_ENV` in ``environ`` as vLLM 0.33.0 reads it
    (``if partition_list_str := envs.VLLM_PP_LAYER_PARTITION``): None when unset or empty."""
    return environ.get(PP_PARTITION_ENV) or None


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``rank`` of a split of the decoder layers: ``split`` holds each stage's
    layer count (:func:`pp_partition`; ``len(split)`` stages, ``sum(split)`` layers). A split of
    one stage is the whole model: what a daemon without ``--pp-rank`` serves."""

    rank: int
    split: tuple[int, ...]

    @classmethod
    def of(cls, num_layers: int, pp_rank: int, pp_size: int, spec: str | None = None) -> Stage:
        """Stage ``pp_rank`` of vLLM's split of ``num_layers`` over ``pp_size`` stages
        (``spec``: :data:`PP_PARTITION_ENV`'s value, if set).

        Raises:
            UsageError: ``pp_rank`` outside ``0..pp_size-1``, or a bad ``spec``.
        """
        if not (type(pp_size) is int and pp_size >= 1 and type(pp_rank) is int):
            raise UsageError(
                f"pipeline stage {pp_rank!r} of {pp_size!r}: not integers, or size < 1"
            )
        if not 0 <= pp_rank < pp_size:
            raise UsageError(
                f"pipeline stage {pp_rank} is out of range: there are {pp_size} stages"
            )
        return cls(pp_rank, tuple(pp_partition(num_layers, pp_size, spec)))

    @property
    def size(self) -> int:
        return len(self.split)

    @property
    def layers(self) -> range:
        """The decoder layers this stage runs."""
        start = sum(self.split[: self.rank])
        return range(start, start + self.split[self.rank])

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def whole(self) -> bool:
        """Whether this is the only stage (every layer, every pass-through tensor)."""
        return self.size == 1

    @staticmethod
    def partial(stage: Stage | None) -> Stage | None:
        """``stage``, or None where it is None or the whole model (a split of one stage)."""
        return None if stage is None or stage.whole else stage

    @staticmethod
    def label(stage: Stage | None) -> str:
        """`` <the stage>`` to follow "rank R" in a message; empty for the whole rank."""
        stage = Stage.partial(stage)
        return "" if stage is None else f" {stage}"

    def __str__(self) -> str:
        span = self.layers
        held = f"layers {span.start}..{span.stop - 1}" if span else "no layers"
        return f"stage {self.rank} of {self.size} ({held}; split {list(self.split)})"


#: The language models whose vLLM 0.33.0 class builds the embeddings, the final norm and
#: lm_head on every pipeline stage, not as ``PPMissingLayer`` (gemma2.py, gemma3.py,
#: mixtral.py, qwen2_moe.py, qwen3_moe.py: ``self.embed_tokens``, ``self.norm`` and
#: ``self.lm_head`` built unconditionally). Every other architecture of :data:`FAMILIES` builds
#: them as llama.py does: the embeddings on the first stage (and on the last when tied, for its
#: lm_head), the final norm and lm_head on the last.
ENDS_ON_EVERY_STAGE = frozenset(
    {
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)


def stage_holds(vllm_name: str, lay: Layout, stage: Stage, tied: bool | None) -> bool:
    """Whether pipeline ``stage`` builds the module of tensor ``vllm_name`` (vLLM's name: a
    rank file's tensors have it, ``common.safetensors``' map to it by :meth:`Layout.vllm_name`),
    so a server of that stage alone must hold it (Note [a layer range per stage] in
    docs/FORMAT.md). The one rule, for the daemon and the loader alike:

    - a decoder layer's tensor: its layer is in ``stage.layers``;
    - the embeddings (``model.embed_tokens``): the first stage, and the last when ``tied``;
      the final norm (``model.norm``) and ``lm_head``: the last stage; all three on every stage
      for :data:`ENDS_ON_EVERY_STAGE`. ``tied`` None (config.json does not say): the first and
      the last, as if tied (the last may hold the embeddings for nothing, never lack them);
    - anything else (a wrapper's vision tower and projector, which vLLM 0.33.0 builds on every
      stage but under Model Runner V2): every stage.
    """
    if stage.whole:
        return True
    i = decoder_index(vllm_name, lay.decoder_prefix)
    if i is not None:
        return i in stage.layers
    text = lay.text_prefix
    end = next(
        (m for m in ("model.embed_tokens", "model.norm", "lm_head") if _under(vllm_name, text + m)),
        None,
    )
    if end is None or lay.text_architecture in ENDS_ON_EVERY_STAGE:
        return True
    if end == "model.embed_tokens":
        return stage.first or (stage.last and tied is not False)
    return stage.last


def _under(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")
