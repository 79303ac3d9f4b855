"""Shared test fixtures: where the golden data lives, and the `gpu` marker's rules.

Without a CUDA device, `gpu` tests are skipped with a reason (`make test`). With
``--require-gpu`` (what `make test-gpu` passes), a machine without one is a usage error at
session start, before any test runs: a GPU run that skipped everything must not pass.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every test, and every CLI process a test starts, checks a checkpoint's scheme for itself: a
# verdict kept by an earlier test (or by the user's own conversions) would skip the check's child
# that many tests are about. tests/convert/test_verdict_cache.py turns the cache on where it is
# the subject, in a folder of its own.
os.environ["MPACK_NO_VERDICT_CACHE"] = "1"


def _has_vllm() -> bool:
    # On pytest's sys.path, tests/vllm itself is a namespace package `vllm` (origin None).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


# tests/vllm needs vLLM, which mpack's own venv does not have: `make test` runs it with
# .venv-vllm's python (Makefile). Where vLLM is not importable, it is not collected at all.
collect_ignore = [] if _has_vllm() else ["vllm"]


def _golden_dir() -> Path:
    """../shared/golden beside the clone (CI and dev machines), or a carried copy on the GPU box."""
    candidates = [
        os.environ.get("MPACK_GOLDEN"),
        REPO.parent / "shared" / "golden",
        REPO / ".golden",
    ]
    for c in candidates:
        if c and (Path(c) / "README.md").is_file():
            return Path(c)
    raise RuntimeError(
        "golden data not found: expected ../shared/golden beside the repository "
        "(or set MPACK_GOLDEN to its path)"
    )


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of ``path`` with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-layer Llama FP8 checkpoint and its sidecar, converted on the CPU: ``(ck, sidecar)``."""
    import mpack.convert as mc
    from mpack.fixtures import make_checkpoint

    root = tmp_path_factory.mktemp("converted")
    ck = make_checkpoint(root / "ck", arch="llama", scheme="FP8", layers=1)
    mc.convert(ck, root / "sc", device="cpu")
    return ck, root / "sc"


@pytest.fixture(scope="session")
def golden() -> Path:
    return _golden_dir()


NO_GPU_MESSAGE = (
    "make test-gpu needs a CUDA device; this machine has none (torch.cuda.is_available() is False)"
)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu",
        action="store_true",
        help="fail at once, rather than skip the gpu tests, when there is no CUDA device "
        "(make test-gpu)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("require_gpu") and not _cuda_available():
        raise pytest.UsageError(NO_GPU_MESSAGE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run `make test-gpu` on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
