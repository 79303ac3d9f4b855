"""What lets vLLM 0.33.0's real classes build and load a compressed-tensors FP8 model on a CPU
through the FP8 *Marlin* path, as they would on a GPU, so the ``--load-format mpack`` loader can
be compared with vLLM's own ``DefaultModelLoader`` without a GPU.

Nothing here touches model code, loaders or the Marlin helpers: vLLM's own
``prepare_fp8_layer_for_marlin`` (padding, scale permutation, exponent fold, bias permutation,
W8A8 requantization) runs unchanged. What a CPU lacks is stood in for, each for one reason:

1. ``VLLM_TARGET_DEVICE=cpu`` before vLLM is imported: the platform is ``CpuPlatform``. Without
   it, vLLM's CUDA wheel finds no GPU, falls back to ``UnspecifiedPlatform`` and the config fails
   ("Device string must not be empty"). Faking CUDA instead would send every CustomOp and the
   attention backend down CUDA-only paths; on ``CpuPlatform`` attention builds as is (CPU_ATTN).
2. The compute capability, which picks the compressed-tensors scheme (``_check_scheme_supported``):
   sm 8.6 gives ``CompressedTensorsW8A16Fp8`` (profile ``w8a16``), sm 9.0 lets a W8A8 checkpoint
   take ``CompressedTensorsW8A8Fp8`` (profile ``w8a8-marlin``). ``CpuPlatform`` has none.
3. The kernel lists are keyed by platform, and the CPU keys hold no Marlin: Marlin becomes the
   CPU's only FP8 candidate, W8A16 and W8A8 alike. ``MarlinFP8ScaledMMLinearKernel.is_supported``
   demands ``is_cuda()``, and ``ScaledMMLinearKernel.__init__`` asserts it, so it says yes.
4. ``torch.accelerator.empty_cache`` raises "Cannot access accelerator device" without one, and
   ``BaseModelLoader.load_model`` calls it after loading: a no-op.
5. The CUDA-only ops Marlin's preparation calls, defined under ``torch.ops._C`` for the CPU (the
   CUDA wheel's ``_C`` library is never loaded on ``CpuPlatform``):

   * ``gptq_marlin_repack``: mpack's own repack (``mpack.convert.marlin.repack``, shown
     byte-identical to vLLM's compiled kernel on the GPU) behind a thin adapter from vLLM's GPTQ
     input layout;
   * ``static_scaled_fp8_quant`` (the W8A8 per-tensor requantization to the largest shard scale):
     vLLM's GPU arithmetic, SPEC §4.

6. ``torch.cpu._is_amx_tile_supported`` says no: where the CPU has AMX tiles, vLLM's CPU
   dispatch of unquantized linears (embeddings, lm_head: not the FP8 Marlin layers) packs their
   weights with ``torch.ops._C.convert_weight_packed``, an op of vLLM's CPU build that the CUDA
   wheel does not hold. vLLM then takes the path it takes on CPUs without AMX.

7. torchvision, for vLLM's multimodal wrappers (Llava, Mistral 3, Qwen2.5-VL, Gemma 3), whose
   modules import transformers' image processors, which import torchvision (and Llava's and
   Mistral 3's, ``mistral_common``). The package index holds torchvision 0.28 (torch 2.13's) only
   as a CUDA build, whose ``_C`` needs ``libtorch_cuda`` and does not load on the CPU torch;
   its import then registers fake kernels for ``nms`` and ``qnms`` all the same, which fails
   unless the ops exist. ``make install-vllm`` puts both packages in ``.venv-vllm/mm-site``,
   outside the venv's own path (there, every ``import vllm.config`` would fail on it); this
   declares the two schemas (no kernel: no image is ever processed) and puts the folder on
   ``sys.path``. torchvision's Python runs unchanged. Where its ``_C`` loads, nothing is declared.
   vLLM's model registry inspects a model class in a child process (to keep CUDA uninitialised
   in the parent), which would lack this; on a CPU there is no CUDA to keep uninitialised, so
   the inspection runs in this process.

8. Marlin's MoE experts, supported on the CPU as stand-in 3 makes the linear kernel:
   ``MarlinExpertsBase._supports_current_device`` demands ``is_cuda()``, so ``--moe-backend
   marlin`` would be refused before any weight is loaded. vLLM's own
   ``prepare_fp8_moe_layer_for_marlin`` then runs unchanged, on stand-in 5's ops.

9. The dequantization before a per-tensor requantization (``per_tensor_dequantize``: the fp16
   weight times the fp32 scale, a 0-dim tensor), with the GPU's rounding. On CUDA the scale is
   rounded to fp16 first (checked on the H200, SPEC §4); torch on a CPU multiplies by the fp32
   scale itself. Scales that fp16 holds exactly (every bf16 one in its range) give the same
   bytes either way; an AutoFP8 checkpoint's fp32 scales do not. The multiply itself is the
   same: fp16 times fp16, computed in fp32 and rounded once.

Use: ``install()`` once, before anything imports vLLM; ``set_profile(p)`` before each model build.
"""

