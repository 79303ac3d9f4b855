"""`mpack convert` end to end: golden cases through the CLI, and real tiny checkpoints checked
against an independent statement of SPEC §3-§9 (fusion, TP slices, KV replication, padding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpack.convert import marlin
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.fixtures import make_checkpoint
from mpack.sidecar import ALIGN, read_file_map
from tests.convert.helpers import same_bytes, tensors
from tests.convert.reference import expected_bias, expected_scale_row, independent_unpack

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def check_sidecar_rules(
    out: Path, *, profile: str, act_dtype: str, tp: int, fusion: str = "vllm"
) -> dict:
    """SPEC §9: manifest keys and values, files, 64-byte alignment, stock safetensors readable."""
    m = json.loads((out / "mpack.json").read_text())
    assert m["format"] == "mpack-sidecar" and m["format_version"] == 2
    assert m["target"] == {
        "kernel": "marlin-fp8",
        "engine": "vllm",
        "engine_version": "0.33.0",
        "profile": profile,
        "act_dtype": act_dtype,
        "tp_size": tp,
        "fusion": fusion,
    }
    assert m["source"]["files"] and all(len(f["sha256"]) == 64 for f in m["source"]["files"])
    listed = {f["name"] for f in m["files"]}
    on_disk = {p.name for p in out.iterdir()} - {"mpack.json"}
    assert listed == on_disk
    for r in range(tp):
        assert f"rank-{r:02d}-of-{tp:02d}.safetensors" in listed
    assert "config.json" in listed
    for name in listed:
        if not name.endswith(".safetensors"):
            continue
        file_map = read_file_map(out / name)
        first = min(e.offset for e in file_map.entries)
        assert first % ALIGN == 0, f"{name}: data section starts at {first}"
        for e in file_map.entries:
            if e.nbytes % ALIGN == 0:
                assert e.offset % ALIGN == 0, f"{name}: {e.name} at {e.offset}"
        tensors(out / name)  # the stock reader accepts it
    return m


# --- golden cases, through the CLI --------------------------------------------------------


def _cases(golden_dir: Path) -> list[Path]:
    return sorted(p for p in (golden_dir / "cases").iterdir() if (p / "case.json").is_file())


def _golden_dir() -> Path:
    from tests.conftest import _golden_dir as g

    return g()


@pytest.mark.parametrize("case_dir", _cases(_golden_dir()), ids=lambda p: p.name)
def test_golden_case_cli(case_dir: Path, tmp_path: Path):
    case = json.loads((case_dir / "case.json").read_text())
    out = tmp_path / "out"
    args = [
        "convert",
        str(case_dir / case["input"]),
        "-o",
        str(out),
        "--profile",
        case["profile"],
        "--act-dtype",
        case["act_dtype"],
        "--tp",
        str(case["tp"]),
        "--device",
        "cpu",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(case["expected_files"])
    for name in case["expected_files"]:
        got, exp = tensors(out / name), tensors(case_dir / "expected" / name)
        assert got.keys() == exp.keys(), name
        for k in exp:
            assert same_bytes(got[k], exp[k]), f"{name}: {k}"
    check_sidecar_rules(out, profile=case["profile"], act_dtype=case["act_dtype"], tp=case["tp"])
    for copied in ("config.json", "generation_config.json"):
        assert (out / copied).read_bytes() == (case_dir / case["input"] / copied).read_bytes()


# --- real tiny checkpoints against an independent reference -------------------------------

SMOL = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=1, vocab=1024)
MODELS = {
    "llama-tensor": dict(arch="llama", scheme="FP8"),
    "llama-channel": dict(arch="llama", scheme="FP8_DYNAMIC"),
    "qwen2-bias": dict(arch="qwen2", scheme="FP8", hidden=256, heads=4, kv_heads=2),
    "qwen3": dict(arch="qwen3", scheme="FP8", head_dim=32),
    "sharded": dict(arch="llama", scheme="FP8", max_shard_size="200KB", scale_in_other_shard=True),
    # SmolLM2-135M's dims, one layer: every fused layer needs padding in N
    "smollm-padded": dict(arch="llama", scheme="FP8", **SMOL),
    "smollm-padded-channel": dict(arch="llama", scheme="FP8_DYNAMIC", dtype="float16", **SMOL),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: make_checkpoint(root / name, **kw) for name, kw in MODELS.items()}


def _source(ck: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ck.glob("*.safetensors")):
        out.update(tensors(f))
    return out


def _reference(ck: Path, *, profile: str, tp: int, rank: int) -> dict[str, dict]:
    """SPEC §6 in the test's own words: per output layer, fused rows, per-channel scales, bias."""
    cfg = json.loads((ck / "config.json").read_text())
    src = _source(ck)
    H, Hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    d = (
        cfg["hidden_size"] // H
        if cfg["model_type"] == "qwen2"
        else (cfg.get("head_dim") or cfg["hidden_size"] // H)
    )
    nq = H // tp
    nkv, rep = (1, tp // Hkv) if tp >= Hkv else (Hkv // tp, 1)
    q_rows = slice(rank * nq * d, (rank + 1) * nq * d)
    kv_rows = slice((rank // rep) * nkv * d, (rank // rep + 1) * nkv * d)
    gu_rows = slice(rank * inter // tp, (rank + 1) * inter // tp)
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        groups = {
            p + "self_attn.qkv_proj": [
                (p + "self_attn.q_proj", q_rows, None),
                (p + "self_attn.k_proj", kv_rows, None),
                (p + "self_attn.v_proj", kv_rows, None),
            ],
            p + "self_attn.o_proj": [(p + "self_attn.o_proj", None, (rank, tp))],
            p + "mlp.gate_up_proj": [
                (p + "mlp.gate_proj", gu_rows, None),
                (p + "mlp.up_proj", gu_rows, None),
            ],
            p + "mlp.down_proj": [(p + "mlp.down_proj", None, (rank, tp))],
        }
        for name, pieces in groups.items():
            ws, scales, biases, shard_scale = [], [], [], []
            for mod, rows, cols in pieces:
                w = src[mod + ".weight"].view(torch.uint8)
                s = src[mod + ".weight_scale"].float().reshape(-1)
                if cols is not None:
                    k = w.shape[1] // cols[1]
                    w = w[:, cols[0] * k : (cols[0] + 1) * k]
                if rows is not None:
                    w = w[rows]
                    s = s[rows] if s.numel() > 1 else s
                ws.append(w)
                shard_scale.append(s)
                if mod + ".bias" in src:
                    b = src[mod + ".bias"]
                    biases.append(b[rows] if rows is not None else b)
            if shard_scale[0].numel() == 1 and profile == "w8a8-marlin":
                s_max = torch.stack([s.reshape(()) for s in shard_scale]).max()
                ws = [
                    marlin.requantize(w, s.reshape(()), s_max)
                    for w, s in zip(ws, shard_scale, strict=True)
                ]
                shard_scale = [s_max.reshape(1) for _ in ws]
            for w, s in zip(ws, shard_scale, strict=True):
                scales.append(s.expand(w.shape[0]) if s.numel() == 1 else s)
            out[name] = {
                "w": torch.cat(ws),
                "s": torch.cat(scales),
                "b": torch.cat(biases) if biases else None,
            }
    return out


def _check_against_reference(ck: Path, out: Path, *, profile: str, act_dtype: str, tp: int) -> None:
    dt = DT[act_dtype]
    for rank in range(tp):
        got = tensors(out / f"rank-{rank:02d}-of-{tp:02d}.safetensors")
        ref = _reference(ck, profile=profile, tp=tp, rank=rank)
        assert {k.rsplit(".", 1)[0] for k in got} == set(ref)
        for name, exp in ref.items():
            n, k = exp["w"].shape
            packed = got[name + ".weight"]
            np_, kp = packed.shape[1] // 4, packed.shape[0] * 16
            assert (np_, kp) == marlin.marlin_padded_nk(n, k), name
            full = independent_unpack(packed)
            assert torch.equal(full[:n, :k], exp["w"]), f"rank {rank}: {name} weight bytes"
            assert not full[n:].any() and not full[:, k:].any(), f"{name}: padding must be zero"
            assert same_bytes(got[name + ".weight_scale"], expected_scale_row(exp["s"], dt, np_)), (
                name
            )
            if exp["b"] is not None:
                assert same_bytes(got[name + ".bias"], expected_bias(exp["b"], dt, np_)), name
            else:
                assert name + ".bias" not in got


def _check_passthrough(ck: Path, out: Path) -> None:
    src = _source(ck)
    common = tensors(out / "common.safetensors")
    consumed = (".weight", ".weight_scale", ".input_scale", ".bias")
    quantized = {k[: -len(".weight_scale")] for k in src if k.endswith(".weight_scale")}
    expect = {k for k in src if not any(k == q + c for q in quantized for c in consumed)}
    assert set(common) == expect
    for k in expect:
        assert same_bytes(common[k], src[k]), k


CONVERSIONS = [
    ("llama-tensor", "w8a16", "bfloat16", 1),
    ("llama-tensor", "w8a16", "float16", 2),
    ("llama-tensor", "w8a8-marlin", "bfloat16", 2),
    ("llama-tensor", "w8a8-marlin", "float16", 4),  # 4 ranks on 2 KV heads: KV replication
    ("llama-tensor", "w8a16", "bfloat16", 4),
    ("llama-channel", "w8a16", "float16", 1),
    ("llama-channel", "w8a8-marlin", "bfloat16", 2),
    ("llama-channel", "w8a16", "bfloat16", 4),
    ("qwen2-bias", "w8a16", "bfloat16", 1),
    ("qwen2-bias", "w8a8-marlin", "float16", 2),
    ("qwen2-bias", "w8a16", "bfloat16", 4),
    ("qwen3", "w8a16", "bfloat16", 2),
    ("sharded", "w8a16", "bfloat16", 2),
    ("sharded", "w8a8-marlin", "bfloat16", 1),
    ("smollm-padded", "w8a16", "bfloat16", 1),
    ("smollm-padded", "w8a8-marlin", "float16", 3),
    ("smollm-padded-channel", "w8a16", "float16", 3),
]


@pytest.mark.parametrize("model, profile, act_dtype, tp", CONVERSIONS, ids=lambda v: str(v))
def test_convert_matches_reference(models, tmp_path, model, profile, act_dtype, tp):
    ck, out = models[model], tmp_path / "sidecar"
    result = run_convert(
        ck, out, ConvertOptions(profile=profile, act_dtype=act_dtype, tp=tp, device="cpu")
    )
    assert not result.up_to_date and result.manifest["target"]["tp_size"] == tp
    check_sidecar_rules(out, profile=profile, act_dtype=act_dtype, tp=tp)
    _check_against_reference(ck, out, profile=profile, act_dtype=act_dtype, tp=tp)
    _check_passthrough(ck, out)


def test_profiles_agree_on_channel_and_differ_on_tensor(models, tmp_path):
    """SPEC §2: channel strategy gives identical bytes in both profiles; tensor strategy does
    not."""
    for model, same in (("llama-channel", True), ("llama-tensor", False)):
        a = run_convert(
            models[model], tmp_path / f"{model}-a", ConvertOptions(profile="w8a16", device="cpu")
        )
        b = run_convert(
            models[model],
            tmp_path / f"{model}-b",
            ConvertOptions(profile="w8a8-marlin", device="cpu"),
        )
        ta = tensors(a.out / "rank-00-of-01.safetensors")
        tb = tensors(b.out / "rank-00-of-01.safetensors")
        assert ta.keys() == tb.keys()
        assert all(same_bytes(ta[k], tb[k]) for k in ta) is same, model


def test_qwen2_bias_lands_in_qkv(models, tmp_path):
    out = tmp_path / "s"
    m = run_convert(models["qwen2-bias"], out, ConvertOptions(device="cpu")).manifest
    assert m["layers"]["model.layers.0.self_attn.qkv_proj"]["bias"] is True
    assert m["layers"]["model.layers.0.self_attn.o_proj"]["bias"] is False
    got = tensors(out / "rank-00-of-01.safetensors")
    assert got["model.layers.0.self_attn.qkv_proj.bias"].abs().sum() > 0


def test_act_dtype_defaults_to_checkpoint_dtype(models, tmp_path):
    m = run_convert(
        models["smollm-padded-channel"], tmp_path / "s", ConvertOptions(device="cpu")
    ).manifest
    assert m["target"]["act_dtype"] == "float16"
    assert m["model"]["config"]["hidden_size"] == 576


def test_fuse_none_keeps_checkpoint_names(models, tmp_path):
    ck, out = models["llama-tensor"], tmp_path / "s"
    m = run_convert(ck, out, ConvertOptions(fuse="none", device="cpu")).manifest
    got = tensors(out / "rank-00-of-01.safetensors")
    src = _source(ck)
    q = "model.layers.1.self_attn.q_proj"
    assert q in m["layers"] and "model.layers.1.self_attn.qkv_proj" not in m["layers"]
    w = src[q + ".weight"].view(torch.uint8)
    assert torch.equal(independent_unpack(got[q + ".weight"])[: w.shape[0], : w.shape[1]], w)
    s = src[q + ".weight_scale"].float().reshape(-1).expand(w.shape[0])
    assert same_bytes(got[q + ".weight_scale"], expected_scale_row(s, torch.bfloat16, w.shape[0]))


def test_no_passthrough(models, tmp_path):
    out = tmp_path / "s"
    run_convert(models["llama-tensor"], out, ConvertOptions(passthrough=False, device="cpu"))
    assert not (out / "common.safetensors").exists()
    assert (out / "rank-00-of-01.safetensors").is_file()


def test_cli_json_summary_and_inspect(models, tmp_path):
    out = tmp_path / "s"
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpack.cli",
            "convert",
            str(models["qwen2-bias"]),
            "-o",
            str(out),
            "--tp",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["up_to_date"] is False and doc["target"]["tp_size"] == 2
    assert set(doc["files"]) >= {
        "rank-00-of-02.safetensors",
        "rank-01-of-02.safetensors",
        "common.safetensors",
    }
    assert doc["manifest_digest"] and doc["bytes"] == sum(doc["files"].values())
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "inspect", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (
        r.returncode == 0
        and "model.layers.0.self_attn.qkv_proj" in r.stdout
        and doc["manifest_digest"] in r.stdout
    )
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "inspect", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(r.stdout)["target"]["tp_size"] == 2
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "verify", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    rep = json.loads(r.stdout)
    assert (
        r.returncode == 0
        and rep["ok"]
        and rep["source_checked"]
        and rep["layers_checked"] == 8 * 2 // 2 * 2
    )


# --- GPU: identical bytes --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case_dir", _cases(_golden_dir()), ids=lambda p: p.name)
def test_gpu_golden_case(case_dir: Path, tmp_path: Path):
    case = json.loads((case_dir / "case.json").read_text())
    out = tmp_path / "out"
    run_convert(
        case_dir / case["input"],
        out,
        ConvertOptions(
            profile=case["profile"], act_dtype=case["act_dtype"], tp=case["tp"], device="cuda"
        ),
    )
    for name in case["expected_files"]:
        got, exp = tensors(out / name), tensors(case_dir / "expected" / name)
        assert got.keys() == exp.keys()
        for k in exp:
            assert same_bytes(got[k], exp[k]), f"{name}: {k}"


@pytest.mark.gpu
@pytest.mark.parametrize("model, profile, act_dtype, tp", CONVERSIONS[::2], ids=lambda v: str(v))
def test_gpu_and_cpu_sidecars_identical(models, tmp_path, model, profile, act_dtype, tp):
    a = run_convert(
        models[model],
        tmp_path / "cpu",
        ConvertOptions(profile=profile, act_dtype=act_dtype, tp=tp, device="cpu"),
    )
    b = run_convert(
        models[model],
        tmp_path / "gpu",
        ConvertOptions(profile=profile, act_dtype=act_dtype, tp=tp, device="cuda"),
    )
    assert a.manifest["files"] == b.manifest["files"]
