"""The device scripts (scripts/device_*.sh), on the CPU: every Python entry point they start
imports what it needs under the environment they give it, and the wheels they install come
from one list, which ``make device-wheels`` downloads.

The environment is scripts/device_python_env.sh's (``PYTHONSAFEPATH=1``, which keeps a script's
own folder off ``sys.path``: ``RUN=tokens`` once failed on the GPU machine with
``No module named 'benchutil'``). Each entry point is started as its device script starts it:
that file sourced, from the tree's root, ``python3`` with the script's flags (``-P``), here this
venv's interpreter under that name; ``PYTHONPATH`` is the one this test runs with where it has
one (on the GPU machine, under device_env.sh: ``$SITE``), else an empty folder (mpack comes from
this venv). ``--help`` proves the imports: a test below keeps
every import of a module beside the scripts at module level, where ``--help`` runs it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
ENV_SH = "scripts/device_python_env.sh"
WHEELS = "scripts/device_wheels.txt"
#: ``python3 [-P] scripts/NAME.py`` in a device script.
_CALL = re.compile(r"\bpython3((?:\s+-[A-Za-z])*)\s+(scripts/[\w/]+\.py)\b")


def device_scripts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(SCRIPTS.glob("device_*.sh"))}


def entry_points() -> list[tuple[str, str, tuple[str, ...], bool]]:
    """``(device script, entry point, interpreter flags, PYTHONPATH set)`` of every Python script
    a device script starts; ``PYTHONPATH set``: it sources device_env.sh (``$SITE``)."""
    found = []
    for name, text in device_scripts().items():
        with_site = "device_env.sh" in text and name != "device_env.sh"
        for m in _CALL.finditer(text):
            found.append((name, m.group(2), tuple(m.group(1).split()), with_site))
    return sorted(set(found))


def test_the_entry_points_are_found() -> None:
    """The parse sees the scripts each device script runs (the two that regressed included)."""
    got = {(d, s) for d, s, _, _ in entry_points()}
    for want in [
        ("device_vllm.sh", "scripts/vllm_engine.py"),
        ("device_vllm.sh", "scripts/vllm_gpu.py"),
        ("device_bench_vs_tools.sh", "scripts/bench_vs_tools.py"),
        ("device_multi_target.sh", "scripts/bench_multi_target.py"),
    ]:
        assert want in got, got
    assert ("device_multi_target.sh", "scripts/bench_multi_target.py", ("-P",), True) in set(
        entry_points()
    )


def test_one_file_sets_the_python_environment() -> None:
    """Every device script that starts Python sources device_python_env.sh (itself, or through
    device_env.sh), and none sets PYTHONSAFEPATH on its own."""
    for name, text in device_scripts().items():
        if name == "device_python_env.sh":
            continue
        assert "PYTHONSAFEPATH=" not in text, name
        if "python3" in text:
            assert ENV_SH in text or "device_env.sh" in text, name


@pytest.fixture(scope="module")
def python3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``python3``: this venv's interpreter (a wrapper: a symbolic link to a venv's
    interpreter from elsewhere loses the venv)."""
    d = tmp_path_factory.mktemp("bin")
    (d / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (d / "python3").chmod(0o755)
    return d


@pytest.mark.parametrize("device, script, flags, with_site", entry_points(), ids=str)
def test_each_entry_point_imports_under_the_device_environment(
    device: str, script: str, flags: tuple[str, ...], with_site: bool, python3: Path, tmp_path
) -> None:
    site = os.environ.get("PYTHONPATH") or tmp_path / "site"  # under device_env.sh: $SITE
    Path(site).mkdir(exist_ok=True)
    env = {"PATH": f"{python3}:/usr/bin:/bin", "HOME": str(tmp_path)}
    start = f'source {ENV_SH} "$1"; shift; exec "$@"'
    cmd = ["bash", "-c", start, "_", str(site) if with_site else "", "python3", *flags]
    p = subprocess.run(
        [*cmd, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and "usage" in p.stdout.lower(), f"{device}: {script}\n{p.stderr}"
    probe = "import os, sys; print(os.environ.get('PYTHONSAFEPATH'), sys.flags.safe_path)"
    p = subprocess.run([*cmd, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.stdout.split() == ["1", "True"], p.stderr  # the environment the device gives


def _local_modules() -> set[str]:
    """What a script imports from beside itself: scripts/ and tests/vllm/ (vllm_gpu.py's)."""
    names = {p.stem for d in (SCRIPTS, ROOT / "tests" / "vllm") for p in d.glob("*.py")}
    return names | {p.parent.name for p in SCRIPTS.glob("*/__init__.py")}


@pytest.mark.parametrize("script", sorted({s for _, s, _, _ in entry_points()}))
def test_local_imports_are_at_module_level(script: str) -> None:
    """A module beside the scripts imported inside a function would fail only when that function
    runs (vllm_engine.py's ``tokens``, on the GPU machine), never under ``--help``."""
    local = _local_modules()
    late = []
    for fn in ast.walk(ast.parse((ROOT / script).read_text())):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            late += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in local]
    assert not late, f"{script} imports these inside a function:\n" + "\n".join(late)


# --- the wheels ---------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed_wheels() -> dict[str, str]:
    """scripts/device_wheels.txt: normalised name -> pinned version."""
    pins = {}
    for line in (ROOT / WHEELS).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and re.fullmatch(r"[A-Za-z0-9][\w.-]*", name), line
        key = _norm(name)
        assert key not in pins, f"{name} listed twice"
        pins[key] = version
    return pins


def test_the_wheels_installed_are_those_downloaded() -> None:
    """One list: device_env.sh installs it from .device/wheels, device_wheels.sh (``make
    device-wheels``) downloads it there, and no device script installs anything else from it."""
    texts = device_scripts()
    installs = [
        line
        for text in texts.values()
        for line in text.splitlines()
        if "pip install" in line and ".device/wheels" in line
    ]
    assert installs, "no device script installs from .device/wheels"
    for line in installs:
        assert f"-r {WHEELS}" in line and "--no-index" in line and "--no-deps" in line, line
        assert ".whl" not in line, line  # a wheel in the folder but not in the list stays there
    download = (SCRIPTS / "device_wheels.sh").read_text()
    assert re.search(rf"pip download .*-r {re.escape(WHEELS)}", download.replace("\\\n", " "))
    for word in ("--only-binary=:all:", "--python-version 3.12", "manylinux2014", '"$dest"'):
        assert word in download, word
    assert ".device/wheels" in download
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^device-wheels:\n\t.*bash scripts/device_wheels\.sh", make, re.M)


def test_the_list_covers_mpacks_dependencies() -> None:
    """Every dependency of mpack (and of its cuda extra, and what the GPU suite imports besides
    transformers) is listed, but torch and numpy, whose GPU builds the device's image has; the
    device's transformers requires huggingface_hub below 2."""
    pins = listed_wheels()
    toml = (ROOT / "pyproject.toml").read_text()  # no tomllib: it is 3.11+, mpack takes 3.10
    lists = [
        re.search(rf"^{key} = \[(.*?)\]", toml, re.M | re.S) for key in ("dependencies", "cuda")
    ]
    wanted = [r for m in lists if m for r in re.findall(r'^\s*"([^"]+)"', m.group(1), re.M)]
    assert all(lists) and len(wanted) >= 8, wanted  # the parse found both lists
    wanted += ["pytest", "jsonschema"]
    names = {_norm(re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0]) for r in wanted}
    missing = sorted(names - {"torch", "numpy"} - set(pins))
    assert not missing, f"{WHEELS} lacks {missing}"
    assert int(pins["huggingface-hub"].split(".")[0]) < 2


# --- checkpoints in pieces (device_vllm.sh PHASE=data) -----------------------------------------


def _load_script(name: str):  # noqa: ANN202
    import importlib.util

    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPTS))


def _data_call(
    root: Path, tmp_path: Path, *pieces: str, vdata: str = "vdata"
) -> subprocess.CompletedProcess[str]:
    """One PHASE=data call whose tree holds ``pieces`` (of root/all), as the device keeps what
    earlier calls left beside what this one carries."""
    import shutil

    dev = root / ".vllmdev" / "data"
    shutil.rmtree(dev, ignore_errors=True)
    for p in pieces:
        shutil.copytree(root / "all" / p, dev / p)
    env = {
        "PATH": "/usr/bin:/bin",
        "PHASE": "data",
        "OUT": str(tmp_path / "out"),
        "VDATA": str(tmp_path / vdata),
        "REAL_DIR": str(tmp_path / "real"),
    }
    return subprocess.run(
        ["bash", "scripts/device_vllm.sh"], cwd=root, env=env, capture_output=True, text=True
    )


def test_checkpoints_travel_in_pieces_and_unpack_once_all_came(tmp_path: Path) -> None:
    """scripts/vllm_pack.py cuts an archive into pieces; device_vllm.sh PHASE=data unpacks it
    only when every piece has come (in any order, an earlier call's pieces still in the tree),
    after checking the whole archive's digest; a corrupt piece is refused."""
    import tarfile

    src = tmp_path / "src" / "fp8-dynamic"
    src.mkdir(parents=True)
    payload = os.urandom(5000)
    (src / "model.safetensors").write_bytes(payload)
    archive = tmp_path / "ck.tar.xz"
    with tarfile.open(archive, "w:xz") as t:
        t.add(src, arcname="fp8-dynamic")
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    for f in ("device_vllm.sh", "device_python_env.sh"):
        (root / "scripts" / f).write_text((SCRIPTS / f).read_text())
    n = _load_script("vllm_pack").cut_pieces(archive.read_bytes(), 1500, root / "all", "ck")
    assert n == -(-archive.stat().st_size // 1500) and n >= 3
    names = sorted(p.name for p in (root / "all").iterdir())
    real = tmp_path / "real" / "fp8-dynamic" / "model.safetensors"
    r = _data_call(root, tmp_path, names[-1])
    assert r.returncode == 0 and f"ck: 1 of {n} pieces" in r.stdout, r.stderr
    r = _data_call(root, tmp_path, names[-1], *names[:-2])  # all but one
    assert r.returncode == 0 and f"{n - 1} of {n}" in r.stdout and not real.exists(), r.stderr
    r = _data_call(root, tmp_path, names[-2])
    assert r.returncode == 0, r.stdout + r.stderr
    assert real.read_bytes() == payload
    real.unlink()  # a later call that still holds the pieces does not unpack them again
    r = _data_call(root, tmp_path, *names)
    assert r.returncode == 0 and not real.exists(), r.stdout + r.stderr

    bad = root / "all" / names[0] / "piece"
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    r = _data_call(root, tmp_path, *names, vdata="vdata-2")
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr, r.stdout
