"""mpack: offline Marlin FP8 packing for compressed-tensors checkpoints, shared zero-copy.

``import mpack`` is cheap and never touches CUDA; the heavy parts live in ``mpack.convert``
(checkpoint -> sidecar) and ``mpack.runtime`` (serve / attach).
"""

__version__ = "0.1.0"
