"""MoE checkpoints (issue 39) through ``mpack convert``: the stacked expert layers it plans and
writes, and the bad inputs it refuses (exit 2, the tensor or config key named, nothing left).

That the bytes are vLLM's own is tests/vllm/test_vllm_moe.py's (vLLM's real classes)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mpack.fixtures_moe import make_moe_checkpoint  # noqa: E402
from tests.convert.helpers import (  # noqa: E402
    assert_refused,
    cli,
    edit_config,
    explain,
    manifest,
    read_tensor,
    set_tensors,
)

B = "model.layers.1.block_sparse_moe"  # the block most cases break (Mixtral)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("moe") / "ck", arch="mixtral")


@pytest.fixture
def ck(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ck"))


def test_experts_are_stacked_layers_of_the_manifest(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, "--tp", "2", "--quiet")
    assert r.returncode == 0, explain(r)
    layers = manifest(out)["layers"]
    w13, w2 = (layers[f"{B}.experts.routed_experts.{p}"] for p in ("w13", "w2"))
    assert (w13["experts"], w13["n"], w13["k"], w13["np"], w13["kp"]) == (4, 128, 256, 128, 256)
    assert (w2["experts"], w2["n"], w2["k"]) == (4, 256, 64)
    assert [s["module"] for s in w13["shards"]] == [f"{B}.experts.0.w1", f"{B}.experts.0.w3"]
    assert w13["requantized"] is True and w2["requantized"] is False  # per-tensor: w13 only
    assert f"{B}.gate.weight" not in str(layers)  # the router passes through
    from safetensors import safe_open

    with safe_open(str(out / "rank-01-of-02.safetensors"), "pt") as f:
        assert list(f.get_slice(f"{B}.experts.routed_experts.w13_weight").get_shape()) == [
            4, 16, 512,
        ]  # fmt: skip
        assert f.get_slice(f"{B}.experts.routed_experts.w2_weight_scale").get_shape() == [4, 1, 256]
        assert f"{B}.gate.weight" not in f.keys()  # noqa: SIM118
    r = cli("verify", out, "--source", ck)
    assert r.returncode == 0, explain(r)


def _drop(*names: str):
    return lambda ck: set_tensors(ck, {}, drop=names)


def _reshape_w1(ck: Path) -> None:
    name = f"{B}.experts.2.w1.weight"
    w = read_tensor(ck, name)
    set_tensors(ck, {name: w[:64].contiguous()})


def _quantize_router(ck: Path) -> None:
    w = read_tensor(ck, f"{B}.gate.weight").float()
    s = w.abs().amax().reshape(1) / 448
    set_tensors(
        ck,
        {f"{B}.gate.weight": (w / s).to(torch.float8_e4m3fn), f"{B}.gate.weight_scale": s},
    )


def _remake(**sizes: Any):
    def remake(ck: Path) -> None:
        shutil.rmtree(ck)
        make_moe_checkpoint(ck, arch="mixtral", **sizes)

    return remake


def _config(**values: Any):
    return lambda ck: edit_config(ck, lambda c: c.update(values))


#: name -> (how the checkpoint is broken, convert's extra args, what the message must hold)
BAD = {
    "expert-missing": (
        _drop(
            f"{B}.experts.3.w3.weight",
            f"{B}.experts.3.w3.weight_scale",
            f"{B}.experts.3.w3.input_scale",
        ),  # fmt: skip
        (),
        (f"{B}.experts.3.w3: no FP8 weight", "num_local_experts=4", "download it again"),
    ),
    "expert-shapes-differ": (
        _reshape_w1,
        (),
        (f"{B}.experts.2.w1.weight is [64, 256]", "implies [128, 256]", "intermediate_size 128"),
    ),
    "router-quantized": (
        _quantize_router,
        (),
        (f"quantized module '{B}.gate'", "is not part of vLLM's fused Llama-family linears"),
    ),
    "expert-count-not-config": (
        _config(num_local_experts=3),
        (),
        ("expert 3, but config.json says num_local_experts=3", "different models"),
    ),
    "hidden-not-a-tile": (
        _remake(hidden=96, heads=2, kv_heads=1, moe_intermediate=64),
        (),
        ("hidden_size 96 is not a multiple of 64", "its limit, not mpack's", "--moe-backend"),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_moe_checkpoint_is_refused(ck: Path, tmp_path: Path, case: str) -> None:
    breaks, args, expect = BAD[case]
    breaks(ck)
    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, *args)
    assert_refused(r, out, *expect)


def test_verify_names_the_expert_whose_bytes_differ(ck: Path, tmp_path: Path) -> None:
    """A changed byte in expert 2's slice of a stacked tensor, the manifest's digests made to
    match: verify reports the stacked tensor once and reads back that expert's slice alone."""
    from mpack.iokit import chunk_digests
    from mpack.sidecar import load_manifest, read_file_map, write_manifest
    from mpack.verify import verify

    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, "--quiet")
    assert r.returncode == 0, explain(r)
    rank = "rank-00-of-01.safetensors"
    w13 = f"{B}.experts.routed_experts.w13_weight"
    e = read_file_map(out / rank).entry(w13)
    data = bytearray((out / rank).read_bytes())
    data[e.offset + e.nbytes // 4 * 2 + 100] ^= 0x40  # inside expert 2 of 4
    (out / rank).write_bytes(data)
    m, _ = load_manifest(out)
    (entry,) = [f for f in m["files"] if f["name"] == rank]
    entry["chunks"]["sha256"] = chunk_digests(out / rank, entry["chunks"]["bytes"])
    write_manifest(out, m)
    report = verify(out, source=ck)
    assert report.problems == [
        f"{rank}: {w13} differs from the tensor re-derived from the source",
        f"{rank}: {w13} (expert 2) does not unpack to the requantized bytes",
    ]


def test_intermediate_is_padded_per_shard_as_vllm_pads_it(tmp_path: Path) -> None:
    """128 at --tp 4 is 32 per rank, which vLLM pads to 64 (marlin_moe_padded_intermediate):
    w13 holds [gate 32 | 0 | up 32 | 0] with scales 0 on the zero rows, w2 32 columns then
    zeros. Per-channel scales, so the bytes are the checkpoint's (no requantization). (That
    these are vLLM's bytes is tests/vllm/test_vllm_moe.py's, padded cases.)"""
    from safetensors import safe_open

    from mpack.convert import marlin

    ck = make_moe_checkpoint(tmp_path / "ck", arch="mixtral", scheme="FP8_DYNAMIC")
    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, "--tp", "4", "--quiet")
    assert r.returncode == 0, explain(r)
    layers = manifest(out)["layers"]
    w13, w2 = (layers[f"{B}.experts.routed_experts.{p}"] for p in ("w13", "w2"))
    assert (w13["n"], w13["np"], [s.get("pad") for s in w13["shards"]]) == (64, 128, [32, 32])
    assert (w2["k"], w2["kp"]) == (32, 64)
    rank, e = 1, 3
    with safe_open(str(out / f"rank-{rank:02d}-of-04.safetensors"), "pt") as f:
        w13_w, w13_s, w2_w = (
            f.get_tensor(f"{B}.experts.routed_experts.{t}")[e]
            for t in ("w13_weight", "w13_weight_scale", "w2_weight")
        )
    rows = marlin.unpack_weight(w13_w, 128, 256)
    mine = slice(32 * rank, 32 * (rank + 1))
    gate, up = (
        read_tensor(ck, f"{B}.experts.{e}.{m}.weight").view(torch.uint8) for m in ("w1", "w3")
    )
    assert torch.equal(rows[:32], gate[mine]) and torch.equal(rows[64:96], up[mine])
    assert not rows[32:64].any() and not rows[96:].any()
    scales = marlin.unpack_scales(w13_s, 128)
    assert (scales[:32] != 0).all() and (scales[64:96] != 0).all()
    assert not scales[32:64].any() and not scales[96:].any()
    cols = marlin.unpack_weight(w2_w, 256, 64)
    down = read_tensor(ck, f"{B}.experts.{e}.w2.weight").view(torch.uint8)
    assert torch.equal(cols[:, :32], down[:, mine]) and not cols[:, 32:].any()
    r = cli("verify", out, "--source", ck)
    assert r.returncode == 0, explain(r)


