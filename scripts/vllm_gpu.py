"""`--load-format mpack` on a GPU with vLLM 0.33.0's compiled ops: the comparison and the benchmark.

Run on the device by scripts/device_vllm.sh. Two Python environments take part, because vLLM
0.33.0 pins compressed-tensors 0.17.0 while mpack's converter reads configs with 0.20:

- ``prepare`` (mpack's environment): tiny checkpoints of all 16 layer kinds (per-tensor and
  per-channel scales x bf16 and fp16 x the w8a16 and w8a8-marlin profiles x without bias (Llama)
  and with q/k/v bias (Qwen2)) and their sidecars, converted on the GPU;
- ``worker`` (vLLM's environment): builds every model with vLLM's real classes twice, with
  ``DefaultModelLoader`` (vLLM's own Marlin processing) and with ``--load-format mpack`` attached
  to a running ``mpack serve`` (``attach: require``), then compares every parameter and buffer
  (names, shapes, dtypes, bytes), checks that each Marlin weight is the daemon's memory itself,
  runs every Marlin layer forward through the real ``marlin_gemm`` on the same inputs, and
  checks that the shared bytes and pointers are unchanged afterwards. Two workers run at once,
  attached to the same daemons; their forward outputs must agree with each other too;
- ``bench`` (vLLM's environment): the time for one engine process to have an 8B-shaped model's
  weights ready, by three paths: vLLM's ordinary load (safetensors + Marlin processing), mpack
  attached, mpack private (one path per process, page cache warm).

The ``w8a16`` profile is vLLM's choice below sm 8.9; on the H200 (sm 9.0) the worker reports a
compute capability of 8.6 to vLLM for those cases (named where it is done), so that vLLM picks
CompressedTensorsW8A16Fp8 as it would on such a GPU. The kernels that run are the real ones.

Without a GPU the same script runs on the CPU with the stand-ins of tests/vllm/cpu_standins.py
(a dry run of the orchestration: daemons on the host backend, gloo, no benchmark).

The engine config, the model build, the tensor digests and the zero-copy check are those of the
CPU suite's tests/vllm/vllm_worker.py; the daemons are started and stopped by mpack.runtime.spawn
(imported from mpack's environment: this process itself may have neither environment on its path).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# This folder (benchutil) and tests/vllm: the device scripts run Python with PYTHONSAFEPATH=1,
# which keeps a script's own folder off sys.path (tests/test_device_scripts.py).
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests" / "vllm")]

import cpu_standins  # noqa: E402
import vllm_worker as vw  # noqa: E402  (installs no stand-ins: its main() does)
from benchutil import (  # noqa: E402  (scripts/, beside this file)
    drop_caches,
    marlin_8b,
    moe_30b,
    mpack_spawn,
)

ARCHS = {"llama": False, "qwen2": True}  # arch -> has q/k/v bias
SCHEMES = {"FP8": "tensor", "FP8_DYNAMIC": "channel"}
DTYPES = ("bfloat16", "float16")
PROFILES = ("w8a16", "w8a8-marlin")


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gpu_standins() -> None:
    """Stand-in (GPU): vLLM's flash-attention module is replaced on the device by
    scripts/vllm_fa_standin.py (its extensions do not travel); here only checked."""
    import vllm.vllm_flash_attn as fa

    if fa.FA2_AVAILABLE or fa.FA3_AVAILABLE or "stand-in" not in (fa.__doc__ or ""):
        print("note: vLLM's own flash attention is present", file=sys.stderr)


ATTENTION = {"attention_backend": "TRITON_ATTN"}


def _engine_args() -> dict[str, Any]:
    """What the comparison adds to ``vw.engine_config``'s ``EngineArgs``: Marlin for both
    profiles, a small share of the GPU, and (on it) Triton attention."""
    args = {"linear_backend": "marlin", "gpu_memory_utilization": 0.05}
    return {**args, **ATTENTION} if _device() == "cuda" else args


#: The MoE cases (``--cases moe``): tiny Mixtral, Qwen3-MoE and Qwen2-MoE models, and one
#: decoder layer of Qwen3-30B-A3B's real shapes (128 experts, hidden 2048, 768 per expert, 32
#: heads / 4 KV), so that vLLM's compiled gptq_marlin_repack meets the real expert shapes.
#: ``make``: the arguments of mpack.fixtures_moe.make_moe_checkpoint.
QWEN3_30B_LAYER = dict(layers=1, experts=128, hidden=2048, moe_intermediate=768, heads=32,
                       kv_heads=4)  # fmt: skip
MOE_CASES = (
    ("mixtral", "FP8", "bfloat16", "w8a8-marlin", "tiny", {}),
    ("qwen3_moe", "FP8_DYNAMIC", "float16", "w8a16", "tiny", {}),
    ("qwen3_moe", "FP8", "bfloat16", "w8a8-marlin", "30b-layer", QWEN3_30B_LAYER),
    # AutoFP8 (Fp8MoEMethod), fp32 scales: the requantization's GPU rounding matters
    ("mixtral", "FP8", "bfloat16", "w8a16", "autofp8", {"autofp8": "static"}),
    # padded experts (marlin_moe_padded_intermediate): one TP-8 rank of Qwen3-30B-A3B's layer
    # (768 / 8 = 96 -> 128); Qwen2-MoE's shared expert and gate, 160 -> 192, AutoFP8
    (
        "qwen3_moe",
        "FP8_DYNAMIC",
        "bfloat16",
        "w8a16",
        "30b-tp8-rank",
        {**QWEN3_30B_LAYER, "moe_intermediate": 96},
    ),
    ("qwen2_moe", "FP8", "bfloat16", "w8a8-marlin", "pad160", {"moe_intermediate": 160}),
    ("qwen2_moe", "FP8", "float16", "w8a16", "autofp8", {"autofp8": "static"}),
    # Llama 4's wrapper: q/k rows in vLLM's rotary order, a shared expert, a dense layer
    ("llama4", "FP8", "bfloat16", "w8a8-marlin", "tiny", {}),
    ("llama4", "FP8_DYNAMIC", "bfloat16", "w8a16", "pad96", {"moe_intermediate": 96}),
)
#: The MoE golden cases (tests/data/golden-moe, docs/VLLM.md): small models (one MoE block;
#: Llama 4: a dense layer and a MoE one), each family once, both scale strategies, requantized
#: and padded experts, AutoFP8's fp32 scales; vLLM's own Marlin MoE tensors are written beside
#: the checkpoint they were made from (``--cases golden``).
GOLDEN_SIZES = {"hidden": 128, "vocab": 256, "heads": 4, "kv_heads": 2}
GOLDEN_CASES = (
    ("mixtral", "FP8", "bfloat16", "w8a16", "pad160", {"moe_intermediate": 160, "layers": 1}),
    (
        "qwen3_moe",
        "FP8_DYNAMIC",
        "float16",
        "w8a16",
        "i128",
        {"moe_intermediate": 128, "layers": 1},
    ),
    (
        "qwen2_moe",
        "FP8",
        "bfloat16",
        "w8a16",
        "autofp8-pad96",
        {"moe_intermediate": 96, "layers": 1, "autofp8": "static"},
    ),
    ("llama4", "FP8_DYNAMIC", "bfloat16", "w8a16", "i128", {"moe_intermediate": 128, "layers": 2}),
)
#: Which cases a run takes (``--cases``): the 16 dense layer kinds, the MoE ones, both, or the
#: MoE golden ones.
CASE_SETS = ("dense", "moe", "all", "golden")


def cases() -> list[dict[str, Any]]:
    which = os.environ.get("MPACK_GPU_CASES", "dense")
    dense = [
        {
            "arch": a,
            "bias": b,
            "scheme": s,
            "strategy": st,
            "dtype": d,
            "profile": p,
            "name": f"{a}-{st}-{d}-{p}",
            "ck": f"ck-{a}-{st}-{d}",
        }
        for a, b in ARCHS.items()
        for s, st in SCHEMES.items()
        for d in DTYPES
        for p in PROFILES
    ]
    moe = [
        {
            "arch": a,
            "moe": True,
            "scheme": s,
            "strategy": SCHEMES[s],
            "dtype": d,
            "profile": p,
            "name": f"{a}-{size}-{SCHEMES[s]}-{d}-{p}",
            "ck": f"ck-{a}-{size}-{SCHEMES[s]}-{d}",
            "make": {"arch": a, "scheme": s, "dtype": d, **make},
        }
        for a, s, d, p, size, make in MOE_CASES
    ]
    golden = [
        {
            "arch": a,
            "moe": True,
            "golden": True,
            "scheme": s,
            "dtype": d,
            "profile": p,
            "name": f"golden-{a}-{size}-{SCHEMES[s]}-{d}-{p}",
            "ck": f"ck-golden-{a}-{size}-{SCHEMES[s]}-{d}",
            "make": {"arch": a, "scheme": s, "dtype": d, **GOLDEN_SIZES, **make},
        }
        for a, s, d, p, size, make in GOLDEN_CASES
    ]
    only = [p for p in os.environ.get("MPACK_GPU_ONLY", "").split(",") if p]
    picked = {"dense": dense, "moe": moe, "all": dense + moe, "golden": golden}[which]
    return [c for c in picked if not only or any(p in c["name"] for p in only)]


# --- prepare (mpack's environment) -----------------------------------------------------------


def prepare(work: Path) -> None:
    from mpack.convert import convert
    from mpack.fixtures import make_checkpoint
    from mpack.fixtures_moe import make_moe_checkpoint

    for c in cases():
        ck = work / c["ck"]
        if not (ck / "config.json").is_file():
            if c.get("moe"):
                make_moe_checkpoint(ck, **c["make"])
            else:
                make_checkpoint(ck, arch=c["arch"], scheme=c["scheme"], dtype=c["dtype"], layers=2)
        convert(ck, work / f"sc-{c['name']}", profile=c["profile"], device="auto")
    print(f"prepared {len(cases())} sidecars in {work}", flush=True)


# --- worker (vLLM's environment) ---------------------------------------------------------------


def _set_capability(profile: str, dev: str) -> None:
    """Stand-in (GPU): the compute capability vLLM sees, which decides the compressed-tensors
    scheme (W8A16 below 8.9). Nothing else is patched: platform, kernels and ops are vLLM's."""
    if dev == "cpu":
        cpu_standins.set_profile(profile)
        return
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    cap = cpu_standins.CAPABILITY[profile]
    type(current_platform).get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(*cap)
    )


