"""convert/marlin.py against SPEC §3-§10, the golden vectors, and an independent unpack."""

from __future__ import annotations

import pytest
import torch

from mpack.convert import host_repack
from mpack.convert import marlin as m
from tests.convert.reference import independent_unpack, load_vectors, rand_bytes

# Llama-3.1-8B linears as [N, K]: qkv, o, gate_up, down.
LLAMA8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


# --- SPEC §10 vectors -------------------------------------------------------------------


def _words(w_kn: torch.Tensor) -> list[int]:
    packed = m.pack_weight(w_kn.T.contiguous().to(torch.uint8))
    return [int(x) & 0xFFFFFFFF for x in packed.reshape(-1)], packed


def test_spec_vector_w_equals_k():
    k, n = torch.meshgrid(torch.arange(128), torch.arange(64), indexing="ij")
    words, packed = _words(k)
    assert packed.shape == (8, 256)
    assert words[0:8] == [0x09010800] * 8
    assert words[8:16] == [0x0B030A02] * 8
    assert words[255] == 0x0F070E06
    assert words[256] == 0x19111810  # row 1, word 0


def test_spec_vector_w_equals_n():
    k, n = torch.meshgrid(torch.arange(128), torch.arange(64), indexing="ij")
    words, _ = _words(n)
    assert words[0:8] == [
        0x00000000,
        0x08080808,
        0x10101010,
        0x18181818,
        0x20202020,
        0x28282828,
        0x30303030,
        0x38383838,
    ]
    assert words[32] == 0x01010101
    assert words[255] == 0x3F3F3F3F


def test_spec_vector_mixed():
    k, n = torch.meshgrid(torch.arange(128), torch.arange(64), indexing="ij")
    words, _ = _words((131 * k + 29 * n + 7) % 256)
    assert words[0] == 0xA28A1F07
    assert words[255] == 0xD7BF543C


@pytest.mark.parametrize(
    "scale, dt, cast_bits, folded_bits",
    [
        (0.0012345, torch.bfloat16, 0x3AA2, 0x76A2),
        (0.0012345, torch.float16, 0x150E, 0x350E),
        (3e-5, torch.float16, 0x01F7, 0x1FDC),
    ],
)
def test_spec_vector_scale_fold(scale, dt, cast_bits, folded_bits):
    s = torch.tensor([scale], dtype=torch.float32)
    assert int(s.to(dt).view(torch.int16)) & 0xFFFF == cast_bits
    packed = m.pack_scales(m.broadcast_scales(s, 64), dt, 64)
    assert packed.dtype == dt and packed.shape == (1, 64)
    assert set((packed.view(torch.int16).reshape(-1).int() & 0xFFFF).tolist()) == {folded_bits}


def _rq(byte: int, s: float, s_max: float) -> int:
    return int(m.requantize(torch.tensor([byte], dtype=torch.uint8), s, s_max)[0])


def test_spec_vector_requant_shards():
    q, k, v = 0.002, 0.004, 0.001
    cases = {
        0x38: (0x30, 0x38, 0x28),
        0x7E: (0x76, 0x7E, 0x6E),
        0xB8: (0xB0, 0xB8, 0xA8),
        0x01: (0x01, 0x01, 0x00),
    }
    for byte, expect in cases.items():
        assert tuple(_rq(byte, s, 0.004) for s in (q, k, v)) == expect, hex(byte)
    # through the fused helper too: shard widths and s_max
    w = torch.tensor([[0x38, 0x7E, 0xB8, 0x01]] * 3, dtype=torch.uint8)
    out, s_max = m.requantize_shards(w, [q, k, v], [1, 1, 1])
    assert s_max == float(torch.tensor(0.004, dtype=torch.float32))
    assert out.tolist() == [
        [0x30, 0x76, 0xB0, 0x01],
        [0x38, 0x7E, 0xB8, 0x01],
        [0x28, 0x6E, 0xA8, 0x00],
    ]


