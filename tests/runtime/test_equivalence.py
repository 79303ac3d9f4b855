"""Model-output equivalence, end to end, the way an engine would use a sidecar: converted,
served by a daemon, attached from two separate processes, each running the model on the
attached bytes. The reference is transformers on the original checkpoint
(verify/forward.py, Note [equivalence tolerance] for the tolerances)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.fixtures import make_checkpoint
from mpack.verify.forward import REL_TOL, forward_check, reference_model, score
from mpack.verify.model import greedy_generate
from tests.runtime.rt_helpers import DaemonProc, child_env

HERE = Path(__file__).resolve().parent
CLIENT = HERE / "equivalence_client.py"
STEPS, PROMPTS, PROMPT_LEN = 16, 2, 8
SMOL = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=1, vocab=1024)

MODELS = {
    "llama-tensor-bf16": dict(arch="llama", scheme="FP8"),
    "llama-channel-fp16": dict(arch="llama", scheme="FP8_DYNAMIC", dtype="float16"),
    "qwen2-bias-tensor-bf16": dict(arch="qwen2", scheme="FP8"),
    "qwen2-bias-channel-fp16": dict(arch="qwen2", scheme="FP8_DYNAMIC", dtype="float16"),
    "qwen2-bias-tensor-fp16": dict(arch="qwen2", scheme="FP8", dtype="float16"),
    "qwen2-bias-tensor-fp32": dict(arch="qwen2", scheme="FP8", dtype="float32"),
    "padded-tensor-bf16": dict(arch="llama", scheme="FP8", **SMOL),
    "padded-channel-fp16": dict(arch="llama", scheme="FP8_DYNAMIC", dtype="float16", **SMOL),
}
CASES = [  # (model, profile, tp)
    ("llama-tensor-bf16", "w8a16", 1),
    ("llama-tensor-bf16", "w8a8-marlin", 1),
    ("llama-channel-fp16", "w8a16", 1),
    ("qwen2-bias-tensor-bf16", "w8a16", 1),
    ("qwen2-bias-tensor-bf16", "w8a8-marlin", 1),
    ("qwen2-bias-channel-fp16", "w8a8-marlin", 1),
    ("padded-tensor-bf16", "w8a16", 1),
    ("padded-channel-fp16", "w8a16", 1),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eq-ckpts")
    return {name: make_checkpoint(root / name, **kw) for name, kw in MODELS.items()}


def _reference(ck: Path, manifest: dict, device: str) -> tuple[torch.Tensor, dict]:
    """Random prompts and, per compute dtype, the reference's greedy tokens and logits."""
    act = manifest["target"]["act_dtype"]
    vocab = manifest["model"]["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    refs = {}
    for name in ("float32", act):
        model = reference_model(ck, manifest, getattr(torch, name)).to(device)
        tokens, logits = greedy_generate(model, ids.to(device), STEPS)
        refs[name] = (tokens.cpu(), logits.cpu())
    return ids, refs


def _serve_and_attach(
    sidecar: Path, tp: int, device: str, ids: torch.Tensor, refs: dict, work: Path
) -> list[dict]:
    """One daemon per rank; two client processes attach all ranks and run the model."""
    xdg = Path(tempfile.mkdtemp(prefix="mpk-", dir="/tmp"))  # short: sockets live under it
    env = child_env(xdg)
    daemons = [DaemonProc(sidecar, device, env, work, "--rank", str(r)) for r in range(tp)]
    try:
        for d in daemons:
            d.wait_ready()
        prompts = work / "prompts.pt"
        torch.save({"input_ids": ids, "tokens": {k: v[0] for k, v in refs.items()}}, prompts)
        outs = [work / f"client{i}.pt" for i in range(2)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(CLIENT), str(sidecar), str(tp), device, str(prompts), str(o)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for o in outs
        ]
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
        for d in daemons:
            assert d.alive(), "the daemon must keep serving"
        return [torch.load(o) for o in outs]
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(xdg, ignore_errors=True)


def _check(results: list[dict], refs: dict) -> None:
    assert results[0]["pid"] != results[1]["pid"]
    for res in results:
        for name, (ref_tokens, ref_logits) in refs.items():
            r = res[name]
            s = score(ref_tokens, ref_logits, r["tokens"], r["tf_logits"], name)
            assert r["zero_copy"], f"{name}: the model must read the attached memory, not a copy"
            assert s["logits_close"], (
                f"{name}: max |logit diff| {s['max_logit_diff']:.3g} > {s['tolerance']:.3g}"
            )
            assert s["decisive_steps_agree"], f"{name}: a greedy choice with a clear margin differs"
            if name == "float32":
                assert s["tokens_identical"], (
                    f"greedy tokens differ: {s['our_tokens']} vs {s['ref_tokens']}"
                )
    # the two processes computed the same thing from the same bytes
    for name in refs:
        assert torch.equal(results[0][name]["tokens"], results[1][name]["tokens"])
        assert torch.equal(results[0][name]["tf_logits"], results[1][name]["tf_logits"])


def _run_case(checkpoints, tmp_path, model, profile, tp, device) -> tuple[list[dict], dict]:
    ck = checkpoints[model]
    sidecar = tmp_path / "sidecar"
    manifest = run_convert(
        ck, sidecar, ConvertOptions(profile=profile, tp=tp, device="cpu")
    ).manifest
    ids, refs = _reference(ck, manifest, "cpu" if device == "cpu" else device)
    results = _serve_and_attach(sidecar, tp, device, ids, refs, tmp_path)
    _check(results, refs)
    return results, refs


@pytest.mark.slow
@pytest.mark.parametrize("model, profile, tp", CASES, ids=lambda v: str(v))
def test_served_model_matches_reference(checkpoints, tmp_path, model, profile, tp):
    _run_case(checkpoints, tmp_path, model, profile, tp, "cpu")


@pytest.mark.slow
def test_tp2_two_daemons_match_tp1(checkpoints, tmp_path):
    """Rank 0 and rank 1 served by two daemons; the combined forward equals the TP 1 one."""
    tp2, refs = _run_case(
        checkpoints, tmp_path / "tp2", "qwen2-bias-tensor-bf16", "w8a16", 2, "cpu"
    )
    tp1, _ = _run_case(checkpoints, tmp_path / "tp1", "qwen2-bias-tensor-bf16", "w8a16", 1, "cpu")
    a, b = tp2[0]["float32"], tp1[0]["float32"]
    assert torch.equal(a["tokens"], b["tokens"])
    scale = refs["float32"][1].abs().max().item()
    assert (a["tf_logits"] - b["tf_logits"]).abs().max().item() <= REL_TOL["float32"] * scale


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model, profile, tp",
    [
        ("llama-tensor-bf16", "w8a16", 1),
        ("qwen2-bias-channel-fp16", "w8a8-marlin", 1),
        ("padded-tensor-bf16", "w8a16", 1),
        ("qwen2-bias-tensor-bf16", "w8a16", 2),
    ],
    ids=lambda v: str(v),
)
def test_gpu_served_model_matches_reference(checkpoints, tmp_path, model, profile, tp):
    _run_case(checkpoints, tmp_path, model, profile, tp, "cuda:0")


