"""Shared test fixtures: where the golden data lives, and the `gpu` marker's rules.

The golden data is vendored in tests/data/golden (PROVENANCE.md there says where it came from);
MPACK_GOLDEN=DIR points the tests at another copy. A plain clone, without ../shared beside it,
runs every test that does not need a GPU or vLLM.

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
    # Only a real vLLM counts, not a folder named vllm found on sys.path (a namespace package).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


# tests/vllm needs vLLM, which mpack's own venv does not have: `make test` runs it with
# .venv-vllm's python (Makefile). Where vLLM is not importable, it is not collected at all.
collect_ignore = [] if _has_vllm() else ["vllm"]


#: The golden data, vendored: byte-for-byte copies of ../shared/golden
#: (tests/data/golden/PROVENANCE.md).
VENDORED_GOLDEN = REPO / "tests" / "data" / "golden"
#: The project's shared folder beside the clone, where there is one (not in a plain clone):
#: tests/test_golden_vendored.py checks the vendored copy against its golden/.
SHARED = REPO.parent / "shared"


def _is_golden(d: Path) -> bool:
    return (d / "cases").is_dir() and (d / "vectors").is_dir()


def _golden_dir() -> Path:
    """$MPACK_GOLDEN if set, else the vendored copy. Never raises: a module may call it at
    collection; a bad $MPACK_GOLDEN stops the session in pytest_configure instead."""
    override = os.environ.get("MPACK_GOLDEN")
    return Path(override) if override else VENDORED_GOLDEN


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


#: What ``--fast`` (``make test-fast``) leaves out: the files whose tests start many processes,
#: engines, venvs or whole conversions (measured with ``--durations`` on the 2-core machine,
#: each over 15 s in all); ``make test`` runs them. The golden checks stay in.
SLOW_FILES = frozenset(
    {
        "tests/runtime/test_equivalence.py",
        "tests/convert/test_bad_inputs.py",
        "tests/test_bench_vs_tools.py",
        "tests/convert/test_atomic.py",
        "tests/test_release.py",
        "tests/convert/test_ctlean.py",
        "tests/runtime/test_serve_attach.py",
        "tests/runtime/test_pipeline_grid.py",
        "tests/hostile/test_convert_hostile.py",
        "tests/hostile/test_sidecar_hostile.py",
        "tests/convert/test_multi_target.py",
        "tests/convert/test_convert.py",
        "tests/convert/test_backends.py",
        "tests/convert/test_moe.py",
        "tests/test_python_m_mpack.py",
        "tests/test_cli_output.py",
        "tests/test_cli_interrupts.py",
        "tests/test_cli_closed_stdout.py",
        "tests/test_device_scripts.py",
        "tests/verify/test_verify_errors.py",
        "tests/hostile/test_peers_hostile.py",
        "tests/hostile/test_daemon_hostile.py",
        "tests/test_first_contact.py",
        "tests/hostile/test_push_hostile.py",
        "tests/convert/test_hub_source.py",
        "tests/test_cli_habits.py",
        "tests/test_doc_examples.py",
        "tests/test_push_hub.py",
        "tests/test_packaging.py",
        "tests/test_synth_checkpoint.py",
        "tests/hostile/test_hub_hostile.py",
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="leave out SLOW_FILES and the tests marked slow (make test-fast)",
    )
    parser.addoption(
        "--require-gpu",
        action="store_true",
        help="fail at once, rather than skip the gpu tests, when there is no CUDA device "
        "(make test-gpu)",
    )


def pytest_configure(config: pytest.Config) -> None:
    golden = _golden_dir()
    if not _is_golden(golden):
        # Once, up front, rather than as a missing file in every golden test.
        env = os.environ.get("MPACK_GOLDEN")
        fix = (
            "fix or unset MPACK_GOLDEN" if env else "restore tests/data/golden from the repository"
        )
        raise pytest.UsageError(
            f"golden data not found in {golden} (no cases/ and vectors/): {fix}"
        )
    if config.getoption("require_gpu") and not _cuda_available():
        raise pytest.UsageError(NO_GPU_MESSAGE)


def pytest_report_header(config: pytest.Config) -> str:
    return f"golden data: {_golden_dir()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--fast"):
        root = Path(str(config.rootpath))
        keep, gone = [], []
        for item in items:
            rel = Path(str(item.path)).relative_to(root).as_posix()
            (gone if rel in SLOW_FILES or item.get_closest_marker("slow") else keep).append(item)
        config.hook.pytest_deselected(items=gone)
        items[:] = keep
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run `make test-gpu` on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