def test_spec_vector_requant_single_shard_and_nan():
    assert _rq(0x01, 1e-5, 1e-5) == 0x00
    assert _rq(0x02, 1e-5, 1e-5) == 0x03
    assert _rq(0x7F, 0.01, 0.01) == 0x7E
    assert _rq(0xFF, 0.01, 0.01) == 0x7E
    assert _rq(0x80, 0.01, 0.01) == 0x80  # -0.0 keeps its sign


# --- golden vector files (bit-exact) ----------------------------------------------------


@pytest.mark.parametrize("packer", ["native", "ops"])
def test_golden_layers(golden, packer):
    """Both CPU repacks of the torch backend: the native one and torch's ops (this module's)."""
    from mpack.convert.backends.torch import pack_weight

    if packer == "native" and not host_repack.available():
        pytest.skip("the native repack is not built here")
    t, index = load_vectors(golden / "vectors" / "layers.safetensors")
    assert index, "layers.safetensors has no index"
    for lid, info in index.items():
        wck, expect = t[f"{lid}.wck"], t[f"{lid}.packed"]
        assert m.marlin_padded_nk(info["N"], info["K"]) == (info["Np"], info["Kp"]), lid
        got = pack_weight(wck.view(torch.uint8), info["Np"], info["Kp"], packer)
        assert got.dtype == torch.int32 and got.shape == expect.shape, lid
        assert torch.equal(got, expect), lid
        assert torch.equal(m.unpack_weight(got, info["N"], info["K"]), wck), lid
        if f"{lid}.repack_nopad" in t:
            assert torch.equal(m.repack(wck), t[f"{lid}.repack_nopad"]), lid


def test_golden_scales_and_bias(golden):
    t, index = load_vectors(golden / "vectors" / "scales.safetensors")
    assert index
    for sid, info in index.items():
        for name, dt in m.TORCH_ACT_DTYPES.items():
            expect = t[f"{sid}.{name}"]
            if sid.startswith("bias"):
                src = t[f"{sid}.bias_f32"]
                got = m.pack_bias(src, dt, info["Np"])
                back = m.unpack_bias(got, info["N"])
            else:
                src = t[f"{sid}.scale_f32"]
                got = m.pack_scales(src, dt, info["Np"])
                back = m.unpack_scales(got, info["N"])
            assert got.dtype == expect.dtype and got.shape == expect.shape, (sid, name)
            assert torch.equal(got.view(torch.int16), expect.view(torch.int16)), (sid, name)
            assert torch.equal(back.view(torch.int16), src.to(dt).view(torch.int16)), (sid, name)


def test_golden_requant(golden):
    t, _ = load_vectors(golden / "vectors" / "requant.safetensors")
    codes, s_shard, s_max, expect = t["codes"], t["s_shard"], t["s_max"], t["expected"]
    assert codes.tolist() == list(range(256))
    for p in range(s_shard.numel()):
        got = m.requantize(codes, s_shard[p], s_max[p])
        bad = (got != expect[p]).nonzero().reshape(-1).tolist()
        assert not bad, (
            f"pair {p} ({float(s_shard[p])} -> {float(s_max[p])}): codes {bad[:8]} differ"
        )


def test_golden_shard_scales_broadcast(golden):
    """The per-shard golden entry is what broadcast_scales makes from three shard scalars."""
    t, _ = load_vectors(golden / "vectors" / "scales.safetensors")
    s = torch.tensor([0.002, 0.004, 0.001], dtype=torch.float32)
    assert torch.equal(
        m.broadcast_scales(s, 256, [128, 64, 64]), t["shards_q128_k64_v64.scale_f32"]
    )


# --- round trips, padding, separability -------------------------------------------------


