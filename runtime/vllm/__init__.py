"""``--load-format mpack``: vLLM takes its FP8 Marlin weights from an mpack sidecar.

Installed with the ``vllm`` extra, mpack registers :func:`register` under vLLM's
``vllm.general_plugins`` entry point group; vLLM calls it in every process (API server, engine
core, workers) and it registers the load format ``mpack``. This package is the only part of mpack
that imports vLLM (docs/VLLM.md):

* ``loader.py``: :class:`~mpack.runtime.vllm.loader.MpackModelLoader`, vLLM's loader for the
  format. It derives from vLLM's ``DefaultModelLoader``, so importing it imports vLLM: only
  :func:`register` imports it, never the import of this package.
* ``source.py``: the sidecar to read (a directory or a Hub repo id) and the rank's tensors
  (attached or loaded privately); no vLLM.
* ``checks.py``: the checks on the loader's inputs, before vLLM builds the model (Note [the
  loader trusts nothing in the sidecar]); neither vLLM nor torch.

Importing the package imports neither vLLM nor torch (it imports nothing beyond
``mpack.runtime``): the entry point costs nothing until vLLM calls it.
"""

from __future__ import annotations

LOAD_FORMAT = "mpack"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``mpack`` load format. Cheap,
    idempotent, touches no device."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    from mpack.runtime import warm
    from mpack.runtime.vllm.loader import MpackModelLoader

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not MpackModelLoader:
        register_model_loader(LOAD_FORMAT)(MpackModelLoader)  # once: vLLM warns on a re-register
    for device in ("cpu", "cuda"):  # the first attach, paid now (Note [warm attach])
        warm(device)


__all__ = ["LOAD_FORMAT", "register"]
