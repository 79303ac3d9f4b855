"""The environment mpack runs in: the variables it reads, and what this install has.

* :data:`VARIABLES`: every ``MPACK_*`` variable the code reads, once. ``mpack --help`` lists
  them from here (:func:`help_entries`); the README's table says the same at more length, and
  tests/test_packaging.py holds the code, this table and the README to each other.
* :func:`report`: ``mpack --version``, an environment report in the manner of ``vllm
  collect-env`` (short): mpack, the vLLM version it targets and the one installed, the native
  repack, cuda-bindings, torch, Python.

This module imports only the standard library and the package itself (:func:`mpack.env_number`).
The report finds the other packages' versions in
their installed metadata and the native repack by its file, importing none of them: ``mpack
--version`` stays fast and never initialises CUDA (tests/test_lean_import.py).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from dataclasses import dataclass

__all__ = [
    "PROGRESS_EVERY_RANGE",
    "PROGRESS_EVERY_S",
    "VARIABLES",
    "Variable",
    "help_entries",
    "progress_every",
    "report",
]

#: ``$MPACK_PROGRESS_EVERY``: seconds between progress lines in a log (convert, push, verify,
#: and the daemon's load); the default, and the range it may take (a tenth of a second at the
#: least: 0 would flood the log).
PROGRESS_EVERY_S = 5.0
PROGRESS_EVERY_RANGE = (0.1, 86400.0)


def progress_every() -> float:
    """``$MPACK_PROGRESS_EVERY``, checked (:func:`mpack.env_number`).

    Raises:
        UsageError: not a number in :data:`PROGRESS_EVERY_RANGE`, naming the value (exit 2).
    """
    from mpack import env_number

    low, high = PROGRESS_EVERY_RANGE
    return env_number("MPACK_PROGRESS_EVERY", PROGRESS_EVERY_S, low=low, high=high)


@dataclass(frozen=True)
class Variable:
    """One environment variable: its ``name``, the ``value`` it takes (``1``, ``S``, ``DIR``, as
    the help writes it: ``NAME=value``) and its ``effect`` in one line."""

    name: str
    value: str
    effect: str


#: Every ``MPACK_*`` variable the code reads, in the order ``mpack --help`` lists them.
VARIABLES = (
    Variable("MPACK_DEBUG", "1", "show the traceback of an error"),
    Variable(
        "MPACK_PROGRESS_EVERY",
        "S",
        "seconds between progress lines when stderr is not a terminal, 0.1 to 86400 (5; empty: 5)",
    ),
    Variable(
        "MPACK_SCHEME_CHECK", "inline", "parse the quantization config in-process, not in a child"
    ),
    Variable(
        "MPACK_CT_IMPORT", "full", "the scheme check's child imports all of compressed-tensors"
    ),
    Variable("MPACK_NO_HOST_REPACK", "1", "no native repack: convert on the CPU with torch's ops"),
    Variable("MPACK_NO_CUDA_KERNEL", "1", "no fused kernel: convert on CUDA with torch's ops"),
    Variable("MPACK_NO_DRIVER_PATH", "1", "convert on CUDA through torch, not cuda-bindings alone"),
    Variable(
        "MPACK_NO_DIRECT_WRITE",
        "1",
        "on fewer than 8 cores, write through the page cache, not O_DIRECT",
    ),
    Variable("MPACK_REPACK_SOURCE", "PATH", "another copy of the fused kernel's marlin_repack.cu"),
    Variable(
        "MPACK_NO_VERDICT_CACHE",
        "1",
        "check the quantization config every time (no cached verdict)",
    ),
    Variable(
        "MPACK_SOURCE_PATH",
        "full",
        "convert records a local source's absolute path in mpack.json, not its name",
    ),
    Variable(
        "MPACK_CACHE_DIR",
        "DIR",
        "mpack's cache of kernels, scheme verdicts and source places (~/.cache/mpack)",
    ),
    Variable("MPACK_GOLDEN", "DIR", "the golden test data, for the test suite (tests/data/golden)"),
)


def help_entries() -> dict[str, str]:
    """``{"NAME=value": effect}`` of :data:`VARIABLES`, in order: what ``mpack --help`` lists."""
    return {f"{v.name}={v.value}": v.effect for v in VARIABLES}


# --- mpack --version ------------------------------------------------------------------------


def _installed(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` (distribution names) that is there."""
    import importlib.metadata  # 15 ms of email parsing, for --version only: not at import

    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _native_repack() -> str:
    """Whether the native repack (``convert/_repack.c``) is built, found without loading it."""
    try:
        built = importlib.util.find_spec("mpack.convert._repack") is not None
    except (ImportError, ValueError):
        built = False
    if not built:
        return "not built (no C compiler at install: CPU conversions use torch's ops, same bytes)"
    if os.environ.get("MPACK_NO_HOST_REPACK", "") not in ("", "0"):
        return "built, turned off by MPACK_NO_HOST_REPACK"
    return "built"


def report() -> list[tuple[str, str]]:
    """``mpack --version``'s lines after the first, ``(what, value)``: the vLLM version mpack
    targets and the one installed, the native repack, cuda-bindings, torch, Python."""
    from mpack import target

    vllm = _installed("vllm")
    if vllm is None:
        engine = "not installed"
    elif vllm == target.ENGINE_VERSION:
        engine = vllm
    else:
        engine = f"{vllm}: not the version this mpack targets (--load-format mpack refuses it)"
    cuda = _installed("cuda-bindings")
    torch = _installed("torch")
    impl = platform.python_implementation()
    return [
        ("targets", f"vLLM {target.ENGINE_VERSION}'s Marlin FP8 layout ({target.KERNEL})"),
        ("vLLM", engine),
        ("native repack", _native_repack()),
        (
            "cuda-bindings",
            cuda
            or "not installed (convert --device cuda and serve on a GPU need it: "
            "pip install 'mpack-marlin[cuda]')",
        ),
        ("torch", torch or "not installed"),
        ("python", f"{platform.python_version()} ({impl}, {sys.platform}, {platform.machine()})"),
    ]
