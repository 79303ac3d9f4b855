"""mpack.fixtures: generated checkpoints look like the golden inputs and are deterministic."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors import safe_open  # noqa: E402

from mpack.fixtures import main, make_checkpoint  # noqa: E402

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
GOLDEN_TENSOR = "tiny-llama-tensor-w8a16-bf16-tp1"
GOLDEN_CHANNEL = "tiny-llama-channel-w8a16-fp16-tp2"


# --- helpers ---------------------------------------------------------------------------------


def _files(ckpt: Path) -> dict[str, str]:
    """Tensor name -> file name, through the index when there is one."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(_files(ckpt).values())):
        with safe_open(str(ckpt / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _header(path: Path) -> dict:
    """The safetensors JSON header without ``__metadata__``: name -> dtype, shape, offsets."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header


def _check(
    ckpt: Path,
    *,
    scheme: str,
    dtype: torch.dtype,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    bias: bool = False,
    lm_head: bool = True,
) -> dict[str, torch.Tensor]:
    """Assert the structure of a generated checkpoint; return its tensors."""
    from compressed_tensors.quantization import QuantizationConfig

    cfg = json.loads((ckpt / "config.json").read_text())
    assert (ckpt / "generation_config.json").is_file()
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert qc.format == "float-quantized"
    assert qc.quantization_status == "compressed"
    assert qc.ignore == ["lm_head"]
    [group] = qc.config_groups.values()
    assert group.targets == ["Linear"]
    assert group.weights.num_bits == 8 and group.weights.type == "float"
    assert group.weights.strategy == ("tensor" if scheme == "FP8" else "channel")
    if scheme == "FP8":
        assert group.input_activations.strategy == "tensor"
        assert group.input_activations.dynamic is False
    else:
        assert group.input_activations.strategy == "token"
        assert group.input_activations.dynamic is True
    assert cfg["dtype"] == str(dtype).removeprefix("torch.")

    t = _tensors(ckpt)
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    consumed: set[str] = set()
    for i in range(layers):
        for lin in LINEARS:
            x = f"model.layers.{i}.{lin}"
            n, k = shapes[lin]
            w, s = t[f"{x}.weight"], t[f"{x}.weight_scale"]
            consumed |= {f"{x}.weight", f"{x}.weight_scale"}
            assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (n, k), x
            assert s.dtype == dtype, x
            assert tuple(s.shape) == ((1,) if scheme == "FP8" else (n, 1)), x
            assert torch.isfinite(s).all() and (s > 0).all(), x
            # min-max scales: the largest |w| of each tensor (or row) lands on 448
            wf = w.float().abs()
            peak = wf.amax() if scheme == "FP8" else wf.amax(dim=1)
            assert (peak == 448).all(), x
            if scheme == "FP8":
                a = t[f"{x}.input_scale"]
                consumed.add(f"{x}.input_scale")
                assert a.dtype == dtype and tuple(a.shape) == (1,), x
                assert torch.isfinite(a).all() and (a > 0).all(), x
            else:
                assert f"{x}.input_scale" not in t, x
            has_bias = bias and lin in LINEARS[:3]
            assert (f"{x}.bias" in t) == has_bias, x
            if has_bias:
                b = t[f"{x}.bias"]
                consumed.add(f"{x}.bias")
                assert b.dtype == dtype and tuple(b.shape) == (n,), x
                assert (b != 0).any(), x
    rest = {k: v for k, v in t.items() if k not in consumed}
    assert ("lm_head.weight" in rest) == lm_head
    assert tuple(rest["model.embed_tokens.weight"].shape) == (vocab, hidden)
    norms = [k for k in rest if k.endswith("norm.weight")]
    assert "model.norm.weight" in norms
    for k, v in rest.items():
        assert v.dtype == dtype, k
        assert k.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight")), k
    for k in norms:
        assert not (rest[k] == 1).all(), k
    return t


# --- fixtures: one checkpoint per configuration -------------------------------------------------


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama-fp8") / "ckpt")


@pytest.fixture(scope="module")
def llama_dynamic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama-dyn") / "ckpt", scheme="FP8_DYNAMIC")


def _sharded(root: Path) -> Path:
    return make_checkpoint(root / "ckpt", max_shard_size="200KB", scale_in_other_shard=True)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _sharded(tmp_path_factory.mktemp("sharded"))


# --- tests --------------------------------------------------------------------------------------

DEFAULT = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=1000)


def test_llama_fp8_structure(llama_fp8: Path) -> None:
    _check(llama_fp8, scheme="FP8", dtype=torch.bfloat16, **DEFAULT)
    t = _tensors(llama_fp8)
    # q/k/v (and gate/up) read the same normed input: one calibration, same input scale
    x = "model.layers.0.self_attn"
    assert t[f"{x}.q_proj.input_scale"].equal(t[f"{x}.k_proj.input_scale"])
    assert t[f"{x}.q_proj.input_scale"].equal(t[f"{x}.v_proj.input_scale"])


def test_llama_fp8_dynamic_structure(llama_dynamic: Path) -> None:
    _check(llama_dynamic, scheme="FP8_DYNAMIC", dtype=torch.bfloat16, **DEFAULT)


@pytest.mark.parametrize(
    ("case", "fixture"), [(GOLDEN_TENSOR, "llama_fp8"), (GOLDEN_CHANNEL, "llama_dynamic")]
)
def test_same_layout_as_golden_input(
    golden: Path, case: str, fixture: str, request: pytest.FixtureRequest
) -> None:
    """Same tensor names, dtypes, shapes (and offsets) and the same config.json as golden."""
    ckpt: Path = request.getfixturevalue(fixture)
    ref = golden / "cases" / case / "input"
    assert _header(ckpt / "model.safetensors") == _header(ref / "model.safetensors")
    got = json.loads((ckpt / "config.json").read_text())
    exp = json.loads((ref / "config.json").read_text())
    for cfg in (got, exp):  # the versions of the writing libraries may differ
        cfg.pop("transformers_version")
    got_qc, exp_qc = got.pop("quantization_config"), exp.pop("quantization_config")
    assert got == exp
    if got_qc.pop("version") == exp_qc.pop("version"):
        assert got_qc == exp_qc
    else:
        # Another compressed-tensors version wrote it (0.17.0 in .venv-vllm, vLLM's pin): each
        # writes a different set of defaults, so the configs must be equal as it parses them.
        from compressed_tensors.quantization import QuantizationConfig

        def parsed(qc: dict) -> dict:
            return QuantizationConfig.model_validate(qc).model_dump(exclude={"version"})

        assert parsed(got_qc) == parsed(exp_qc)


def test_qwen2_fp8_has_nonzero_qkv_bias(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "q2", arch="qwen2")
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen2"
    _check(ckpt, scheme="FP8", dtype=torch.bfloat16, bias=True, **DEFAULT)


def test_qwen3_dynamic_fp16_with_qk_norm(tmp_path: Path) -> None:
    ckpt = make_checkpoint(
        tmp_path / "q3", arch="qwen3", scheme="FP8_DYNAMIC", dtype="float16", head_dim=32
    )
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] == 32
    dims = {**DEFAULT, "head_dim": 32}
    t = _check(ckpt, scheme="FP8_DYNAMIC", dtype=torch.float16, **dims)
    assert tuple(t["model.layers.0.self_attn.q_norm.weight"].shape) == (32,)
    assert tuple(t["model.layers.1.self_attn.k_norm.weight"].shape) == (32,)


def test_mistral_tied_embeddings(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "mi", arch="mistral", tie_embeddings=True, layers=1)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "mistral"
    _check(ckpt, scheme="FP8", dtype=torch.bfloat16, lm_head=False, **{**DEFAULT, "layers": 1})


def test_padded_smollm_dims(tmp_path: Path) -> None:
    dims = dict(layers=1, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64)
    ckpt = make_checkpoint(tmp_path / "smol", vocab=1024, **dims)
    _check(ckpt, scheme="FP8", dtype=torch.bfloat16, vocab=1024, **dims)


def test_sharded_scale_in_other_shard(sharded: Path) -> None:
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == shards
    # the index and the shard files agree exactly
    seen: dict[str, str] = {}
    for fname in shards:
        with safe_open(str(sharded / fname), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert k not in seen, k
                seen[k] = fname
    assert seen == weight_map
    x = "model.layers.0.self_attn.q_proj"
    assert weight_map[f"{x}.weight_scale"] != weight_map[f"{x}.weight"]
    _check(sharded, scheme="FP8", dtype=torch.bfloat16, **DEFAULT)


def test_same_arguments_give_identical_bytes(sharded: Path, tmp_path: Path) -> None:
    again = _sharded(tmp_path)
    names = sorted(p.name for p in sharded.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (sharded / name).read_bytes() == (again / name).read_bytes(), name


def test_seed_changes_weights(llama_fp8: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        llama_fp8 / "model.safetensors"
    ).read_bytes()


def test_transformers_loads_it(sharded: Path) -> None:
    """A real compressed-tensors checkpoint: transformers' quantizer loads it and runs it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sharded)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7]])).logits
    assert tuple(logits.shape) == (1, 3, 1000)
    assert torch.isfinite(logits).all()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    rc = main(
        [
            str(out),
            "--arch",
            "qwen2",
            "--scheme",
            "FP8_DYNAMIC",
            "--layers",
            "1",
            "--hidden",
            "128",
            "--intermediate",
            "256",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--vocab",
            "256",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(out)
    dims = dict(layers=1, hidden=128, intermediate=256, heads=2, kv_heads=1, head_dim=64)
    _check(out, scheme="FP8_DYNAMIC", dtype=torch.bfloat16, vocab=256, bias=True, **dims)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "gpt2"},
        {"scheme": "W8A16"},
        {"dtype": "float8"},
        {"heads": 4, "kv_heads": 3},
        {"arch": "qwen2", "head_dim": 32},
        {"scale_in_other_shard": True},
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()
