"""mpack's declared requirements and vLLM 0.33.0's can be satisfied together.

`pip install 'mpack-marlin[vllm]'` (and `pip install vllm==0.33.0 mpack-marlin`) must resolve, and
mpack must then run on the versions vLLM pins. vLLM's requirements are read from its installed
metadata (its wheel's METADATA, in .venv-vllm), mpack's from pyproject.toml: no version here is
copied by hand. Three checks: the declared ranges, pairwise and offline; this venv, where mpack
went in with its dependencies under vLLM's pins (Makefile); and pip's own resolver, run dry on
this checkout, which needs the package index.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]

#: The one requirement this venv does not meet on purpose: vLLM pins torch==2.14.0, a CUDA build
#: on Linux; the venv has the CPU build of constraints-vllm.txt (Makefile, $(VLLM_STAMP)).
NOT_INSTALLED_AT_VLLMS_PIN = {"torch"}


def _active(reqs: list[str], extras: tuple[str, ...] = ("",)) -> list[Requirement]:
    """The requirements that apply here, for a plain install plus ``extras``."""
    out = []
    for text in reqs:
        r = Requirement(text)
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
            out.append(r)
    return out


def mpack_requirements(extra: str | None = "vllm") -> list[Requirement]:
    """What `pip install 'mpack-marlin[vllm]'` asks for, from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"])
    if extra:
        reqs += project["optional-dependencies"][extra]
    return _active(reqs)


def vllm_requirements() -> list[Requirement]:
    """What the installed vLLM declares for a plain install (no extras), markers applied."""
    return _active(metadata.requires("vllm") or [])


def _installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def _candidates(*reqs: Requirement) -> set[Version]:
    """Versions worth trying against both sides: each version a specifier names, one just above
    it (a component more, the last one bumped), 0, and the installed one."""
    out = {Version("0")}
    for r in reqs:
        for spec in r.specifier:
            try:
                v = Version(spec.version.removesuffix(".*"))
            except InvalidVersion:
                continue
            rel = v.release
            out |= {v, Version(".".join(map(str, (*rel, 1))))}
            out.add(Version(".".join(map(str, (*rel[:-1], rel[-1] + 1)))))
        if (v := _installed(r.name)) is not None:
            out.add(v)
    return out


def disagreements(ours: list[Requirement], theirs: list[Requirement]) -> list[str]:
    """Each project both lists for which no candidate version satisfies both specifiers."""
    by_name: dict[str, list[Requirement]] = {}
    for t in theirs:
        by_name.setdefault(canonicalize_name(t.name), []).append(t)
    bad = []
    for r in ours:
        for t in by_name.get(canonicalize_name(r.name), []):
            if not r.specifier or not t.specifier:
                continue  # no range on one side: the other alone decides
            if not any(
                r.specifier.contains(v, prereleases=True)
                and t.specifier.contains(v, prereleases=True)
                for v in _candidates(r, t)
            ):
                bad.append(f"{r.name}: mpack wants {r.specifier}, vLLM {t.specifier}")
    return bad


def test_the_installed_vllm_is_the_one_mpack_names() -> None:
    """The metadata read below is that of the vLLM that mpack's `vllm` extra pins."""
    (pin,) = [r for r in mpack_requirements() if canonicalize_name(r.name) == "vllm"]
    installed = _installed("vllm")
    assert installed is not None and pin.specifier.contains(installed), (pin, installed)


def test_declared_requirements_agree() -> None:
    """Every project mpack and vLLM both require has a version that both admit."""
    theirs = vllm_requirements()
    shared = {canonicalize_name(r.name) for r in theirs} & {
        canonicalize_name(r.name) for r in mpack_requirements()
    }
    assert {"compressed-tensors", "torch"} <= shared, shared  # the check compares something
    bad = disagreements(mpack_requirements(), theirs)
    assert not bad, "mpack's requirements exclude vLLM 0.33.0's: " + "; ".join(bad)


def test_this_venv_is_mpack_on_vllms_pins() -> None:
    """mpack went into this venv with its dependencies: each is installed in a version mpack
    admits, and each that vLLM also requires (torch aside) in a version vLLM admits. So the tests
    run here (Makefile, VLLM_PINNED_TESTS) test mpack on vLLM's pins."""
    theirs = {canonicalize_name(r.name): r for r in vllm_requirements()}
    problems = []
    for r in mpack_requirements(extra=None):
        name = canonicalize_name(r.name)
        v = _installed(name)
        if v is None or not r.specifier.contains(v, prereleases=True):
            problems.append(f"{r.name} {v or 'not installed'}: mpack wants {r}")
        elif (
            name in theirs
            and name not in NOT_INSTALLED_AT_VLLMS_PIN
            and not theirs[name].specifier.contains(v, prereleases=True)
        ):
            problems.append(f"{r.name} {v}: vLLM wants {theirs[name]}")
    assert not problems, problems


# pip's messages when it cannot reach the index (no network on this machine, the GPU box).
_OFFLINE = (
    "Failed to establish a new connection",
    "Name or service not known",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
    "Read timed out",
)


@pytest.mark.slow
def test_pip_resolves_mpack_with_vllm(tmp_path: Path) -> None:
    """pip's real resolver, dry, as in a fresh venv: `pip install '<this checkout>[vllm]'`, the
    same requirements as `pip install vllm==0.33.0 mpack-marlin`.

    fast-deps: the resolver reads each wheel's METADATA through HTTP range requests. On pypi.org
    pip fetches only the metadata files anyway (PEP 658); an index without them (this machine's)
    would otherwise send every wheel whole: torch 2.14.0 and its CUDA wheels, 2.2 GB a run here
    against 84 MB, for the same resolution."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--use-feature=fast-deps",
        "--timeout",
        "20",
        "--retries",
        "1",
        "--report",
        str(report),
        f"{REPO}[vllm]",
    ]
    r = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=tmp_path
    )
    out = r.stdout
    if r.returncode != 0 and "ResolutionImpossible" not in out and any(s in out for s in _OFFLINE):
        pytest.skip("the package index is not reachable: " + out.strip().splitlines()[-1])
    lines = [line for line in out.splitlines() if not line.startswith("WARNING:")]
    first_error = next((i for i, line in enumerate(lines) if line.startswith("ERROR:")), -20)
    assert r.returncode == 0, "\n".join(lines[first_error:])  # pip's account of the conflict
    got = {
        canonicalize_name(i["metadata"]["name"]): (Version(i["metadata"]["version"]), i)
        for i in json.loads(report.read_text())["install"]
    }
    mpack_version, item = got["mpack-marlin"]
    assert item["download_info"]["url"] == REPO.as_uri()  # this checkout, not an index's
    assert got["vllm"][0] == _installed("vllm")
    for req in vllm_requirements() + mpack_requirements():
        name = canonicalize_name(req.name)
        if name in got:
            assert req.specifier.contains(got[name][0], prereleases=True), (req, got[name][0])
