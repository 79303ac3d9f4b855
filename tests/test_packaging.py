"""The package as built and the Makefile's test targets.

A wheel built from the tree is the `mpack-marlin` distribution (the command and the import name
stay `mpack`), builds without warnings, installs into a fresh venv and runs `mpack --help`.
`make test-gpu` on a machine without a CUDA device fails with a clear message, while a plain
pytest run skips the GPU tests with a reason.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import mpack
from tests.conftest import NO_GPU_MESSAGE, REPO

DIST_NAME = "mpack-marlin"
# A CPU-only view of the machine, GPU box included: torch.cuda.is_available() is False under it.
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
GPU_MODULE = "tests/runtime/test_cuda_vmm.py"  # every test in it is marked gpu
# Where convert/cuda_repack.py's kernel_source_path() looks in an installed wheel.
KERNEL_SOURCE = "mpack/cuda/marlin_repack.cu"


# Not copied for the build: hidden folders (.git, venvs, caches, carried data) and earlier
# outputs. A stale build/ would put files into the wheel that the tree no longer has.
NOT_SOURCE = shutil.ignore_patterns(".*", "__pycache__", "build", "dist", "*.egg-info", "demo-out")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built from a copy of the tree (without build outputs), and the build's whole
    output (pip -v shows the backend's)."""
    dist = tmp_path_factory.mktemp("dist")
    tree = tmp_path_factory.mktemp("tree") / "src"
    shutil.copytree(REPO, tree, ignore=NOT_SOURCE)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(dist),
            str(tree),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:]
    (wheel,) = dist.glob("*.whl")
    return wheel, r.stdout


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (member,) = [m for m in z.namelist() if m.endswith(f".dist-info/{name}")]
        return z.read(member).decode()


@pytest.mark.slow
def test_wheel_is_mpack_marlin_with_the_mpack_command(built: tuple[Path, str]) -> None:
    wheel, _ = built
    assert wheel.name.startswith("mpack_marlin-"), wheel.name
    meta = _dist_info(wheel, "METADATA")
    assert re.search(r"^Name: mpack-marlin$", meta, re.M), meta[:500]
    assert re.search(r"^License-Expression: Apache-2\.0$", meta, re.M), meta[:500]
    scripts = _dist_info(wheel, "entry_points.txt")
    assert re.search(r"^\[console_scripts\]\nmpack = mpack\.cli:main$", scripts, re.M), scripts
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {m.split("/")[0] for m in names if not m.split("/")[0].endswith(".dist-info")}
    assert tops == {"mpack"}, tops  # no top-level `cuda`: it would meet cuda-bindings' namespace
    assert KERNEL_SOURCE in names, sorted(n for n in names if "cuda" in n)


@pytest.mark.slow
def test_the_build_warns_about_nothing(built: tuple[Path, str]) -> None:
    """setuptools' warnings (e.g. the `project.license` table form, refused after 2027-02-18)
    would be the first sign of a build that stops working."""
    _, out = built
    warned = [line for line in out.splitlines() if re.search(r"\b[A-Z]\w*Warning\b", line)]
    assert not warned, "\n".join(warned)
    assert "project.license" not in out