def test_expert_parallel_target_holds_whole_experts_per_rank(ck: Path, tmp_path: Path) -> None:
    """--ep on (vLLM's --enable-expert-parallel): rank r of 2 holds experts 2r and 2r+1 whole,
    byte for byte the TP-1 sidecar's slices of the stacked tensors (made in the same run: one
    read); the attention stays TP-sharded as in the plain TP-2 target. Names: tp2ep-..., and
    at --tp 1, --ep on is the TP-1 target (one rank holds every expert either way)."""
    from safetensors import safe_open

    out = tmp_path / "out"
    r = cli("convert", ck, "-o", out, "--tp", "1,2", "--ep", "off,on", "--quiet")
    assert r.returncode == 0, explain(r)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16", "tp2ep-w8a16-bfloat16"]
    ep, tp1, tp2 = (out / n for n in ("tp2ep-w8a16-bfloat16", names[0], names[1]))
    m = manifest(ep)
    assert m["target"]["expert_parallel"] is True
    assert "expert_parallel" not in manifest(tp2)["target"]
    w13, w2 = (m["layers"][f"{B}.experts.routed_experts.{p}"] for p in ("w13", "w2"))
    assert (w13["experts"], w13["n"], w2["k"]) == (2, 256, 128)  # whole intermediate, 2 of 4
    with safe_open(str(tp1 / "rank-00-of-01.safetensors"), "pt") as one:
        for rank in range(2):
            with (
                safe_open(str(ep / f"rank-{rank:02d}-of-02.safetensors"), "pt") as mine,
                safe_open(str(tp2 / f"rank-{rank:02d}-of-02.safetensors"), "pt") as plain,
            ):
                for name in mine.keys():  # noqa: SIM118
                    got = mine.get_tensor(name)
                    want = (
                        one.get_tensor(name)[2 * rank : 2 * rank + 2]
                        if ".experts." in name
                        else plain.get_tensor(name)
                    )
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    r = cli("verify", ep, "--source", ck)
    assert r.returncode == 0, explain(r)
    r = cli("inspect", ep)
    assert r.returncode == 0 and "expert parallel" in r.stdout and "experts per rank" in r.stdout


@pytest.mark.parametrize(
    ("how", "args", "expect"),
    [
        (
            "uneven",
            ("--tp", "4", "--ep", "on"),
            ("num_local_experts=6 experts do not split into --tp 4", "mpack's limit", "--ep off"),
        ),
        ("bad-value", ("--tp", "2", "--ep", "yes"), ("--ep takes off or on, got 'yes'",)),
    ],
)
def test_expert_parallel_refusals(
    ck: Path, tmp_path: Path, how: str, args: tuple[str, ...], expect: tuple[str, ...]
) -> None:
    if how == "uneven":
        _remake(experts=6)(ck)
    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, *args)
    assert_refused(r, out, *expect)


def test_expert_parallel_target_of_a_dense_model_is_refused(tmp_path: Path) -> None:
    from mpack.fixtures import make_checkpoint

    ck = make_checkpoint(tmp_path / "dense")
    out = tmp_path / "sc"
    r = cli("convert", ck, "-o", out, "--tp", "2", "--ep", "on")
    assert_refused(r, out, "--ep on splits a mixture-of-experts model's experts", "has none")