def _init_dist(config: Any, port: int, backend: str) -> None:
    """One rank (TP 1) of vLLM's distributed state, met on ``127.0.0.1:port``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend=backend,
        )
        initialize_model_parallel(tensor_model_parallel_size=1)


def _load(case: dict[str, Any], work: Path, mpack: bool) -> dict[str, Any]:
    """A load of ``vw.engine_config``: vLLM's own (``mpack`` false) or attached to the daemon."""
    ck = work / case["ck"]
    load = {"model": str(ck), "profile": case["profile"], "dtype": case["dtype"]}
    if mpack:
        load.update(
            load_format="mpack",
            extra={"sidecar": str(work / f"sc-{case['name']}"), "attach": "require"},
        )
    return load


def _write_golden(model: Any, case: dict[str, Any], work: Path, out: Path) -> None:
    """A MoE golden case (tests/data/golden-moe/README.md): the checkpoint, and what vLLM's own
    load + ``process_weights_after_loading`` left in every Marlin layer of ``model`` (each
    int32 ``*weight`` parameter, its ``*_scale`` and its layer's ``bias``), named as vLLM
    names them."""
    import shutil

    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    keep = {
        n for n, p in params.items() if p.dtype.is_floating_point is False and n.endswith("weight")
    }
    keep |= {n + "_scale" for n in keep if n + "_scale" in params}
    keep |= {n.rpartition(".")[0] + ".bias" for n in keep} & set(params)
    tensors = {n: params[n].detach().to("cpu").contiguous() for n in sorted(keep)}
    dest = out / case["name"]
    shutil.copytree(work / case["ck"], dest / "input", dirs_exist_ok=True)
    (dest / "expected").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "expected" / "rank-00-of-01.safetensors"))
    how = {"profile": case["profile"], "act_dtype": case["dtype"], "tp": 1, "make": case["make"]}
    (dest / "case.json").write_text(json.dumps(how, indent=1, sort_keys=True) + "\n")


