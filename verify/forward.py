"""Model-output equivalence: the sidecar path against the original checkpoint, end to end.

The **reference** is the original checkpoint run by transformers, with compressed-tensors
decompressing the FP8 weights and its activation fake-quantization switched off (Marlin is
weight-only, so the kernel never quantizes activations). For the ``w8a8-marlin`` profile the
reference's fused shards carry the weights requantized to the max shard scale (SPEC §4), which is
what vLLM itself computes from the same checkpoint on that path. The reference's scales and biases
of the packed layers are rounded to the activation dtype, as the sidecar (and vLLM) store them
(Note [act-dtype scales and bias]).

The **sidecar path** is :func:`mpack.verify.model.build_model` on the sidecar's tensors, every
linear layer computed by the reference Marlin FP8 linear from the packed bytes.

Note [equivalence tolerance]: run in float32, both sides compute the same products of exactly
dequantized weights (fp8 x scale is exact in fp32; both use the same act-dtype scales and bias)
and differ only in summation order, so their logits agree far inside the float32 bound (figures:
docs/BENCHMARKS.md, section 9) and greedy decoding must give identical tokens; one act-dtype ulp
on one layer's scales or bias exceeds the bound. Run in the
activation dtype, every layer's activations are rounded to bf16/fp16 at different points on the
two sides, so the logits may differ by a few of that dtype's roundings per layer relative to
their size: we allow ``REL_TOL[dtype] * max|logit|`` (``2^-5`` bf16, ``2^-7`` fp16: 4 and 8 times
the dtype's machine epsilon, ``2^-7`` and ``2^-10``) and compare greedy choices only where the
reference's top-2 margin exceeds twice that bound (elsewhere either token is a correct rounding of
a near-tie).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mpack.fsutil import parse_json
from mpack.sidecar import CONFIG_NAME, torch_dtype
from mpack.target import act_dtype

#: Allowed logit difference relative to max |logit|, by compute dtype (Note [equivalence
#: tolerance]); in float32 the observed gap is far smaller (docs/BENCHMARKS.md, section 9).
REL_TOL = {"bfloat16": 2.0**-5, "float16": 2.0**-7, "float32": 1e-4}


def reference_model(source: str | os.PathLike, manifest: dict[str, Any], dtype: Any) -> Any:
    """The original checkpoint as transformers runs it, weight-only (see the module docstring).

    compressed-tensors keeps each quantized linear's fp8 ``weight`` and ``weight_scale`` and
    dequantizes them in its forward; for ``w8a8-marlin`` both are replaced by the requantized
    bytes and the max scale. Every packed layer's scales and bias are then rounded to the
    activation dtype (Note [act-dtype scales and bias]).
    """
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    model.apply(disable_quantization)
    if manifest["target"]["profile"] == "w8a8-marlin":
        _requantize(model, source, manifest)
    _round_to_act_dtype(model, manifest)
    return model


def _requantize(model: Any, source: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """The ``w8a8-marlin`` reference: every requantized layer's shards get the requantized bytes
    and the max shard scale (SPEC §4), as the sidecar holds them."""
    import torch

    from mpack.convert.checkpoint import open_checkpoint, read_scale
    from mpack.convert.marlin import requantize_shards

    ck = open_checkpoint(source)
    with torch.no_grad():
        for ly in manifest["layers"].values():
            if not ly["requantized"]:
                continue
            mods = [s["module"] for s in ly["shards"]]
            w = torch.cat([ck.read(f"{m}.weight") for m in mods])  # fp8 [N, K], every shard
            widths = [ck.tensors[f"{m}.weight"].shape[0] for m in mods]
            q, s_max = requantize_shards(w, torch.cat([read_scale(ck, m) for m in mods]), widths)
            for mod, qm in zip(mods, q.split(widths), strict=True):
                module = model.get_submodule(mod)  # compressed-tensors dequantizes on the fly
                _set(module, "weight", qm.view(torch.float8_e4m3fn))
                _set(module, "weight_scale", torch.full_like(module.weight_scale, s_max))


def _set(module: Any, name: str, value: Any) -> None:
    from compressed_tensors.offload import update_offload_parameter

    update_offload_parameter(module, name, value)


# Note [act-dtype scales and bias]: a sidecar stores every layer's per-channel scales and its
# bias in the activation dtype (``pack_scales`` / ``pack_bias`` cast them, round to nearest
# even), because vLLM's Marlin keeps them there. A checkpoint in another dtype (fp16 packed for
# bf16, bf16 for fp16, fp32 for either) keeps finer values, which transformers uses as they are
# in a float32 run: the two sides would then multiply by different scales (one bf16 ulp is 2^-8
# relative, far above fp32 summation noise; issue 11). So the reference's scales and bias of
# every packed layer take the value the sidecar holds: cast to the activation dtype, then back
# to the model's dtype (exact). With the checkpoint in the activation dtype, or the model run in
# it, this changes nothing.
def _round_to_act_dtype(model: Any, manifest: dict[str, Any]) -> None:
    """Round every packed layer's scales and bias of the reference ``model`` to the sidecar's
    activation dtype, and back (Note [act-dtype scales and bias])."""
    import torch

    act = torch_dtype(act_dtype(manifest["target"]["act_dtype"]).st)
    with torch.no_grad():
        for ly in manifest["layers"].values():
            for shard in ly["shards"]:
                module = model.get_submodule(shard["module"])
                for name in ("weight_scale", "bias"):
                    t = getattr(module, name, None)
                    if t is not None:  # as pack_scales / pack_bias round: via float32 to act
                        _set(module, name, t.to(torch.float32).to(act).to(t.dtype))


def teacher_forced_logits(model: Any, input_ids: Any, tokens: Any) -> Any:
    """float32 ``[B, steps, V]``: the model's next-token logits along ``input_ids`` + ``tokens``."""
    import torch

    seq = torch.cat([input_ids, tokens], dim=1)
    with torch.no_grad():
        return model(seq[:, :-1], use_cache=False).logits[:, input_ids.shape[1] - 1 :].float()