def test_reference_linear_equals_dense_on_8b_shapes():
    """marlin_linear == x @ dequant(W)^T + b in fp32, on random layers of the Llama-3.1-8B
    shapes."""
    from mpack.convert import marlin
    from mpack.target import padded_nk
    from mpack.verify.reference import marlin_linear

    g = torch.Generator().manual_seed(0)
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        w8 = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        w8[(w8 & 0x7F) == 0x7F] = 0  # no NaN codes
        scale = torch.rand(n, generator=g) * 1e-3 + 1e-5
        bias = torch.randn(n, generator=g)
        np_, kp = padded_nk(n, k)
        packed = marlin.pack_weight(w8, np_, kp)
        s = marlin.pack_scales(scale, torch.bfloat16, np_)
        b = marlin.pack_bias(bias, torch.bfloat16, np_)
        x = torch.randn(3, k, generator=g)
        dense = w8.view(torch.float8_e4m3fn).float() * scale.to(torch.bfloat16).float()[:, None]
        want = x @ dense.T + bias.to(torch.bfloat16).float()
        got = marlin_linear(x, packed, s, b, n=n, k=k, out_dtype=torch.float32)
        # the same fp32 products, summed in another order: |err| <= K * 2^-24 * sum|x w|
        bound = k * 2.0**-24 * (x.abs() @ dense.abs().T) + 1e-6
        assert ((got - want).abs() <= bound).all(), (n, k)
        assert got.to(torch.bfloat16).dtype == marlin_linear(x, packed, s, b, n=n, k=k).dtype


@pytest.mark.slow
def test_verify_forward_cli(checkpoints, tmp_path):
    """`mpack verify --forward`: greedy tokens and logit differences, as JSON for CI."""
    import json

    sidecar = tmp_path / "s"
    run_convert(checkpoints["qwen2-bias-tensor-bf16"], sidecar, ConvertOptions(tp=2, device="cpu"))
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "verify", str(sidecar), "--forward", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    fwd = doc["forward"]
    assert doc["ok"] and fwd["ok"] and fwd["tp"] == 2
    fp32, low = fwd["runs"]
    assert fp32["dtype"] == "float32" and fp32["tokens_identical"]
    assert len(fp32["ref_tokens"]) == 2 and len(fp32["ref_tokens"][0]) == 16
    assert low["dtype"] == "bfloat16" and low["max_logit_diff"] <= low["tolerance"]


