"""``--load-format mpack`` against vLLM 0.33.0's real model classes and DefaultModelLoader, on CPU.

Runs in .venv-vllm (``make test``; see the Makefile). Checkpoints and sidecars are made by the
main venv's CLI (``MPACK_MAIN_PYTHON``, default ``.venv/bin/python``): ``python -m
mpack.fixtures`` and ``python -m mpack convert``; the attached loads attach to real ``mpack serve
--device cpu`` daemons (one per sidecar and rank, in a private ``XDG_RUNTIME_DIR``). vLLM runs in
``vllm_worker.py`` processes, one per TP rank over gloo, with the CPU stand-ins of
``cpu_standins.py`` (vLLM's own Marlin preparation runs; only CUDA-only pieces are stood in).

The six cases cover every pair of: Llama (no bias) / Qwen2 (q/k/v bias), tensor / channel
weight scales, ``w8a16`` / ``w8a8-marlin``, bfloat16 / float16, TP 1 / TP 2. In each, every
parameter and buffer (name, class, shape, dtype, bytes) of the mpack loader's model equals
DefaultModelLoader's, loaded privately (``attach: never``), attached from the daemons
(``require``) and with ``auto``; attached Marlin tensors are the daemon's read-only mapping
itself. Bad inputs are refused with an mpack error naming both values before any layer is built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.rt_helpers import DaemonProc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

WORKER = HERE / "vllm_worker.py"
WORKER_TIMEOUT_S = 600
READY_TIMEOUT_S = 60


def main_python() -> str:
    """The interpreter of mpack's main venv: its CLI makes the checkpoints and sidecars."""
    p = os.environ.get("MPACK_MAIN_PYTHON")
    if p:
        path = Path(p) if Path(p).is_absolute() else REPO / p
        return str(path) if path.exists() else p  # a bare name (python3) is looked up on PATH
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@dataclass(frozen=True)
class Case:
    name: str
    arch: str  # llama: no bias; qwen2: q/k/v bias
    scheme: str  # FP8: per-tensor weight scales (static W8A8); FP8_DYNAMIC: per-channel;
    # AUTOFP8 / AUTOFP8_DYNAMIC: an AutoFP8 checkpoint (quant_method fp8, per-tensor weight
    # scales), static or dynamic activations
    profile: str
    dtype: str  # the engine's dtype, and the sidecar's act dtype
    tp: int

    @property
    def ckpt(self) -> str:
        return CKPT_OF[(self.arch, self.scheme)]