def worker(work: Path, out: Path, role: str, go: Path) -> None:
    dev = _device()
    if dev == "cpu":
        cpu_standins.install()  # before vLLM is imported
    else:
        _gpu_standins()
    import torch

    from mpack.runtime.vllm import register

    register()
    boot = vw.engine_config(_load(cases()[0], work, False), 1, **_engine_args())
    _init_dist(boot, 29600 + (role == "b"), "nccl" if dev == "cuda" else "gloo")
    if dev == "cuda":
        torch.cuda.set_device(0)
    results: dict[str, Any] = {}
    held = []
    for c in cases():
        _set_capability(c["profile"], dev)
        r: dict[str, Any] = {}
        mp = vw.build(vw.engine_config(_load(c, work, True), 1, **_engine_args()))
        held.append(mp)
        w = mp._mpack_weights
        layers = list(w.manifest["layers"])
        r["backend"] = w.backend
        _, views = vw.marlin_views(mp, str(work / f"sc-{c['name']}"))
        r["zero_copy"] = bool(views) and all(
            v.get(k) for v in views.values() for k in ("same_ptr", "same_storage", "in_mapping")
        )
        shared = {
            k: (w[k].data_ptr(), vw.digest(w[k])) for k in w if k.rpartition(".")[0] in layers
        }
        if role == "a":
            df = vw.build(vw.engine_config(_load(c, work, False), 1, **_engine_args()))
            held.append(df)
            if c.get("golden"):
                _write_golden(df, c, work, out / "golden")
            sd, sm = vw.tensors_of(df), vw.tensors_of(mp)
            r["same_names"] = sorted(sd) == sorted(sm)
            r["differ"] = sorted(k for k in sd if sd[k] != sm.get(k))[:10]
            r["tensors"] = len(sd)
        r["passthrough"] = getattr(mp, "_mpack_passthrough", None)
        r["outside_sidecar"] = vw.outside_sidecar(mp)
        r["_layers"] = layers
        r["_shared"] = shared
        r["_models"] = (len(held) - 2, len(held) - 1) if role == "a" else (len(held) - 1,)
        results[c["name"]] = r
    (out / f"loaded-{role}").write_text("1")
    deadline = time.time() + 300
    while not go.exists() and time.time() < deadline:
        time.sleep(0.1)
    for c in cases():
        r = results[c["name"]]
        mods = [dict(held[i].named_modules()) for i in r["_models"]]
        outs: dict[str, str] = {}
        equal = True
        # no marlin_gemm on a CPU (dry run); a MoE block's experts run in the engines
        # (scripts/vllm_engine.py tokens), not alone
        dense = [n for n in r["_layers"] if ".experts.routed_experts." not in n]
        for n in dense if dev == "cuda" else []:
            layer = mods[0][n]
            seed = int(hashlib.sha256(n.encode()).hexdigest()[:8], 16)  # the same in both workers
            g = torch.Generator(device=dev).manual_seed(seed)
            x = torch.randn(
                16,
                layer.input_size_per_partition,
                generator=g,
                device=dev,
                dtype=getattr(torch, c["dtype"]),
            )
            y = mods[0][n](x)[0]
            outs[n] = vw.digest(y)
            if role == "a":  # mods = (mpack, default)
                equal &= torch.equal(y, mods[1][n](x)[0])
        if dev == "cuda":
            torch.cuda.synchronize()
        w = held[r["_models"][0]]._mpack_weights
        r["unchanged_after_forward"] = all(
            (w[k].data_ptr(), vw.digest(w[k])) == v for k, v in r["_shared"].items()
        )
        r["outputs"] = outs
        if role == "a":
            r["forward_equal_default"] = bool(equal) if dev == "cuda" else None
        for k in ("_layers", "_shared", "_models"):
            r.pop(k)
    (out / f"worker-{role}.json").write_text(json.dumps(results, indent=1))