def test_verify_forward_with_a_missing_source_is_exit_2(checkpoints, tmp_path):
    sidecar = tmp_path / "s"
    run_convert(checkpoints["llama-tensor-bf16"], sidecar, ConvertOptions(device="cpu"))
    missing = tmp_path / "no-such-checkpoint"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpack.cli",
            "verify",
            str(sidecar),
            "--forward",
            "--source",
            str(missing),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "no-such-checkpoint" in r.stderr and "Traceback" not in r.stderr


# The checkpoint's dtype is not the act dtype: the sidecar's scales and bias are rounded to the
# act dtype (vLLM's Marlin keeps them there), and the reference must use those values too (issue
# 11; Note [act-dtype scales and bias]). Both archs x both directions x both profiles, tp 1 and 2.
ACT_CASES = [  # (model, --act-dtype, profile, tp)
    ("qwen2-bias-tensor-fp16", "bfloat16", "w8a8-marlin", 2),  # the case of issue 11
    ("qwen2-bias-tensor-fp16", "bfloat16", "w8a16", 1),
    ("llama-channel-fp16", "bfloat16", "w8a8-marlin", 1),
    ("llama-channel-fp16", "bfloat16", "w8a16", 2),
    ("llama-tensor-bf16", "float16", "w8a16", 1),
    ("llama-tensor-bf16", "float16", "w8a8-marlin", 2),
    ("qwen2-bias-tensor-bf16", "float16", "w8a8-marlin", 1),
    ("qwen2-bias-tensor-bf16", "float16", "w8a16", 2),
    ("qwen2-bias-tensor-fp32", "bfloat16", "w8a8-marlin", 2),
]


@pytest.fixture
def one_thread():
    """torch on one thread: on a shared 2-core runner its OpenMP barriers otherwise stall (a
    forward check took 0.6 s on one thread and up to 23 s on two, under the same load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _forward(checkpoints, tmp_path, model, act, profile, tp) -> dict:
    ck = checkpoints[model]
    sidecar = tmp_path / "s"
    run_convert(ck, sidecar, ConvertOptions(profile=profile, act_dtype=act, tp=tp, device="cpu"))
    return forward_check(sidecar, ck)


@pytest.mark.parametrize("model, act, profile, tp", ACT_CASES, ids=lambda v: str(v))
def test_forward_check_act_dtype_other_than_checkpoint(
    checkpoints, tmp_path, one_thread, model, act, profile, tp
):
    report = _forward(checkpoints, tmp_path, model, act, profile, tp)
    fp32, low = report["runs"]
    assert low["dtype"] == act
    assert fp32["logits_close"], f"float32: {fp32['max_logit_diff']:.3g} > {fp32['tolerance']:.3g}"
    assert fp32["tokens_identical"] and report["ok"], report


@pytest.mark.parametrize("tensor", ["weight_scale", "bias"])
def test_forward_check_fails_a_scale_or_bias_one_ulp_off(
    checkpoints, tmp_path, one_thread, monkeypatch, tensor
):
    """The check still catches the error it now models: every scale (or bias) of one layer of rank
    1 one bf16 ulp off makes the float32 run differ beyond its tolerance (the same sidecar
    unchanged passes: ACT_CASES[0])."""
    from mpack.runtime import loader

    real_load = loader.load

    def load_corrupted(sidecar, *, rank=0, device="cpu"):
        w = real_load(sidecar, rank=rank, device=device)
        if rank == 1:  # a private, writable copy: each value one bf16 ulp away from zero
            w[f"model.layers.0.self_attn.qkv_proj.{tensor}"].view(torch.int16).add_(1)
        return w

    monkeypatch.setattr(loader, "load", load_corrupted)
    report = _forward(checkpoints, tmp_path, "qwen2-bias-tensor-fp16", "bfloat16", "w8a8-marlin", 2)
    fp32 = report["runs"][0]
    assert not report["ok"] and not fp32["logits_close"], fp32
    assert fp32["max_logit_diff"] > 3 * fp32["tolerance"], fp32


def test_verify_forward_on_cuda_without_cuda_is_a_usage_error(
    checkpoints, tmp_path, one_thread, monkeypatch, capsys
):
    """`verify --forward --device cuda:0` where there is no CUDA: exit 2 with a hint, no
    traceback."""
    from mpack.cli import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as here; on a GPU box too
    ck = checkpoints["llama-tensor-bf16"]
    sidecar = tmp_path / "s"
    run_convert(ck, sidecar, ConvertOptions(device="cpu"))
    argv = ["verify", str(sidecar), "--source", str(ck), "--forward", "--device", "cuda:0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cuda:0" in err and "--device cpu" in err and "internal error" not in err, err
    assert main([*argv[:-1], "gpu"]) == 2
    assert "--device must be cpu, cuda or cuda:N" in capsys.readouterr().err
