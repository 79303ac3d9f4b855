"""Verification: checksums, re-derivation from the source, and forward equivalence
(docs/ARCHITECTURE.md).

One entry point, :func:`verify`, returning a :class:`Verification` (what was checked, every
problem found), and its form for the targets of a directory of sidecars,
:func:`verify_targets` (one read of the source for them all); ``mpack verify`` prints them.
The layer may use the core, ``mpack.convert`` (to re-derive what a conversion writes) and
``mpack.runtime`` (to load a sidecar as an engine would); neither of those imports it
(``mpack.convert.verify`` forwards here, on each call).

* :mod:`mpack.verify.check`: the entry point and the file checks (no torch at import);
* :mod:`mpack.verify.rederive`: finding the source, re-deriving every tensor from it;
* :mod:`mpack.verify.compare`: one sidecar file read once, hashed and compared with what a
  conversion writes into it;
* :mod:`mpack.verify.reference`: the reference Marlin FP8 linear (what the packed bytes mean);
* :mod:`mpack.verify.model`: a transformers model run from a sidecar's weights;
* :mod:`mpack.verify.forward`: its outputs against transformers on the source checkpoint.
"""

from mpack.verify.check import Verification, check_arguments, verify, verify_targets

__all__ = ["Verification", "check_arguments", "verify", "verify_targets"]