#: The multimodal wrappers of issue 38 (arch: the wrapper), one checkpoint each: its scheme and
#: the fixture's arguments. Both name layouts are covered (legacy ``language_model.model.*`` /
#: Qwen2.5-VL's original ``model.*``; transformers 4.52's ``model.language_model.*``), and the
#: language models of four families: Mistral (pixtral-12b's Llava), Mistral again (Mistral 3),
#: Qwen2 with q/k/v bias (Qwen2.5-VL), Gemma 3 (tied, q/k norms).
WRAPPER_CKPT = {
    "llava": ("FP8", ["--arch", "mistral", "--layout", "legacy", "--dtype", "bfloat16"]),
    "mistral3": ("FP8_DYNAMIC", ["--layout", "hf", "--dtype", "float16"]),
    "qwen2_5_vl": ("FP8_DYNAMIC", ["--layout", "legacy", "--dtype", "bfloat16"]),
    "gemma3": ("FP8", ["--layout", "hf", "--dtype", "bfloat16"]),
}
# (arch, scheme) -> checkpoint name; the checkpoint's own dtype is in CKPTS.
CKPT_OF = {
    ("llama", "FP8"): "llama-tensor",
    ("llama", "FP8_DYNAMIC"): "llama-channel",
    ("qwen2", "FP8"): "qwen2-tensor",
    ("qwen2", "FP8_DYNAMIC"): "qwen2-channel",
    **{
        (f, sch): f"{f}-{kind}"
        for f in ("gemma2", "granite", "phi3")
        for sch, kind in (("FP8", "tensor"), ("FP8_DYNAMIC", "channel"))
    },
    ("llama", "AUTOFP8"): "llama-autofp8-static",
    ("gemma2", "AUTOFP8_DYNAMIC"): "gemma2-autofp8-dynamic",
    ("phi3", "AUTOFP8"): "phi3-autofp8-static",
    **{(w, sch): w for w, (sch, _) in WRAPPER_CKPT.items()},
}
#: The families of issue 38, each with its real quirk: Gemma 2 with a head_dim that is not
#: hidden / heads (as gemma-2-2b's 256) and no lm_head (always tied); Granite plain; Phi-3 with
#: qkv_proj and gate_up_proj stored fused, and one KV head (K/V replicated at TP 2).
FAMILY_CKPT = {
    "gemma2": ["--arch", "gemma2", "--head-dim", "32"],
    "granite": ["--arch", "granite"],
    "phi3": ["--arch", "phi3", "--kv-heads", "1"],
}
LLAMA_TENSOR = ["--arch", "llama", "--scheme", "FP8", "--dtype", "bfloat16"]
CKPTS = {
    "llama-tensor": LLAMA_TENSOR,
    # a vocabulary of 1024, a multiple of vLLM's 64-row padding at TP 1 and 2: embeddings and
    # lm_head used in place (runtime/vllm/inplace.py); the others' 1000 pads, and is copied
    "llama-channel": [
        *("--arch", "llama", "--scheme", "FP8_DYNAMIC", "--dtype", "float16", "--vocab", "1024")
    ],
    "qwen2-tensor": ["--arch", "qwen2", "--scheme", "FP8", "--dtype", "float16"],
    "qwen2-channel": [
        *("--arch", "qwen2", "--scheme", "FP8_DYNAMIC", "--dtype", "bfloat16", "--vocab", "1024")
    ],
    # One layer fewer than llama-tensor, otherwise the same: a sidecar of another model.
    "llama-tensor-1layer": [*LLAMA_TENSOR, "--layers", "1"],
    # llama-tensor's config and shapes, other weights (a fine-tune of the same model, as far as
    # the loader can tell from anything but the bytes): Note [a sidecar is bound to its
    # checkpoint].
    "llama-tensor-seed1": [*LLAMA_TENSOR, "--seed", "1"],
    **{
        f"{f}-tensor": [*args, "--scheme", "FP8", "--dtype", "bfloat16"]
        for f, args in FAMILY_CKPT.items()
    },
    **{
        f"{f}-channel": [*args, "--scheme", "FP8_DYNAMIC", "--dtype", "float16"]
        for f, args in FAMILY_CKPT.items()
    },
    # AutoFP8 (quant_method fp8), as Mistral-7B-Instruct-v0.3-FP8 (static) and
    # gemma-2-9b-it-FP8 (dynamic) are; Phi-3's fused layers with one scale each.
    "llama-autofp8-static": ["--arch", "llama", "--autofp8", "static", "--dtype", "float16"],
    "gemma2-autofp8-dynamic": [*FAMILY_CKPT["gemma2"], "--autofp8", "dynamic"],
    "phi3-autofp8-static": [*FAMILY_CKPT["phi3"], "--autofp8", "static"],
    **{w: ["--wrapper", w, "--scheme", sch, *args] for w, (sch, args) in WRAPPER_CKPT.items()},
}

