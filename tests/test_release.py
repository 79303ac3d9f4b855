"""The release files, as a user gets them: `python -m build` and `pip install` into a fresh venv.

One build per module, as `make dist` and the release workflow make it: the sdist, then a wheel
built from the sdist (so a file the sdist lacks fails the wheel, not a later user). One fresh venv
per module (torch first, the CPU build, then the wheel with its dependencies, pinned by
constraints.txt), shared by the tests below: the install is most of this module's time.
From a directory outside the checkout, that venv converts the demo checkpoint, verifies the
sidecar, and shows what the metadata promises: the vLLM plugin entry point, the native repack,
the licence file, the project URLs. Last, the release workflow (.github/workflows/release.yml)
passes actionlint and zizmor, and `make lint` runs both on it.
"""

from __future__ import annotations

import email
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import mpack
from tests.conftest import REPO

NAME = f"mpack_marlin-{mpack.__version__}"
URL = "https://github.com/mpack-marlin/mpack"
# LICENSE is the Apache License 2.0 as published, unmodified: apache.org's LICENSE-2.0.txt
# (sha256 cfc7749b..., Debian's /usr/share/common-licenses/Apache-2.0) less its first, blank line,
# as GitHub and most wheels carry it.
APACHE_2_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"

# Not copied for the build: hidden folders (.git, venvs, caches) and earlier build outputs.
NOT_SOURCE = shutil.ignore_patterns(
    ".*", "__pycache__", "build", "dist", "*.egg-info", "*.so", "demo-out"
)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """The sdist and the wheel built from it, from a copy of the tree, and the build's output.
    Without build isolation: this venv's setuptools, no download (`make dist` isolates)."""
    tree = tmp_path_factory.mktemp("tree") / "src"
    shutil.copytree(REPO, tree, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    r = _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "log": r.stdout}


