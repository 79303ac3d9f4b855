"""Run a transformers Llama-family model straight from attached sidecar weights.

:func:`build_model` takes the ``SharedWeights`` of every TP rank of a sidecar (attached from a
daemon or loaded) and returns a transformers ``*ForCausalLM`` whose

* linear layers compute with the reference Marlin FP8 linear
  (:func:`mpack.convert.linear.marlin_linear`) on the fused packed tensors: ``q/k/v_proj`` and
  ``gate/up_proj`` each take their rows of the fused ``qkv_proj`` / ``gate_up_proj`` output,
  split by the shard widths the manifest records;
* embeddings, norms and ``lm_head`` are the pass-through tensors themselves (no copy when their
  dtype is the compute dtype).

Note [combining TP ranks]: with T ranks, column-parallel outputs are concatenated across ranks
(each rank holds a contiguous block of q heads and of the MLP rows; the K/V heads of ranks that
replicate the same KV group are taken once), and row-parallel layers get their slice of the input
features on each rank, the partial products summed in fp32 with the bias added once. With one
rank this is the plain TP-1 model.

Supported: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 — vLLM's fusion rules (``fusion: vllm``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.errors import UnsupportedSchemeError, UsageError

if TYPE_CHECKING:
    import torch

    from mpack.runtime.weights import SharedWeights

__all__ = ["build_model", "greedy_generate"]

_COLUMN = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROW = ("o_proj", "down_proj")


def _torch():
    import torch

    return torch


def _nn_modules():
    import torch

    from mpack.convert.linear import marlin_linear

    class FusedColumn(torch.nn.Module):
        """A column-parallel fused linear over all ranks; returns one full output per shard."""

        def __init__(self, parts: list[tuple[Any, ...]], widths: list[int], keep: list[list[int]],
                     dtype: torch.dtype) -> None:  # fmt: skip
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
                torch.cat([per_rank[r][j] for r in ranks], dim=-1)
                for j, ranks in enumerate(self.keep)
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

    class RowParallel(torch.nn.Module):
        """A row-parallel linear over all ranks: input features split, partial sums added."""

        def __init__(self, parts: list[tuple[Any, ...]], dtype: torch.dtype) -> None:
            super().__init__()
            self.parts, self.dtype = parts, dtype
            self.ks = [k for (_, _, _, _, k) in parts]  # each rank's input features

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = None
            for r, ((w, s, b, n, k), xr) in enumerate(
                zip(self.parts, x.split(self.ks, dim=-1), strict=True)
            ):
                part = marlin_linear(
                    xr, w, s, b if r == 0 else None, n=n, k=k, out_dtype=torch.float32
                )
                y = part if y is None else y + part
            return y.to(self.dtype)

    return FusedColumn, ShardOutput, RowParallel


def _config(sidecar: Path, manifest: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    cfg_path = sidecar / "config.json"
    if not cfg_path.is_file():
        raise UsageError(
            f"{sidecar}: no config.json in the sidecar; it is needed to build the model"
        )
    raw = json.loads(cfg_path.read_text())
    for key in ("quantization_config", "compression_config"):
        raw.pop(key, None)
    arch = (raw.get("architectures") or [None])[0]
    if manifest["target"]["fusion"] != "vllm" or arch not in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    ):  # fmt: skip
        raise UnsupportedSchemeError(
            f"{sidecar}: the model adapter supports vLLM-fused Llama-family sidecars, not {arch}"
        )
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


def _set_param(model: Any, name: str, tensor: torch.Tensor) -> None:
    torch = _torch()
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    mod._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


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
    torch = _torch()
    from transformers import AutoModelForCausalLM

    ranks = [weights] if not isinstance(weights, Sequence) else list(weights)
    m = ranks[0].manifest
    tp = m["target"]["tp_size"]
    if len(ranks) != tp or [w.rank for w in ranks] != list(range(tp)):
        raise UsageError(
            f"build_model needs the SharedWeights of all {tp} ranks in order, got ranks {[w.rank for w in ranks]}"
        )
    sidecar = Path(sidecar)
    act = {"bfloat16": torch.bfloat16, "float16": torch.float16}[m["target"]["act_dtype"]]
    dt = dtype or act
    cfg = _config(sidecar, m)
    device = next(iter(ranks[0].values())).device
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    FusedColumn, ShardOutput, RowParallel = _nn_modules()

    kv = cfg.num_key_value_heads
    rep = tp // kv if tp >= kv else 1
    for name, ly in m["layers"].items():
        parent, _, leaf = name.rpartition(".")
        parts = [
            (
                w[f"{name}.weight"],
                w[f"{name}.weight_scale"],
                w.get(f"{name}.bias"),
                ly["n"],
                ly["k"],
            )
            for w in ranks
        ]
        if leaf in _COLUMN:
            widths = [s["rows"] for s in ly["shards"]]
            keep = [
                list(range(0, tp, rep)) if sub in ("k_proj", "v_proj") else list(range(tp))
                for sub in _COLUMN[leaf]
            ]
            fused = FusedColumn(parts, widths, keep, dt)
            for j, sub in enumerate(_COLUMN[leaf]):
                model.get_submodule(parent)._modules[sub] = ShardOutput(fused, j)
        elif leaf in _ROW:
            model.get_submodule(parent)._modules[leaf] = RowParallel(parts, dt)
        else:
            raise UnsupportedSchemeError(f"{sidecar}: layer {name} is not a Llama-family linear")

    common = ranks[0]
    for pname, _ in list(model.named_parameters()):
        if pname in common:
            t = common[pname]
            _set_param(model, pname, t if t.dtype == dt else t.to(dt))
        elif pname == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            raise UsageError(
                f"{sidecar}: the sidecar has no tensor {pname} (converted with --no-passthrough?)"
            )
    if cfg.tie_word_embeddings and "lm_head.weight" not in common:
        model.lm_head.weight = model.get_input_embeddings().weight
    for mod_name, mod in list(model.named_modules()):
        if "Rotary" in type(mod).__name__:  # buffers computed from the config, not weights
            parent, _, leaf = mod_name.rpartition(".")
            with torch.device(device):
                new = type(mod)(config=cfg)
            (model.get_submodule(parent) if parent else model)._modules[leaf] = new
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
    torch = _torch()
    ids, logits = input_ids, []
    with torch.no_grad():
        for _ in range(steps):
            last = model(ids, use_cache=False).logits[:, -1].float()  # [B, V]
            logits.append(last)
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=-1)
    return ids[:, input_ids.shape[1] :], torch.stack(logits, dim=1)
