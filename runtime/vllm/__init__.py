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

Note [one logger]: everything ``--load-format mpack`` logs goes through one logger,
:data:`LOGGER_NAME`, got from :func:`logger` and nowhere else. Its name is under ``vllm.``, so
in an engine its lines go through the handler vLLM configures on ``vllm`` (its format: process,
pid, level, time, file and line; its ``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING`` and
logging config file), and it is vLLM's ``init_logger`` that makes it (its ``info_once`` and
friends) whenever vLLM is loaded in the process. Without vLLM (the source tests) it is the plain
``logging`` logger of the same name.
"""

from __future__ import annotations

import logging
import sys

LOAD_FORMAT = "mpack"
#: The one logger name of the loader (Note [one logger]).
LOGGER_NAME = "vllm.mpack"


def logger() -> logging.Logger:
    """The loader's logger (Note [one logger]): vLLM's ``init_logger(LOGGER_NAME)`` once vLLM is
    imported in this process, else ``logging.getLogger(LOGGER_NAME)``; never imports vLLM."""
    if "vllm" in sys.modules:
        from vllm.logger import init_logger

        return init_logger(LOGGER_NAME)
    return logging.getLogger(LOGGER_NAME)


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


__all__ = ["LOAD_FORMAT", "LOGGER_NAME", "logger", "register"]
