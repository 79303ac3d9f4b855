"""MoE experts (issue 39): the sidecar's stacked expert tensors against vLLM 0.33.0's own load.

Tiny Mixtral, Qwen3-MoE, Qwen2-MoE and Llama 4 checkpoints (``python -m mpack.fixtures_moe``,
the Hub's per-expert compressed-tensors form) are converted by the main venv's CLI, then loaded
by vLLM's real classes with ``DefaultModelLoader`` and the Marlin MoE backend
(``moe_backend="marlin"``), one worker per TP rank (tests/vllm/vllm_worker.py, with the CPU
stand-ins: vLLM's own ``prepare_fp8_moe_layer_for_marlin`` and ``prepare_fp8_layer_for_marlin``
run). Every tensor of every rank file (the attention's Marlin layers and the experts' stacked
``w13`` / ``w2`` weights and scales) must be a parameter of vLLM's model on that rank with the
same name, shape, dtype and bytes; and every FP8 parameter vLLM prepared for Marlin must be in
the rank file.

Then the same models through ``--load-format mpack`` (runtime/vllm/moe.py), privately and
attached to real ``mpack serve --device cpu`` daemons: every parameter and buffer, and the
post-processed state of every quantized layer and MoE block, equal vLLM's own load's.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime.rt_helpers import DaemonProc
from tests.vllm.test_vllm_loader import assert_same_tensors, main_python, run_cli, run_workers

#: --load-format mpack's ways to load: privately, attached to the daemons.
PATHS = ("mpack-never", "mpack-require")


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    scheme: str  # FP8: per-tensor weights, static inputs; FP8_DYNAMIC: per-channel, dynamic;
    # AUTOFP8: an AutoFP8 checkpoint (quant_method fp8), per-tensor, static inputs
    profile: str  # the dense layers' (the experts' layout is the same for both)
    dtype: str
    tp: int
    inter: int = 256  # the experts' intermediate size
    blocks: int = 2  # MoE blocks in the model's 2 decoder layers (Llama 4's: every second)
    ep: bool = False  # expert parallelism: convert --ep on, vLLM --enable-expert-parallel


#: Both families, both scale strategies (w13's two per-tensor scales requantized to one), both
#: dtypes and profiles, TP 1, 2 and 4 (256 intermediate: 64 per rank at TP 4, no padding); and
#: intermediate sizes vLLM pads per rank to a multiple of 64 (marlin_moe_padded_intermediate):
#: 96 -> 128, as Qwen3-30B-A3B's 768 at TP 8, and 160 -> 192.
CASES = [
    Case("mixtral-tensor-w8a16-bf16-tp1", "mixtral", "FP8", "w8a16", "bfloat16", 1),
    Case("mixtral-channel-w8a8-fp16-tp2", "mixtral", "FP8_DYNAMIC", "w8a8-marlin", "float16", 2),
    Case("qwen3_moe-tensor-w8a8-bf16-tp2", "qwen3_moe", "FP8", "w8a8-marlin", "bfloat16", 2),
    Case("qwen3_moe-channel-w8a16-fp16-tp4", "qwen3_moe", "FP8_DYNAMIC", "w8a16", "float16", 4),
    # as Mixtral-8x7B-Instruct-v0.1-FP8: Fp8MoEMethod, whose Marlin path is weight-only too
    Case("mixtral-autofp8-w8a16-bf16-tp2", "mixtral", "AUTOFP8", "w8a16", "bfloat16", 2),
    Case("qwen3_moe-tensor-pad96-w8a16-bf16-tp2", "qwen3_moe", "FP8", "w8a16", "bfloat16", 2, 192),
    Case(
        "mixtral-channel-pad160-w8a8-fp16-tp1",
        "mixtral",
        "FP8_DYNAMIC",
        "w8a8-marlin",
        "float16",
        1,
        160,
    ),
    # Qwen2-MoE: a shared expert (dense Marlin linears, 2x the experts' intermediate size), its
    # bf16 gate, q/k/v biases; padded experts at TP 2; AutoFP8, as Qwen2-57B-A14B-Instruct-FP8
    Case("qwen2_moe-tensor-pad96-w8a16-bf16-tp2", "qwen2_moe", "FP8", "w8a16", "bfloat16", 2, 192),
    Case(
        "qwen2_moe-channel-w8a8-fp16-tp1", "qwen2_moe", "FP8_DYNAMIC", "w8a8-marlin", "float16", 1
    ),
    Case("qwen2_moe-autofp8-w8a16-bf16-tp4", "qwen2_moe", "AUTOFP8", "w8a16", "bfloat16", 4),
    # Llama 4 (Llama4ForConditionalGeneration): a MoE block with a shared expert in layer 1, a
    # dense feed_forward in layer 0, a vision tower passed through
    Case("llama4-tensor-w8a8-bf16-tp2", "llama4", "FP8", "w8a8-marlin", "bfloat16", 2, blocks=1),
    Case(
        "llama4-channel-pad96-w8a16-fp16-tp2",
        "llama4",
        "FP8_DYNAMIC",
        "w8a16",
        "float16",
        2,
        192,
        blocks=1,
    ),
    # Expert parallelism (--ep on; vLLM's enable_expert_parallel): whole experts per rank at
    # the full intermediate size (160 -> 192 padded: marlin_moe_padded_intermediate of 160),
    # the attention and the shared expert TP-sharded; per-tensor w13 requantized; at TP 4, one
    # of the tiny models' 4 experts per rank
    Case(
        "mixtral-channel-pad160-ep-w8a8-fp16-tp2",
        "mixtral",
        "FP8_DYNAMIC",
        "w8a8-marlin",
        "float16",
        2,
        160,
        ep=True,
    ),
    Case(
        "qwen2_moe-tensor-ep-w8a16-bf16-tp2",
        "qwen2_moe",
        "FP8",
        "w8a16",
        "bfloat16",
        2,
        192,
        ep=True,
    ),
    Case(
        "qwen3_moe-channel-ep-w8a16-fp16-tp4",
        "qwen3_moe",
        "FP8_DYNAMIC",
        "w8a16",
        "float16",
        4,
        ep=True,
    ),
    Case(
        "llama4-tensor-ep-w8a8-bf16-tp2",
        "llama4",
        "FP8",
        "w8a8-marlin",
        "bfloat16",
        2,
        blocks=1,
        ep=True,
    ),
]
CASE_IDS = [c.name for c in CASES]
#: Loaded from a --no-passthrough sidecar (the rest from the checkpoint): a per-tensor case with
#: static input scales, whose experts' input_scale vLLM must still read, and an EP one.
NO_PASSTHROUGH = [CASES[0], next(c for c in CASES if c.name.startswith("qwen2_moe-tensor-ep"))]


def ckpt_name(c: Case) -> str:
    return f"ck-{c.arch}-{c.scheme}-{c.dtype}-{c.inter}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("vllm-moe")
    cks = {ckpt_name(c): c for c in CASES}

    def make(name: str) -> None:
        c = cks[name]
        scheme = ["--scheme", "FP8", "--autofp8", "static"] if c.scheme == "AUTOFP8" else [
            "--scheme", c.scheme]  # fmt: skip
        run_cli(
            ["mpack.fixtures_moe", str(work / name), "--arch", c.arch, *scheme,
             "--dtype", c.dtype, "--moe-intermediate", str(c.inter)],
            work,
        )  # fmt: skip

    def convert(c: Case, out: str, *extra: str) -> None:
        run_cli(
            ["mpack", "convert", str(work / ckpt_name(c)), "-o", str(work / out), "--quiet",
             "--tp", str(c.tp), "--ep", "on" if c.ep else "off", "--profile", c.profile,
             "--act-dtype", c.dtype, *extra],
            work,
        )  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(make, cks))
        list(pool.map(lambda c: convert(c, f"sc-{c.name}"), CASES))
        list(pool.map(lambda c: convert(c, f"np-{c.name}", "--no-passthrough"), NO_PASSTHROUGH))
    by_tp: dict[int, list[dict[str, Any]]] = {}
    for c in CASES:
        engine = {"engine_args": {"enable_expert_parallel": True}} if c.ep else {}
        base = {"model": str(work / ckpt_name(c)), "profile": c.profile, "dtype": c.dtype,
                **engine}  # fmt: skip
        by_tp.setdefault(c.tp, []).append({"id": c.name, **base})
        sidecar = str(work / f"sc-{c.name}")
        for path in PATHS:  # the same model through --load-format mpack
            by_tp[c.tp].append(
                {"id": f"{c.name}/{path}", **base, "load_format": "mpack", "sidecar": sidecar,
                 "extra": {"sidecar": sidecar, "attach": path.removeprefix("mpack-")}}
            )  # fmt: skip
        if c in NO_PASSTHROUGH:
            np_ = str(work / f"np-{c.name}")
            by_tp[c.tp].append(
                {"id": f"{c.name}/no-passthrough", **base, "load_format": "mpack",
                 "sidecar": np_, "extra": {"sidecar": np_, "attach": "never"}}
            )  # fmt: skip
    # an expert-parallel sidecar in an engine without expert parallelism, and the reverse; and
    # in one that places the experts round robin
    ep_case = next(c for c in CASES if c.ep)
    ep_sc = str(work / f"sc-{ep_case.name}")
    by_tp[ep_case.tp].append(
        {"id": "round-robin", "model": str(work / ckpt_name(ep_case)),
         "profile": ep_case.profile, "dtype": ep_case.dtype, "load_format": "mpack",
         "sidecar": ep_sc, "extra": {"sidecar": ep_sc, "attach": "never"},
         "engine_args": {"enable_expert_parallel": True,
                         "expert_placement_strategy": "round_robin"}}
    )  # fmt: skip
    plain = next(c for c in CASES if not c.ep and c.tp == ep_case.tp)
    for sc, c, on in ((ep_case, plain, False), (plain, ep_case, True)):
        by_tp[c.tp].append(
            {"id": f"mismatch-ep-{on}", "model": str(work / ckpt_name(sc)), "profile": sc.profile,
             "dtype": sc.dtype, "load_format": "mpack", "sidecar": str(work / f"sc-{sc.name}"),
             "engine_args": {"enable_expert_parallel": on},
             "extra": {"sidecar": str(work / f"sc-{sc.name}"), "attach": "never"}}
        )  # fmt: skip
    runtime = work / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "XDG_RUNTIME_DIR": str(runtime)}  # fmt: skip
    daemons = [
        DaemonProc(work / f"sc-{c.name}", "cpu", env, work, "--rank", str(r), python=main_python())
        for c in CASES
        for r in range(c.tp)
    ]
    try:
        for d in daemons:
            d.wait_ready(60)
        results = run_workers(by_tp, env, work)
    finally:
        for d in daemons:
            d.stop(timeout=20)
    print(f"\nvLLM MoE suite: {time.monotonic() - t0:.1f} s")
    return {"work": work, "results": results}


def rank_file_digests(path: Path) -> dict[str, dict[str, Any]]:
    """Each tensor of a rank file as vllm_worker.tensors_of describes a parameter (its sha256
    is of the raw bytes, as vllm_worker.digest's)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name).contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rank_files_are_vllms_marlin_moe_tensors(world: dict[str, Any], case: Case) -> None:
    sidecar = world["work"] / f"sc-{case.name}"
    for rank in range(case.tp):
        res = world["results"][case.tp][rank][f"{case.name}"]
        assert res["ok"], res.get("traceback")
        vllm = res["tensors"]
        mine = rank_file_digests(sidecar / f"rank-{rank:02d}-of-{case.tp:02d}.safetensors")
        experts = [n for n in mine if ".experts.routed_experts.w" in n]
        assert len(experts) == 4 * case.blocks, sorted(mine)  # w13/w2 weight and scale
        for name, t in mine.items():
            assert name in vllm, f"rank {rank}: {name} is not a parameter of vLLM's model"
            v = vllm[name]
            got = (t["shape"], t["dtype"], t["sha256"])
            assert got == (v["shape"], v["dtype"], v["sha256"]), f"rank {rank}: {name} differs"
        # every Marlin tensor vLLM prepared (int32 tiles and their scales) is in the rank file
        # (an expert-parallel block's int32 _expert_map is vLLM's own buffer)
        prepared = {n for n, v in vllm.items() if v["dtype"] == "int32" and n.endswith("weight")}
        prepared |= {n + "_scale" for n in prepared}  # X.weight_scale, w13_weight_scale
        assert prepared <= set(mine), sorted(prepared - set(mine))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_mpack_loads_the_same_model_as_vllm(world: dict[str, Any], case: Case, path: str) -> None:
    """Every parameter and buffer (the experts' stacked tensors, their input scales reduced to
    one, the attention's Marlin layers, the routers) and the post-processed state of every
    quantized layer and MoE block (the method's backend, quant config and kernel)."""
    for rank in range(case.tp):
        res = world["results"][case.tp][rank]
        default = res[case.name]
        got = res[f"{case.name}/{path}"]
        assert got["ok"], got.get("traceback")
        assert_same_tensors(got["tensors"], default["tensors"], f"{case.name} {path} r{rank}")
        assert got["state"] == default["state"], f"{case.name} {path} rank {rank}"
        moe = [n for n in default["state"] if n.endswith(".experts.routed_experts")]
        assert len(moe) == case.blocks and all(
            default["state"][n]["method"]["moe_kernel"] != "NoneType" for n in moe
        )
        if path == "mpack-require":
            assert got["weights"]["backend"] == "host", got["weights"]
        # the build allocated none of the stacked experts (runtime/vllm/placeholders.py)
        assert got["load"]["placeholder_bytes"] >= got["marlin_bytes"] > 0, got["load"]


@pytest.mark.slow
@pytest.mark.parametrize("case", NO_PASSTHROUGH, ids=[c.name for c in NO_PASSTHROUGH])
def test_no_passthrough_moe_sidecar_loads_the_same_model(world: dict[str, Any], case: Case) -> None:
    """A --no-passthrough sidecar: the experts from its rank files, the rest (routers, norms,
    the experts' input scales) from the checkpoint, whose expert weights vLLM must skip on every
    rank (under expert parallelism, the other ranks' experts too)."""
    for rank in range(case.tp):
        res = world["results"][case.tp][rank]
        got = res[f"{case.name}/no-passthrough"]
        assert got["ok"], got.get("traceback")
        assert_same_tensors(got["tensors"], res[case.name]["tensors"], f"np r{rank}")
        assert got["state"] == res[case.name]["state"]


@pytest.mark.slow
@pytest.mark.parametrize("engine_ep", [False, True])
def test_expert_parallelism_must_match(world: dict[str, Any], engine_ep: bool) -> None:
    """An expert-parallel sidecar in an engine without --enable-expert-parallel (whose ranks
    hold a slice of every expert), and the reverse: refused naming both, before any layer."""
    ep_case = next(c for c in CASES if c.ep)
    res = world["results"][ep_case.tp][0][f"mismatch-ep-{engine_ep}"]
    assert not res["ok"]
    err = res["error"]
    assert "EngineMismatchError" in err["mro"], res.get("traceback")
    have, want = ("off", "on") if engine_ep else ("on", "off")
    assert f"expert parallelism is {have}, the engine's is {want}" in err["message"]
    assert f"--ep {want}" in err["hint"] and "--enable-expert-parallel" in err["hint"]
    assert err["linear_layers_built"] == 0


@pytest.mark.slow
def test_expert_parallel_sidecar_refuses_another_placement(world: dict[str, Any]) -> None:
    """vLLM's round_robin placement puts experts 0, 2, ... on rank 0, not the sidecar's
    consecutive ones: refused as mpack's limit, naming the placement, before any layer."""
    ep_case = next(c for c in CASES if c.ep)
    res = world["results"][ep_case.tp][0]["round-robin"]
    assert not res["ok"]
    err = res["error"]
    assert "EngineMismatchError" in err["mro"], res.get("traceback")
    assert "expert placement is round_robin" in err["message"]
    assert "mpack's limit" in err["message"] and "linear" in err["hint"]
    assert err["linear_layers_built"] == 0