def tolerance(dtype_name: str, max_abs_logit: float) -> float:
    """The allowed logit difference of a run in ``dtype_name`` (Note [equivalence tolerance])."""
    return REL_TOL[dtype_name] * max_abs_logit


def score(
    ref_tokens: Any, ref_logits: Any, our_tokens: Any, our_tf_logits: Any, dtype_name: str
) -> dict[str, Any]:
    """Our run against the reference's (Note [equivalence tolerance]).

    Args:
        ref_tokens: int64 ``[B, steps]`` reference greedy tokens; ref_logits: float32
            ``[B, steps, V]`` its logits; our_tokens: our free-running greedy tokens;
            our_tf_logits: our logits along the reference's tokens (teacher forcing).
    """
    import torch

    diff = (our_tf_logits - ref_logits).abs().max().item()
    scale = ref_logits.abs().max().item()
    tol = tolerance(dtype_name, scale)
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * tol
    agree = (our_tf_logits.argmax(-1) == ref_tokens) | ~decisive
    return {
        "dtype": dtype_name,
        "ref_tokens": ref_tokens.tolist(),
        "our_tokens": our_tokens.tolist(),
        "tokens_identical": bool(torch.equal(ref_tokens.cpu(), our_tokens.cpu())),
        "max_logit_diff": diff,
        "max_abs_logit": scale,
        "tolerance": tol,
        "logits_close": diff <= tol,
        "decisive_steps": int(decisive.sum()),
        "decisive_steps_agree": bool(agree.all()),
    }


def compare(ours: Any, ref: Any, input_ids: Any, steps: int, dtype_name: str) -> dict[str, Any]:
    """Greedy-decode both; score ours against the reference (free-running and teacher-forced)."""
    from mpack.verify.model import greedy_generate

    ref_tokens, ref_logits = greedy_generate(ref, input_ids, steps)
    our_tokens, _ = greedy_generate(ours, input_ids, steps)
    tf = teacher_forced_logits(ours, input_ids, ref_tokens)
    return score(ref_tokens, ref_logits, our_tokens, tf, dtype_name)


def forward_check(
    sidecar: str | os.PathLike,
    source: str | os.PathLike,
    *,
    device: str = "cpu",
    prompts: int = 2,
    prompt_len: int = 8,
    steps: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Run random prompts through the sidecar (all ranks, :func:`mpack.runtime.load`) and the
    reference, in float32 and in the activation dtype; see Note [equivalence tolerance]."""
    import torch

    from mpack.runtime.loader import load
    from mpack.sidecar import load_manifest
    from mpack.verify.model import build_model

    manifest, _ = load_manifest(sidecar)
    tp = manifest["target"]["tp_size"]
    ranks = [load(sidecar, rank=r, device=device) for r in range(tp)]
    cfg_path = Path(sidecar) / CONFIG_NAME
    cfg = parse_json(cfg_path.read_bytes(), cfg_path)  # not an object: build_model says so
    vocab = int(cfg.get("vocab_size", 1000)) if isinstance(cfg, dict) else 1000
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (prompts, prompt_len), generator=g).to(device)
    act = manifest["target"]["act_dtype"]
    report: dict[str, Any] = {
        "sidecar": str(sidecar),
        "source": str(source),
        "device": device,
        "tp": tp,
        "runs": [],
    }
    for name in ("float32", act):
        dt = getattr(torch, name)
        ours = build_model(ranks, sidecar, dtype=dt)
        ref = reference_model(source, manifest, dt).to(device)
        report["runs"].append(compare(ours, ref, ids, steps, name))
    fp32, low = report["runs"]
    report["ok"] = (
        fp32["tokens_identical"]
        and fp32["logits_close"]
        and low["logits_close"]
        and low["decisive_steps_agree"]
    )
    return report
