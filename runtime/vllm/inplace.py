"""Pass-through tensors used in place (issue 40): vLLM's parameters become views of the
sidecar's ``common.safetensors`` tensors instead of copies of them.

vLLM's model ``load_weights`` hands every tensor it is given to the parameter's
``weight_loader``. For the duration of the load, each non-Marlin parameter's loader is wrapped
(:class:`InPlace`): where the original would have copied the tensor as it is, the parameter's
``.data`` becomes the tensor itself, or, for a vocabulary-parallel embedding or lm_head, its
rank's row range of it (a contiguous view). With an attached sidecar those are views of the
daemon's read-only mapping, as the Marlin layers' are (Note [loading from a sidecar] in
runtime/vllm/loader.py). The original loader runs, and copies, everywhere else, and each such
tensor is counted and named (:attr:`InPlace.copied`): never a silent copy.

Used in place only when all of these hold, so that the bytes are exactly those vLLM's loader
would have written:

- the loader is vLLM's ``default_weight_loader`` (a plain copy after a shape check) or
  ``VocabParallelEmbedding.weight_loader`` on a vocabulary-sharded weight whose rank has no
  padding rows (vLLM zero-fills those: a vocabulary that is not a multiple of 64 is copied);
- the tensor is one the loader yielded from the sidecar (not a model's transform of it),
  contiguous, of the parameter's dtype, device and shape (or row range).

Nothing vLLM 0.33.0 does after loading writes into these parameters on CUDA: the unquantized
linear and embedding methods' ``process_weights_after_loading`` change nothing there (on a CPU
they pack linear weights into new tensors, which leaves the views unwritten), and a tied lm_head
is the embedding's parameter itself. This module imports vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpack.runtime.vllm.placeholders import Placeholders


@dataclass
class InPlace:
    """The wrapped loaders of one load, and what they did."""

    #: ``data_ptr()`` of every tensor yielded from the sidecar: only those are used in place.
    yielded: set[int] = field(default_factory=set)
    in_place: int = 0
    in_place_bytes: int = 0
    #: The parameters vLLM's loader copied into (their names), and the bytes.
    copied: list[str] = field(default_factory=list)
    copied_bytes: int = 0
    _names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name
    #: The parameters built without memory (runtime/vllm/placeholders.py): one that vLLM's
    #: loader copies into gets its memory first.
    placeholders: Placeholders = field(default_factory=Placeholders)

    @contextlib.contextmanager
    def loading(self, model: nn.Module, skip: Iterable[nn.Module]) -> Iterator[None]:
        """Wrap the loader of every parameter of ``model`` outside the modules ``skip`` (the
        Marlin layers, whose parameters are the sidecar's already) for the duration of the
        load; the originals are put back however it ends."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        held, restore = set(skip), []
        try:
            for prefix, module in model.named_modules():
                if module in held:
                    continue
                for pname, p in module.named_parameters(recurse=False):
                    if id(p) in self._names:  # a tied parameter: its first module's
                        continue
                    original = getattr(p, "weight_loader", None)
                    vocab = isinstance(module, VocabParallelEmbedding) and p is module.weight
                    plain = original is None or original is default_weight_loader
                    loader = self._loader(module, original or default_weight_loader, plain, vocab)
                    name = f"{prefix}.{pname}" if prefix else pname
                    try:
                        p.weight_loader = loader
                    except AttributeError:  # a vLLM parameter class's read-only loader: copies
                        self.placeholders.materialize(p, name)
                        continue
                    self._names[id(p)] = name
                    restore.append((p, original))
            yield
        finally:
            for p, original in restore:
                if original is None:
                    del p.weight_loader
                else:
                    p.weight_loader = original

    def feed(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors`` as they are, each one marked as the sidecar's (only those go in place)."""
        for name, t in tensors:
            self.yielded.add(t.data_ptr())
            yield name, t

    def _view(
        self, module: nn.Module, param: nn.Parameter, loaded: torch.Tensor, plain: bool, vocab: bool
    ) -> torch.Tensor | None:
        """The part of ``loaded`` that is exactly what the original loader would copy into the
        whole of ``param``; None where that is not so."""
        if (
            loaded.data_ptr() not in self.yielded
            or not loaded.is_contiguous()
            or loaded.dtype != param.dtype
            or loaded.device != param.device
        ):
            return None
        if plain:
            return loaded if loaded.shape == param.shape else None
        if not vocab or getattr(param, "output_dim", None) != 0:
            return None
        if getattr(param, "packed_dim", None) is not None:
            return None
        idx = module.shard_indices
        start, stop = idx.org_vocab_start_index, idx.org_vocab_end_index
        if loaded.shape[0] != module.org_vocab_size or stop - start != param.shape[0]:
            return None  # padding rows on this rank: vLLM zero-fills them
        view = loaded[start:stop]
        return view if view.shape == param.shape else None

    def _loader(self, module: nn.Module, original: Any, plain: bool, vocab: bool) -> Any:
        def load(param: nn.Parameter, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            view = None if args or kwargs else self._view(module, param, loaded, plain, vocab)
            if view is None:
                name = self._names.get(id(param), "?")
                if name not in self.copied:  # a fused parameter is loaded part by part
                    self.copied.append(name)
                    self.copied_bytes += param.numel() * param.element_size()
                self.placeholders.materialize(param, name)
                return original(param, loaded, *args, **kwargs)
            param.data = view
            self.in_place += 1
            self.in_place_bytes += view.numel() * view.element_size()
            return None

        return load

    def report(self) -> dict[str, Any]:
        return {
            "in_place": self.in_place,
            "in_place_bytes": self.in_place_bytes,
            "copied": list(self.copied),
            "copied_bytes": self.copied_bytes,
        }


__all__ = ["InPlace"]
