"""vLLM's engine generates from a sidecar on a GPU: the same tokens, two engines, restart.

Run on the device by scripts/device_vllm.sh (RUN=tokens or RUN=restart; docs/VLLM.md). What the
layer-level comparison (scripts/vllm_gpu.py) leaves open is here: whole ``vllm.LLM`` engines,
built by vLLM's own ``EngineArgs`` -> ``LLMEngine`` -> worker -> model runner, serving greedy
requests. Three steps, each its own mode:

- ``tokens``: for 22 tiny checkpoints (``cases``: Llama without bias and Qwen2 with q/k/v bias,
  each with per-tensor and per-channel scales, bf16 and fp16, the ``w8a16`` and ``w8a8-marlin``
  profiles; Gemma 2, Granite and Phi-3 with two cases each that cover both scales, both profiles
  and the dtypes vLLM runs them in), one engine process builds, one after another, an engine
  on the checkpoint with vLLM's own Marlin path (``linear_backend="marlin"``), one with
  ``load_format="mpack"`` loading the sidecar privately and one attached to ``mpack serve``;
  each generates the same prompts greedily with the top-5 logprobs of every step. The token
  ids and logprobs must be equal across the three. A control engine takes the sidecar of
  another checkpoint with the same config as the first selected case's, and its logprobs must
  differ: the comparison can fail. ``--only`` picks cases by name (``--only
  gemma2,granite,phi3``: the new families alone).
- ``restart``: the 8B-shaped checkpoint (scripts/synth_checkpoint.py, 9.08 GB). Engines are
  separate processes, timed from their start to ready (and vLLM's own "Model loading took"
  figure): the ordinary path with the page cache dropped and warm; then one ``mpack serve``
  and two engines attached to it at once, both generating, with the GPU memory of every
  process; then one engine killed with SIGKILL and started again, and the survivor generating
  after the kill; last, one engine loading the sidecar privately, for its memory.

The ``w8a16`` profile is vLLM's own choice on the H200 for weight-only FP8 checkpoints: those
cases use a copy of the compressed-tensors checkpoint without activation quantization
(``weight_only``), so no compute capability is stood in. vLLM must run on its CUDA platform:
device_vllm.sh checks which platform vLLM resolves, and where its NVML probe fails it adds the
platform plugin of ``platform_standin`` (docs/VLLM.md, "Engine stand-ins").

    python3 scripts/vllm_engine.py tokens  --mpack-env P --vllm-env P --out DIR [--only A,B]
    python3 scripts/vllm_engine.py restart --mpack-env P --vllm-env P --out DIR [--layers 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# benchutil is beside this file, and the device scripts run Python with PYTHONSAFEPATH=1, which
# keeps a script's own folder off sys.path (tests/test_device_scripts.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import drop_caches, marlin_8b, mpack_spawn  # noqa: E402
from real_checkpoints import answer_text  # noqa: E402

SCHEMES = {"FP8": "tensor", "FP8_DYNAMIC": "channel"}
DTYPES = ("bfloat16", "float16")
PROFILES = ("w8a16", "w8a8-marlin")
#: The (scheme, profile) pairs of a family that does not run the full product: both scales and
#: both profiles, in two engines' worth of cases (the dtypes alternate, ``cases``).
COVER = (("FP8", "w8a16"), ("FP8_DYNAMIC", "w8a8-marlin"))
#: One row per family (arch of ``mpack.fixtures.make_checkpoint``): the keyword arguments its
#: quirk adds to the fixture (as FAMILY_CKPT in tests/vllm/test_vllm_loader.py), the dtypes
#: vLLM runs it in, and whether it runs every (scheme, dtype, profile) or only ``COVER``.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"fixture": {}, "dtypes": DTYPES, "full": True},  # no bias
    "qwen2": {"fixture": {}, "dtypes": DTYPES, "full": True},  # q/k/v bias
    # head_dim 32, not hidden / heads = 64 (as gemma-2-2b's 256); always tied (no lm_head).
    # vLLM refuses Gemma 2 in float16 ("numerical instability").
    "gemma2": {"fixture": {"head_dim": 32}, "dtypes": ("bfloat16",), "full": False},
    "granite": {"fixture": {}, "dtypes": DTYPES, "full": False},
    # qkv_proj and gate_up_proj stored fused; one KV head (replicated at TP > 1)
    "phi3": {"fixture": {"kv_heads": 1}, "dtypes": DTYPES, "full": False},
}
#: AutoFP8 checkpoints (quant_method fp8, mpack.fixtures.make_autofp8_checkpoint): scheme ->
#: its activation scheme. vLLM's Fp8LinearMethod runs them weight-only on Marlin (w8a16).
AUTOFP8 = {"AUTOFP8": "static", "AUTOFP8_DYNAMIC": "dynamic"}
#: (arch, scheme, dtype, profile) of the AutoFP8 cases: as Mistral-7B-Instruct-v0.3-FP8
#: (static) and gemma-2-9b-it-FP8 (dynamic) are.
AUTOFP8_CASES = (
    ("llama", "AUTOFP8", "float16", "w8a16"),
    ("gemma2", "AUTOFP8_DYNAMIC", "bfloat16", "w8a16"),
)
#: The multimodal wrappers (mpack.fixtures.make_wrapper_checkpoint): (wrapper, its language
#: model's --arch or None for the wrapper's own, scheme, dtype, profile, name layout). Both
#: scales, both profiles, both layouts. The engines run them text-only (vLLM's
#: ``language_model_only``: the vision tower is not built, as for a VLM served for text), since
#: no tokenizer or image processor takes part here; tests/vllm compares the towers' tensors.
WRAPPER_CASES = (
    ("llava", "mistral", "FP8", "bfloat16", "w8a16", "legacy"),
    ("mistral3", None, "FP8_DYNAMIC", "float16", "w8a8-marlin", "hf"),
    ("qwen2_5_vl", None, "FP8", "bfloat16", "w8a8-marlin", "legacy"),
    ("gemma3", None, "FP8_DYNAMIC", "bfloat16", "w8a16", "hf"),
)
#: The MoE families (mpack.fixtures_moe): (arch, scheme, dtype). A compressed-tensors MoE
#: checkpoint keeps its input activations (vLLM has no weight-only FP8 MoE scheme), so on the
#: H200 the dense layers run W8A8 on Marlin (w8a8-marlin) and the experts Marlin MoE
#: (``moe_backend="marlin"``, weight-only: the same bytes for either profile).
#: A fourth item: the experts' intermediate size where it is not the fixture's 128; 160 is
#: padded to 192 (marlin_moe_padded_intermediate). Qwen2-MoE adds a shared expert and its gate.
MOE_CASES = (
    ("mixtral", "FP8", "bfloat16"),
    ("qwen3_moe", "FP8_DYNAMIC", "float16"),
    ("mixtral", "AUTOFP8", "bfloat16"),  # as Mixtral-8x7B-Instruct-v0.1-FP8: Fp8MoEMethod, w8a16
    ("qwen2_moe", "FP8", "bfloat16", 160),
    ("qwen2_moe", "AUTOFP8", "bfloat16"),  # as Qwen2-57B-A14B-Instruct-FP8
    ("qwen3_moe", "FP8_DYNAMIC", "bfloat16", 96),  # as one TP-8 rank of Qwen3-30B-A3B: 96 -> 128
    ("llama4", "FP8", "bfloat16"),  # Llama4ForConditionalGeneration, text-only engines
)
#: The MoE families whose model is a multimodal wrapper: their engines run text-only.
MOE_WRAPPERS = ("llama4",)
#: Special tokens of the wrapper fixtures sit at the top of the vocabulary (image, vision start,
#: ...): prompts stay below them.
WRAPPER_SPECIAL_TOKENS = 3
MODES = ("ordinary", "private", "attached")
N_PROMPTS, MAX_TOKENS, TOP_LOGPROBS = 4, 16, 5
READY_TIMEOUT_S = 300
# vLLM's own line at the end of its model load (v1 gpu_model_runner.load_model)
LOAD_LINE = re.compile(r"Model loading took ([0-9.]+) GiB memory and ([0-9.]+) seconds")


def family_combos(arch: str) -> list[tuple[str, str, str]]:
    """(scheme, dtype, profile) of each case of ``arch``: the full product, or ``COVER`` with
    the family's dtypes in turn."""
    row = FAMILIES[arch]
    if row["full"]:
        return [(s, d, p) for s in SCHEMES for d in row["dtypes"] for p in PROFILES]
    return [(s, row["dtypes"][i % len(row["dtypes"])], p) for i, (s, p) in enumerate(COVER)]


