"""AutoFP8 checkpoints (``quant_method: fp8``), read as vLLM 0.33.0's ``Fp8Config`` reads them.

Such a checkpoint stores every quantized linear ``X`` as ``X.weight`` float8_e4m3fn ``[N, K]``
with one float32 ``X.weight_scale`` (shape ``[]``, per tensor) and, for ``activation_scheme:
static``, an ``X.input_scale`` of the same shape. vLLM runs it with ``Fp8LinearMethod``; on
Marlin (forced, or on a GPU without FP8) that method transposes the weight and hands it to
``prepare_fp8_layer_for_marlin`` with the scales as loaded: no requantization to one scale, and
the input scale is dropped. The result is byte for byte the compressed-tensors ``tensor``
strategy's under ``CompressedTensorsW8A16Fp8``, so the sidecar is the ``w8a16`` profile's, for
static and dynamic activations alike (:data:`mpack.target.QUANT_METHODS`).

What vLLM refuses is refused here first, with the reason and whose limit it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.errors import UnsupportedSchemeError, quote, shown
from mpack.target import BLOCK_FP8, BLOCK_FP8_HINT

if TYPE_CHECKING:
    from mpack.convert.checkpoint import Checkpoint, SourceTensor

QUANT_METHOD = "fp8"
#: vLLM 0.33.0's ``ACTIVATION_SCHEMES`` for ``Fp8Config``.
ACTIVATION_SCHEMES = ("static", "dynamic")


@dataclass(frozen=True)
class Fp8Config:
    """The keys of an AutoFP8 quantization config that decide what vLLM builds."""

    activation_scheme: str  # "static" | "dynamic"
    ignored_layers: tuple[str, ...]  # module names, matched exactly (vLLM's "exact" mode)


def parse(qc: dict[str, Any], where: Path) -> Fp8Config:
    """The config as vLLM's ``Fp8Config.from_config`` reads it.

    Raises:
        UnsupportedSchemeError: a block-quantized config (``weight_block_size``), a missing or
            unknown ``activation_scheme`` (vLLM refuses it too), or ignored layers that are not
            a list of names.
    """
    if qc.get("weight_block_size") is not None:
        raise UnsupportedSchemeError(
            f"{where}: quantization_config.weight_block_size is "
            f"{quote(qc['weight_block_size'])}: block FP8; {BLOCK_FP8}",
            hint=BLOCK_FP8_HINT,
        )
    scheme = qc.get("activation_scheme")
    if scheme not in ACTIVATION_SCHEMES:
        what = (
            "has no activation_scheme"
            if scheme is None
            else (f"activation_scheme is {quote(scheme)}")
        )
        raise UnsupportedSchemeError(
            f"{where}: quantization_config {what}, not one of {', '.join(ACTIVATION_SCHEMES)}: "
            "vLLM 0.33.0 cannot load this checkpoint either",
            hint="use the checkpoint's own config.json (AutoFP8 writes activation_scheme)",
        )
    # vLLM: ignored_layers, else modules_to_not_convert (an empty list counts as none).
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    if not isinstance(ignored, list) or not all(isinstance(x, str) for x in ignored):
        raise UnsupportedSchemeError(
            f"{where}: quantization_config.ignored_layers is {quote(ignored)}, "
            "not a list of module names"
        )
    return Fp8Config(scheme, tuple(ignored))


def check_layer(
    ck: Checkpoint, cfg: Fp8Config, module: str, scale: SourceTensor, where: str
) -> str:
    """The strategy of AutoFP8 linear ``module`` (always ``tensor``), once its scales are those
    vLLM's ``Fp8LinearMethod`` loads.

    Raises:
        UnsupportedSchemeError: naming the tensor and the value.
    """
    if module in cfg.ignored_layers:
        raise UnsupportedSchemeError(
            f"{where}: FP8 weight, but quantization_config.ignored_layers lists {module}: vLLM "
            "would load its FP8 bytes as an unquantized layer",
            hint="the config does not describe these weights; use the checkpoint's own",
        )
    if scale.shape not in ((), (1,)):
        kind = "per-channel " if math.prod(scale.shape) > 1 else ""
        raise UnsupportedSchemeError(
            f"{ck.root / scale.file}: {scale.name}: {kind}scale shape {list(scale.shape)}: vLLM "
            "0.33.0's Fp8LinearMethod (quant_method fp8) loads one weight scale per tensor, "
            "shape [] or [1]",
            hint="per-channel FP8 is compressed-tensors' FP8_DYNAMIC scheme: use such a "
            "checkpoint (e.g. RedHatAI/<model>-FP8-dynamic)",
        )
    iname = f"{module}.input_scale"
    has_input = iname in ck.tensors
    if cfg.activation_scheme == "static" and not has_input:
        raise UnsupportedSchemeError(
            f"{where}: activation_scheme is static, but the checkpoint has no {iname}",
            hint="the checkpoint is incomplete: download it again, or use its dynamic version",
        )
    if cfg.activation_scheme == "dynamic" and has_input:
        raise UnsupportedSchemeError(
            f"{ck.root / ck.tensors[iname].file}: {shown(iname)}: activation_scheme is dynamic, "
            "which has no input scales: vLLM 0.33.0 cannot load this checkpoint either (it has "
            "no parameter for the tensor)",
            hint="set activation_scheme to static in config.json if the scales were calibrated, "
            "else drop the input_scale tensors",
        )
    return "tensor"


def not_serialized(root: Path) -> UnsupportedSchemeError:
    """The refusal of a ``quant_method: fp8`` checkpoint without FP8 weights."""
    return UnsupportedSchemeError(
        f"{root}: quant_method is fp8, but no linear holds float8_e4m3fn weights with a "
        "weight_scale: the weights are not FP8-serialized",
        hint="mpack packs FP8-serialized checkpoints; vLLM 0.33.0 quantizes 16-bit weights "
        "online itself (--quantization fp8_per_tensor), without mpack",
    )
