"""Run a transformers Llama-family model straight from attached sidecar weights.

:func:`build_model` takes the ``SharedWeights`` of every TP rank of a sidecar (attached from a
daemon or loaded) and returns a transformers ``*ForCausalLM`` whose

* linear layers compute with the reference Marlin FP8 linear
  (:func:`mpack.verify.reference.marlin_linear`) on the fused packed tensors: ``q/k/v_proj`` and
  ``gate/up_proj`` each take their rows of the fused ``qkv_proj`` / ``gate_up_proj`` output,
  split by the shard widths the manifest records;
* embeddings, norms and ``lm_head`` are the pass-through tensors themselves (no copy when their
  dtype is the compute dtype).

Note [combining TP ranks]: with T ranks, column-parallel outputs are concatenated across ranks
(each rank holds a contiguous block of q heads and of the MLP rows; the K/V heads of ranks that
replicate the same KV group are taken once, :func:`mpack.arch.distinct_ranks`), and row-parallel
layers get their slice of the input features on each rank, the partial products summed in fp32
with the bias added once. With one rank this is the plain TP-1 model.

Supported: :data:`mpack.arch.FAMILIES` (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3, Gemma 2,
Granite) with vLLM's fusion rules (``fusion: vllm``, :mod:`mpack.arch`); where the model keeps
the fused linear itself (a ``prefused`` family), it gets the parts concatenated.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mpack.arch import (
    ARCHITECTURES,
    FUSED,
    ROW_PARALLEL,
    Dims,
    Family,
    dims_of,
    distinct_ranks,
    family_of,
)
from mpack.errors import CorruptFileError, UnsupportedSchemeError, UsageError, arg
from mpack.fsutil import parse_json
from mpack.sidecar import CONFIG_NAME, torch_dtype
from mpack.target import BIAS, SCALE, WEIGHT, act_dtype
from mpack.verify.reference import marlin_linear

if TYPE_CHECKING:
    from mpack.runtime.weights import SharedWeights

__all__ = ["build_model", "greedy_generate"]

#: One rank's tensors of a packed layer: ``(weight, weight_scale, bias or None, n, k)``.
Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]


class FusedColumn(torch.nn.Module):
    """A column-parallel fused linear over all ranks; returns one full output per shard."""

    def __init__(
        self, parts: list[Part], widths: list[int], keep: list[list[int]], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.parts, self.widths, self.keep, self.dtype = parts, widths, keep, dtype
        self._x: torch.Tensor | None = None
        self._y: list[torch.Tensor] = []

    def shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x is self._x:  # q/k/v (gate/up) ask for the same input in a row
            return self._y
        per_rank = [
            marlin_linear(x, w, s, b, n=n, k=k, out_dtype=self.dtype).split(self.widths, dim=-1)
            for (w, s, b, n, k) in self.parts
        ]  # [rank][shard] -> [..., width]
        self._y = [
            torch.cat([per_rank[r][j] for r in ranks], dim=-1) for j, ranks in enumerate(self.keep)
        ]
        self._x = x
        return self._y


class ShardOutput(torch.nn.Module):
    """What ``q_proj`` (etc.) returns: shard ``j`` of a fused column-parallel layer."""

    def __init__(self, fused: FusedColumn, j: int) -> None:
        super().__init__()
        self.j = j
        object.__setattr__(self, "fused", fused)  # shared, not a registered submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.shards(x)[self.j]


class FusedOutput(torch.nn.Module):
    """What a fused linear the model keeps whole (``qkv_proj``) returns: every part, in row
    order."""

    def __init__(self, fused: FusedColumn) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.fused.shards(x), dim=-1)


class RowParallel(torch.nn.Module):
    """A row-parallel linear over all ranks: input features split, partial sums added."""

    def __init__(self, parts: list[Part], dtype: torch.dtype) -> None:
        super().__init__()
        self.parts, self.dtype = parts, dtype
        self.ks = [k for (_, _, _, _, k) in parts]  # each rank's input features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = None
        for r, ((w, s, b, n, k), xr) in enumerate(
            zip(self.parts, x.split(self.ks, dim=-1), strict=True)
        ):
            part = marlin_linear(xr, w, s, b if r == 0 else None, n=n, k=k, out_dtype=torch.float32)
            y = part if y is None else y + part
        return y.to(self.dtype)


def _config(sidecar: Path, manifest: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The architecture and the model config the sidecar copied, without its quantization keys.

    Raises:
        UsageError: the sidecar has no config.json.
        UnsupportedSchemeError: not a vLLM-fused Llama-family sidecar.
    """
    cfg_path = sidecar / CONFIG_NAME
    if not cfg_path.is_file():
        raise UsageError(
            f"{sidecar}: no {CONFIG_NAME} in the sidecar; it is needed to build the model"
        )
    raw = parse_json(cfg_path.read_bytes(), cfg_path)
    if not isinstance(raw, dict):
        raise CorruptFileError(f"{cfg_path}: holds a JSON {type(raw).__name__}, not an object")
    for key in ("quantization_config", "compression_config"):
        raw.pop(key, None)
    arch = (raw.get("architectures") or [None])[0]
    if manifest["target"]["fusion"] != "vllm" or arch not in ARCHITECTURES:
        raise UnsupportedSchemeError(
            f"{sidecar}: the model adapter supports vLLM-fused Llama-family sidecars, not {arch}"
        )
    return arch, raw


