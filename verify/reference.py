"""The reference Marlin FP8 linear: the executable definition of what a sidecar's bytes mean.

Given one layer's packed ``weight``, ``weight_scale`` (and ``bias``) exactly as the sidecar stores
them, :func:`marlin_linear` computes ``y = x @ W^T + b`` the way vLLM's FP8 Marlin kernel
defines it: weights widened from fp8 (exact), multiplied by the per-channel scale in the
activation dtype (the folded scale times the kernel's 2^-bias widening is that scale exactly),
products accumulated in fp32, bias added, the result rounded once to the activation dtype.

It unpacks the layout (:mod:`mpack.convert.marlin`) on every call: it is a reference, not a
kernel. It runs on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import torch

from mpack.convert.marlin import unpack_bias, unpack_scales, unpack_weight

__all__ = ["dequantize", "marlin_linear"]


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense weight a packed layer stands for.

    Args:
        weight: int32 ``[Kp/16, 4*Np]`` (Marlin tiles).
        weight_scale: ``dt [1, Np]`` (permuted, exponent-folded; ``dt`` float16 or bfloat16).
        n, k: the layer's unpadded output and input channels.

    Returns:
        float32 ``[N, K]``: ``fp8(w) * scale`` — exact, since an fp8 value (4 significant bits)
        times a 16-bit float scale (at most 11) fits float32's 24 bits.
    """
    w = unpack_weight(weight, n, k).view(torch.float8_e4m3fn).to(torch.float32)  # [N, K]
    s = unpack_scales(weight_scale, n).to(torch.float32)  # [N]
    return w * s[:, None]


def marlin_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    n: int,
    k: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``y = x @ W^T + b`` for one Marlin FP8 layer.

    Args:
        x: ``[..., K]`` activations (any float dtype; used as float32).
        weight: int32 ``[Kp/16, 4*Np]``; weight_scale: ``dt [1, Np]``; bias: ``dt [Np]`` or None —
            the tensors exactly as stored in a sidecar rank file.
        n, k: unpadded dims (the manifest's ``layers[name]["n"]`` / ``["k"]``).
        out_dtype: result dtype; default ``dt`` (the scale's dtype, the activation dtype).
            Pass ``torch.float32`` to get the accumulator before the final rounding.

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the layer has K={k}")
    w = dequantize(weight, weight_scale, n, k).to(x.device)  # float32 [N, K]
    y = x.to(torch.float32) @ w.T  # float32 [..., N]
    if bias is not None:
        y = y + unpack_bias(bias, n).to(device=x.device, dtype=torch.float32)
    return y.to(out_dtype or weight_scale.dtype)
