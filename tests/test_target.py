"""mpack/target.py: the target's facts, checked against facts found elsewhere.

The activation dtypes against torch's own description of the float formats (``torch.finfo``);
the padding rule and the packed shapes against the golden vectors' recorded ``(Np, Kp)`` and the
tensors actually stored in the golden cases' expected rank files; the names against SPEC §9.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors import safe_open

from mpack import target
from mpack.target import ACT_DTYPES, act_dtype, packed_specs, packed_weight_shape, padded_nk

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _exponent_bias(dt: torch.dtype) -> int:
    """The exponent bias of a float format: its smallest normal is ``2**(1 - bias)``."""
    return 1 - int(math.log2(torch.finfo(dt).smallest_normal))


# --- the activation dtypes ------------------------------------------------------------------


def test_act_dtypes_are_the_two_16_bit_floats_by_their_safetensors_names(tmp_path: Path) -> None:
    assert set(ACT_DTYPES) == set(TORCH)
    for name, a in ACT_DTYPES.items():
        assert a.name == name
        path = tmp_path / f"{name}.safetensors"
        safetensors.torch.save_file({"x": torch.zeros(1, dtype=TORCH[name])}, str(path))
        with safe_open(str(path), framework="pt") as f:
            assert f.get_slice("x").get_dtype() == a.st, name


@pytest.mark.parametrize("name", sorted(TORCH))
def test_exp_fold_is_the_exponent_bias_difference_to_fp8(name: str) -> None:
    """SPEC §7.5: widening FP8 e4m3 by bit shifts scales by 2**(bias(fp8) - bias(dt))."""
    fp8 = _exponent_bias(torch.float8_e4m3fn)
    assert fp8 == 7
    assert ACT_DTYPES[name].exp_fold == 2.0 ** (_exponent_bias(TORCH[name]) - fp8)


@pytest.mark.parametrize("name", sorted(TORCH))
def test_fold_limit_is_the_largest_scale_that_stays_finite_after_the_fold(name: str) -> None:
    a, dt = ACT_DTYPES[name], TORCH[name]
    limit = torch.tensor(a.fold_limit, dtype=dt)
    assert float(limit) == a.fold_limit  # exactly representable in dt
    assert torch.isfinite(limit * a.exp_fold) and float(limit * a.exp_fold) == torch.finfo(dt).max
    above = torch.nextafter(limit, torch.tensor(math.inf, dtype=dt))
    assert torch.isinf(above * a.exp_fold)


@pytest.mark.parametrize("bad", ["float32", "BF16", "", None, ["bfloat16"]])
def test_act_dtype_refuses_other_names_with_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match="must be one of bfloat16, float16") as e:
        act_dtype(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(e.value)
    assert act_dtype("float16") is ACT_DTYPES["float16"]


# --- names --------------------------------------------------------------------------------


def test_names_are_the_ones_spec_9_requires() -> None:
    from tests.conftest import SHARED

    spec = SHARED / "SPEC-marlin-fp8.md"  # the contract itself is not vendored, only its data
    if not spec.is_file():
        pytest.skip(f"the SPEC is not beside this clone ({spec} is absent)")
    text = " ".join(spec.read_text().split())
    m = re.search(r'"kernel": "([^"]+)", "engine": "([^"]+)", "engine_version": "([^"]+)"', text)
    assert m and m.groups() == (target.KERNEL, target.ENGINE, target.ENGINE_VERSION)
    alternatives = dict(re.findall(r'"(profile|act_dtype|fusion)": ((?:"[^"]+"\|?)+)', text))
    assert tuple(re.findall(r'"([^"]+)"', alternatives["profile"])) == target.PROFILES
    assert tuple(re.findall(r'"([^"]+)"', alternatives["fusion"])) == target.FUSIONS
    assert set(re.findall(r'"([^"]+)"', alternatives["act_dtype"])) == set(ACT_DTYPES)


# --- padding and packed shapes ----------------------------------------------------------------


def _vector_index(path: Path) -> dict[str, dict]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["index"])


def test_padded_nk_and_weight_shape_match_the_golden_layer_vectors(golden: Path) -> None:
    path = golden / "vectors" / "layers.safetensors"
    index = _vector_index(path)
    assert len(index) >= 10
    with safe_open(str(path), framework="pt") as f:
        for lid, info in index.items():
            assert padded_nk(info["N"], info["K"]) == (info["Np"], info["Kp"]), lid
            packed = f.get_slice(f"{lid}.packed")
            assert packed.get_dtype() == "I32"
            assert tuple(packed.get_shape()) == packed_weight_shape(info["Np"], info["Kp"]), lid


def test_padded_np_matches_the_golden_scale_vectors(golden: Path) -> None:
    """The scale vectors record N and Np; any K that needs no padding gives that Np."""
    path = golden / "vectors" / "scales.safetensors"
    index = _vector_index(path)
    with safe_open(str(path), framework="pt") as f:
        for sid, info in index.items():
            assert padded_nk(info["N"], 128)[0] == info["Np"], sid
            for name, a in ACT_DTYPES.items():
                got = f.get_slice(f"{sid}.{name}")
                want = packed_specs("x", info["Np"], 128, name, sid.startswith("bias"))[-1]
                assert (got.get_dtype(), tuple(got.get_shape())) == want[1:], (sid, name)
                assert a.st == got.get_dtype()


def _golden_case_layers(case: Path) -> dict[str, tuple[int, int]]:
    """``(n, k)`` of every output layer of a golden case, from its input checkpoint's weight
    shapes and SPEC §6 in words: the fused shards' rows add up; column-parallel layers split N
    by TP, row-parallel ones split K (every case here has TP <= KV heads)."""
    opts = json.loads((case / "case.json").read_text())
    tp = opts["tp"]
    with safe_open(str(case / opts["input"] / "model.safetensors"), framework="pt") as f:
        shape = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 - not a dict
    cfg = json.loads((case / opts["input"] / "config.json").read_text())
    assert tp <= cfg["num_key_value_heads"]
    fused = {
        "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    }
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, parts in fused.items():
            n = sum(shape[f"{p}.{s}.weight"][0] for s in parts)
            out[f"{p}.{name}"] = (n // tp, shape[f"{p}.{parts[0]}.weight"][1])
        for row in ("self_attn.o_proj", "mlp.down_proj"):
            n, k = shape[f"{p}.{row}.weight"]
            out[f"{p}.{row}"] = (n, k // tp)
    return out


def test_packed_specs_are_every_tensor_of_the_golden_rank_files(golden: Path) -> None:
    cases = sorted(p for p in (golden / "cases").iterdir() if (p / "case.json").is_file())
    assert cases
    for case in cases:
        opts = json.loads((case / "case.json").read_text())
        layers = _golden_case_layers(case)
        want = {}
        for name, (n, k) in layers.items():
            np_, kp = padded_nk(n, k)
            for t, dt, shape in packed_specs(name, np_, kp, opts["act_dtype"], bias=False):
                want[t] = (dt, shape)
        for r in range(opts["tp"]):
            path = case / "expected" / f"rank-{r:02d}-of-{opts['tp']:02d}.safetensors"
            got = {
                name: (info["dtype"], tuple(info["shape"]))
                for name, info in safetensors.deserialize(path.read_bytes())
            }
            assert got == want, (case.name, r)


def test_packed_specs_order_and_bias() -> None:
    assert packed_specs("m.qkv_proj", 128, 256, "float16", True) == [
        ("m.qkv_proj.weight", "I32", (16, 512)),
        ("m.qkv_proj.weight_scale", "F16", (1, 128)),
        ("m.qkv_proj.bias", "F16", (128,)),
    ]
    assert [s[0] for s in packed_specs("m.o", 64, 128, "bfloat16", False)] == [
        "m.o.weight",
        "m.o.weight_scale",
    ]
    with pytest.raises(ValueError, match="activation dtype"):
        packed_specs("m.o", 64, 128, "float32", False)


def test_padded_nk_pads_nothing_that_already_fits_a_tile() -> None:
    """SPEC §3.3: nothing is padded when N%64==0 and K%128==0, or N%128==0 and K%64==0;
    otherwise the result is one of the two candidates and covers (N, K)."""
    for n in range(4, 700, 4):
        for k in (4, 16, 60, 64, 96, 128, 192, 200, 256, 576, 640):
            np_, kp = padded_nk(n, k)
            if (n % 64 == 0 and k % 128 == 0) or (n % 128 == 0 and k % 64 == 0):
                assert (np_, kp) == (n, k)
            assert np_ >= n and kp >= k
            assert (np_ % 64 == 0 and kp % 128 == 0) or (np_ % 128 == 0 and kp % 64 == 0)
            assert np_ - n < 128 and kp - k < 128


@pytest.mark.parametrize("n, k", [(0, 128), (64, 0), (-64, 128)])
def test_padded_nk_refuses_empty_layers(n: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"N={n}, K={k}"):
        padded_nk(n, k)
