"""A wheel built from the tree installs into a fresh venv and runs `mpack --help`."""

from __future__ import annotations

import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.slow
def test_wheel_in_fresh_venv(tmp_path: Path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("mpack-*.whl")
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
    r = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "mpack.cli", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "layout" in r.stdout, r.stderr
    script = fresh_site / "bin" / "mpack"
    assert script.exists(), "the wheel must declare the `mpack` console script"
