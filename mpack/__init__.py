"""mpack: offline Marlin FP8 packing for compressed-tensors checkpoints, shared zero-copy.

vLLM repacks an FP8 checkpoint's weights into the Marlin kernel's tile layout at every engine
start; mpack does it once, offline, byte-identical to vLLM 0.33.0, and shares the result. Its
three parts:

* **convert** (``mpack convert``, :mod:`mpack.convert`): a checkpoint (a Hub repo or a
  directory) -> a Marlin-packed *sidecar*: per-TP-rank safetensors and a manifest;
* **serve** (``mpack serve``, :mod:`mpack.runtime`): maps a sidecar into (GPU) memory once per
  device, held by a daemon;
* **attach** (:func:`mpack.runtime.attach`): any number of processes map what a daemon serves,
  zero-copy and read-only.

``__version__`` is the package's version. ``import mpack`` is cheap and never touches CUDA or
torch; docs/ARCHITECTURE.md maps the modules. From a checkout's root, :mod:`mpack._checkout`
makes the checkout's ``mpack/`` the whole package (Note [checkout on sys.path] in
mpack/_checkout.py).
"""

from __future__ import annotations

__version__ = "0.1.0"


def env_flag(name: str) -> bool:
    """Whether the environment switch ``name`` (``MPACK_NO_...``) is on: set to anything but
    empty or ``0``."""
    import os

    return os.environ.get(name, "") not in ("", "0")


def env_number(name: str, default: float, *, low: float, high: float) -> float:
    """The number the environment variable ``name`` holds, checked: ``default`` when it is unset
    or empty (as for :func:`env_flag`, empty is unset), else a finite number from ``low`` to
    ``high`` (``0.5``, ``2``, ``1e1``). Every numeric ``MPACK_*`` variable is read through here.

    Raises:
        UsageError: anything else (``abc``, ``0``, ``-1``, ``nan``, ``inf``, out of range),
            naming the variable, its value and what it may be (exit 2).
    """
    import math
    import os

    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # nan and out of range alike
        from mpack.errors import UsageError, quote

        raise UsageError(
            f"{name}={quote(raw)}: must be a number from {low:g} to {high:g}",
            hint=f"set {name} to such a number (e.g. {default:g}), or unset it for the "
            f"default, {default:g}",
        )
    return value


if __name__ == "mpack":  # maybe a checkout's mpack/ alone (Note [checkout on sys.path])
    from mpack import _checkout

    _checkout.settle(__file__)