def _ranks(weights: SharedWeights | Sequence[SharedWeights]) -> list[SharedWeights]:
    """Every rank's weights, checked to be all of them, in rank order."""
    ranks = [weights] if not isinstance(weights, Sequence) else list(weights)
    tp = ranks[0].manifest["target"]["tp_size"]
    if len(ranks) != tp or [w.rank for w in ranks] != list(range(tp)):
        raise UsageError(
            f"build_model needs the SharedWeights of all {tp} ranks in order, "
            f"got ranks {[w.rank for w in ranks]}"
        )
    return ranks


def _replace_linears(
    model: Any,
    ranks: list[SharedWeights],
    fam: Family,
    dims: Dims,
    dt: torch.dtype,
    sidecar: Path,
) -> None:
    """Every packed layer in place of the model's linears (Note [combining TP ranks])."""
    tp = len(ranks)
    for name, ly in ranks[0].manifest["layers"].items():
        parent, _, leaf = name.rpartition(".")
        parts: list[Part] = [
            (w[f"{name}.{WEIGHT}"], w[f"{name}.{SCALE}"], w.get(f"{name}.{BIAS}"), ly["n"], ly["k"])
            for w in ranks
        ]
        if leaf in FUSED:
            widths = [s["rows"] for s in ly["shards"]]
            keep = [distinct_ranks(sub, dims, tp) for sub in FUSED[leaf]]
            fused = FusedColumn(parts, widths, keep, dt)
            if fam.prefused:
                model.get_submodule(parent)._modules[leaf] = FusedOutput(fused)
            else:
                for j, sub in enumerate(FUSED[leaf]):
                    model.get_submodule(parent)._modules[sub] = ShardOutput(fused, j)
        elif leaf in ROW_PARALLEL:
            model.get_submodule(parent)._modules[leaf] = RowParallel(parts, dt)
        else:
            raise UnsupportedSchemeError(f"{sidecar}: layer {name} is not a Llama-family linear")


def _set_param(model: Any, name: str, tensor: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    mod._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


def _place_passthrough(
    model: Any, common: SharedWeights, cfg: Any, dt: torch.dtype, sidecar: Path
) -> None:
    """Embeddings, norms and ``lm_head``: the pass-through tensors (cast when ``dt`` differs)."""
    for pname, _ in list(model.named_parameters()):
        if pname in common:
            t = common[pname]
            _set_param(model, pname, t if t.dtype == dt else t.to(dt))
        elif pname == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            raise UsageError(
                f"{sidecar}: the sidecar has no tensor {pname} (converted with "
                f"{arg('passthrough', False)}?)"
            )
    if cfg.tie_word_embeddings and "lm_head.weight" not in common:
        model.lm_head.weight = model.get_input_embeddings().weight


def _rebuild_rotary(model: Any, cfg: Any, device: torch.device) -> None:
    """Rotary embeddings on ``device``: their buffers come from the config, not from weights."""
    for mod_name, mod in list(model.named_modules()):
        if "Rotary" in type(mod).__name__:
            parent, _, leaf = mod_name.rpartition(".")
            with torch.device(device):
                new = type(mod)(config=cfg)
            (model.get_submodule(parent) if parent else model)._modules[leaf] = new


def build_model(
    weights: SharedWeights | Sequence[SharedWeights],
    sidecar: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
) -> Any:
    """A transformers causal LM whose weights are the sidecar's (Note [combining TP ranks]).

    Args:
        weights: one ``SharedWeights`` per TP rank, in rank order (all of them).
        sidecar: the sidecar directory (for ``config.json``).
        dtype: compute dtype; default the sidecar's activation dtype. ``torch.float32`` runs
            norms and embeddings in fp32 (those tensors are then copied, once).

    Returns:
        A ``*ForCausalLM`` in eval mode on the weights' device.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    ranks = _ranks(weights)
    m = ranks[0].manifest
    sidecar = Path(sidecar)
    dt = dtype or torch_dtype(act_dtype(m["target"]["act_dtype"]).st)
    arch, raw = _config(sidecar, m)
    dims = dims_of(arch, raw)
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    fam = family_of(arch)
    assert fam is not None, "_config refuses other architectures"
    _replace_linears(model, ranks, fam, dims, dt, sidecar)
    _place_passthrough(model, ranks[0], cfg, dt, sidecar)
    _rebuild_rotary(model, cfg, next(iter(ranks[0].values())).device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise UsageError(f"{sidecar}: could not place {left[:5]} from the sidecar")
    return model.eval()


def greedy_generate(
    model: Any, input_ids: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding without a KV cache (the full sequence each step; fine for references).

    Args:
        input_ids: int64 ``[B, S]`` on the model's device.

    Returns:
        (int64 ``[B, steps]`` generated tokens, float32 ``[B, steps, V]`` logits of each step).
    """
    ids, logits = input_ids, []
    with torch.no_grad():
        for _ in range(steps):
            last = model(ids, use_cache=False).logits[:, -1].float()  # [B, V]
            logits.append(last)
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=-1)
    return ids[:, input_ids.shape[1] :], torch.stack(logits, dim=1)