@pytest.mark.slow
def test_wheel_in_fresh_venv(built: tuple[Path, str], tmp_path: Path) -> None:
    wheel, _ = built
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    fresh_site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    # The dependencies (torch & co.) come from this interpreter's site-packages, appended after the
    # fresh venv's own; mpack itself only from the wheel, unpacked with this pip into the venv.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(fresh_site),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = subprocess.check_output(
        [str(py), "-c", "import mpack, mpack.convert.marlin, mpack.runtime; print(mpack.__file__)"],
        text=True,
        cwd=tmp_path,  # not the repo root, whose ./mpack would shadow the wheel
    )
    assert where.startswith(str(fresh_site)), where
    version = subprocess.check_output(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version({DIST_NAME!r}))"],
        text=True,
        cwd=tmp_path,
    )
    assert version.strip() == mpack.__version__  # pyproject.toml reads it from there
    r = subprocess.run(
        [str(py), "-m", "mpack.cli", "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0 and "layout" in r.stdout, r.stderr
    src = subprocess.check_output(
        [
            str(py),
            "-c",
            "from mpack.convert.cuda_repack import kernel_source_path as k; "
            "p = k(); print(p if p.is_file() else 'missing: ' + str(p))",
        ],
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "MPACK_REPACK_SOURCE"},
    )
    assert src.strip() == str(fresh_site / KERNEL_SOURCE), src
    script = fresh_site / "bin" / "mpack"
    assert script.exists(), "the wheel must declare the `mpack` console script"


# --- make test-gpu without a GPU ------------------------------------------------------------


def _python() -> list[str]:
    """This interpreter, with its -P (the GPU box imports the installed mpack, not ./mpack)."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else [])]


def _env() -> dict[str, str]:
    # Not the variables of a `make test` around this run: they would reach the inner make.
    drop = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ARGS", "SYSTEM_PYTHON")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **NO_GPU_ENV}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_gpu_fails_without_a_gpu() -> None:
    r = subprocess.run(
        [
            "make",
            "-s",
            "test-gpu",
            f"SYSTEM_PYTHON={' '.join(_python())}",
            f"PYTEST_ARGS=-p no:cacheprovider {GPU_MODULE}",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert NO_GPU_MESSAGE in out, out
    assert "passed" not in out and "skipped" not in out, out  # it stopped before any test


@pytest.mark.slow
def test_without_the_option_gpu_tests_skip_with_a_reason() -> None:
    r = subprocess.run(
        [
            *_python(),
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            GPU_MODULE,
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"^\d+ skipped(, \d+ deselected)? in ", out, re.M), out  # none ran
    assert "needs a CUDA device: run `make test-gpu` on a GPU machine" in out, out


# --- README: the environment variables --------------------------------------------------------

READS_ENV = re.compile(
    r"""(?:environ\.get|getenv|environ\[|env_flag|env_number)\(?\s*["'](MPACK_\w+)["']"""
)


def _variables_the_code_reads() -> set[str]:
    """Every ``MPACK_*`` variable the library and the test suite's conftest read."""
    code = [p for d in ("mpack", "convert", "runtime", "verify") for p in (REPO / d).rglob("*.py")]
    code.append(REPO / "tests" / "conftest.py")
    read = {v for p in code for v in READS_ENV.findall(p.read_text())}
    from mpack.convert.backends import SWITCHES  # read through env_flag(var), by name there

    read |= set(SWITCHES.values())
    assert {"MPACK_DEBUG", "MPACK_GOLDEN"} <= read, read  # the scan itself works
    return read


def test_help_lists_every_mpack_variable_the_code_reads() -> None:
    """``mpack --help`` ends with ``cli.ENVIRONMENT``: the same variables as the README."""
    from mpack.cli import ENVIRONMENT

    listed = [k.split("=", 1)[0] for k in ENVIRONMENT]
    read = _variables_the_code_reads()
    assert set(listed) == read, f"--help lists {sorted(listed)}, the code reads {sorted(read)}"


def test_readme_lists_every_mpack_variable_the_code_reads() -> None:
    read = _variables_the_code_reads()
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(MPACK_\w+)", section, re.M)
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == read, f"README lists {sorted(listed)}, the code reads {sorted(read)}"


def test_the_index_page_installs_every_extra() -> None:
    """docs/PYPI.md, the page the index shows, has an install line for each extra a user picks
    (``cuda`` for ``--device cuda``, ``vllm`` for ``--load-format mpack``; not ``dev``)."""
    toml = (REPO / "pyproject.toml").read_text()  # no tomllib: it is 3.11+, mpack takes 3.10
    section = toml.split("\n[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = [e for e in re.findall(r"^(\w+) = \[", section, re.M) if e != "dev"]
    assert {"cuda", "vllm"} <= set(extras), extras
    page = (REPO / "docs" / "PYPI.md").read_text()
    for extra in extras:
        assert re.search(rf"^pip install '{DIST_NAME}\[{extra}\]' +# ", page, re.M), extra
