"""Tiny, real compressed-tensors FP8 checkpoints, generated offline (for tests, demo, benchmarks).

A checkpoint is produced the way llm-compressor's ``oneshot`` produces one, without
llm-compressor and without the Hugging Face Hub:

1. a transformers model (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Granite or Phi-3, whose
   checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused) built from a config, with random
   weights from a fixed seed: linear weights and embeddings ``N(0, 0.02)``, norm weights
   ``1 + N(0, 0.1)`` (not all ones, so pass-through bytes mean something), biases
   ``N(0, 0.02)`` (non-zero);
2. ``apply_quantization_config`` with a compressed-tensors preset (``FP8`` or ``FP8_DYNAMIC``)
   on every ``Linear`` except ``lm_head``;
3. min-max weight scales (``calculate_qparams`` of the weight's min and max, per tensor or per
   output channel);
4. ``FP8`` only: a calibration forward pass on random token ids; a forward pre-hook on each
   quantized linear keeps the running min/max of its input (static min-max) and sets
   ``input_scale`` from it before the layer's fake-quantized forward runs, as llm-compressor's
   observers do;
5. ``ModelCompressor.compress_model``, ``save_pretrained`` and ``update_config``.

On disk, for every quantized linear ``X``: ``X.weight`` float8_e4m3fn ``[N, K]``,
``X.weight_scale`` in the model dtype (``[1]`` for ``FP8``, ``[N, 1]`` for ``FP8_DYNAMIC``) and,
for ``FP8`` only, ``X.input_scale`` in the model dtype ``[1]``. Embeddings, norms and
``lm_head`` stay unquantized in the model dtype. ``config.json`` carries a
``quantization_config`` (``quant_method`` ``compressed-tensors``, format ``float-quantized``).

Usage: ``make_checkpoint(tmp_path / "ckpt")`` or ``python -m mpack.fixtures OUT [options]``.
Import this module explicitly: it is not imported by ``import mpack`` and it imports torch,
transformers and compressed-tensors lazily.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.sidecar import INDEX_NAME

if TYPE_CHECKING:
    import torch

__all__ = ["ARCHS", "SCHEMES", "DTYPES", "make_autofp8_checkpoint", "make_checkpoint", "main"]

#: arch name -> (transformers config class, causal LM class)
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
#: Architectures whose models always tie lm_head to the embeddings (vLLM's Gemma 2 has no
#: lm_head, and refuses a checkpoint that stores one).
ALWAYS_TIED = ("gemma2",)
#: Architectures whose transformers config has no ``head_dim`` (it is ``hidden // heads``).
NO_HEAD_DIM = ("qwen2", "phi3")
SCHEMES: tuple[str, ...] = ("FP8", "FP8_DYNAMIC")
#: integer weight presets :func:`make_int_checkpoint` writes (checkpoints mpack must refuse)
INT_SCHEMES: tuple[str, ...] = ("W4A16", "W4A16_ASYM", "W8A16")
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
#: AutoFP8's activation schemes (:func:`make_autofp8_checkpoint`).
AUTOFP8_ACTIVATIONS: tuple[str, ...] = ("static", "dynamic")

_CALIB_BATCH = 2
_CALIB_SEQ = 32


def make_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    vocab: int = 1000,
    scheme: str = "FP8",
    dtype: str = "bfloat16",
    max_shard_size: str | int | None = None,
    scale_in_other_shard: bool = False,
    tie_embeddings: bool = False,
    seed: int = 0,
    _presets: tuple[str, ...] = SCHEMES,
) -> Path:
    """Write a random compressed-tensors FP8 checkpoint to ``out_dir`` and return its path.

    Args:
        out_dir: directory to write (created if missing). Gets ``config.json``,
            ``generation_config.json`` and ``model.safetensors`` (or shards
            ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``).
        arch: ``"llama"``, ``"mistral"``, ``"qwen2"`` (q/k/v have a bias), ``"qwen3"``
            (q/k norms over ``head_dim``), ``"gemma2"`` (four norms per layer, always tied),
            ``"granite"`` or ``"phi3"`` (fused ``qkv_proj`` / ``gate_up_proj``).
        hidden, intermediate, layers, heads, kv_heads, vocab: model dimensions.
        head_dim: per-head dimension; ``None`` means ``hidden // heads``. Qwen2 has no
            ``head_dim`` setting, so there it must be ``None`` or ``hidden // heads``.
        scheme: compressed-tensors preset: ``"FP8"`` (per-tensor weight scales ``[1]``, static
            per-tensor ``input_scale`` ``[1]``) or ``"FP8_DYNAMIC"`` (per-channel weight scales
            ``[N, 1]``, dynamic per-token activations, no ``input_scale``).
        dtype: model dtype, ``"bfloat16"``, ``"float16"`` or ``"float32"``: the dtype of the
            unquantized tensors and of every scale.
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"200KB"``) to write several shards.
        scale_in_other_shard: after saving, move ``model.layers.0.self_attn.q_proj.weight_scale``
            into another shard than its weight (needs a ``max_shard_size`` that gives at least
            two shards); the index's ``weight_map`` is updated.
        tie_embeddings: ``tie_word_embeddings`` (then no ``lm_head.weight`` is stored).
        seed: seed of the weights and of the calibration tokens.
        _presets: the presets accepted (:func:`make_int_checkpoint` passes ``INT_SCHEMES``).

    Same arguments give byte-identical safetensors files. It stays over 60 lines: one keyword
    argument per knob of the fixture, each documented here; the work is in the helpers it calls.
    """
    arch, scheme = arch.lower(), scheme.upper()
    _check_args(
        arch,
        scheme,
        _presets,
        dtype,
        hidden,
        heads,
        kv_heads,
        head_dim,
        scale_in_other_shard,
        max_shard_size,
    )
    config = _build_config(
        arch,
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        tie_embeddings=tie_embeddings,
    )
    model, compressor = _compressed_model(arch, config, dtype, scheme, vocab, seed)
    out = Path(out_dir)  # created once there is something to write
    out.mkdir(parents=True, exist_ok=True)
    _save(model, compressor, out, max_shard_size)
    if scale_in_other_shard:
        _move_to_other_shard(out, "model.layers.0.self_attn.q_proj.weight_scale")
    return out


def _check_args(
    arch: str,
    scheme: str,
    _presets: tuple[str, ...],
    dtype: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int | None,
    scale_in_other_shard: bool,
    max_shard_size: Any,
) -> None:
    """``ValueError`` for arguments of :func:`make_checkpoint` that cannot make a checkpoint."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    if scheme not in _presets:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {list(_presets)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None and hidden % heads:
        raise ValueError(
            f"hidden ({hidden}) must be a multiple of heads ({heads}) when head_dim is not given"
        )
    if arch in NO_HEAD_DIM and head_dim not in (None, hidden // heads):
        raise ValueError(
            f"{arch} derives head_dim from hidden // heads = {hidden // heads}, "
            f"got head_dim={head_dim}"
        )
    if scale_in_other_shard and max_shard_size is None:
        raise ValueError("scale_in_other_shard needs max_shard_size (at least two shards)")


def _build_config(
    arch: str,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int | None,
    vocab: int,
    tie_embeddings: bool,
) -> Any:
    """The transformers config of ``arch`` with these dimensions (bos 1, eos 2, 512 positions);
    ``head_dim`` ``None`` is ``hidden // heads``."""
    import transformers

    if head_dim is None:
        head_dim = hidden // heads

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch not in NO_HEAD_DIM:
        kwargs["head_dim"] = head_dim
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in ALWAYS_TIED:
        kwargs["tie_word_embeddings"] = True
    if arch == "gemma2":
        kwargs["query_pre_attn_scalar"] = head_dim
    if arch in ("gemma2", "phi3"):  # their default pad token lies outside a small vocabulary
        kwargs["pad_token_id"] = 0
    return getattr(transformers, ARCHS[arch][0])(**kwargs)


def _compressed_model(
    arch: str,
    config: Any,
    dtype: str,
    scheme: str,
    vocab: int,
    seed: int,
    model_class: str | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
) -> tuple[torch.nn.Module, Any]:
    """The model of ``config`` in ``dtype`` (class ``model_class``, default ``arch``'s causal
    LM), quantized with ``scheme`` but for ``ignore`` and compressed in place, with the
    ``ModelCompressor`` that compressed it (its ``update_config`` comes after saving)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor

    threads = torch.get_num_threads()
    # One thread: the calibration matmuls then reduce in the same order on every machine.
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            model = _build_model(arch, config, getattr(torch, dtype), seed, model_class)
            _quantize(model, scheme, vocab, seed, ignore)
            compressor = ModelCompressor.from_pretrained_model(model)
            compressor.compress_model(model)
    finally:
        torch.set_num_threads(threads)
    return model, compressor


def _save(model: Any, compressor: Any, out: Path, max_shard_size: str | int | None) -> None:
    """``save_pretrained`` into ``out`` (in shards of ``max_shard_size`` when given), then the
    compressor's ``quantization_config`` into its ``config.json``."""
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    compressor.update_config(str(out))


def _build_model(
    arch: str, config: Any, torch_dtype: torch.dtype, seed: int, model_class: str | None = None
) -> torch.nn.Module:
    """A causal LM (or ``model_class``) for ``config`` in ``torch_dtype``, every parameter drawn
    from ``seed``.

    Parameters are drawn in float32 in ``named_parameters`` order and then cast: norm weights
    ``1 + N(0, 0.1)``, biases and all other weights ``N(0, 0.02)``.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class or ARCHS[arch][1])(config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        values = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * values
        else:
            values = 0.02 * values
        p.data = values
    model = model.to(torch_dtype).eval()
    model.config.dtype = torch_dtype
    return model


def _quantize(
    model: torch.nn.Module,
    scheme: str,
    vocab: int,
    seed: int,
    ignore: tuple[str, ...] = ("lm_head",),
) -> None:
    """Apply preset ``scheme`` to every Linear but ``ignore`` (``lm_head``); set weight and
    input scales.

    Weight scales are min-max (``calculate_qparams``) per tensor (``[1]``) or per output channel
    (``[N, 1]``), in the model dtype. Static input scales (``FP8``) come from a calibration
    forward pass over ``[2, 32]`` random token ids with quantization active: a pre-hook keeps the
    running min/max of each layer's input and updates ``input_scale`` before the layer's
    fake-quantized forward uses it.
    """
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    qconfig = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
        ignore=list(ignore),
    )
    # show_progress (its progress bar, off here) came after 0.17.0, the version vLLM 0.33.0 pins.
    quiet = "show_progress" in inspect.signature(apply_quantization_config).parameters
    apply_quantization_config(model, qconfig, **({"show_progress": False} if quiet else {}))
    quantized = [
        (name, m) for name, m in model.named_modules() if hasattr(m, "quantization_scheme")
    ]
    if not quantized:
        raise RuntimeError("apply_quantization_config matched no Linear layer")

    _set_weight_scales(quantized)
    input_args = quantized[0][1].quantization_scheme.input_activations
    if input_args is not None and not input_args.dynamic:
        _calibrate_inputs(model, quantized, vocab, seed)


def _set_weight_scales(quantized: list[tuple[str, Any]]) -> None:
    """Min-max weight scales (and zero points) per tensor, channel or group."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    for _, m in quantized:
        args = m.quantization_scheme.weights
        w = m.weight.data
        if args.strategy == QuantizationStrategy.TENSOR:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        elif args.strategy == QuantizationStrategy.CHANNEL:
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        elif args.strategy == QuantizationStrategy.GROUP:  # the integer presets (INT_SCHEMES)
            groups = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        else:
            raise ValueError(f"weight strategy {args.strategy} is not supported here")
        scale, zero_point = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero_point)


