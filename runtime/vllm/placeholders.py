"""Parameters built without memory of their own (issue 40): what vLLM allocates while it builds
the model, for tensors the sidecar is about to supply, is given back at once.

vLLM builds every parameter with ``torch.empty`` on the target device, and under
``--load-format mpack`` most of them are then replaced by the sidecar's tensors (attached: views
of the daemon's mapping): the Marlin layers' and MoE experts' tensors, and the embeddings and
lm_head used in place (runtime/vllm/inplace.py). Building them for real costs an allocation of
the whole model (9 GB for an 8B) and its release, for nothing.

While the model is built (:func:`building`), a parameter registration hook looks at each
parameter as vLLM registers it. Those the sidecar fills (:func:`_filled`) get, as their data, a
**placeholder**: one element of the parameter's dtype on its device, expanded to its shape (all
strides 0). The parameter object stays vLLM's (its class, its weight loader and attributes), its
shape, dtype and device are unchanged, and the memory ``torch.empty`` gave it goes back to the
caching allocator, where the next parameter's ``torch.empty`` finds it: the build's peak is one
parameter, not the model.

Why a placeholder and not a meta tensor: a parameter's data cannot change device type (CUDA to
meta and back is refused by ``set_data``), and a placeholder is safe against what a meta tensor
would hide. A copy into it raises (``more than one element of the written-to tensor refers to a
single memory location``), so no loader can write into it silently. What vLLM writes while it
builds (a ``fill_``) is lost, as it would be when the sidecar's tensor replaces the parameter.
Every placeholder is then either replaced by the sidecar's tensor (``_swap_in``, ``moe.swap_in``,
:class:`~mpack.runtime.vllm.inplace.InPlace`), or given real memory (``torch.empty``, as vLLM
built it) just before vLLM's own loader copies into it (:meth:`Placeholders.materialize`, from
``InPlace``'s copying branch); :meth:`Placeholders.check_replaced` refuses a model with one
left. This module imports vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


def _filled(module: nn.Module, name: str, passthrough_in_place: bool) -> bool:
    """Whether the sidecar supplies parameter ``name`` of ``module`` whole: a dense FP8 linear's
    ``weight``, ``weight_scale`` and ``bias`` (the loader checks that they are exactly the
    sidecar's), an FP8 MoE block's four stacked tensors, and, when the pass-through tensors are
    the sidecar's (not a ``--no-passthrough`` checkpoint's), an embedding's or lm_head's weight.
    Everything else (norms, input scales, routers, unquantized linears, buffers) is built as
    vLLM builds it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from mpack.runtime.vllm import moe
    from mpack.runtime.vllm.checks import scheme_class

    if moe.is_fp8_moe(module):
        return name in {f"{w}_{leaf}" for w in ("w13", "w2") for leaf in moe.LEAVES}
    # a compressed-tensors layer has its scheme before its parameters; an AutoFP8 layer's
    # method gets its kernel (``fp8_linear``) only after them
    autofp8 = type(getattr(module, "quant_method", None)).__name__ == scheme_class("fp8", "w8a16")
    if getattr(module, "scheme", None) is not None or autofp8:
        return name in ("weight", "weight_scale", "bias")
    return passthrough_in_place and isinstance(module, VocabParallelEmbedding) and name == "weight"


@dataclass
class Placeholders:
    """The parameters of one build that hold a placeholder, and what they saved."""

    #: id(parameter) -> (parameter, data_ptr of its placeholder element)
    held: dict[int, tuple[nn.Parameter, int]] = field(default_factory=dict)
    bytes_saved: int = 0
    materialized: list[str] = field(default_factory=list)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` still has its placeholder as data."""
        entry = self.held.get(id(param))
        return entry is not None and param.data_ptr() == entry[1] and 0 in param.stride()

    def materialize(self, param: nn.Parameter, name: str) -> None:
        """Give ``param`` memory of its own, as vLLM built it (``torch.empty``), before vLLM's
        loader copies into it."""
        if self.holds(param):
            param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            self.materialized.append(name)

    def check_replaced(self, model: nn.Module) -> None:
        """Refuse a model with a placeholder left: a parameter the sidecar should have filled
        and did not (an internal error: the loader's checks name a sidecar that lacks one)."""
        from mpack.errors import MpackError

        left = [n for n, p in model.named_parameters() if self.holds(p)]
        if left:
            raise MpackError(
                f"--load-format mpack left {len(left)} parameter(s) without their tensors, "
                f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''}"
            )

    def _hook(self, passthrough_in_place: bool):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if (
                param is None
                or param.device.type == "meta"
                or id(param) in self.held
                or param.numel() <= 1
                or not _filled(module, name, passthrough_in_place)
            ):
                return
            one = torch.empty(1, dtype=param.dtype, device=param.device)
            self.bytes_saved += param.numel() * param.element_size()
            param.data = one.expand(param.shape)
            self.held[id(param)] = (param, one.data_ptr())

        return hook


@contextlib.contextmanager
def building(passthrough_in_place: bool) -> Iterator[Placeholders]:
    """While the model is built: the parameters the sidecar fills get placeholders (module
    docstring). The hook is the process's for the duration only."""
    ph = Placeholders()
    handle = nn.modules.module.register_module_parameter_registration_hook(
        ph._hook(passthrough_in_place)
    )
    try:
        yield ph
    finally:
        handle.remove()


__all__ = ["Placeholders", "building"]