DT_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
# A pairwise covering set over (arch, scales, profile, dtype, TP).
CASES = [
    Case("llama-tensor-w8a16-bf16-tp1", "llama", "FP8", "w8a16", "bfloat16", 1),
    Case("llama-tensor-w8a16-bf16-tp2", "llama", "FP8", "w8a16", "bfloat16", 2),
    Case("llama-channel-w8a8-fp16-tp1", "llama", "FP8_DYNAMIC", "w8a8-marlin", "float16", 1),
    Case("qwen2-tensor-w8a8-fp16-tp1", "qwen2", "FP8", "w8a8-marlin", "float16", 1),
    # The checkpoint is bfloat16: the engine and the sidecar run it in float16.
    Case("qwen2-channel-w8a16-fp16-tp2", "qwen2", "FP8_DYNAMIC", "w8a16", "float16", 2),
    Case("qwen2-channel-w8a8-bf16-tp2", "qwen2", "FP8_DYNAMIC", "w8a8-marlin", "bfloat16", 2),
    # Per family, every pair of (scales, profile), (scales, TP) and (profile, TP). vLLM runs
    # Gemma 2 in bfloat16 only ("numerical instability" in float16): its float16 checkpoint too.
    *(
        Case(f"{f}-{kind}-{short}-{DT_SHORT[dt]}-tp{tp}", f, sch, prof, dt, tp)
        for f in FAMILY_CKPT
        for kind, sch, short, prof, dtype, tp in (
            ("tensor", "FP8", "w8a16", "w8a16", "bfloat16", 1),
            ("tensor", "FP8", "w8a8", "w8a8-marlin", "bfloat16", 2),
            ("channel", "FP8_DYNAMIC", "w8a8", "w8a8-marlin", "float16", 1),
            ("channel", "FP8_DYNAMIC", "w8a16", "w8a16", "float16", 2),
        )
        for dt in ["bfloat16" if f == "gemma2" else dtype]
    ),
    # AutoFP8: vLLM's Fp8LinearMethod runs it weight-only on Marlin (w8a16), static and dynamic
    # activations alike, on any GPU (the sm 9.0 stand-in of w8a8-marlin would not change that).
    Case("llama-autofp8-static-w8a16-fp16-tp1", "llama", "AUTOFP8", "w8a16", "float16", 1),
    Case(
        "gemma2-autofp8-dynamic-w8a16-bf16-tp2", "gemma2", "AUTOFP8_DYNAMIC", "w8a16", "bfloat16", 2
    ),
    Case("phi3-autofp8-static-w8a16-bf16-tp2", "phi3", "AUTOFP8", "w8a16", "bfloat16", 2),
    # The wrappers: each profile and each TP twice, the vision tower and projector passed
    # through (and compared like every other parameter).
    Case("llava-mistral-tensor-w8a16-bf16-tp1", "llava", "FP8", "w8a16", "bfloat16", 1),
    Case(
        "mistral3-hf-channel-w8a8-fp16-tp2", "mistral3", "FP8_DYNAMIC", "w8a8-marlin", "float16", 2
    ),
    Case("qwen2_5_vl-channel-w8a16-bf16-tp2", "qwen2_5_vl", "FP8_DYNAMIC", "w8a16", "bfloat16", 2),
    Case("gemma3-hf-tensor-w8a8-bf16-tp1", "gemma3", "FP8", "w8a8-marlin", "bfloat16", 1),
]
CASE_IDS = [c.name for c in CASES]
BASE = CASES[0]  # the bad-input loads start from this one: llama-tensor, w8a16, bf16, TP 1
PATHS = ("mpack-never", "mpack-require", "mpack-auto")

# Bad inputs, each loaded into BASE's model (TP 1) unless it says otherwise: what is loaded,
# what the message must be about (a regex) and two values it must name (the sidecar's and the
# engine's), loosely.
BAD = {
    "tp-size": dict(
        sidecar="sc:" + CASES[1].name, about=r"tensor.parallel|\btp\b", needs=("2", "1")
    ),
    "tp-size-on-tp2": dict(
        sidecar="sc:" + BASE.name, tp=2, about=r"tensor.parallel|\btp\b", needs=("1", "2")
    ),
    "profile": dict(
        sidecar="sc:" + BASE.name,
        profile="w8a8-marlin",
        about="profile",
        needs=("w8a16", "w8a8-marlin"),
    ),
    "act-dtype": dict(
        sidecar="sc:" + BASE.name, dtype="float16", about="dtype", needs=("bfloat16", "float16")
    ),
    "engine-version": dict(sidecar="old-engine", about="version", needs=("0.32.1", "0.33.0")),
    "architecture": dict(
        sidecar="other-arch", about="model", needs=("Qwen3ForCausalLM", "LlamaForCausalLM")
    ),
    "require-no-daemon": dict(
        sidecar="sc:" + BASE.name,
        attach="require",
        no_daemon=True,
        about="daemon|serve",
        needs=("require",),
    ),
    "corrupt-rank-file": dict(
        sidecar="corrupt", about="checksum|sha256|digest|corrupt", needs=("rank-00-of-01",)
    ),
    # the binding check off, to reach the layer check behind it
    "other-layers": dict(
        sidecar="one-layer", about="layer", needs=("1", "2"), extra={"check_source": False}
    ),
    # made from another checkpoint of the same shapes, with and without its pass-through
    "other-checkpoint": dict(
        sidecar="other-weights", about="another checkpoint", needs=("model.safetensors",)
    ),
    "other-checkpoint-no-passthrough": dict(
        sidecar="other-weights-np", about="another checkpoint", needs=("model.safetensors",)
    ),
    "check-source-not-bool": dict(
        sidecar="sc:" + BASE.name,
        about="check_source",
        needs=("yes",),
        extra={"check_source": "yes"},
    ),
}


# --- the world: checkpoints, sidecars, daemons, worker results ----------------------------------