def _calibrate_inputs(model: Any, quantized: list[tuple[str, Any]], vocab: int, seed: int) -> None:
    """Static input scales from one calibration forward pass (see :func:`_quantize`)."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def make_hook(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            lo, hi = x.amin().reshape(1), x.amax().reshape(1)
            if name in running:
                lo = torch.minimum(lo, running[name][0])
                hi = torch.maximum(hi, running[name][1])
            running[name] = (lo, hi)
            scale, zero_point = calculate_qparams(
                lo, hi, module.quantization_scheme.input_activations
            )
            module.input_scale.data.copy_(scale)
            if hasattr(module, "input_zero_point"):
                module.input_zero_point.data.copy_(zero_point)

        return hook

    handles = [m.register_forward_pre_hook(make_hook(name)) for name, m in quantized]
    try:
        gen = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, vocab, (_CALIB_BATCH, _CALIB_SEQ), generator=gen)
        model(input_ids=tokens, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [name for name, _ in quantized if name not in running]
    if missing:
        raise RuntimeError(f"calibration did not reach {missing}")


def _move_to_other_shard(out: Path, tensor_name: str) -> None:
    """Move ``tensor_name`` out of the shard that holds its layer's weight.

    Both shard files are rewritten with ``safetensors.torch.save_file`` (metadata
    ``{"format": "pt"}``) and ``model.safetensors.index.json``'s ``weight_map`` is updated.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = out / INDEX_NAME
    if not index_path.is_file():
        raise ValueError(
            f"scale_in_other_shard needs a sharded checkpoint, but {out} has no {INDEX_NAME}: "
            "use a smaller max_shard_size"
        )
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    weight_name = tensor_name.rsplit(".", 1)[0] + ".weight"
    weight_file = weight_map[weight_name]
    shards = sorted(set(weight_map.values()))
    if len(shards) < 2:
        raise ValueError(f"scale_in_other_shard needs two shards or more, got {shards}")
    src = weight_map[tensor_name]
    if src == weight_file:
        dst = shards[(shards.index(src) + 1) % len(shards)]

        def load(fname: str) -> dict[str, torch.Tensor]:
            with safe_open(str(out / fname), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}

        src_tensors, dst_tensors = load(src), load(dst)
        dst_tensors[tensor_name] = src_tensors.pop(tensor_name)
        save_file(src_tensors, str(out / src), metadata={"format": "pt"})
        save_file(dst_tensors, str(out / dst), metadata={"format": "pt"})
        weight_map[tensor_name] = dst
        index["weight_map"] = dict(sorted(weight_map.items()))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    with safe_open(str(out / weight_map[tensor_name]), framework="pt") as f:
        assert tensor_name in f.keys()
    with safe_open(str(out / weight_file), framework="pt") as f:
        assert tensor_name not in f.keys() and weight_name in f.keys()
    assert weight_map[tensor_name] != weight_map[weight_name]