def strategy_of(scheme: str) -> str:
    """The part of a case's name that says how its checkpoint is quantized."""
    return f"autofp8-{AUTOFP8[scheme]}" if scheme in AUTOFP8 else SCHEMES[scheme]


def cases() -> list[dict[str, Any]]:
    combos = [(a, s, d, p) for a in FAMILIES for s, d, p in family_combos(a)]
    dense = [
        {
            "arch": a,
            "scheme": s,
            "strategy": strategy_of(s),
            "dtype": d,
            "profile": p,
            "name": f"{a}-{strategy_of(s)}-{d}-{p}",
        }
        for a, s, d, p in [*combos, *AUTOFP8_CASES]
    ]
    wrappers = [
        {
            "arch": w,
            "wrapper": w,
            "text": text,
            "layout": lay,
            "scheme": s,
            "strategy": strategy_of(s),
            "dtype": d,
            "profile": p,
            "name": f"{w}-{lay}-{strategy_of(s)}-{d}-{p}",
        }
        for w, text, s, d, p, lay in WRAPPER_CASES
    ]
    moes = [
        {
            "arch": a,
            "moe": True,
            "scheme": s,
            "strategy": strategy_of(s),
            "dtype": d,
            "profile": p,
            "name": f"{a}-{strategy_of(s)}-{d}-{p}" + "".join(f"-i{i}" for i in inter),
            "moe_intermediate": inter[0] if inter else None,
        }
        for a, s, d, *inter in MOE_CASES
        for p in ["w8a16" if s in AUTOFP8 else "w8a8-marlin"]
    ]
    return dense + wrappers + moes