def run_cli(args: list[str], cwd: Path) -> None:
    cmd = [main_python(), "-m", *args]
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_sidecars(work: Path) -> dict[str, Path]:
    """Every checkpoint and sidecar, two CLI processes at a time (the CI runner has 2 cores)."""
    ck = {name: work / f"ck-{name}" for name in CKPTS}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda n: run_cli(["mpack.fixtures", str(ck[n]), *CKPTS[n]], work), CKPTS))
    converts = {
        "sc:" + c.name: (
            ck[c.ckpt],
            ["--tp", str(c.tp), "--profile", c.profile, "--act-dtype", c.dtype],
        )
        for c in CASES
    }
    converts["one-layer"] = (
        ck["llama-tensor-1layer"],
        ["--tp", "1", "--profile", BASE.profile, "--act-dtype", BASE.dtype],
    )
    base_opts = ["--tp", "1", "--profile", BASE.profile, "--act-dtype", BASE.dtype]
    converts["other-weights"] = (ck["llama-tensor-seed1"], base_opts)
    converts["other-weights-np"] = (ck["llama-tensor-seed1"], [*base_opts, "--no-passthrough"])
    out = {key: work / key.replace(":", "-") for key in converts}

    def convert(key: str) -> None:
        src, opts = converts[key]
        run_cli(["mpack", "convert", str(src), "-o", str(out[key]), "--quiet", *opts], work)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(convert, converts))
    base = out["sc:" + BASE.name]

    # Made for another vLLM: the manifest's target.engine_version edited and written back.
    from mpack.sidecar import load_manifest, write_manifest

    out["old-engine"] = work / "sc-old-engine"
    shutil.copytree(base, out["old-engine"])
    manifest, _ = load_manifest(out["old-engine"])
    manifest["target"]["engine_version"] = "0.32.1"
    write_manifest(out["old-engine"], manifest)
    # Made from another architecture (same dims): the manifest's model.architecture edited.
    out["other-arch"] = work / "sc-other-arch"
    shutil.copytree(base, out["other-arch"])
    manifest, _ = load_manifest(out["other-arch"])
    manifest["model"]["architecture"] = "Qwen3ForCausalLM"
    write_manifest(out["other-arch"], manifest)

    # One flipped byte in the middle of the rank file's data: its checksum no longer matches.
    out["corrupt"] = work / "sc-corrupt"
    shutil.copytree(base, out["corrupt"])
    rank_file = out["corrupt"] / "rank-00-of-01.safetensors"
    with open(rank_file, "r+b") as f:
        f.seek(rank_file.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))

    out.update({"ck:" + name: path for name, path in ck.items()})
    return out


