"""What ``--load-format mpack`` checks before vLLM builds the model (runtime/vllm/loader.py).

Note [the loader trusts nothing in the sidecar]: a sidecar's manifest passes mpack's strict
reader (mpack.sidecar.check_manifest), but a schema-valid manifest can still describe another
model, or only part of this one: a ``model.config`` without dimensions, a ``layers`` table that
leaves decoder layers out, a ``common.safetensors`` from a model with another vocabulary. vLLM
would load such a sidecar without a word (it skips its own "weights not loaded" check for
quantized models) and serve from uninitialised memory. So every fact the loader acts on is
checked here against the engine, before any model memory is allocated:

* ``--model-loader-extra-config``: known keys, each of the right type;
* the target (engine version, TP size, dtype, fusion, profile) and the architecture;
* ``model.config``: a mapping holding every dimension of ``MODEL_DIMS``, each equal to the
  engine's (a missing dimension is a mismatch, not a pass);
* ``layers``: not empty, and exactly the linears vLLM will run on FP8 Marlin in this model (the
  engine's layer count and quantization config say which);
* ``shards`` of a ``--no-passthrough`` sidecar, whose checkpoint tensors vLLM must skip;
* the tensors of ``common.safetensors``: none belongs to a Marlin layer, embeddings and norms
  have the engine's vocabulary and hidden size, no decoder layer beyond the model's.

After the build, runtime/vllm/loader.py checks the model itself the same way (every Marlin layer
gets sidecar weights, every other parameter is loaded). This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mpack import __version__, arch
from mpack.errors import InputError, UnsupportedSchemeError, UsageError, quote, shown
from mpack.sidecar import MANIFEST_NAME, MODEL_DIMS, regenerate_hint_of
from mpack.target import (
    BLOCK_FP8,
    BLOCK_FP8_HINT,
    ENGINE_VERSION,
    EXPERT_PARALLEL,
    QUANT_METHODS,
)

ATTACH_MODES = ("auto", "require", "never")
#: The keys ``--model-loader-extra-config`` may hold for ``--load-format mpack``.
EXTRA_KEYS = ("sidecar", "attach", "socket", "check_source")
#: Where vLLM's Llama-family models keep their decoder layers (mpack.arch owns it).
DECODER_PREFIX = arch.DECODER_PREFIX
#: The linears of a decoder layer, by their leaf name, and vLLM's class for each.
DECODER_LINEARS = {
    "qkv_proj": "QKVParallelLinear",
    "o_proj": "RowParallelLinear",
    "gate_up_proj": "MergedColumnParallelLinear",
    "down_proj": "RowParallelLinear",
}


class EngineMismatchError(UnsupportedSchemeError):
    """The sidecar was made for another engine, TP size, profile, dtype or model."""


OTHER_MODEL_HINT = "serve the sidecar of this model (mpack inspect shows what a sidecar holds)"


def first_and_more(names: list[str]) -> str:
    """``NAME`` or ``NAME (and N more)``: the first of a sorted list, for a message."""
    return shown(names[0]) + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


# --- --model-loader-extra-config ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """``--model-loader-extra-config`` for ``--load-format mpack``."""

    sidecar: str | None = None
    attach: str = "auto"
    socket: str | None = None
    #: Check that ``sidecar`` was made from the model argument's checkpoint (Note [a sidecar
    #: is bound to its checkpoint] in mpack/binding.py); false: load them together anyway.
    check_source: bool = True

    @classmethod
    def parse(cls, extra: Any) -> Options:
        """Raises:
        UsageError: not a mapping, an unknown key, or a value of the wrong type (the key named).
        """
        where = "--model-loader-extra-config"
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise UsageError(
                f"{where}: {quote(extra)} is a {type(extra).__name__}, not a JSON object",
                hint='pass a JSON object, e.g. \'{"sidecar": "PATH"}\' (docs/VLLM.md)',
            )
        unknown = sorted(str(k) for k in extra if k not in EXTRA_KEYS)
        if unknown:
            raise UsageError(
                f"{where}: unknown key(s) {', '.join(map(quote, unknown))} for --load-format mpack",
                hint=f"the keys are {', '.join(EXTRA_KEYS)} (docs/VLLM.md)",
            )
        for key in ("sidecar", "socket"):  # paths: a non-empty string, or absent
            value = extra.get(key)
            if value is not None and not (isinstance(value, str) and value and "\0" not in value):
                raise UsageError(
                    f"{where}: {key} is {quote(value)}, not a path",
                    hint=f'pass {key} as a JSON string, e.g. \'{{"{key}": "/path"}}\'',
                )
        if not isinstance(extra.get("check_source", True), bool):
            raise UsageError(
                f"{where}: check_source is {quote(extra['check_source'])}, not true or false",
                hint='e.g. \'{"sidecar": "PATH", "check_source": false}\' (docs/VLLM.md)',
            )
        opts = cls(**extra)
        if not isinstance(opts.attach, str) or opts.attach not in ATTACH_MODES:
            raise UsageError(
                f"{where}: attach is {quote(opts.attach)}, not one of {', '.join(ATTACH_MODES)}",
                hint='e.g. \'{"attach": "auto"}\' (docs/VLLM.md)',
            )
        return opts


# --- the target and the model -------------------------------------------------------------------


def quant_method_of(quant_config: Any) -> str:
    """The checkpoint format of a model's quantization config (a key of
    :data:`mpack.target.QUANT_METHODS`).

    Raises:
        EngineMismatchError: a format an mpack sidecar is never made from.
    """
    method = quant_config.get("quant_method") if isinstance(quant_config, Mapping) else None
    if not isinstance(method, str) or method not in QUANT_METHODS:
        raise EngineMismatchError(
            f"the model's quantization is {shown(method)}: an mpack sidecar is made from "
            f"{' or '.join(QUANT_METHODS)} FP8 checkpoints",
            hint="serve this model without --load-format mpack",
        )
    return method


def scheme_class(quant_method: str, profile: str) -> str:
    """The vLLM class that runs a ``profile`` layer of a ``quant_method`` checkpoint."""
    return QUANT_METHODS[quant_method][profile]


def expected_profile(quant_config: Any, capability: int | None) -> str:
    """The mpack profile of the scheme vLLM 0.33.0 picks for an FP8 checkpoint's config: for
    compressed-tensors, W8A8 (activations quantized too) on sm >= 8.9 -> ``w8a8-marlin``;
    weight-only, or any FP8 on an older GPU -> ``w8a16``. AutoFP8 (``quant_method: fp8``):
    ``w8a16`` always (its Marlin path is weight-only, mpack/convert/autofp8.py).

    Raises:
        EngineMismatchError: a scheme an mpack sidecar never holds (block or group FP8, integer
            weights, ...).
    """
    if quant_method_of(quant_config) == "fp8":
        if quant_config.get("weight_block_size") is not None:
            raise EngineMismatchError(
                f"the model's quantization_config has weight_block_size "
                f"{shown(quant_config['weight_block_size'])}: block FP8; {BLOCK_FP8}",
                hint=BLOCK_FP8_HINT,
            )
        return "w8a16"
    groups = quant_config.get("config_groups") if isinstance(quant_config, Mapping) else None
    if not isinstance(groups, Mapping) or not groups:
        raise EngineMismatchError("the model's quantization config has no config_groups")
    acts = set()
    for name, group in groups.items():
        group = group if isinstance(group, Mapping) else {}
        w = group.get("weights") if isinstance(group.get("weights"), Mapping) else {}
        strategy, kind, bits = w.get("strategy"), w.get("type"), w.get("num_bits")
        if not (kind == "float" and bits == 8 and strategy in ("tensor", "channel")):
            raise EngineMismatchError(
                f"quantization group {shown(name)}: weights {shown(kind)} {shown(bits)}-bit, "
                f"strategy {shown(strategy)}: an mpack sidecar holds FP8 weights with tensor or "
                "channel scales only; vLLM loads this checkpoint itself",
                hint=BLOCK_FP8_HINT,
            )
        acts.add(bool(group.get("input_activations")))
    w8a8 = any(acts)
    return "w8a8-marlin" if (w8a8 and capability is not None and capability >= 89) else "w8a16"


def _check_expert_placement(engine: dict[str, Any], where: Path) -> None:
    """An expert-parallel sidecar holds experts ``[r*E/T, (r+1)*E/T)`` on TP rank ``r``: what
    vLLM 0.33.0 places there with data parallelism 1, the ``linear`` placement and no EPLB
    (mpack's limit: its targets are TP sizes; refused before any model memory)."""
    for what, have, want in (
        ("data-parallel size", engine["data_parallel_size"], 1),
        ("expert placement", engine["expert_placement"], "linear"),
        ("expert load balancing (EPLB)", "on" if engine["eplb"] else "off", "off"),
    ):
        if have != want:
            raise EngineMismatchError(
                f"{where}: the engine's {what} is {have}: an expert-parallel sidecar holds "
                f"whole experts split over the TP ranks as vLLM places them with {what} {want} "
                "(mpack's limit)",
                hint=f"run vLLM with {what} {want}, or load a sidecar converted with --ep off",
            )


def engine_version_hint(version: str) -> str:
    """The ways out of an engine whose vLLM is ``version``, not the one this mpack targets:
    converting again does not help (this mpack writes sidecars for its own vLLM only)."""
    return (
        f"three ways out: install vLLM {ENGINE_VERSION} (pip install vllm=={ENGINE_VERSION}); "
        f"or install an mpack-marlin release that targets vLLM {shown(version)}, and convert the "
        "sidecar again with it; or serve the model without --load-format mpack (vLLM then "
        "repacks the checkpoint itself)"
    )


def check_engine_version(version: str, where: Path) -> None:
    """The engine is the vLLM this mpack targets (:data:`mpack.target.ENGINE_VERSION`): its
    loader hooks into that version's classes, and its sidecars hold that version's Marlin
    layout. Checked before the sidecar's own target (:func:`check_target`).

    Raises:
        EngineMismatchError: another vLLM, naming both versions and the ways out.
    """
    if version != ENGINE_VERSION:
        raise EngineMismatchError(
            f"{where}: this engine runs vLLM {shown(version)}, and mpack {__version__} works "
            f"with vLLM {ENGINE_VERSION} only (its loader and the Marlin layout of its sidecars "
            "are that version's)",
            hint=engine_version_hint(version),
        )


def check_target(manifest: dict[str, Any], engine: dict[str, Any], where: Path) -> None:
    """Every fact of the sidecar's target and model that the engine fixes, compared; one error
    naming both values for the first that differs (docs/VLLM.md, "What is refused"). The
    engine's vLLM comes first (:func:`check_engine_version`): with another version, no sidecar
    this mpack writes can load, and converting again would not help."""
    check_engine_version(engine["version"], where)
    t = manifest["target"]
    again = regenerate_hint_of(manifest, where).removeprefix("regenerate it: ")
    checks = [
        (  # the engine is ENGINE_VERSION: the sidecar was written by an mpack for another
            "engine version",
            t["engine_version"],
            engine["version"],
            f"convert it again with this mpack (mpack {__version__}, for vLLM {ENGINE_VERSION}): "
            + again,
        ),
        (
            "tensor-parallel size",
            t["tp_size"],
            engine["tp_size"],
            f"run vLLM with --tensor-parallel-size {t['tp_size']}, or convert with "
            f"--tp {engine['tp_size']}",
        ),
        (
            "activation dtype",
            t["act_dtype"],
            engine["dtype"],
            f"run vLLM with --dtype {t['act_dtype']}, "
            f"or convert with --act-dtype {engine['dtype']}",
        ),
        ("fusion", t["fusion"], "vllm", "convert with --fuse vllm (vLLM's fused layer names)"),
        (
            "profile",
            t["profile"],
            engine["profile"],
            f"convert with --profile {engine['profile']}: {engine['profile_why']}",
        ),
    ]
    ep, engine_ep = bool(t.get(EXPERT_PARALLEL)), engine["expert_parallel"]
    checks.append(
        (
            "expert parallelism",
            "on" if ep else "off",
            "on" if engine_ep else "off",
            f"run vLLM {'with' if ep else 'without'} --enable-expert-parallel, or convert with "
            f"--ep {'on' if engine_ep else 'off'}",
        )
    )
    for what, have, want, hint in checks:
        if have != want:
            raise EngineMismatchError(
                f"{where}: the sidecar's {what} is {shown(have)}, the engine's is {want}",
                hint=hint,
            )
    if ep:
        _check_expert_placement(engine, where)
    made_from = manifest["model"].get("architecture")
    if _layout(manifest).family is None or made_from != engine["architecture"]:
        known = arch.ARCHITECTURES + arch.WRAPPER_ARCHITECTURES
        raise EngineMismatchError(
            f"{where}: the sidecar was made from a {shown(made_from)} model, this model is a "
            f"{engine['architecture']}; mpack's fusion rules cover {', '.join(known)}",
            hint=OTHER_MODEL_HINT,
        )
    check_model_config(manifest, engine["model"], where)


def check_model_config(manifest: dict[str, Any], engine_dims: dict[str, Any], where: Path) -> None:
    """``model.config`` holds every dimension of ``MODEL_DIMS``, each an integer equal to the
    engine's. A missing ``num_key_value_heads`` is ``num_attention_heads`` (the rule of
    transformers and vLLM, and what a checkpoint that omits it means); any other missing
    dimension is a mismatch: a manifest that names no dimensions says nothing about its model."""
    manifest_path = Path(where) / MANIFEST_NAME
    cfg = manifest["model"].get("config")
    if not isinstance(cfg, Mapping):
        raise EngineMismatchError(
            f"{manifest_path}: model.config is {quote(cfg, 80)}, not a JSON object",
            hint="regenerate the sidecar with mpack convert (it records the model's dimensions)",
        )
    have = dict(cfg)
    if "num_key_value_heads" not in have and "num_attention_heads" in have:
        have["num_key_value_heads"] = have["num_attention_heads"]
    for key in MODEL_DIMS:
        mine, theirs = have.get(key), engine_dims.get(key)
        if key not in have or type(mine) is not int:
            what = "no " + key if key not in have else f"{key} {quote(mine)}"
            raise EngineMismatchError(
                f"{manifest_path}: model.config has {what}, this model has {key} {theirs}: "
                "the sidecar does not say it was made from this model",
                hint=OTHER_MODEL_HINT + "; or regenerate it with mpack convert",
            )
        if mine != theirs:
            raise EngineMismatchError(
                f"{where}: the sidecar was made from a model with {key} {mine}, this model "
                f"has {theirs}",
                hint=OTHER_MODEL_HINT,
            )


def decoder_linears(
    num_layers: int,
    prefix: str = DECODER_PREFIX,
    family: arch.Family | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Every dense linear of a Llama-family model's decoder layers, by vLLM name -> vLLM class
    name; ``prefix``: where the model keeps them (:attr:`mpack.arch.Layout.decoder_prefix`).
    A MoE ``family``'s MLPs are its MoE blocks where its (text) ``config`` puts them
    (:func:`mpack.arch.mlp_linears`; their experts: runtime/vllm/moe.py)."""
    out = {}
    for i in range(num_layers):
        mlp = arch.mlp_linears(family, config or {}, i)
        for leaf in ("self_attn.qkv_proj", "self_attn.o_proj", *mlp):
            out[f"{prefix}.{i}.{leaf}"] = DECODER_LINEARS[leaf.rpartition(".")[2]]
    return out


def check_layers(manifest: dict[str, Any], expected: Iterable[str], where: Path) -> None:
    """The sidecar's ``layers`` are exactly ``expected``: the linears vLLM will run on FP8
    Marlin in this model. None may be left out (vLLM would run it from uninitialised memory),
    none may be extra (the sidecar of another model), and ``layers`` may not be empty."""
    manifest_path = Path(where) / MANIFEST_NAME
    layers, expected = manifest["layers"], set(expected)
    if not layers:
        raise EngineMismatchError(
            f"{manifest_path}: layers is empty: the sidecar holds no Marlin weights, and this "
            f"model runs {len(expected)} linear layers on FP8 Marlin",
            hint="regenerate the sidecar with mpack convert",
        )
    missing = sorted(expected - set(layers), key=arch.layer_order)
    if missing:
        raise EngineMismatchError(
            f"{manifest_path}: the sidecar has no weights for layer {first_and_more(missing)}, "
            f"which this model runs on FP8 Marlin: it covers {len(layers)} of the model's "
            f"{len(expected)} FP8 linear layers",
            hint=OTHER_MODEL_HINT,
        )
    extra = sorted(set(layers) - expected, key=arch.natural_key)
    if extra:
        raise EngineMismatchError(
            f"{manifest_path}: the model has no FP8 linear layer {first_and_more(extra)}: "
            "the sidecar was made for another model",
            hint=OTHER_MODEL_HINT,
        )


def _layout(manifest: dict[str, Any]) -> arch.Layout:
    model = manifest["model"]
    text = model.get("text_architecture")
    return arch.layout_of(model.get("architecture"), text if isinstance(text, str) else None)


def layout(manifest: dict[str, Any]) -> arch.Layout:
    """Where the model a sidecar was made from keeps its language model, and that model's
    family (:func:`check_target` checked that it is one of :data:`mpack.arch.FAMILIES`, and
    that the architecture is this model's)."""
    lay = _layout(manifest)
    assert lay.family is not None, "check_target first"
    return lay


def family(manifest: dict[str, Any]) -> arch.Family:
    """The family of the (language) model a sidecar was made from (:func:`layout`)."""
    fam = layout(manifest).family
    assert fam is not None
    return fam


def _shard_modules(name: str, ly: Mapping[str, Any], fam: arch.Family) -> list[str]:
    """The modules (vLLM's names) a layer's ``shards`` must list: vLLM's fusion of a dense
    layer; a MoE block's stacked layer's first expert's gate and up (``w13``) or down (``w2``)."""
    if "experts" not in ly or fam.experts is None:
        return arch.part_modules(name, fam)
    block, _, param = name.rpartition(".experts.")
    linears = (0, 1) if param == arch.EXPERTS_PARAMS[0] else (2,)
    return [fam.experts.module(block, 0, i) for i in linears]


def check_shards(manifest: dict[str, Any], where: Path) -> set[str]:
    """The checkpoint modules the Marlin layers of a ``--no-passthrough`` sidecar stand for (vLLM
    must skip their tensors when it reads the checkpoint), from each layer's ``shards``: a list
    of ``{"module", "rows"}``, the modules those of vLLM's fusion of the layer (a MoE block's
    stacked layer: its first expert's), the rows adding up to ``n`` (docs/FORMAT.md). A MoE
    block's layer stands for that linear of every expert of the block: ``experts`` per rank, on
    every rank under expert parallelism."""
    manifest_path = Path(where) / MANIFEST_NAME
    skip: set[str] = set()
    lay = layout(manifest)
    fam = family(manifest)
    t = manifest["target"]
    ranks_of_experts = t["tp_size"] if t.get(EXPERT_PARALLEL) else 1
    for name, ly in manifest["layers"].items():
        want = _shard_modules(name, ly, fam)
        shards = ly.get("shards")
        ok = isinstance(shards, list) and all(
            isinstance(s, Mapping)
            and isinstance(s.get("module"), str)
            and type(s.get("rows")) is int
            and s["rows"] >= 1
            for s in shards
        )
        if ok:
            modules = [s["module"] for s in shards]
            ok = [lay.vllm_name(m) for m in modules] == want and sum(
                s["rows"] for s in shards
            ) == ly["n"]
        if not ok:
            raise InputError(
                f"{manifest_path}: layer {first_and_more([name])}: shards is {quote(shards)}, not "
                f"[{{'module', 'rows'}}, ...] for {', '.join(want)} with "
                f"rows adding up to n={ly['n']}",
                hint="regenerate the sidecar with mpack convert",
            )
        if "experts" in ly and fam.experts is not None:
            count = ly["experts"] * ranks_of_experts
            for m in modules:
                block, _, linear = fam.experts.expert_of(m) or (m, 0, 0)
                skip.update(fam.experts.module(block, e, linear) for e in range(count))
        else:
            skip.update(modules)
    return skip


def check_common(
    tensors: Mapping[str, tuple[int, ...]],
    lay: arch.Layout,
    marlin: Iterable[str],
    dims: Mapping[str, int],
    tied: bool,
    path: Path,
    stage: arch.Stage | None = None,
) -> None:
    """The tensors of ``common.safetensors`` (name -> shape), which vLLM's own loaders take:
    all of them, or those pipeline ``stage`` holds (:func:`mpack.arch.stage_holds`: what a
    stage's allocation has of the file).

    Every tensor a Llama-family model needs besides its Marlin layers must be there: the
    embeddings, the final norm, each decoder layer's two norms, and lm_head unless the model
    ties it to the embeddings (``tied``). The architectures' own extras (Qwen3's q/k norms) are
    checked once the model is built, as every parameter is. None may belong to a Marlin layer
    (vLLM would write it into the sidecar's tensors, which an attached engine maps read-only),
    none to a decoder layer the model does not have, and the embeddings, lm_head and norms must
    have the model's vocabulary and hidden size (vLLM asserts the vocabulary deep in its loader,
    after the whole model is built).

    The file keeps the checkpoint's names (vLLM's loader maps a wrapper's itself); they are
    compared here in vLLM's names (``lay``: :meth:`mpack.arch.Layout.vllm_name`), which the
    Marlin layers ``marlin`` have. A wrapper's vision tower and projector are not checked
    here: the check of every parameter after the build covers them."""
    fam = lay.family
    assert fam is not None, "check_target first"
    owned = {m for layer in marlin for m in (layer, *arch.shard_modules(layer, fam))}
    vocab, hidden, layers = dims["vocab_size"], dims["hidden_size"], dims["num_hidden_layers"]
    text, decoder = lay.text_prefix, lay.decoder_prefix
    shapes = {
        f"{text}model.embed_tokens.weight": (vocab, hidden),
        f"{text}lm_head.weight": (vocab, hidden),
        f"{text}model.norm.weight": (hidden,),
    }
    norms = ("input_layernorm.weight", "post_attention_layernorm.weight")
    required = {f"{text}model.embed_tokens.weight", f"{text}model.norm.weight"}
    required |= {f"{decoder}.{i}.{n}" for i in range(layers) for n in norms}
    required |= set() if tied else {f"{text}lm_head.weight"}
    if stage is not None:
        required = {n for n in required if arch.stage_holds(n, lay, stage, tied)}
    mapped = {lay.vllm_name(n): n for n in tensors}  # vLLM's name -> the file's
    missing = sorted(required - set(mapped), key=arch.natural_key)
    if missing:
        named = " (vLLM's name)" if lay.wrapper is not None else ""
        raise EngineMismatchError(
            f"{path}: has no {first_and_more(missing)}{named}, which this model needs: "
            "vLLM would run it from uninitialised memory",
            hint=OTHER_MODEL_HINT,
        )
    for vname, name in sorted(mapped.items(), key=lambda kv: arch.natural_key(kv[1])):
        module = vname.rpartition(".")[0]
        if module in owned:
            raise InputError(
                f"{path}: tensor {first_and_more([name])} belongs to the Marlin layer "
                "the sidecar's rank files hold: vLLM would write it over the sidecar's weights",
                hint="regenerate the sidecar with mpack convert",
            )
        m = arch.decoder_index(vname, decoder)
        if m is not None and m >= layers:
            raise EngineMismatchError(
                f"{path}: tensor {first_and_more([name])} is for decoder layer {m}, "
                f"this model has {layers} decoder layers",
                hint=OTHER_MODEL_HINT,
            )
        want = shapes.get(vname) or ((hidden,) if m is not None and name.endswith(norms) else None)
        if want is not None and tuple(tensors[name]) != want:
            what = "vocab_size x hidden_size" if len(want) == 2 else "hidden_size"
            raise EngineMismatchError(
                f"{path}: {name} is {list(tensors[name])}, this model's is {list(want)} "
                f"({what}): the file was taken from another model",
                hint=OTHER_MODEL_HINT,
            )


__all__ = [
    "ATTACH_MODES",
    "EXTRA_KEYS",
    "quant_method_of",
    "scheme_class",
    "EngineMismatchError",
    "Options",
    "check_common",
    "check_layers",
    "check_model_config",
    "check_shards",
    "check_engine_version",
    "check_target",
    "decoder_linears",
    "family",
    "layout",
    "expected_profile",
]