@pytest.mark.parametrize(
    "n, k",
    [
        (64, 16),
        (64, 64),
        (64, 128),
        (96, 192),
        (128, 64),
        (192, 256),
        (200, 300),
        (960, 576),
        (576, 1536),
        (1, 4),
        (130, 132),
        (1000, 256),
    ],
)
def test_round_trip_and_independent_unpack(n, k):
    w = rand_bytes(n, k, seed=n * 7919 + k)
    np_, kp = m.marlin_padded_nk(n, k)
    packed = m.pack_weight(w.view(torch.float8_e4m3fn))
    assert packed.dtype == torch.int32 and packed.shape == (kp // 16, 4 * np_)
    assert torch.equal(m.unpack_weight(packed, n, k), w)
    full = independent_unpack(packed)  # [Np, Kp]
    assert torch.equal(full[:n, :k], w)
    assert not full[n:].any() and not full[:, k:].any(), "padding must be zero bytes"


@pytest.mark.parametrize("n, k", LLAMA8B_SHAPES)
def test_round_trip_llama8b_shapes(n, k):
    w = rand_bytes(n, k, seed=1)
    assert m.marlin_padded_nk(n, k) == (n, k)
    packed = m.pack_weight(w)
    assert packed.shape == (k // 16, 4 * n)
    assert torch.equal(m.unpack_weight(packed, n, k), w)
    # spot-check against the index form on one k-tile row and the first n-tiles
    rows = packed[:2, : 4 * 128].contiguous()
    assert torch.equal(independent_unpack(rows), w[:128, :32])


@pytest.mark.parametrize("workers", [None, 3])
@pytest.mark.parametrize("block_bytes", [1, 64 * 256 * 3, 1 << 40])
def test_repack_blocks_match_one_pass(monkeypatch, block_bytes, workers):
    """Note [repack in blocks]: any block size (one n-tile, a remainder block, the whole layer),
    in this thread or on a pool, gives the bytes of the independent unpack; torch's thread count
    is back to what it was afterwards."""
    n, k = 64 * 7, 256  # 7 n-tiles: blocks of 3 leave a remainder of 1
    w = rand_bytes(n, k, seed=77)
    monkeypatch.setattr(m, "REPACK_BLOCK_BYTES", block_bytes)
    threads = torch.get_num_threads()
    if workers is None:
        packed = m.repack(w)
    else:
        with host_repack.block_pool(workers) as pool:
            packed = m.pack_weight(w, pool=pool)
    assert torch.get_num_threads() == threads
    assert packed.shape == (k // 16, 4 * n)
    assert torch.equal(independent_unpack(packed), w)


def test_padding_rule():
    assert m.marlin_padded_nk(64, 64) == (64, 128)  # full tie: (64,128) vs (128,64) -> the first
    assert m.marlin_padded_nk(96, 192) == (128, 192)
    assert m.marlin_padded_nk(960, 576) == (1024, 576)
    assert m.marlin_padded_nk(128, 128) == (128, 128)
    assert m.marlin_padded_nk(576, 1536) == (576, 1536)  # SmolLM2-135M o_proj
    assert m.marlin_padded_nk(1536, 576) == (1536, 576)  # SmolLM2-135M gate
    for n, k in [(64, 128), (128, 64), (6144, 4096)]:
        assert m.marlin_padded_nk(n, k) == (n, k)


def test_separability_along_n_and_k():
    a, b, c = (
        rand_bytes(64, 256, 1),
        rand_bytes(192, 256, 2),
        rand_bytes(128, 256, 3),
    )
    fused = m.repack(torch.cat([a, b, c]))
    assert torch.equal(fused, torch.cat([m.repack(a), m.repack(b), m.repack(c)], dim=1))
    w = rand_bytes(128, 256, 4)
    full = m.repack(w)
    assert torch.equal(m.repack(w[:, 48:112].contiguous()), full[3:7])


def test_scales_broadcast_variants():
    n = 256
    one = torch.tensor([0.5], dtype=torch.bfloat16)
    assert torch.equal(m.broadcast_scales(one, n), torch.full((n,), 0.5))
    assert torch.equal(m.broadcast_scales(torch.tensor(0.25), n), torch.full((n,), 0.25))
    ch = torch.rand(n, 1, dtype=torch.float16)
    assert torch.equal(m.broadcast_scales(ch, n), ch.reshape(-1).float())
    with pytest.raises(ValueError, match="cannot broadcast"):
        m.broadcast_scales(torch.rand(3), n)
    with pytest.raises(ValueError, match="do not sum"):
        m.broadcast_scales(torch.rand(3), n, [100, 100, 100])


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_scale_and_bias_round_trip_with_padding(dt):
    n = 200
    np_, _ = m.marlin_padded_nk(n, 256)
    s = torch.rand(n) * 0.01 + 1e-4
    packed = m.pack_scales(s, dt, np_)
    assert packed.shape == (1, np_) and packed.dtype == dt
    assert torch.equal(m.unpack_scales(packed, n), s.to(dt))
    assert not m.unpack_scales(packed, np_)[n:].any(), "padded scales must be zero"
    bias = torch.randn(n)
    pb = m.pack_bias(bias, dt, np_)
    assert pb.shape == (np_,) and torch.equal(m.unpack_bias(pb, n), bias.to(dt))


def test_scale_permutation_is_the_spec_one():
    s = torch.arange(64, dtype=torch.float32)
    packed = m.pack_scales(s, torch.bfloat16, 64)
    unfolded = (packed.float() / 2.0**120).reshape(-1)
    expect = [32 * g + p for g in range(2) for p in m.SCALE_PERM]
    assert unfolded.tolist() == [float(x) for x in expect]


def test_rejects_bad_inputs():
    with pytest.raises(TypeError):
        m.pack_weight(torch.zeros(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="N % 64"):
        m.repack(torch.zeros(65, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        m.pack_scales(torch.ones(64), torch.float32, 64)


# --- GPU: identical bytes on CUDA -------------------------------------------------------


@pytest.mark.gpu
def test_gpu_matches_cpu_golden(golden):
    t, index = load_vectors(golden / "vectors" / "layers.safetensors")
    for lid in index:
        got = m.pack_weight(t[f"{lid}.wck"].cuda())
        assert got.is_cuda and torch.equal(got.cpu(), t[f"{lid}.packed"]), lid
    t, index = load_vectors(golden / "vectors" / "scales.safetensors")
    for sid, info in index.items():
        for name, dt in m.TORCH_ACT_DTYPES.items():
            src = t[f"{sid}.bias_f32" if sid.startswith("bias") else f"{sid}.scale_f32"].cuda()
            fn = m.pack_bias if sid.startswith("bias") else m.pack_scales
            got = fn(src, dt, info["Np"]).cpu()
            assert torch.equal(got.view(torch.int16), t[f"{sid}.{name}"].view(torch.int16)), sid
    t, _ = load_vectors(golden / "vectors" / "requant.safetensors")
    codes = t["codes"].cuda()
    for p in range(t["s_shard"].numel()):
        got = m.requantize(codes, t["s_shard"][p], t["s_max"][p]).cpu()
        assert torch.equal(got, t["expected"][p]), p


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(200, 300), (960, 576), *LLAMA8B_SHAPES])
def test_gpu_matches_cpu_random(n, k):
    w = rand_bytes(n, k, seed=5)
    cpu = m.pack_weight(w)
    gpu = m.pack_weight(w.cuda())
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(m.unpack_weight(gpu, n, k).cpu(), w)
    scales = torch.tensor([0.002, 3e-5, 2e-7], dtype=torch.float32)
    widths = [n // 3, n // 3, n - 2 * (n // 3)]
    rq_cpu, _ = m.requantize_shards(w, scales, widths)
    rq_gpu, _ = m.requantize_shards(w.cuda(), scales, widths)
    assert torch.equal(rq_gpu.cpu(), rq_cpu)