# --- bench (vLLM's environment) -----------------------------------------------------------------


def bench_one(ck: Path, sc: Path, path: str) -> None:
    _gpu_standins()
    import torch

    from mpack.runtime.vllm import register

    register()
    prep = _time_moe_preparation()
    load = {"model": str(ck), "profile": "w8a8-marlin", "dtype": "auto"}
    how = path.removesuffix("-cold")  # the caller dropped the page cache for a cold one
    if how != "default":
        load.update(
            load_format="mpack",
            extra={"sidecar": str(sc), "attach": "require" if how == "attached" else "never"},
        )
    config = vw.engine_config(load, 1, max_model_len=1024, gpu_memory_utilization=0.5, **ATTENTION)
    _init_dist(config, 29650, "nccl")
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = vw.build(config)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    res = {"path": path, "seconds": round(dt, 3), "param_bytes": n}
    # what this process holds itself (an attached engine: what it did not map from the daemon)
    res["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
    res["passthrough"] = getattr(model, "_mpack_passthrough", None)
    # the loader's own phases (host seconds) and what its build did not allocate
    res["mpack_load"] = getattr(model, "_mpack_load", None)
    print(json.dumps(res | {k: round(v, 4) for k, v in prep.items()}), flush=True)


def _time_moe_preparation() -> dict[str, float]:
    """Seconds (CUDA-synchronized) vLLM spends, summed over the model's MoE blocks, in its MoE
    methods' ``process_weights_after_loading`` and, within it, in
    ``prepare_fp8_moe_layer_for_marlin``: what a sidecar takes away (mpack's loader runs
    neither). Filled as the model loads."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_fp8 as ct,
    )

    out = {"moe_process_weights_s": 0.0, "moe_marlin_prepare_s": 0.0}

    def timing(fn: Any, key: str) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                torch.cuda.synchronize()
                out[key] += time.perf_counter() - t

        return wrapped

    oracle.prepare_fp8_moe_layer_for_marlin = timing(
        oracle.prepare_fp8_moe_layer_for_marlin, "moe_marlin_prepare_s"
    )
    for cls in (ct.CompressedTensorsW8A8Fp8MoEMethod, fp8.Fp8MoEMethod):
        cls.process_weights_after_loading = timing(
            cls.process_weights_after_loading, "moe_process_weights_s"
        )
    return out


# --- orchestration ------------------------------------------------------------------------------


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``cmd`` writing stdout and stderr to ``log`` (this process keeps no handle on it)."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def _kill(procs: dict[str, subprocess.Popen]) -> None:
    """Kill every process of ``procs`` still running (a run that failed midway), and reap it."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


READY_TIMEOUT_S = 180


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["run", "prepare", "worker", "bench-one"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/mpack-vllm"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/mpack-out")))
    ap.add_argument("--mpack-env", default="", help="PYTHONPATH of mpack's environment")
    ap.add_argument("--vllm-env", default="", help="PYTHONPATH of vLLM's environment")
    ap.add_argument("--role", default="a")
    ap.add_argument("--go", type=Path)
    ap.add_argument("--ck", type=Path)
    ap.add_argument("--sc", type=Path)
    ap.add_argument("--path", default="default")
    ap.add_argument("--bench-layers", type=int, default=32)
    ap.add_argument(
        "--bench-model",
        choices=["llama-8b", "qwen3-30b-a3b"],
        default="llama-8b",
        help="the shape of the load bench's checkpoint (qwen3-30b-a3b: also convert vs cp -r)",
    )
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--cases", choices=CASE_SETS, default=None, help="default: dense")
    ap.add_argument("--only", default="", help="of those, the cases whose name holds one of A,B")
    a = ap.parse_args()
    if a.cases:  # read by cases(), here and in every process this one starts
        os.environ["MPACK_GPU_CASES"] = a.cases
    if a.only:
        os.environ["MPACK_GPU_ONLY"] = a.only
    if a.mode == "prepare":
        prepare(a.work)
        return 0
    if a.mode == "worker":
        worker(a.work, a.out, a.role, a.go)
        return 0
    if a.mode == "bench-one":
        bench_one(a.ck, a.sc, a.path)
        return 0
    return run(a)


