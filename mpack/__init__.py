"""mpack: offline Marlin FP8 packing for compressed-tensors checkpoints, shared zero-copy.

``import mpack`` is cheap and never touches CUDA; the heavy parts live in ``mpack.convert``
(checkpoint -> sidecar) and ``mpack.runtime`` (serve / attach).
"""

__version__ = "0.1.0"


def env_flag(name: str) -> bool:
    """Whether the environment switch ``name`` (``MPACK_NO_...``) is on: set to anything but
    empty or ``0``."""
    import os

    return os.environ.get(name, "") not in ("", "0")