def make_int_checkpoint(out_dir: str | Path, *, scheme: str = "W4A16", **dims: Any) -> Path:
    """Write a random compressed-tensors *integer weight-only* checkpoint (llm-compressor's
    ``W4A16`` and friends), as llm-compressor writes one, and return its path.

    Not something mpack converts: these are real examples of what it must refuse by name. The
    model of :func:`make_checkpoint` (Llama, ``bfloat16``; ``dims``: its dimension and ``seed``
    arguments); the preset is applied to every ``Linear`` but ``lm_head``, weight scales (and
    zero points of ``*_ASYM``) are min-max per group of ``group_size`` input channels, and
    ``ModelCompressor`` packs the weights (``pack-quantized``: ``X.weight_packed`` int32,
    ``X.weight_scale``, ``X.weight_shape``).
    """
    return make_checkpoint(
        out_dir, arch="llama", scheme=scheme, dtype="bfloat16", _presets=INT_SCHEMES, **dims
    )


def make_autofp8_checkpoint(
    out_dir: str | Path, *, activation: str = "static", **kwargs: Any
) -> Path:
    """Write a random AutoFP8 checkpoint (``quant_method: fp8``), as AutoFP8 writes one, and
    return its path.

    The model and weights of :func:`make_checkpoint` with the ``FP8`` preset (``kwargs``: its
    other arguments), then in AutoFP8's form: ``quantization_config`` is ``{"quant_method":
    "fp8", "activation_scheme": activation, "ignored_layers": ["lm_head"]}``, every
    ``weight_scale`` and ``input_scale`` a float32 scalar (shape ``[]``, the same value), and
    for ``activation="dynamic"`` no ``input_scale`` at all.
    """
    from safetensors.torch import load_file, save_file

    if activation not in AUTOFP8_ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected {AUTOFP8_ACTIVATIONS}")
    out = make_checkpoint(out_dir, scheme="FP8", **kwargs)
    drop = ".input_scale" if activation == "dynamic" else None
    sizes: dict[str, int] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(f).items():
            if drop and name.endswith(drop):
                continue
            if name.endswith((".weight_scale", ".input_scale")):
                t = t.float().reshape(())  # exact: every bf16/fp16 value is a float32
            tensors[name] = t
            sizes[name] = t.numel() * t.element_size()
        save_file(tensors, str(f), metadata={"format": "pt"})
    index_path = out / INDEX_NAME
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in sizes}
        index.setdefault("metadata", {})["total_size"] = sum(sizes.values())
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": activation,
        "ignored_layers": ["lm_head"],
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