def selected(only: str) -> list[dict[str, Any]]:
    """The cases whose name holds ``only``, or one of its comma-separated parts (all for an
    empty one): ``"gemma2,phi3"`` is every Gemma 2 and Phi-3 case."""
    parts = [p for p in only.split(",") if p] or [""]
    return [c for c in cases() if any(p in c["name"] for p in parts)]


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """``N_PROMPTS`` prompts of token ids, of different lengths (no tokenizer takes part)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(5 + 7 * i)] for i in range(N_PROMPTS)]


# --- checkpoints (mpack's environment) -------------------------------------------------------


def weight_only(ck: Path) -> None:
    """Make the compressed-tensors checkpoint ``ck`` weight-only FP8, in place: every config
    group's ``input_activations`` becomes null and the ``input_scale`` tensors go. vLLM runs such
    a checkpoint under ``CompressedTensorsW8A16Fp8`` on every GPU (the ``w8a16`` profile)."""
    from safetensors.torch import load_file, save_file

    cfg_path = ck / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2))
    index = ck / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {
            k: v for k, v in idx["weight_map"].items() if not k.endswith(".input_scale")
        }
        index.write_text(json.dumps(idx, indent=2))
    for f in sorted(ck.glob("*.safetensors")):
        tensors = load_file(f)
        save_file(
            {k: v for k, v in tensors.items() if not k.endswith(".input_scale")},
            f,
            metadata={"format": "pt"},
        )


def checkpoint_dir(work: Path, case: dict[str, Any], seed: int = 0) -> Path:
    wo = "-wo" if case["profile"] == "w8a16" else ""
    inter = f"-i{case['moe_intermediate']}" if case.get("moe_intermediate") else ""
    return work / f"ck-{case['arch']}-{case['strategy']}-{case['dtype']}{wo}{inter}-s{seed}"


def tiny_jobs(only: str = "") -> list[tuple[dict[str, Any], int]]:
    """(case, seed) of every tiny checkpoint and sidecar of the selected cases: each at seed 0,
    and the control, the first selected case again at seed 1 (the same config, other
    weights)."""
    sel = selected(only)
    return [(c, 0) for c in sel] + [(sel[0], 1)] if sel else []


def fixture_args(case: dict[str, Any], seed: int) -> dict[str, Any]:
    """``make_checkpoint``'s keyword arguments (beyond the folder) for ``case`` at ``seed``
    (``make_autofp8_checkpoint``'s, with its ``activation``, for an AutoFP8 case)."""
    scheme = case["scheme"]
    if case.get("moe"):
        auto = {"scheme": "FP8", "autofp8": AUTOFP8[scheme]} if scheme in AUTOFP8 else {}
        inter = {"moe_intermediate": case["moe_intermediate"]} if case["moe_intermediate"] else {}
        return {"arch": case["arch"], "scheme": scheme, "dtype": case["dtype"], "seed": seed,
                **auto, **inter}  # fmt: skip
    if "wrapper" in case:
        return {
            "wrapper": case["wrapper"],
            "layout": case["layout"],
            "arch": case["text"],
            "scheme": scheme,
            "dtype": case["dtype"],
            "layers": 2,
            "seed": seed,
        }
    return {
        "arch": case["arch"],
        **({"activation": AUTOFP8[scheme]} if scheme in AUTOFP8 else {"scheme": scheme}),
        "dtype": case["dtype"],
        "layers": 2,
        "seed": seed,
        **FAMILIES[case["arch"]]["fixture"],
    }


def prepare_tiny(work: Path, only: str = "") -> None:
    from mpack.convert import convert
    from mpack.fixtures import make_autofp8_checkpoint, make_checkpoint, make_wrapper_checkpoint

    jobs = tiny_jobs(only)
    for c, seed in jobs:
        ck = checkpoint_dir(work, c, seed)
        if not (ck / "config.json").is_file():
            if c.get("moe"):
                from mpack.fixtures_moe import make_moe_checkpoint

                make_moe_checkpoint(ck, **fixture_args(c, seed))
            elif "wrapper" in c:
                make_wrapper_checkpoint(ck, **fixture_args(c, seed))
                if c["profile"] == "w8a16":
                    weight_only(ck)
            elif c["scheme"] in AUTOFP8:
                make_autofp8_checkpoint(ck, **fixture_args(c, seed))
            else:
                make_checkpoint(ck, **fixture_args(c, seed))
                if c["profile"] == "w8a16":
                    weight_only(ck)
        sc = work / f"sc-{c['name']}-s{seed}"
        if not (sc / "mpack.json").is_file():
            convert(ck, sc, profile=c["profile"], device="auto")
    n = len(jobs) - 1 if jobs else 0
    print(f"prepared {n} checkpoints and sidecars (+1 control) in {work}", flush=True)


# --- one engine (vLLM's environment) ---------------------------------------------------------


def engine_kwargs(run: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` arguments of one run: eager mode, no tokenizer (prompts are token ids),
    Marlin for FP8 linears, a fixed KV cache so that memory figures compare across engines."""
    kw: dict[str, Any] = dict(
        model=run["model"],
        dtype=run["dtype"],
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=run.get("max_model_len", 256),
        max_num_seqs=N_PROMPTS,
        seed=0,
        kv_cache_memory_bytes=run.get("kv_bytes", 256 << 20),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
    )
    if not run.get("unquantized"):  # the bf16 reference of a real model has no FP8 linear
        kw["linear_backend"] = "marlin"
    if run["mode"] != "ordinary":
        extra = {
            "sidecar": run["sidecar"],
            "attach": "never" if run["mode"] == "private" else "require",
        }
        if "check_source" in run:  # the control: a sidecar of other weights, on purpose
            extra["check_source"] = run["check_source"]
        kw.update(load_format="mpack", model_loader_extra_config=extra)
    if run.get("text_only"):
        kw["language_model_only"] = True
    if run.get("moe"):
        kw["moe_backend"] = "marlin"  # the ordinary engine too: the same kernels
    if os.environ.get("MPACK_ENGINE_ATTN"):
        kw["attention_backend"] = os.environ["MPACK_ENGINE_ATTN"]
    return kw


def generate(llm: Any, run: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation of the run's prompts (``prompt_ids``, else ``prompts(vocab)``): token
    ids and the top logprobs of every step, and with a ``tokenizer`` the text of each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = run.get("prompt_ids") or prompts(run["vocab"])
    sp = SamplingParams(
        max_tokens=run.get("max_tokens", MAX_TOKENS),
        temperature=0.0,
        logprobs=TOP_LOGPROBS,
        detokenize=False,
        ignore_eos=True,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
    tokens, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append([{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs])
    out: dict[str, Any] = {"tokens": tokens, "logprobs": logprobs}
    if run.get("tokenizer"):
        out["texts"] = texts_of(run["tokenizer"], tokens)
    return out


def texts_of(tokenizer: str, tokens: list[list[int]]) -> list[str]:
    """Each token sequence as the answer's text (``answer_text``; the comparison covers every
    generated token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return [answer_text(tok, seq) for seq in tokens]


def _model_facts(model: Any) -> dict[str, Any]:
    """Run inside the worker (``LLM.apply_model``): the scheme and kernel of the first FP8
    layer, the attention implementations, and where the Marlin weights come from."""
    facts: dict[str, Any] = {}
    for name, mod in model.named_modules():
        scheme = getattr(mod, "scheme", None)
        if scheme is None and hasattr(getattr(mod, "quant_method", None), "fp8_linear"):
            scheme = mod.quant_method  # an AutoFP8 layer: Fp8LinearMethod
        if scheme is not None and hasattr(mod, "weight"):
            kernel = getattr(scheme, "kernel", None) or getattr(scheme, "fp8_linear", None)
            facts.update(
                layer=name,
                scheme=type(scheme).__name__,
                kernel=type(kernel).__name__ if kernel is not None else None,
            )
            break
    facts["attention"] = sorted(
        {type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")}
    )
    w = getattr(model, "_mpack_weights", None)
    facts["mpack_backend"] = getattr(w, "backend", None) if w is not None else None
    return facts


def engine_facts(llm: Any) -> dict[str, Any]:
    """What the built engine runs: its platform, and ``_model_facts`` of its model."""
    import torch
    from vllm.platforms import current_platform

    facts: dict[str, Any] = {
        "platform": type(current_platform).__name__,
        "torch_allocated_mib": torch.cuda.memory_allocated() >> 20,
    }
    free, total = torch.cuda.mem_get_info()
    facts["device_used_mib"] = (total - free) >> 20  # every process on the GPU
    try:
        facts.update(llm.apply_model(_model_facts)[0])
    except Exception as e:  # noqa: BLE001  (a fact we could not read is recorded, not fatal)
        facts["facts_error"] = f"{type(e).__name__}: {e}"[:300]
    return facts


def build_and_generate(run: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(run))
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = generate(llm, run)
    out.update(build_s=round(built, 3), generate_s=round(time.perf_counter() - t1, 3))
    out["facts"] = engine_facts(llm)
    return llm, out


def release(llm: Any) -> None:
    """Shut one in-process engine down, so that the next one starts clean."""
    import gc

    import torch
    from vllm.distributed import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()


def engine_many(plan: Path, out: Path) -> None:
    """Every run of ``plan`` in this process, one engine after another; results to ``out``
    after each run (a run that fails records its error and the rest go on)."""
    runs = json.loads(plan.read_text())
    results: dict[str, Any] = {}
    for run in runs:
        t = time.perf_counter()
        try:
            llm, r = build_and_generate(run)
            release(llm)
        except Exception as e:  # noqa: BLE001  (recorded; the summary fails the run)
            r = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "where": traceback.format_exc()[-3000:],
            }
        results[run["key"]] = r
        print(
            f"{run['key']}: {time.perf_counter() - t:.1f} s"
            f"{' ERROR ' + r['error'][:300] if 'error' in r else ''}",
            flush=True,
        )
        out.write_text(json.dumps(results))


def engine_one(spec: Path, out: Path, ctl: Path) -> None:
    """One engine of ``restart``, timed from the process start (``MPACK_T0``, wall clock): it
    generates, writes ``out``, prints READY, then obeys ``ctl``: ``gen N`` generates again into
    ``out``.N, ``exit`` ends it."""
    t_start = float(os.environ["MPACK_T0"])
    import vllm  # noqa: F401  (the import is part of the start)

    t_import = time.time()
    run = json.loads(spec.read_text())
    llm, r = build_and_generate(run)
    r.update(
        import_s=round(t_import - t_start, 3),
        ready_s=round(time.time() - t_start, 3),
        pid=os.getpid(),
    )
    out.write_text(json.dumps(r))
    print("READY", flush=True)
    done: set[str] = set()
    while True:
        cmds = ctl.read_text().split() if ctl.exists() else []
        if "exit" in cmds:
            break
        for n in [c for c in cmds if c.isdigit() and c not in done]:
            done.add(n)
            Path(f"{out}.{n}").write_text(json.dumps(generate(llm, run)))
        time.sleep(0.05)
    release(llm)


# --- comparisons -----------------------------------------------------------------------------


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Token ids equal, and the largest difference between the logprobs of the same token ids
    (inf where a step's top tokens differ)."""
    if "error" in a or "error" in b:
        return {"tokens_equal": False, "max_logprob_diff": None}
    worst = 0.0
    for pa, pb in zip(a["logprobs"], b["logprobs"], strict=True):
        for sa, sb in zip(pa, pb, strict=True):
            if sa.keys() != sb.keys():
                worst = float("inf")
                continue
            worst = max([worst, *(abs(sa[t] - sb[t]) for t in sa)])
    return {"tokens_equal": a["tokens"] == b["tokens"], "max_logprob_diff": worst}


def summarize_tokens(results: dict[str, Any], only: str = "") -> dict[str, Any]:
    """Each selected case's private and attached runs against its ordinary one, and the control
    against the first selected case's ordinary run."""
    rows: dict[str, Any] = {}
    sel = selected(only)
    for c in sel:
        base = results.get(f"{c['name']}/ordinary", {"error": "missing"})
        row: dict[str, Any] = {
            "facts": {m: results.get(f"{c['name']}/{m}", {}).get("facts") for m in MODES}
        }
        for m in MODES[1:]:
            row[m] = compare(base, results.get(f"{c['name']}/{m}", {"error": "missing"}))
        got = {m: results.get(f"{c['name']}/{m}", {"error": "missing"}) for m in MODES}
        errors = {m: r["error"] for m, r in got.items() if "error" in r}
        if errors:
            row["errors"] = errors
        rows[c["name"]] = row
    has_control = bool(sel)
    ctl = compare(
        results.get(f"{sel[0]['name']}/ordinary" if sel else "", {"error": "missing"}),
        results.get("control", {"error": "missing"}),
    )
    ok = all(
        r[m]["tokens_equal"] and r[m]["max_logprob_diff"] == 0.0
        for r in rows.values()
        for m in MODES[1:]
    )
    return {
        "all_equal": ok,
        "control_differs": ctl["max_logprob_diff"] not in (None, 0.0) if has_control else None,
        "control": ctl,
        "cases": rows,
    }


# --- orchestration ----------------------------------------------------------------------------


def _env(base: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": base,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.update(extra)
    return env


def gpu_memory() -> dict[str, Any]:
    """nvidia-smi's view: MiB used on the GPU, and by each process."""
    q = ["nvidia-smi", "--format=csv,noheader,nounits"]
    total = subprocess.run([*q, "--query-gpu=memory.used"], capture_output=True, text=True)
    apps = subprocess.run(
        [*q, "--query-compute-apps=pid,used_memory"], capture_output=True, text=True
    )
    per = {}
    for line in apps.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            per[parts[0]] = int(parts[1]) if parts[1].isdigit() else parts[1]
    used = total.stdout.strip().splitlines()
    return {"used_mib": int(used[0]) if used and used[0].isdigit() else None, "per_pid_mib": per}


def _prompt_space(case: dict[str, Any]) -> dict[str, Any]:
    """A run's prompt vocabulary, and for a wrapper, text-only engines."""
    if "wrapper" in case:
        return {"vocab": 1000 - WRAPPER_SPECIAL_TOKENS, "text_only": True}
    if case.get("moe"):
        return {"vocab": 1000, "moe": True, "text_only": case["arch"] in MOE_WRAPPERS}
    return {"vocab": 1000}


def run_plan(
    a: argparse.Namespace, runs: list[dict[str, Any]], sidecars: list[Path], name: str, t0: float
) -> tuple[int, dict[str, Any]]:
    """``runs`` in one engine process (``engine-many``, vLLM's environment), with one
    ``mpack serve`` per sidecar of ``sidecars`` on the GPU (for the attached runs) from before
    the first engine to after the last; its log ``OUT/NAME.log``, its results
    ``OUT/NAME-raw.json``. The engine process's exit code, and the results by run key."""
    plan = a.work / f"{name}-plan.json"
    plan.write_text(json.dumps(runs))
    menv, res = _env(a.mpack_env), a.out / f"{name}-raw.json"
    sp = mpack_spawn(a.mpack_env)
    with contextlib.ExitStack() as stack:
        daemons = [
            stack.enter_context(
                sp.DaemonHandle(
                    sc,
                    device="cuda:0",
                    env=menv,
                    cwd=a.work,
                    log_dir=a.work,
                    timeout=READY_TIMEOUT_S,
                )
            )
            for sc in sidecars
        ]
        for d in daemons:
            d.wait_ready()
        print(f"{len(daemons)} daemons ready: {time.time() - t0:.0f} s", flush=True)
        with open(a.out / f"{name}.log", "w") as log:
            rc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "engine-many",
                 "--plan", str(plan), "--res", str(res)],
                env=_env(a.vllm_env),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=a.timeout,
            ).returncode  # fmt: skip
    return rc, json.loads(res.read_text()) if res.exists() else {}


def tokens(a: argparse.Namespace) -> int:
    me = [sys.executable, str(Path(__file__).resolve())]
    menv = _env(a.mpack_env)
    work = a.work
    sel = selected(a.only)
    if not sel:
        names = ", ".join(c["name"] for c in cases())
        print(f"--only {a.only!r} selects no case; the cases are: {names}", file=sys.stderr)
        return 2
    t = time.time()
    prep = [*me, "prepare-tiny", "--work", str(work), "--only", a.only]
    subprocess.run(prep, env=menv, check=True)
    print(f"prepare: {time.time() - t:.0f} s", flush=True)
    runs = []
    for c in sel:
        for m in MODES:
            runs.append(
                {
                    "key": f"{c['name']}/{m}",
                    "mode": m,
                    "dtype": c["dtype"],
                    **_prompt_space(c),
                    "model": str(checkpoint_dir(work, c)),
                    "sidecar": str(work / f"sc-{c['name']}-s0"),
                }
            )
    c0 = sel[0]
    runs.append(
        {
            "key": "control",
            "mode": "private",
            "dtype": c0["dtype"],
            **_prompt_space(c0),
            "model": str(checkpoint_dir(work, c0)),
            "sidecar": str(work / f"sc-{c0['name']}-s1"),
            # The seed-1 sidecar is not bound to this checkpoint, and the loader would refuse
            # it (Note [a sidecar is bound to its checkpoint] in mpack/binding.py).
            "check_source": False,
        }
    )
    sidecars = [work / f"sc-{c['name']}-s0" for c in sel]
    rc, results = run_plan(a, runs, sidecars, "engine-tokens", t)
    summary = {
        "engine_rc": rc,
        "runs": len(results),
        "only": a.only,
        **summarize_tokens(results, a.only),
    }
    (a.out / "engine-tokens.json").write_text(json.dumps(summary, indent=1))
    brief = {k: v for k, v in summary.items() if k != "cases"}
    brief["failed_cases"] = [
        n
        for n, r in summary["cases"].items()
        if "errors" in r or not all(r[m]["tokens_equal"] for m in MODES[1:])
    ]
    print(json.dumps(brief, indent=1), flush=True)
    return 0 if summary["all_equal"] and summary["control_differs"] is not False else 1


class Engine:
    """One engine process of ``restart`` (``engine-one``), with its control file."""

    def __init__(
        self, me: list[str], env: dict, work: Path, out: Path, role: str, run: dict[str, Any]
    ) -> None:
        self.role, self.res = role, out / f"engine-{role}.json"
        spec = work / f"spec-{role}.json"
        spec.write_text(json.dumps(run))
        self.ctl = work / f"ctl-{role}"
        self.ctl.unlink(missing_ok=True)
        self.log = out / f"engine-{role}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                [
                    *me,
                    "engine-one",
                    "--spec",
                    str(spec),
                    "--res",
                    str(self.res),
                    "--ctl",
                    str(self.ctl),
                ],
                env={**env, "MPACK_T0": repr(time.time())},
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> dict[str, Any]:
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if "READY" in self.log.read_text(errors="replace"):
                r = json.loads(self.res.read_text())
                m = LOAD_LINE.search(self.log.read_text(errors="replace"))
                if m:
                    r["vllm_load_gib"], r["vllm_load_s"] = float(m[1]), float(m[2])
                return r
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"engine {self.role} not ready:\n" + self.log.read_text()[-3000:])

    def command(self, cmd: str) -> None:
        prev = self.ctl.read_text() if self.ctl.exists() else ""
        self.ctl.write_text(prev + cmd + "\n")

    def generate_again(self, n: int) -> dict[str, Any]:
        self.command(str(n))
        path = Path(f"{self.res}.{n}")
        deadline = time.time() + 120
        while not path.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # written whole by then (small)
        return json.loads(path.read_text())

    def stop(self) -> None:
        self.command("exit")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def restart(a: argparse.Namespace) -> int:
    me = [sys.executable, str(Path(__file__).resolve())]
    menv, venv = _env(a.mpack_env), _env(a.vllm_env)
    work, out = a.work, a.out
    t = time.time()
    ck, sc = marlin_8b(work, a.layers, menv)
    print(f"8B-shaped checkpoint and sidecar: {time.time() - t:.0f} s", flush=True)
    partial = out / "engine-restart-partial.json"

    def save() -> None:  # after each step: a run cut short still leaves its record
        partial.write_text(json.dumps(brief(res), indent=1))

    base = {
        "model": str(ck),
        "dtype": "bfloat16",
        "vocab": 128256,
        "sidecar": str(sc),
        "kv_bytes": 2 << 30,
        "max_model_len": 1024,
    }
    res: dict[str, Any] = {"layers": a.layers, "memory": {}}
    mem = res["memory"]
    sp = mpack_spawn(a.mpack_env)

    def one(role: str, mode: str) -> dict[str, Any]:
        e = Engine(me, venv, work, out, role, {**base, "mode": mode})
        r = e.wait_ready()
        mem[role] = gpu_memory()  # while it runs
        e.stop()
        res[role.replace("-", "_")] = r
        save()
        return r

    mem["idle"] = gpu_memory()
    dropped = drop_caches()
    res["ordinary_cold"] = {"dropped_caches": dropped, **one("ordinary-cold", "ordinary")}
    one("ordinary-warm", "ordinary")
    print("ordinary:", res["ordinary_cold"]["ready_s"], res["ordinary_warm"]["ready_s"], flush=True)
    engines: dict[str, Engine] = {}
    try:
        with sp.DaemonHandle(
            sc, device="cuda:0", env=menv, cwd=work, log_dir=work, timeout=READY_TIMEOUT_S
        ) as d:
            ready = d.wait_ready()
            res["serve"] = {
                "ready_s": round(d.ready_s, 3),
                "load_s": ready.load_s,
                "bytes": ready.bytes,
                "pid": ready.pid,
            }
            mem["daemon"] = gpu_memory()
            save()
            for role in ("a", "b"):
                engines[role] = Engine(me, venv, work, out, role, {**base, "mode": "attached"})
                res[f"attached_{role}"] = engines[role].wait_ready()
                mem[f"daemon+{role}"] = gpu_memory()
                save()
            st = subprocess.run(
                [sys.executable, "-m", "mpack", "status", "--json"],
                env=menv,
                capture_output=True,
                text=True,
            )
            res["status_two_engines"] = json.loads(st.stdout or '{"daemons": []}')["daemons"]
            engines["a"].kill()  # SIGKILL: no detach, no goodbye
            time.sleep(0.5)
            res["b_after_a_killed"] = engines["b"].generate_again(1)
            engines["a2"] = Engine(me, venv, work, out, "a2", {**base, "mode": "attached"})
            res["attached_a_restarted"] = engines["a2"].wait_ready()
            mem["daemon+b+a_restarted"] = gpu_memory()
            save()
            for e in engines.values():
                e.stop()
            res["daemon_alive_at_end"] = d.alive()
        if not a.no_private:
            one("private", "private")
    finally:
        for e in engines.values():
            e.kill()
    ref = res["ordinary_warm"]
    runs = (
        "ordinary_cold",
        "attached_a",
        "attached_b",
        "b_after_a_killed",
        "attached_a_restarted",
        "private",
    )
    res["compare"] = {k: compare(ref, res[k]) for k in runs if k in res}
    res["all_equal"] = all(
        c["tokens_equal"] and c["max_logprob_diff"] == 0.0 for c in res["compare"].values()
    )
    record = brief(res)
    (out / "engine-restart.json").write_text(json.dumps(record, indent=1))
    print(
        json.dumps({k: v for k, v in record.items() if k != "status_two_engines"}, indent=1),
        flush=True,
    )
    return 0 if res["all_equal"] else 1


def brief(res: dict[str, Any]) -> dict[str, Any]:
    """``res`` without the logprobs (kept in ``compare``) and with the first prompt's tokens
    only: the record stays readable."""
    out: dict[str, Any] = {}
    for k, v in res.items():
        if isinstance(v, dict) and "tokens" in v:
            v = {**v, "tokens": v["tokens"][:1]}
            v.pop("logprobs", None)
        out[k] = v
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "mode", choices=["tokens", "restart", "prepare-tiny", "engine-many", "engine-one"]
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/mpack-engine"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/mpack-out")))
    ap.add_argument("--mpack-env", default="", help="PYTHONPATH of mpack's environment")
    ap.add_argument("--vllm-env", default="", help="PYTHONPATH of vLLM's environment")
    ap.add_argument("--layers", type=int, default=32, help="restart: layers of the 8B shape")
    ap.add_argument("--timeout", type=float, default=480, help="tokens: the engine process")
    ap.add_argument("--no-private", action="store_true", help="restart: skip the private engine")
    ap.add_argument(
        "--only",
        default="",
        help="tokens: the cases whose name holds this, or one of its comma-separated parts "
        "(e.g. gemma2,granite,phi3)",
    )
    ap.add_argument("--plan", type=Path)
    ap.add_argument("--spec", type=Path)
    ap.add_argument("--res", type=Path)
    ap.add_argument("--ctl", type=Path)
    a = ap.parse_args()
    if a.mode == "prepare-tiny":
        prepare_tiny(a.work, a.only)
        return 0
    if a.mode == "engine-many":
        engine_many(a.plan, a.res)
        return 0
    if a.mode == "engine-one":
        engine_one(a.spec, a.res, a.ctl)
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    return tokens(a) if a.mode == "tokens" else restart(a)


if __name__ == "__main__":
    sys.exit(main())