@pytest.fixture(scope="module")
def venv_py(built: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed as a user installs it (pip's cache is reused)."""
    env_dir = tmp_path_factory.mktemp("release") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    # A current pip: the one the venv comes with may predate License-Expression in `pip show`.
    r = _run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    r = _run(
        [
            "bash",
            str(REPO / "scripts" / "install_torch.sh"),
            str(py),
            str(REPO / "constraints.txt"),
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    r = _run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "-c",
            str(REPO / "constraints.txt"),
            str(built["wheel"]),
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    return py


def _outside_env() -> dict[str, str]:
    """The environment for the venv's processes: nothing that points back into the checkout."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MPACK_REPACK_SOURCE", "MPACK_GOLDEN"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "HF_HUB_OFFLINE": "1"}


def _in_venv(py: Path, code: str, cwd: Path) -> str:
    r = _run([str(py), "-c", code], cwd=cwd, env=_outside_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    return r.stdout


# --- the files --------------------------------------------------------------------------------


@pytest.mark.slow
def test_sdist_holds_what_the_build_and_the_tests_need(built: dict) -> None:
    with tarfile.open(built["sdist"]) as t:
        names = {n.removeprefix(f"{NAME}/") for n in t.getnames()}
    need = {
        "setup.py",
        "pyproject.toml",
        "MANIFEST.in",
        "LICENSE",
        "README.md",
        "docs/PYPI.md",
        "convert/_repack.c",
        "cuda/marlin_repack.cu",
        "Makefile",
        "constraints.txt",
        "scripts/install_torch.sh",
        "docs/FORMAT.md",
    }
    assert need <= names, sorted(need - names)
    # Every file of the test suite, its data (tests/data: the golden cases) included.
    tests = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "tests").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")
    }
    assert tests - names == set(), sorted(tests - names)[:20]
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
    # `python -m build` made the wheel from the sdist, not from the tree.
    assert "Building wheel from sdist" in built["log"], built["log"][-2000:]


@pytest.mark.slow
def test_twine_check_passes(built: dict) -> None:
    """What the index checks on upload: the metadata and that the long description renders."""
    r = _run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            str(built["sdist"]),
            str(built["wheel"]),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout
    assert r.stdout.count("PASSED") == 2, r.stdout


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        return email.message_from_bytes(z.read(f"{NAME}.dist-info/METADATA"))


@pytest.mark.slow
def test_long_description_is_the_index_page_with_absolute_links(built: dict) -> None:
    meta = _wheel_metadata(built["wheel"])
    assert meta["Description-Content-Type"] == "text/markdown"
    body = meta.get_payload()
    assert body.strip() == (REPO / "docs" / "PYPI.md").read_text().strip()
    targets = re.findall(r"\]\(([^)]+)\)", body)
    assert targets, "the page links to the repository"
    assert [t for t in targets if not t.startswith("https://")] == [], targets
    # It is the index's page of a published release: it installs from the index, with the vLLM
    # extra, and says nothing that is true only before the first upload.
    assert "pip install mpack-marlin " in body and "pip install 'mpack-marlin[vllm]'" in body
    assert not re.search(r"no release|finds nothing|until one is", body, re.I), body


@pytest.mark.slow
def test_wheel_carries_the_licence_urls_and_authors(built: dict) -> None:
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
    with zipfile.ZipFile(built["wheel"]) as z:
        licence = z.read(f"{NAME}.dist-info/licenses/LICENSE")
    assert licence == (REPO / "LICENSE").read_bytes()
    meta = _wheel_metadata(built["wheel"])
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["Author"] == "mpack developers"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Homepage"] == URL and urls["Issues"] == f"{URL}/issues", urls


# --- the wheel, installed ---------------------------------------------------------------------


@pytest.mark.slow
def test_installed_wheel_converts_from_outside_the_checkout(venv_py: Path, tmp_path: Path) -> None:
    """The demo conversion with the venv's own `mpack`, in a directory that is not the checkout
    (whose ./mpack would shadow the installed package)."""
    env = _outside_env()
    where = _in_venv(venv_py, "import mpack; print(mpack.__file__)", tmp_path)
    assert where.startswith(str(venv_py.parent.parent)), where
    mpack = str(venv_py.parent / "mpack")
    steps = [
        [
            str(venv_py),
            "-m",
            "mpack.fixtures",
            str(tmp_path / "tiny"),
            "--arch",
            "llama",
            "--scheme",
            "FP8",
        ],
        [mpack, "convert", str(tmp_path / "tiny"), "-o", str(tmp_path / "out"), "--tp", "2"],
        [mpack, "verify", str(tmp_path / "out")],
    ]
    for cmd in steps:
        r = _run(cmd, cwd=tmp_path, env=env, timeout=600)
        assert r.returncode == 0, (cmd, r.stdout[-3000:])
    files = {p.name for p in (tmp_path / "out").iterdir()}
    want = {
        "mpack.json",
        "rank-00-of-02.safetensors",
        "rank-01-of-02.safetensors",
        "common.safetensors",
    }
    assert want <= files, files
    assert "byte-identical" in r.stdout, r.stdout


@pytest.mark.slow
def test_installed_metadata_entry_point_and_native_repack(venv_py: Path, tmp_path: Path) -> None:
    out = _in_venv(
        venv_py,
        """if True:
        import importlib.metadata as m, json
        from mpack.convert import host_repack
        import mpack.convert._repack as native
        d = m.distribution("mpack-marlin")
        print(json.dumps({
            "plugins": {e.name: e.value for e in m.entry_points(group="vllm.general_plugins")},
            "native": host_repack.available(),
            "native_file": native.__file__,
            "licence": [str(f) for f in d.files if f.name == "LICENSE"],
            "licence_text": [f.locate().read_text() for f in d.files if f.name == "LICENSE"][0],
            "urls": d.metadata.get_all("Project-URL"),
        }))
        """,
        tmp_path,
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert got["plugins"] == {"mpack": "mpack.runtime.vllm:register"}, got["plugins"]
    assert got["native"] is True
    assert got["native_file"].startswith(str(venv_py.parent.parent)), got["native_file"]
    assert got["licence"] == [f"{NAME}.dist-info/licenses/LICENSE"], got["licence"]
    assert got["licence_text"] == (REPO / "LICENSE").read_text()
    assert f"Repository, {URL}" in got["urls"], got["urls"]
    # What `pip show` prints: empty License and Home-page lines before (issue 23).
    r = _run(
        [str(venv_py), "-m", "pip", "show", "mpack-marlin"],
        cwd=tmp_path,
        env=_outside_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stdout
    assert re.search(r"^Home-page: https://github\.com/mpack-marlin/mpack$", r.stdout, re.M), (
        r.stdout
    )
    assert re.search(r"^License(-Expression)?: Apache-2\.0$", r.stdout, re.M), r.stdout


# --- the release workflow ---------------------------------------------------------------------

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def _tool(name: str) -> str:
    """A tool of the dev extra, beside this interpreter (the way `make lint` finds it)."""
    path = Path(sysconfig.get_path("scripts")) / name
    assert path.is_file(), f"{path}: missing; `pip install -e '.[dev]'` installs it"
    return str(path)


def test_release_workflow_passes_actionlint_and_zizmor() -> None:
    for cmd in (
        [_tool("actionlint"), str(WORKFLOW)],
        [_tool("zizmor"), "--offline", "--no-progress", "--persona", "pedantic", str(WORKFLOW)],
    ):
        r = _run(cmd, cwd=REPO, timeout=120)
        assert r.returncode == 0, (cmd[0], r.stdout[-3000:])


def test_make_lint_checks_the_workflows() -> None:
    r = _run(["make", "-n", "lint", f"SYSTEM_PYTHON={sys.executable}"], cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stdout
    assert re.search(r"actionlint .*\.github/workflows/release\.yml", r.stdout), r.stdout
    assert re.search(r"zizmor --offline .*\.github/workflows/release\.yml", r.stdout), r.stdout


def test_release_builds_cpython_310_to_313_on_x86_64_and_aarch64() -> None:
    # (tomllib is 3.11+; the section's `build` line is enough)
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("\n[tool.cibuildwheel]\n", 1)[1].split("\n[", 1)[0]
    build = re.search(r"^build = (.*)$", section, re.M)
    assert build and build[1] == '["cp310-*", "cp311-*", "cp312-*", "cp313-*"]', section
    text = WORKFLOW.read_text()
    arches = set(re.findall(r"^\s*- arch: (\S+)$", text, re.M))
    assert arches == {"x86_64", "aarch64"}, arches
    assert "CIBW_ARCHS_LINUX: ${{ matrix.arch }}" in text
    # The upload happens on a tag only, and with no stored password (trusted publishing).
    assert "if: github.event_name == 'push' && github.ref_type == 'tag'" in text
    assert not re.search(r"^\s*password:", text, re.M)
    assert "id-token: write" in text