#: Multimodal wrapper -> (transformers config class, model class, vision config class, the
#: ``--arch`` values its language model may have). The language model is quantized; the vision
#: tower and the projector stay in the model dtype, as llm-compressor's multimodal recipes leave
#: them (their ``ignore``).
WRAPPERS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "llava": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        "CLIPVisionConfig",
        ("mistral", "llama"),
    ),
    "mistral3": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        "PixtralVisionConfig",
        ("mistral",),
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLVisionConfig",
        ("qwen2",),
    ),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "SiglipVisionConfig", ("gemma3",)),
}
#: The two name layouts of wrapper checkpoints on the Hub: ``legacy`` as transformers'
#: ``save_pretrained`` writes them (``language_model.model.layers.*``; Qwen2.5-VL's original
#: ``model.layers.*`` and ``visual.*``), ``hf`` the module names of transformers >= 4.52
#: (``model.language_model.layers.*``, ``model.vision_tower.*``, ``lm_head``).
LAYOUTS: tuple[str, ...] = ("legacy", "hf")
#: Per wrapper, legacy prefix -> hf prefix.
_HF_LAYOUT = {
    "qwen2_5_vl": (("model.", "model.language_model."), ("visual.", "model.visual.")),
    **{
        w: (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        )
        for w in ("llava", "mistral3", "gemma3")
    },
}