def run(a: argparse.Namespace) -> int:
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    menv = {**os.environ, "PYTHONPATH": a.mpack_env}
    venv = {**os.environ, "PYTHONPATH": a.vllm_env}
    t = time.time()
    subprocess.run([*me, "prepare", "--work", str(a.work)], env=menv, check=True)
    print(f"prepare: {time.time() - t:.0f} s", flush=True)
    dev = "cuda:0" if _device() == "cuda" else "cpu"
    sp = mpack_spawn(a.mpack_env)
    # the daemons are stopped (and the workers killed) however the run ends
    with contextlib.ExitStack() as stack:
        daemons = [
            stack.enter_context(
                sp.DaemonHandle(
                    a.work / f"sc-{c['name']}",
                    device=dev,
                    env=menv,
                    cwd=a.work,
                    log_dir=a.work,
                    timeout=READY_TIMEOUT_S,
                )
            )
            for c in cases()
        ]
        for d in daemons:
            d.wait_ready()
        print(f"{len(daemons)} daemons ready: {time.time() - t:.0f} s", flush=True)
        go = a.work / "go"
        go.unlink(missing_ok=True)
        wcmd = [*me, "worker", "--work", str(a.work), "--out", str(a.out), "--go", str(go)]
        workers: dict[str, subprocess.Popen] = {}
        stack.callback(_kill, workers)
        for role in ("a", "b"):
            workers[role] = _spawn([*wcmd, "--role", role], venv, a.out / f"worker-{role}.log")
        deadline = time.time() + 400
        while not all((a.out / f"loaded-{r}").exists() for r in workers) and time.time() < deadline:
            if any(w.poll() not in (None, 0) for w in workers.values()):
                break
            time.sleep(0.2)
        status = subprocess.run(
            [sys.executable, "-m", "mpack", "status", "--json"],
            env=menv,
            capture_output=True,
            text=True,
        )
        clients = {
            d.get("sidecar"): len(d.get("clients", []))
            for d in json.loads(status.stdout or '{"daemons": []}')["daemons"]
        }
        go.write_text("1")
        rcs = {r: w.wait(timeout=400) for r, w in workers.items()}
    summary: dict[str, Any] = {"clients_per_daemon_while_both_attached": clients, "worker_rc": rcs}
    if all(rc == 0 for rc in rcs.values()):
        ra = json.loads((a.out / "worker-a.json").read_text())
        rb = json.loads((a.out / "worker-b.json").read_text())
        rows = {}
        for name, r in ra.items():
            rows[name] = {
                "params_and_buffers_identical": r["same_names"] and not r["differ"],
                "tensors": r["tensors"],
                "differ": r["differ"],
                "backend": r["backend"],
                "zero_copy": r["zero_copy"] and rb[name]["zero_copy"],
                "forward_equal_default": r["forward_equal_default"],
                "two_processes_same_outputs": r["outputs"] == rb[name]["outputs"],
                "shared_unchanged_after_forwards": r["unchanged_after_forward"]
                and rb[name]["unchanged_after_forward"],
                # every parameter in the daemon's mapping but those the loader names as copied
                "passthrough": r["passthrough"],
                "nothing_copied_silently": sorted(r["outside_sidecar"] or [])
                == sorted((r["passthrough"] or {}).get("copied", [None])),
            }
        summary["cases"] = rows
        need = [
            "params_and_buffers_identical",
            "zero_copy",
            "shared_unchanged_after_forwards",
            "nothing_copied_silently",
        ]
        if dev != "cpu":  # forwards run only where marlin_gemm exists
            need += ["forward_equal_default", "two_processes_same_outputs"]
        summary["all_ok"] = all(row[k] is True for row in rows.values() for k in need) and all(
            n >= 2 for n in clients.values()
        )
    if not a.skip_bench and dev != "cpu" and summary.get("all_ok"):
        summary["bench"] = bench(a, me, menv, venv)
    (a.out / "vllm_gpu.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}, indent=1))
    return 0 if summary.get("all_ok") else 1


def bench(a: argparse.Namespace, me: list[str], menv: dict, venv: dict) -> dict[str, Any]:
    t = time.time()
    res: dict[str, Any] = {"model": a.bench_model, "layers": a.bench_layers}
    paths = ["default", "attached", "private"]  # the page cache is warm: convert read it
    if a.bench_model == "qwen3-30b-a3b":
        ck, sc, res["convert"] = moe_30b(a.work, a.bench_layers, menv)
        paths += ["default-cold", "attached-cold"]
    else:
        ck, sc = marlin_8b(a.work, a.bench_layers, menv)
    print(f"bench prepare: {time.time() - t:.0f} s", flush=True)
    with mpack_spawn(a.mpack_env).spawn(
        sc, device="cuda:0", env=menv, cwd=a.work, log_dir=a.work, timeout=READY_TIMEOUT_S
    ):
        for path in paths:
            if path.endswith("-cold") and not drop_caches():
                res[path] = {"error": "this process may not drop the page cache"}
                continue
            r = subprocess.run(
                [*me, "bench-one", "--ck", str(ck), "--sc", str(sc), "--path", path],
                env=venv,
                capture_output=True,
                text=True,
            )
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode or not line:
                res[path] = {"error": (r.stdout + r.stderr)[-1500:]}
            else:
                res[path] = json.loads(line[-1])
            print(path, res[path] if "error" not in res[path] else "failed", flush=True)
    for path in paths:
        base = "default-cold" if path.endswith("-cold") else "default"
        d, s = res.get(base, {}).get("seconds"), res.get(path, {}).get("seconds")
        if path != base and d and s:
            res[f"{path}_vs_{base}"] = round(s / d, 3)
    return res


if __name__ == "__main__":
    sys.exit(main())