from __future__ import annotations

import os
import sys

import torch

#: Compute capability per mpack profile (stand-in 2).
CAPABILITY = {"w8a16": (8, 6), "w8a8-marlin": (9, 0)}

_state = {"capability": CAPABILITY["w8a16"], "installed": False}
_LIB = None  # the torch.library fragment: kept alive, or its definitions go with it
_TV_LIB = None  # stand-in 7's, likewise


def set_profile(profile: str) -> None:
    """The capability the next model build sees (stand-in 2)."""
    _state["capability"] = CAPABILITY[profile]


def install(profile: str = "w8a16") -> None:
    """Apply every stand-in (idempotent). Call before anything imports vLLM."""
    set_profile(profile)
    if _state["installed"]:
        return
    # 1. CpuPlatform. vLLM resolves the platform on first use of current_platform: too late to
    # change it once vllm.platforms has resolved it.
    if "vllm.platforms" in sys.modules and os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        raise RuntimeError("cpu_standins.install() must run before vLLM is imported")
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    # 7. torchvision and mistral_common for the multimodal wrappers (before transformers).
    _multimodal_site()

    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability, PlatformEnum

    if current_platform._enum != PlatformEnum.CPU:
        raise RuntimeError(f"expected vLLM's CpuPlatform, got {type(current_platform).__name__}")

    # 2. Compute capability (has_device_capability and is_device_capability derive from it).
    type(current_platform).get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(*_state["capability"])
    )

    # 3. Marlin as the CPU's FP8 kernel, and supported there.
    import vllm.model_executor.kernels.linear as kernels
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import MarlinFP8ScaledMMLinearKernel

    MarlinFP8ScaledMMLinearKernel.is_supported = classmethod(
        lambda cls, compute_capability=None: (True, None)
    )
    kernels._POSSIBLE_WFP8A16_KERNELS[PlatformEnum.CPU] = [MarlinFP8ScaledMMLinearKernel]
    kernels._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU] = [MarlinFP8ScaledMMLinearKernel]

    # 4. No accelerator cache to empty.
    torch.accelerator.empty_cache = lambda: None

    # 5. The CUDA-only ops, on the CPU.
    _define_ops()

    # 6. No AMX: on a CPU with AMX tiles vLLM packs unquantized weights (embeddings, lm_head)
    # with CPU ops of its CPU build (``_C.convert_weight_packed``) that the CUDA wheel lacks.
    torch.cpu._is_amx_tile_supported = lambda: False

    # 7. The registry's inspection in this process, where the multimodal site is on the path.
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()

    # 8. Marlin MoE experts on the CPU.
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExpertsBase

    MarlinExpertsBase._supports_current_device = staticmethod(lambda: True)

    # 9. The GPU's rounding of the scale in per_tensor_dequantize (where it is imported too).
    import vllm.model_executor.layers.quantization.utils.fp8_utils as fp8_utils
    import vllm.model_executor.layers.quantization.utils.w8a8_utils as w8a8_utils

    for module in (w8a8_utils, fp8_utils):
        module.per_tensor_dequantize = per_tensor_dequantize
    _state["installed"] = True


def per_tensor_dequantize(tensor: torch.Tensor, inv_scale: float | torch.Tensor) -> torch.Tensor:
    """vLLM's ``per_tensor_dequantize`` as it computes on a GPU (stand-in 9): the scale rounded
    to fp16, then an fp16 multiply."""
    scale = torch.as_tensor(inv_scale, device=tensor.device).to(torch.float16)
    return tensor.to(torch.float16) * scale