def make_wrapper_checkpoint(
    out_dir: str | Path,
    *,
    wrapper: str = "llava",
    layout: str = "legacy",
    arch: str | None = None,
    scheme: str = "FP8",
    dtype: str = "bfloat16",
    layers: int = 2,
    kv_heads: int = 2,
    vocab: int = 1000,
    tie_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random compressed-tensors FP8 checkpoint of a multimodal ``wrapper`` (transformers'
    own class, a one-layer vision tower of width 32) around a language model of
    :func:`make_checkpoint`'s default dimensions (hidden 256, intermediate 512, 4 heads), in
    name ``layout`` (:data:`LAYOUTS`), and return its path.

    ``arch``: the language model (the first of :data:`WRAPPERS`' choices when None). Only the
    language model's linears are quantized (``ignore``: lm_head, the vision tower and the
    projector); Gemma 3 always ties its embeddings.
    """
    import transformers

    if wrapper not in WRAPPERS:
        raise ValueError(f"unknown wrapper {wrapper!r}; expected one of {sorted(WRAPPERS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {list(LAYOUTS)}")
    cfg_cls, model_cls, vision_cls, texts = WRAPPERS[wrapper]
    arch = arch or texts[0]
    if arch not in texts:
        raise ValueError(f"{wrapper} wraps {', '.join(texts)}, not {arch!r}")
    scheme = scheme.upper()
    _check_args("llama", scheme, SCHEMES, dtype, 256, 4, kv_heads, None, False, None)
    config = getattr(transformers, cfg_cls)(
        text_config=_wrapper_text_config(
            wrapper, arch, layers, kv_heads, vocab, tie_embeddings
        ).to_dict(),
        vision_config=getattr(transformers, vision_cls)(**_VISION[wrapper]).to_dict(),
        **_wrapper_tokens(wrapper, vocab),
    )
    # The wrapper's own flag, whatever its config class defaults to (Mistral 3's: tied).
    config.tie_word_embeddings = wrapper == "gemma3" or tie_embeddings
    skip = "visual" if wrapper == "qwen2_5_vl" else "vision_tower"
    ignore = ("re:.*lm_head", f"re:.*{skip}.*", "re:.*multi_modal_projector.*")
    model, compressor = _compressed_model(
        arch, config, dtype, scheme, vocab, seed, model_cls, ignore
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(model, compressor, out, None)
    if layout == "hf":
        _rename(out, _HF_LAYOUT[wrapper], set(model.state_dict()))
    if wrapper in _TOWER_ROOT:  # after the layout: its prefixes are the model's names
        tower = "model.vision_tower." if layout == "hf" else "vision_tower."
        root = tower + _TOWER_ROOT[wrapper]
        _rename(out, ((root, root), (tower, root)), None)  # a transformers that keeps it: as is
    # The recipe's patterns, as llm-compressor's multimodal examples leave them: the module names
    # the compressor expanded them into are transformers 5's, not the file's after the renames.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["ignore"] = list(ignore)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


#: The CLIP and SigLIP towers' root module on the Hub (llava-1.5, gemma-3: ``vision_tower.
#: vision_model.embeddings...``), which transformers 5 leaves out of the names it saves.
_TOWER_ROOT = {"llava": "vision_model.", "gemma3": "vision_model."}


#: Each wrapper's tiny vision tower (its config class's arguments).
_VISION: dict[str, dict[str, Any]] = {
    "llava": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16),
    "mistral3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, image_size=32, patch_size=16, head_dim=16),
    "qwen2_5_vl": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                       out_hidden_size=256, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
    "gemma3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=32, patch_size=16),
}  # fmt: skip


def _wrapper_tokens(wrapper: str, vocab: int) -> dict[str, Any]:
    """Special-token ids inside a small vocabulary (their defaults lie far outside it)."""
    if wrapper == "qwen2_5_vl":
        return dict(
            image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3
        )
    if wrapper == "gemma3":
        return dict(image_token_index=vocab - 1, boi_token_index=vocab - 2,
                    eoi_token_index=vocab - 3, mm_tokens_per_image=4)  # fmt: skip
    return dict(image_token_index=vocab - 1)


def _wrapper_text_config(
    wrapper: str, arch: str, layers: int, kv_heads: int, vocab: int, tied: bool
) -> Any:
    """The language model's config: :func:`_build_config`'s, or Gemma 3's / Qwen2.5-VL's text
    config (multimodal rotary sections) with the same dimensions."""
    import transformers

    if arch in ARCHS and wrapper != "qwen2_5_vl":
        return _build_config(
            arch, hidden=256, intermediate=512, layers=layers, heads=4, kv_heads=kv_heads,
            head_dim=None, vocab=vocab, tie_embeddings=tied,
        )  # fmt: skip
    dims = dict(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**dims, head_dim=64, query_pre_attn_scalar=64)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    return transformers.Qwen2_5_VLTextConfig(**dims, rope_parameters=rope, tie_word_embeddings=tied)


def _rename(out: Path, prefixes: tuple[tuple[str, str], ...], names: set[str] | None) -> None:
    """Rename every tensor of ``out``'s one safetensors file by the first of ``prefixes`` it
    starts with; each new name must be one of the model's ``names`` (its state dict; None: not
    checked)."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    renamed = {}
    for name, t in load_file(path).items():
        old, new = next(((o, n) for o, n in prefixes if name.startswith(o)), ("", ""))
        renamed[new + name[len(old) :]] = t
    unknown = sorted(set(renamed) - names) if names is not None else []
    if unknown:
        raise AssertionError(f"not the model's names: {unknown[:4]}")
    save_file(dict(sorted(renamed.items())), str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    """``python -m mpack.fixtures OUT [options]``: write a checkpoint and print its path."""
    p = argparse.ArgumentParser(
        prog="python -m mpack.fixtures",
        description="Write a tiny random compressed-tensors FP8 checkpoint (offline).",
    )
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--arch", default=None, choices=sorted(ARCHS), help="default llama")
    p.add_argument("--scheme", default="FP8", choices=list(SCHEMES))
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--max-shard-size", default=None, help='e.g. "200KB"')
    p.add_argument("--scale-in-other-shard", action="store_true")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--autofp8",
        choices=list(AUTOFP8_ACTIVATIONS),
        default=None,
        help="an AutoFP8 checkpoint (quant_method fp8) with this activation scheme "
        "(per-tensor weight scales; --scheme is FP8)",
    )
    p.add_argument(
        "--wrapper",
        choices=sorted(WRAPPERS),
        default=None,
        help="a multimodal wrapper around the language model (--arch: its language model; "
        "only --scheme, --dtype, --layers, --kv-heads, --vocab, --tie-embeddings and --seed apply)",
    )
    p.add_argument("--layout", choices=list(LAYOUTS), default="legacy", help="with --wrapper")
    a = p.parse_args(argv)
    # what every kind of checkpoint takes
    common = dict(
        dtype=a.dtype,
        layers=a.layers,
        kv_heads=a.kv_heads,
        vocab=a.vocab,
        tie_embeddings=a.tie_embeddings,
        seed=a.seed,
    )
    if a.wrapper:
        path = make_wrapper_checkpoint(
            a.out, wrapper=a.wrapper, layout=a.layout, arch=a.arch, scheme=a.scheme, **common
        )
        print(path)
        return 0
    if a.autofp8 and a.scheme != "FP8":
        p.error("--autofp8 writes per-tensor weight scales: --scheme must be FP8")
    path = (make_autofp8_checkpoint if a.autofp8 else make_checkpoint)(
        a.out,
        **({"activation": a.autofp8} if a.autofp8 else {"scheme": a.scheme}),
        **common,
        arch=a.arch or "llama",
        hidden=a.hidden,
        intermediate=a.intermediate,
        heads=a.heads,
        head_dim=a.head_dim,
        max_shard_size=a.max_shard_size,
        scale_in_other_shard=a.scale_in_other_shard,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
