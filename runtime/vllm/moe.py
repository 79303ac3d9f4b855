"""MoE blocks under ``--load-format mpack``: vLLM's ``FusedMoE`` experts filled from a sidecar's
stacked layers (mpack/convert/moe.py, docs/FORMAT.md), without vLLM's Marlin MoE repack.

A block's experts live on one module, ``<block>.experts.routed_experts`` (vLLM's
``RoutedExperts``), whose ``w13_weight``, ``w13_weight_scale``, ``w2_weight`` and
``w2_weight_scale`` parameters get the sidecar's tensors as their data (attached views, no copy).
What vLLM's ``process_weights_after_loading`` leaves beyond those tensors is rebuilt by
:func:`finish`, from vLLM's own helpers: the static input scales reduced to their maximum
(``process_fp8_input_tensor_strategy_moe``; vLLM's loader fills them from the checkpoint's
per-expert ``input_scale`` tensors, which the sidecar passes through), the method's
``moe_quant_config`` and its Marlin MoE kernel.

Covered: compressed-tensors FP8 MoE (``CompressedTensorsW8A8Fp8MoEMethod``) and AutoFP8's
(``Fp8MoEMethod``, per-tensor) on the Marlin MoE backend, which ``--moe-backend`` must be
(``auto`` is set to it). This module imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from mpack import arch
from mpack.errors import UsageError
from mpack.runtime.vllm.checks import OTHER_MODEL_HINT, EngineMismatchError

#: The vLLM methods that run an FP8 MoE block: compressed-tensors', and AutoFP8's
#: (``quant_method: fp8``), by checkpoint format (mpack.target.QUANT_METHODS' keys).
MOE_METHODS = {"compressed-tensors": "CompressedTensorsW8A8Fp8MoEMethod", "fp8": "Fp8MoEMethod"}
#: A stacked layer's tensors: vLLM's parameter names under the experts' module.
LEAVES = ("weight", "weight_scale")


def block_layers(
    family: arch.Family | None, num_layers: int, prefix: str, config: Mapping[str, Any]
) -> dict[str, str]:
    """The stacked layers of every MoE block (in the decoder layers the (text) ``config`` puts
    them), by name -> the checkpoint module of expert 0's gate (to ask the quantization config
    about); empty for a dense family."""
    ex = family.experts if family is not None else None
    if ex is None:
        return {}
    out = {}
    for i in range(num_layers):
        if not ex.is_moe_layer(config, i):
            continue
        block = f"{prefix}.{i}.{ex.block}"
        for p in arch.EXPERTS_PARAMS:
            out[f"{block}.experts.{p}"] = ex.module(block, 0, 0)
    return out


def force_marlin_moe(vllm_config: Any) -> None:
    """The MoE experts on Marlin (the sidecar holds Marlin MoE weights); refuse another choice."""
    kc = vllm_config.kernel_config
    if kc.moe_backend not in ("auto", "marlin"):
        raise UsageError(
            f"--moe-backend is {kc.moe_backend!r}, but --load-format mpack holds Marlin MoE "
            "weights",
            hint="drop the option, or pass --moe-backend marlin",
        )
    kc.moe_backend = "marlin"


def is_fp8_moe(module: nn.Module) -> bool:
    """Whether vLLM built ``module`` with one of :data:`MOE_METHODS`."""
    return type(getattr(module, "quant_method", None)).__name__ in MOE_METHODS.values()


def experts_module(
    modules: dict[str, nn.Module], name: str, quant_method: str, sidecar: Path
) -> nn.Module:
    """The module holding stacked layer ``name``'s parameters, checked to run vLLM's FP8 MoE
    method of the checkpoint's format (``quant_method``) on the Marlin backend."""
    owner = name.rpartition(".")[0]
    module = modules.get(owner)
    qm = getattr(module, "quant_method", None)
    backend = getattr(getattr(qm, "fp8_backend", None), "name", None)
    want = MOE_METHODS[quant_method]
    if module is None or type(qm).__name__ != want or backend != "MARLIN":
        raise EngineMismatchError(
            f"{sidecar}: MoE layer {name}: the model's {owner} runs "
            f"{type(qm).__name__} on {backend}; the sidecar holds {want} weights for "
            "the Marlin MoE backend",
            hint="pass --moe-backend marlin, or convert for this engine",
        )
    return module


def swap_in(module: nn.Module, name: str, ly: dict[str, Any], weights: Any, sidecar: Path) -> None:
    """Give ``module`` the stacked layer ``name``'s tensors (Note [loading from a sidecar] in
    runtime/vllm/loader.py), after checking that they are the shapes vLLM would leave."""
    leaf = name.rpartition(".")[2]  # w13 | w2
    for part in LEAVES:
        param = getattr(module, f"{leaf}_{part}", None)
        t = weights[f"{name}_{part}"]
        if param is None or param.shape[0] != t.shape[0]:
            raise EngineMismatchError(
                f"{sidecar}: MoE layer {name} has {t.shape[0]} experts in the sidecar, "
                f"{getattr(module, 'local_num_experts', '?')} in the model",
                hint=OTHER_MODEL_HINT,
            )
        param.data = t
    hidden, per = module.hidden_size, module.intermediate_size_per_partition
    want = (2 * per, hidden) if leaf == "w13" else (hidden, per)
    if (ly["n"], ly["k"]) != want:
        raise EngineMismatchError(
            f"{sidecar}: MoE layer {name} is {want[0]} x {want[1]} per expert in the model, "
            f"{ly['n']} x {ly['k']} in the sidecar",
            hint=OTHER_MODEL_HINT,
        )


def finish(module: nn.Module) -> None:
    """What vLLM's Marlin MoE processing leaves on the block besides its four tensors: the
    static input scales' maximum, the method's quant config and its kernel."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import make_fp8_moe_kernel
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        process_fp8_input_tensor_strategy_moe,
    )
    from vllm.model_executor.utils import replace_parameter

    qm = module.quant_method
    static = getattr(qm, "static_input_scales", None)  # compressed-tensors'
    if static is None:  # AutoFP8's Fp8MoEMethod
        static = qm.quant_config.activation_scheme == "static"
    if static:
        w13, w2 = process_fp8_input_tensor_strategy_moe(
            module.w13_input_scale,
            module.w2_input_scale,
            module.moe_config.moe_parallel_config.enable_eplb,
        )
        replace_parameter(module, "w13_input_scale", w13)
        replace_parameter(module, "w2_input_scale", w2)
    if hasattr(qm, "_init_moe_kernel"):  # Fp8MoEMethod: its own last step
        qm._init_moe_kernel(module)
        return
    qm.moe_quant_config = qm.get_fused_moe_quant_config(module)
    if qm.moe_quant_config:
        qm.moe_kernel = make_fp8_moe_kernel(
            moe_quant_config=qm.moe_quant_config,
            moe_config=qm.moe,
            fp8_backend=qm.fp8_backend,
            experts_cls=qm.experts_cls,
            routing_tables=module._expert_routing_tables(),
        )


__all__ = [
    "MOE_METHODS",
    "block_layers",
    "experts_module",
    "finish",
    "force_marlin_moe",
    "is_fp8_moe",
    "swap_in",
]