def jobs(paths: dict[str, Path], no_daemon_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """The loads of the TP 1 and the TP 2 workers."""
    by_tp: dict[int, list[dict[str, Any]]] = {1: [], 2: []}

    def load(case: Case, path: str, **kw: Any) -> dict[str, Any]:
        d = {
            "id": f"{case.name}/{path}",
            "model": str(paths["ck:" + case.ckpt]),
            "profile": case.profile,
            "dtype": case.dtype,
        }
        if path != "default":
            sidecar = paths["sc:" + case.name]
            d.update(
                load_format="mpack",
                sidecar=str(sidecar),
                extra={"sidecar": str(sidecar), "attach": path.removeprefix("mpack-")},
            )
        d.update(kw)
        return d

    for case in CASES:
        by_tp[case.tp] += [load(case, p) for p in ("default", *PATHS)]

    base_sc = str(paths["sc:" + BASE.name])
    by_tp[1] += [
        # The model directory is the sidecar: no "sidecar" key.
        load(
            BASE,
            "model-dir",
            model=base_sc,
            load_format="mpack",
            sidecar=base_sc,
            extra={"attach": "never"},
        ),
        # A sidecar of other weights, the binding check turned off: it loads (the override).
        load(
            BASE,
            "other-checkpoint-override",
            load_format="mpack",
            sidecar=str(paths["other-weights"]),
            extra={
                "sidecar": str(paths["other-weights"]),
                "attach": "never",
                "check_source": False,
            },
        ),
        # auto with no daemon reachable: a private load.
        load(
            BASE,
            "auto-no-daemon",
            load_format="mpack",
            sidecar=base_sc,
            extra={"sidecar": base_sc, "attach": "auto"},
            env={"XDG_RUNTIME_DIR": str(no_daemon_dir)},
        ),
    ]
    for name, bad in BAD.items():
        sidecar = str(paths[bad["sidecar"]])
        d = load(
            BASE,
            f"bad/{name}",
            load_format="mpack",
            sidecar=sidecar,
            extra={
                "sidecar": sidecar,
                "attach": bad.get("attach", "never"),
                **bad.get("extra", {}),
            },
        )
        d.update({k: bad[k] for k in ("profile", "dtype") if k in bad})
        if bad.get("no_daemon"):
            d["env"] = {"XDG_RUNTIME_DIR": str(no_daemon_dir)}
        by_tp[bad.get("tp", 1)].append(d)
    return by_tp


def run_workers(by_tp: dict[int, list[dict[str, Any]]], env: dict, work: Path, pp: int = 1) -> dict:
    """Every rank of every job at once, each job over ``pp`` pipeline stages; ``{tp: {rank:
    {load id: result}}}``, rank ``r`` being TP rank ``r % tp`` of stage ``r // tp``."""
    procs = []
    for tp, loads in by_tp.items():
        name = f"tp{tp}" + (f"-pp{pp}" if pp > 1 else "")
        out_dir = work / f"results-{name}"
        out_dir.mkdir()
        job = work / f"job-{name}.json"
        job.write_text(
            json.dumps(
                {"tp": tp, "pp": pp, "port": free_port(), "out_dir": str(out_dir), "loads": loads},
                indent=1,
            )
        )
        for rank in range(tp * pp):
            log = work / f"worker-{name}-r{rank}.log"
            with open(log, "w") as f:
                p = subprocess.Popen(
                    [sys.executable, str(WORKER), str(job), str(rank)],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=work,
                )
            procs.append((tp, rank, p, log, out_dir / f"rank-{rank}.json"))
    results: dict[int, dict[int, dict]] = {tp: {} for tp in by_tp}
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    failed = []
    for tp, rank, p, log, out in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.returncode != 0 or not out.exists():
            failed.append(
                f"worker tp{tp} rank {rank} exited {p.returncode}:\n" + log.read_text()[-6000:]
            )
        else:
            results[tp][rank] = json.loads(out.read_text())
    if failed:
        for _, _, p, _, _ in procs:
            if p.poll() is None:
                p.kill()
        raise AssertionError("\n\n".join(failed))
    return results


def serve_and_run(
    served: list[tuple[Path, int]],
    by_tp: dict[int, list[dict[str, Any]]],
    work: Path,
    runtime: Path,
    pp: int = 1,
    staged: list[tuple[Path, int, int, int, Path]] = (),  # type: ignore[assignment]
) -> dict:
    """:func:`run_workers` while the main venv's ``mpack serve SIDECAR --rank R --device cpu``
    serves each ``(SIDECAR, R)`` of ``served`` in the runtime directory ``runtime``, and
    ``mpack serve SIDECAR --rank R --pp-rank P --pp-size N`` each ``(SIDECAR, R, P, N, DIR)`` of
    ``staged`` in the runtime directory ``DIR``."""
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    daemons = [
        DaemonProc(sidecar, "cpu", env, work, "--rank", str(rank), python=main_python())
        for sidecar, rank in served
    ]
    daemons += [
        DaemonProc(
            sidecar,
            "cpu",
            {**env, "XDG_RUNTIME_DIR": str(where)},
            work,
            *("--rank", str(rank), "--pp-rank", str(p), "--pp-size", str(n)),
            python=main_python(),
        )
        for sidecar, rank, p, n, where in staged
    ]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for d in daemons:
            d.wait_ready(max(0.0, deadline - time.monotonic()))
        return run_workers(by_tp, env, work, pp)
    finally:
        for d in daemons:
            d.stop(timeout=20)  # SIGKILL if it has not stopped by then


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # tests/vllm itself is a namespace package `vllm`
    if spec is None or spec.origin is None:
        pytest.fail(f"{sys.executable} has no vLLM: run these tests with .venv-vllm (make test)")
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("vllm")
    runtime = work / "xdg-runtime"
    no_daemon = work / "xdg-runtime-empty"
    for d in (runtime, no_daemon):
        d.mkdir(mode=0o700)
    paths = make_sidecars(work)
    t_made = time.monotonic()

    served = [(paths["sc:" + c.name], rank) for c in CASES for rank in range(c.tp)]
    results = serve_and_run(served, jobs(paths, no_daemon), work, runtime)
    t_done = time.monotonic()
    print(
        f"\nvLLM loader suite: checkpoints + sidecars {t_made - t0:.1f} s, daemons + workers "
        f"{t_done - t_made:.1f} s"
    )
    return {"paths": paths, "results": results}


def ranks(world: dict[str, Any], tp: int) -> list[dict[str, Any]]:
    return [world["results"][tp][r] for r in range(tp)]


def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert result["ok"], f"load failed: {result['error']}\n{result.get('traceback', '')}"
    return result


def assert_same_tensors(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = {
        n: {k: (got[n][k], want[n][k]) for k in want[n] if got[n][k] != want[n][k]}
        for n in sorted(set(got) & set(want))
        if got[n] != want[n]
    }
    assert not (missing or extra or differ), (
        f"{what}: the mpack model differs from DefaultModelLoader's: missing {missing}, "
        f"extra {extra}, differing (mpack, default) {differ}"
    )


def rank_file_tensors(sidecar: Path, rank: int) -> set[str]:
    from mpack.sidecar import rank_file_name, read_file_map

    from_manifest = json.loads((sidecar / "mpack.json").read_text())
    tp = from_manifest["target"]["tp_size"]
    return {t.name for t in read_file_map(sidecar / rank_file_name(rank, tp)).entries}


# --- equal to DefaultModelLoader ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_same_model_as_default_loader(world: dict[str, Any], case: Case, path: str) -> None:
    for rank, res in enumerate(ranks(world, case.tp)):
        default = ok(res[f"{case.name}/default"])["tensors"]
        got = ok(res[f"{case.name}/{path}"])["tensors"]
        assert_same_tensors(got, default, f"{case.name} {path} rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_same_post_processed_state_as_default_loader(
    world: dict[str, Any], case: Case, path: str
) -> None:
    """Every piece of state other than tensors that vLLM's Marlin processing leaves on a layer
    (the layer's attributes such as ``processed_weight_dims``, the scheme's weight key, the
    kernel's input dtype and config, which tensor attributes exist: no ``input_scale``, no
    workspace on the layer) is the mpack loader's too: carried in the sidecar or rebuilt."""
    for rank, res in enumerate(ranks(world, case.tp)):
        default = ok(res[f"{case.name}/default"])["state"]
        got = ok(res[f"{case.name}/{path}"])["state"]
        assert sorted(got) == sorted(default), f"{case.name} {path} rank {rank}: layers differ"
        assert default, "no layer with a quantization scheme in vLLM's own load"
        differ = {
            (layer, part, k): (got[layer][part].get(k), v)
            for layer, parts in default.items()
            for part, attrs in parts.items()
            for k, v in attrs.items()
            if got[layer].get(part, {}).get(k) != v
        }
        extra = {
            (layer, part, k)
            for layer, parts in got.items()
            for part, attrs in parts.items()
            for k in attrs
            if k not in default[layer].get(part, {})
        }
        assert not differ and not extra, (
            f"{case.name} {path} rank {rank}: post-processed state differs (mpack, vLLM): "
            f"{differ}; only in mpack's: {sorted(extra)}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_default_loader_took_marlin(world: dict[str, Any], case: Case) -> None:
    """The stand-ins hold: vLLM's own load prepared Marlin layers (int32 tiles, [1, Np] scales,
    no input_scale), the same tensors the sidecar holds."""
    sidecar = world["paths"]["sc:" + case.name]
    for rank, res in enumerate(ranks(world, case.tp)):
        default = ok(res[f"{case.name}/default"])["tensors"]
        names = rank_file_tensors(sidecar, rank)
        assert names and names <= set(default), sorted(names - set(default))
        for name in names:
            t = default[name]
            leaf = name.rpartition(".")[2]
            if leaf == "weight":
                assert t["dtype"] == "int32" and len(t["shape"]) == 2, (name, t)
            elif leaf == "weight_scale":
                assert t["dtype"] == case.dtype and t["shape"][0] == 1, (name, t)
        assert not [n for n in default if n.endswith("input_scale")]
        if case.arch in ("qwen2", "qwen2_5_vl"):  # q/k/v bias
            assert any(n.endswith("qkv_proj.bias") for n in names)
        else:
            assert not any(n.endswith(".bias") for n in names)


# --- where the Marlin tensors live ----------------------------------------------------------------


def assert_views(res: dict[str, Any], sidecar: Path, rank: int, backend: str, what: str) -> None:
    weights = res["weights"]
    assert weights is not None, f"{what}: the model has no _mpack_weights"
    assert weights["backend"] == backend, f"{what}: {weights}"
    views = res["marlin"]
    assert set(views) == rank_file_tensors(sidecar, rank), what
    for name, v in views.items():
        assert v["same_ptr"] and v["same_storage"] and v["in_mapping"], (
            f"{what}: {name} is not a view of the sidecar's allocation: {v}"
        )
        if backend == "host":
            assert v["region"].startswith("/memfd:mpack:") and v["perms"].startswith("r-"), (
                f"{what}: {name} lies in {v['perms']} {v['region']}, not the daemon's read-only "
                "memfd mapping"
            )
        else:
            assert "memfd:mpack" not in v["region"], f"{what}: {name}: {v}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_attached_weights_are_the_daemons_mapping(world: dict[str, Any], case: Case) -> None:
    sidecar = world["paths"]["sc:" + case.name]
    for rank, res in enumerate(ranks(world, case.tp)):
        for path in ("mpack-require", "mpack-auto"):
            what = f"{case.name} {path} rank {rank}"
            assert_views(ok(res[f"{case.name}/{path}"]), sidecar, rank, "host", what)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_private_load_uses_sidecar_tensors(world: dict[str, Any], case: Case) -> None:
    sidecar = world["paths"]["sc:" + case.name]
    for rank, res in enumerate(ranks(world, case.tp)):
        what = f"{case.name} mpack-never rank {rank}"
        assert_views(ok(res[f"{case.name}/mpack-never"]), sidecar, rank, "private", what)


@pytest.mark.slow
@pytest.mark.parametrize("load", ["model-dir", "auto-no-daemon"])
def test_other_ways_to_load_privately(world: dict[str, Any], load: str) -> None:
    """model-dir: the model directory is the sidecar (no "sidecar" key); auto-no-daemon:
    ``attach: auto`` with no daemon reachable loads privately."""
    (res,) = ranks(world, 1)
    default = ok(res[f"{BASE.name}/default"])["tensors"]
    got = ok(res[f"{BASE.name}/{load}"])
    assert_same_tensors(got["tensors"], default, load)
    assert_views(got, world["paths"]["sc:" + BASE.name], 0, "private", load)


@pytest.mark.slow
def test_vllm_plugin_registers_the_load_format(world: dict[str, Any]) -> None:
    """In a real deployment nothing calls ``register()`` but vLLM's plugin loading."""
    from importlib.metadata import entry_points

    if not [e for e in entry_points(group="vllm.general_plugins") if e.name == "mpack"]:
        pytest.skip("mpack is importable but not installed here: no vllm.general_plugins entry")
    for tp in (1, 2):
        for rank, res in enumerate(ranks(world, tp)):
            assert res["_plugin_registered"], f"TP {tp} rank {rank}: load format mpack unknown"
            # the plugin paid for the first attach ahead (Note [warm attach])
            warmed = ["mpack.hub_sidecar", "mpack.runtime.client", "mpack.runtime.memfd"]
            assert res["_warmed"] == warmed, f"TP {tp} rank {rank}: {res['_warmed']}"


@pytest.mark.slow
def test_check_source_false_loads_another_checkpoints_sidecar(world: dict[str, Any]) -> None:
    """The override of Note [a sidecar is bound to its checkpoint] does what it says: the
    sidecar of other weights loads, and its Marlin weights are those other weights."""
    res = ranks(world, 1)[0]
    got = ok(res[f"{BASE.name}/other-checkpoint-override"])["tensors"]
    mine = ok(res[f"{BASE.name}/mpack-never"])["tensors"]
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert got[name] != mine[name], "the other checkpoint's sidecar gave this one's weights"


# --- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_refused_before_the_model(world: dict[str, Any], name: str) -> None:
    bad = BAD[name]
    for rank, res in enumerate(ranks(world, bad.get("tp", 1))):
        r = res[f"{BASE.name}/bad/{name}"]
        assert not r["ok"], f"{name}: rank {rank} loaded without an error"
        err = r["error"]
        assert "MpackError" in err["mro"], f"{name}: not an mpack error: {err}\n{r['traceback']}"
        assert re.search(bad["about"], err["message"], re.I), f"{name}: {err['message']!r}"
        for s in bad["needs"]:
            assert s in err["message"], f"{name}: {s!r} not in {err['message']!r}"
        assert err["linear_layers_built"] == 0, (
            f"{name}: refused only after building {err['linear_layers_built']} linear layers: "
            f"{err['message']}"
        )


#: The checkpoints whose vocabulary (1024) needs no padding rows at TP 1 and 2.
IN_PLACE_VOCAB = ("llama-channel", "qwen2-channel")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_pass_through_tensors_are_used_in_place(world: dict[str, Any], case: Case) -> None:
    """Every parameter of the loaded model lies in the sidecar's tensors (the daemon's mapping,
    or the private load) except those the loader names as copied (runtime/vllm/inplace.py):
    nothing copied silently. Where the rank's vocabulary rows need no padding, no embedding is
    copied (a vocabulary of 1024: nothing at all); where vLLM pads them (1000 -> 1024: at TP 1,
    and on TP 2's rank 1, rows 512-999 and 24 zero rows), the embedding is copied, and named."""
    vocab = 1024 if case.ckpt in IN_PLACE_VOCAB else 1000
    args = CKPTS[case.ckpt]
    # an engine dtype other than the checkpoint's: vLLM casts every tensor as it copies it
    made = args[args.index("--dtype") + 1] if "--dtype" in args else "bfloat16"  # the fixture's
    cast = made != case.dtype
    for rank, res in enumerate(ranks(world, case.tp)):
        pads = cast or (rank + 1) * 1024 // case.tp > vocab
        for path in ("mpack-require", "mpack-never"):
            got = ok(res[f"{case.name}/{path}"])
            report, outside = got["passthrough"], got["outside_sidecar"]
            what = f"{case.name} {path} rank {rank}"
            assert report is not None and (report["in_place"] > 0) != cast, what
            assert sorted(outside) == sorted(report["copied"]), what
            copied_embedding = any(n.endswith("embed_tokens.weight") for n in report["copied"])
            assert copied_embedding == pads, what
            if case.ckpt in IN_PLACE_VOCAB and not cast:
                assert report["copied"] == [] and report["copied_bytes"] == 0, what


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_build_allocates_nothing_the_sidecar_fills(world: dict[str, Any], case: Case) -> None:
    """While vLLM builds the model, the parameters the sidecar fills hold a one-element
    placeholder (runtime/vllm/placeholders.py): at least every rank-file tensor's bytes, plus the
    embeddings used in place, were never allocated. A placeholder vLLM's loader copies into (an
    embedding with padding rows) got its memory first, and is named; the models still equal
    vLLM's own load (test_same_model_as_default_loader)."""
    for rank, res in enumerate(ranks(world, case.tp)):
        for path in ("mpack-require", "mpack-never"):
            got = ok(res[f"{case.name}/{path}"])
            load, report = got["load"], got["passthrough"]
            what = f"{case.name} {path} rank {rank}"
            assert load is not None and got["marlin_bytes"] > 0, what
            assert load["placeholder_bytes"] >= got["marlin_bytes"], what
            embeddings = [
                n for n in report["copied"] if n.endswith(("embed_tokens.weight", "lm_head.weight"))
            ]
            assert sorted(load["materialized"]) == sorted(embeddings), what
            assert set(load["seconds"]) == {
                "checks",
                "weights",
                "build",
                "marlin",
                "rest",
                "process",
            }


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_vllm_counts_the_daemons_weights_as_external(world: dict[str, Any], case: Case) -> None:
    """vLLM's worker asks the loader for the weights held outside the engine before it sizes its
    memory (``get_external_weight_memory``): an engine that attaches answers the daemon's bytes
    for its rank (its mapping's size), one that loads privately 0, as vLLM's own load does."""
    for rank, res in enumerate(ranks(world, case.tp)):
        attached = ok(res[f"{case.name}/mpack-require"])
        what = f"{case.name} rank {rank}"
        assert attached["external_weight_memory"] == attached["weights"]["nbytes"] > 0, what
        assert ok(res[f"{case.name}/mpack-never"])["external_weight_memory"] == 0, what
        assert ok(res[f"{case.name}/default"])["external_weight_memory"] == 0, what


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_load_freezes_the_heap_vllms_collections_would_walk(
    world: dict[str, Any], case: Case
) -> None:
    """Note [the heap frozen for vLLM's collections]: an mpack load (vLLM's question about the
    external weights, then the load) freezes the objects alive as it starts, so that the
    collections vLLM runs around the load (``DeviceMemoryProfiler``) do not walk them again;
    vLLM's own load leaves the collector as it was."""
    for rank, res in enumerate(ranks(world, case.tp)):
        what = f"{case.name} rank {rank}"
        for path in ("mpack-require", "mpack-never"):
            assert ok(res[f"{case.name}/{path}"])["frozen_by_load"] > 0, f"{what} {path}"
        assert ok(res[f"{case.name}/default"])["frozen_by_load"] <= 0, what  # freed, not frozen
