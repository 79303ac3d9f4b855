"""`python -m mpack` from any directory, with any install (Note [checkout on sys.path] in
mpack/_checkout.py).

A copy of the checkout, named ``mpack`` as a clone of it is, is installed into fresh venvs: once
as a regular install, once editable, once not at all (its dependencies only). Each runs
``python -m mpack --version`` and a tiny conversion from the clone's root (where ``./mpack`` is
the checkout's core package), from the directory above it (where the clone itself looks like a
namespace package ``mpack``) and from elsewhere. The dependencies (torch & co.) come from this
interpreter's site-packages, listed in a ``.pth`` file; mpack itself only from the install.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import mpack
from mpack.fixtures import make_checkpoint
from tests.conftest import REPO
from tests.convert.helpers import cli_env

#: Not copied: hidden folders (.git, venvs), build outputs, the native build of the checkout
#: (each install builds its own), and the tests (16 MB of golden data).
NOT_SOURCE = shutil.ignore_patterns(
    ".*", "__pycache__", "build", "dist", "*.egg-info", "*.so", "demo-out", "tests"
)


def _venv(where: Path, clone: Path, install: list[str] | None) -> Path:
    """A venv at ``where`` that sees this interpreter's packages, with ``clone`` installed by
    ``pip install --no-deps INSTALL... clone`` (None: not installed)."""
    venv.EnvBuilder(with_pip=False).create(where)
    py = where / "bin" / "python"
    purelib = subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
    ).strip()
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    if install is not None:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(py),
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                *install,
                str(clone),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return py


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("python-m")
    clone = root / "parent" / "mpack"
    shutil.copytree(REPO, clone, ignore=NOT_SOURCE)
    return {
        "clone": clone,
        "elsewhere": (root / "elsewhere").resolve(),
        "ck": make_checkpoint(root / "ck", arch="llama", scheme="FP8", layers=1),
        "out": root / "out",
        "regular": _venv(root / "regular", clone, []),
        "editable": _venv(root / "editable", clone, ["-e"]),
        "none": _venv(root / "none", clone, None),
    }


def _where(world: dict[str, Path], name: str) -> Path:
    return {"root": world["clone"], "parent": world["clone"].parent}.get(name) or world[name]


def _run(world: dict[str, Path], install: str, cwd: str, *args: str) -> subprocess.CompletedProcess:
    where = _where(world, cwd)
    where.mkdir(exist_ok=True)
    return subprocess.run(
        [str(world[install]), *args],
        capture_output=True,
        text=True,
        cwd=where,
        env=cli_env(),
        timeout=300,
    )


CASES = [(i, d) for i in ("regular", "editable") for d in ("root", "parent", "elsewhere")]
CASES += [("none", "root"), ("none", "parent")]  # elsewhere, there is no mpack to run


@pytest.mark.slow
@pytest.mark.parametrize("install, cwd", CASES)
def test_python_m_mpack_runs_and_converts(world, install: str, cwd: str) -> None:
    v = _run(world, install, cwd, "-m", "mpack", "--version")
    assert (v.returncode, v.stderr) == (0, "")
    assert v.stdout.splitlines()[0] == f"mpack {mpack.__version__}"  # then the environment report
    out = world["out"] / f"{install}-{cwd}"
    r = _run(
        world,
        install,
        cwd,
        "-m",
        "mpack",
        "convert",
        str(world["ck"]),
        "-o",
        str(out),
        "--device",
        "cpu",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["out"] == str(out)


@pytest.mark.slow
@pytest.mark.parametrize("install", ["regular", "editable", "none"])
def test_the_readme_host_repack_check_from_the_clone_root(world, install: str) -> None:
    """The README's ``python -c "from mpack.convert import host_repack; ..."``, run in the
    checkout's root: it answers for the mpack that runs there (the installed one, if any)."""
    code = (
        "import mpack.convert\n"
        "from mpack.convert import host_repack\n"
        "print(host_repack.available(), mpack.convert.__file__)\n"
    )
    r = _run(world, install, "root", "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    available, where = r.stdout.split()
    assert available in ("True", "False")
    inside_clone = Path(where).is_relative_to(world["clone"])
    assert inside_clone is (install != "regular"), where  # a regular install runs itself