# --- 5. torch.ops._C on the CPU ------------------------------------------------------------------

_SCHEMAS = {
    "gptq_marlin_repack": "gptq_marlin_repack(Tensor b_q_weight, SymInt size_k, SymInt size_n, "
    "int num_bits, bool is_a_8bit=False) -> Tensor",
    "static_scaled_fp8_quant": "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, "
    "Tensor scale, int[]? group_shape=None) -> ()",
}


def gptq_marlin_repack(
    b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
) -> torch.Tensor:
    """vLLM's ``gptq_marlin_repack`` for 8-bit FP8 weights, by mpack's repack.

    vLLM hands it ``pack_fp8_to_int32(W[K, N])``: int32 ``[K/4, N]`` whose word ``(r, n)`` holds
    the bytes ``W[4r .. 4r+3, n]`` (little-endian). Its transpose, as bytes, is the checkpoint's
    row-major ``[N, K]`` that :func:`mpack.convert.marlin.repack` takes; both return int32
    ``[K/16, 4*N]`` Marlin tiles.
    """
    from mpack.convert.marlin import repack

    if num_bits != 8 or is_a_8bit:
        raise NotImplementedError(
            f"CPU gptq_marlin_repack stand-in: only 8-bit FP8 weights (num_bits={num_bits}, "
            f"is_a_8bit={is_a_8bit})"
        )
    if tuple(b_q_weight.shape) != (size_k // 4, size_n) or b_q_weight.dtype != torch.int32:
        raise ValueError(
            f"expected int32 [{size_k // 4}, {size_n}], got {b_q_weight.dtype} "
            f"{tuple(b_q_weight.shape)}"
        )
    rows = b_q_weight.t().contiguous().view(torch.uint8)  # [N, K]: row n holds W[:, n]
    return repack(rows)  # int32 [K/16, 4*N]


def static_scaled_fp8_quant(
    result: torch.Tensor,
    input: torch.Tensor,
    scale: torch.Tensor,
    group_shape: list[int] | None = None,
) -> None:
    """vLLM's per-tensor ``static_scaled_fp8_quant`` with its GPU rounding (SPEC §4): one fp32
    multiply by the correctly rounded fp32 reciprocal of the scale, NaN -> 448, clamp to ±448,
    round to nearest even e4m3. This is the tail of :func:`mpack.convert.marlin.requantize`
    (which also does the dequantization vLLM does before calling this op)."""
    if scale.numel() != 1 or (group_shape is not None and list(group_shape) != [-1, -1]):
        raise NotImplementedError(
            f"CPU static_scaled_fp8_quant stand-in: per-tensor scales only (scale "
            f"{tuple(scale.shape)}, group_shape {group_shape})"
        )
    inv = torch.reciprocal(scale.detach().to("cpu", torch.float32).reshape(()))
    x = input.to(torch.float32) * inv.to(input.device)
    x = torch.nan_to_num(x, nan=448.0).clamp_(-448.0, 448.0)
    result.copy_(x.to(torch.float8_e4m3fn))


def _define_ops() -> None:
    global _LIB
    lib = torch.library.Library("_C", "FRAGMENT")
    for name, fn in (
        ("gptq_marlin_repack", gptq_marlin_repack),
        ("static_scaled_fp8_quant", static_scaled_fp8_quant),
    ):
        if not hasattr(torch.ops._C, name):  # a machine with vLLM's compiled _C defines them
            lib.define(_SCHEMAS[name])
        lib.impl(name, fn, "CPU")
    _LIB = lib


# --- 7. torchvision and mistral_common, for the multimodal wrappers ----------------------------

#: Where ``make install-vllm`` puts them (beside the venv's site-packages, not in it).
MM_SITE = "mm-site"
_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _multimodal_site() -> None:
    global _TV_LIB
    from pathlib import Path

    site = Path(sys.prefix) / MM_SITE
    if not site.is_dir():
        return  # an interpreter with its own torchvision (the GPU machine's), or none
    try:
        torch.ops.load_library(str(site / "torchvision" / "_C.so"))  # its own ops: nothing to do
    except OSError:  # the CUDA build on the CPU torch (or none)
        _TV_LIB = torch.library.Library("torchvision", "DEF")
        for schema in _TORCHVISION_SCHEMAS:
            _TV_LIB.define(schema)
    sys.path.insert(0, str(site))
