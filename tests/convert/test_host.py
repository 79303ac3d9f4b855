"""The torch-free host backend (Note [host path], [host repack]): the native repack and the numpy
scales and bias against the golden vectors, the independent unpack and torch's ops; which plans
it takes, ``auto``'s order, recycled buffers; a host conversion never imports torch. (Whole
sidecars on every backend: tests/convert/test_backends.py.)"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from mpack import iokit, target
from mpack.convert import host_repack, marlin
from mpack.convert.backends import host
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.device import no_cuda_here
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import HOST_MODELS, cli_env, plan_of, python_c, safetensors_bytes
from tests.convert.reference import independent_unpack, load_vectors, rand_bytes

pytestmark = pytest.mark.skipif(
    not host_repack.available(), reason="the native host repack is not built here"
)


#: The extension's kernels built here (Note [tile kernel]): every repack test runs on each.
KERNELS = ["tile", "rows"] if host_repack.KERNEL == "tile" else ["rows"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch) -> str:
    monkeypatch.setattr(host_repack, "KERNEL", request.param)
    return request.param


def _native(a: np.ndarray, **kw) -> torch.Tensor:
    return torch.from_numpy(host_repack.pack_rows(host_repack.rows_of(a), a.shape[1], **kw))


def _torch_path(w: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    return marlin.pack_weight(w)  # torch's ops, whatever is built


# --- the native repack ------------------------------------------------------------------------


def test_the_tile_kernel_is_built_on_x86_64():
    """setup.py's plain build has the SSE2 tile kernel on x86-64 (SSE2 is part of the ABI), so
    a conversion there never falls back to the slower row kernel unnoticed."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert host_repack.KERNEL == "tile"
    else:
        assert host_repack.KERNEL == "rows"


def test_an_unknown_kernel_is_refused(monkeypatch):
    monkeypatch.setattr(host_repack, "KERNEL", "avx9")
    with pytest.raises(ValueError, match="'tile' or 'rows', not 'avx9'"):
        host_repack.pack_rows(host_repack.rows_of(np.zeros((64, 16), np.uint8)), 16)


def test_native_repack_matches_golden_layers(golden, kernel):
    t, index = load_vectors(golden / "vectors" / "layers.safetensors")
    assert index
    for lid, info in index.items():
        wck, expect = t[f"{lid}.wck"], t[f"{lid}.packed"]
        got = _native(wck.numpy())
        assert got.shape == expect.shape and torch.equal(got, expect), lid
        np_, kp = info["Np"], info["Kp"]
        assert torch.equal(marlin.pack_weight(wck), expect), lid  # pack_weight's CPU default
        if f"{lid}.repack_nopad" in t:
            nopad = _native(wck.numpy(), np_=info["N"], kp=info["K"])
            assert torch.equal(nopad, t[f"{lid}.repack_nopad"]), lid
        assert (np_, kp) == target.padded_nk(info["N"], info["K"]), lid


@pytest.mark.parametrize(
    "n, k", [(64, 16), (64, 4), (100, 40), (192, 12), (200, 300), (960, 576), (4096, 260)]
)
def test_native_repack_matches_unpack_and_torch(monkeypatch, kernel, n, k):
    """Padding in N and K (K % 16 != 0 included): the independent unpack gives the bytes back
    with zero padding, and the torch path gives the same words."""
    w = rand_bytes(n, k, seed=n + k)
    got = _native(w.numpy())
    np_, kp = target.padded_nk(n, k)
    assert got.shape == target.packed_weight_shape(np_, kp)
    full = independent_unpack(got)
    assert torch.equal(full[:n, :k], w)
    assert not full[n:].any() and not full[:, k:].any()
    assert torch.equal(got, _torch_path(w, monkeypatch))


@pytest.mark.parametrize("kb", [1, 5, 8, 64])
@pytest.mark.parametrize("n, k", [(100, 40), (200, 300), (960, 576), (130, 1000)])
def test_native_repack_in_k_blocks_gives_the_same_words(monkeypatch, n, k, kb):
    """host_repack.K_BLOCK (the row kernel's k-tiles per pass over an n-tile's rows, a last
    shorter block included) changes the order of the stores, never the words; the tile
    kernel, where built, gives them too."""
    w = rand_bytes(n, k, seed=3 * n + k).numpy()
    monkeypatch.setattr(host_repack, "KERNEL", "rows")
    whole = _native(w)
    if "tile" in KERNELS:
        monkeypatch.setattr(host_repack, "KERNEL", "tile")
        assert torch.equal(_native(w), whole)
        monkeypatch.setattr(host_repack, "KERNEL", "rows")
    monkeypatch.setattr(host_repack, "K_BLOCK", kb)
    got = _native(w)
    assert torch.equal(got, whole)
    full = independent_unpack(got)
    assert torch.equal(full[:n, :k], torch.from_numpy(w)) and not full[n:].any()
    packed = got.numpy()  # the read back, in the same blocks
    assert not host_repack.unpack_differs(packed, host_repack.rows_of(w), k)
    w[n - 1, k - 1] ^= 2
    assert host_repack.unpack_differs(packed, host_repack.rows_of(w), k)


@pytest.mark.parametrize("workers", [2, 5])
def test_native_repack_rows_from_pieces_on_a_pool(kernel, workers):
    """Fused and sliced rows (row addresses into two arrays, from a column on) on a pool of
    threads that split the n-tiles: the bytes of the concatenated copy, in one call."""
    a, b = rand_bytes(64 * 9, 512, seed=1).numpy(), rand_bytes(128, 512, seed=2).numpy()
    rows = [host_repack.rows_of(a, (64, 64 * 9), 128), host_repack.rows_of(b, None, 128)]
    fused = np.ascontiguousarray(np.concatenate([a[64:, 128:384], b[:, 128:384]]))
    old = host_repack.RUN_BYTES
    try:
        host_repack.RUN_BYTES = 64 * 256 * 2  # two n-tiles per call: 5 calls, a remainder
        with iokit.pool("test-repack", workers) as p:
            got = host_repack.pack_rows(rows, 256, pool=p)
    finally:
        host_repack.RUN_BYTES = old
    assert np.array_equal(got, _native(fused).numpy())
    assert torch.equal(independent_unpack(torch.from_numpy(got)), torch.from_numpy(fused))


def test_native_repack_refuses_bad_shapes():
    a = np.zeros((64, 16), np.uint8)
    with pytest.raises(ValueError, match="padded"):
        marlin.pack_weight(torch.from_numpy(a), 0, 16)
    with pytest.raises(ValueError, match="bad shape"):
        host_repack.pack_rows(host_repack.rows_of(a), 16, 64, 8)
    with pytest.raises(ValueError, match="contiguous rows"):
        host_repack.rows_of(np.zeros((64, 16), np.int32))


# --- scales and bias --------------------------------------------------------------------------

SPECIAL = np.array(
    [
        0.0,
        -0.0,
        1.0,
        1e-40,
        -3e-39,
        1e-45,
        65504.0,
        65520.0,
        1e30,
        np.inf,
        -np.inf,
        255.875,
        255.0,
        3.0e38,
        1.00390625,
        1.0078125,
        1.01171875,
        2.0**-24,
        2.0**-25,
        2.0**-26,
    ],
    dtype=np.float32,
)


def _random_f32(n: int, seed: int) -> np.ndarray:
    """Random float32 bit patterns: every class, NaNs with payloads and both signs included."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


@pytest.mark.parametrize("act", sorted(target.ACT_DTYPES))
def test_act_casts_match_torch(act):
    """float32 -> bf16/fp16 bits as torch rounds them on the CPU, over random bit patterns
    (NaNs with payloads too), subnormals, ties, overflow and infinities."""
    x = np.concatenate([SPECIAL, _random_f32(20000, 3), np.array([np.nan, -np.nan], np.float32)])
    assert np.isnan(x).sum() > 10
    want = torch.from_numpy(x).to(marlin.TORCH_ACT_DTYPES[act]).view(torch.int16).numpy()
    assert np.array_equal(host.act_bits(x, act).view(np.int16), want)


def test_golden_scales_and_bias_on_the_host(golden):
    t, index = load_vectors(golden / "vectors" / "scales.safetensors")
    for sid, info in index.items():
        for name in target.ACT_DTYPES:
            expect = t[f"{sid}.{name}"].view(torch.int16).numpy().reshape(-1)
            if sid.startswith("bias"):
                bits = host.act_bits(t[f"{sid}.bias_f32"].numpy(), name)
                got = host.pack_bias(bits, info["Np"])
            else:
                got = host.pack_scales(t[f"{sid}.scale_f32"].numpy(), name, info["Np"])
            assert np.array_equal(got.view(np.int16).reshape(-1), expect), (sid, name)


@pytest.mark.parametrize("act", sorted(target.ACT_DTYPES))
def test_scales_and_bias_match_torch(act):
    """Random in-range scales and any-value biases, padded from N=200 to 256."""
    dt = marlin.TORCH_ACT_DTYPES[act]
    rng = np.random.default_rng(7)
    s = (rng.random(200, dtype=np.float32) * 255.0 + 1e-30).astype(np.float32)
    s[:5] = [target.act_dtype(act).fold_limit, 1e-40, 2.0**-24, 1.0, 2.0**-20]
    want = marlin.pack_scales(torch.from_numpy(s), dt, 256).view(torch.int16).numpy()
    assert np.array_equal(host.pack_scales(s, act, 256).view(np.int16), want)
    b = np.concatenate([SPECIAL, _random_f32(180, 9)])
    want = marlin.pack_bias(torch.from_numpy(b), dt, 256).view(torch.int16).numpy()
    assert np.array_equal(host.pack_bias(host.act_bits(b, act), 256).view(np.int16), want)


# --- the layout read backwards (mpack verify: Note [verify without torch]) --------------------


def test_native_unpack_reads_the_golden_layers_back(golden, kernel):
    t, index = load_vectors(golden / "vectors" / "layers.safetensors")
    for lid in index:
        w = t[f"{lid}.wck"].view(torch.uint8).numpy()
        packed = np.ascontiguousarray(t[f"{lid}.packed"].numpy())
        assert not host_repack.unpack_differs(packed, host_repack.rows_of(w), w.shape[1]), lid
        bad = w.copy()
        bad[-1, -1] ^= 0x40  # the last byte of the last real row
        assert host_repack.unpack_differs(packed, host_repack.rows_of(bad), w.shape[1]), lid


@pytest.mark.parametrize("n, k", [(100, 40), (200, 300), (130, 1000), (64, 16)])
def test_native_unpack_finds_every_flipped_byte(kernel, n, k):
    """A byte flipped anywhere inside [N, K] is found; a padding byte of the tiles is not read."""
    rng = np.random.default_rng(n * k)
    w = rng.integers(0, 256, (n, k), dtype=np.uint8)
    packed = host_repack.pack_rows(host_repack.rows_of(w), k)
    rows = host_repack.rows_of(w)
    assert not host_repack.unpack_differs(packed, rows, k)
    for r, c in [(0, 0), (n - 1, k - 1), (n // 2, k // 2), (63 % n, 15 % k)]:
        w[r, c] ^= 1
        assert host_repack.unpack_differs(packed, rows, k, None), (r, c)
        w[r, c] ^= 1
    np_, kp = target.padded_nk(n, k)
    if np_ > n:  # padding rows of the tiles: not read back
        full = independent_unpack(torch.from_numpy(packed))
        assert not full[n:].any()
    with pytest.raises(ValueError, match="does not hold"):
        host_repack.unpack_differs(packed, rows, kp + 16)


@pytest.mark.parametrize("act", sorted(target.ACT_DTYPES))
def test_scales_and_bias_unpack_as_torch_unpacks_them(act):
    dt = marlin.TORCH_ACT_DTYPES[act]
    rng = np.random.default_rng(11)
    s = (rng.random(200, dtype=np.float32) * 255.0 + 1e-30).astype(np.float32)
    s[:3] = [target.act_dtype(act).fold_limit, 2.0**-24, 1.0]
    packed = host.pack_scales(s, act, 256)
    want = marlin.unpack_scales(torch.from_numpy(packed.view(np.int16)).view(dt), 200)
    got = host.unpack_scales(packed, act, 200)
    assert np.array_equal(got.view(np.int16), want.view(torch.int16).numpy())
    assert np.array_equal(got, host.act_bits(s, act))
    b = host.act_bits(np.concatenate([SPECIAL, _random_f32(180, 5)]), act)
    pb = host.pack_bias(b, 256)
    want_b = marlin.unpack_bias(torch.from_numpy(pb.view(np.int16)).view(dt), b.size)
    assert np.array_equal(
        host.unpack_bias(pb, b.size).view(np.int16), want_b.view(torch.int16).numpy()
    )
    assert np.array_equal(host.unpack_bias(pb, b.size), b)


def test_backwards_names_each_damaged_tensor(models):
    """:func:`host.backwards` on a real fused layer with bias: nothing differs as packed; a
    damaged weight, scale or bias word is named, and only that one."""
    plan = plan_of(models["bias"], tp=2)
    ck = plan.ckpt
    unit = next(u for u in plan.units if len(u[0].pieces) > 1 and u[0].has_bias)
    src = host.read_unit(ck, unit, "bfloat16")
    layer = unit[1]
    outs = [x[0] for x in host.transform_stack([layer], src, "bfloat16")]
    assert [d for _, d in host.backwards(layer, src, outs, "bfloat16")] == [False] * 3
    for i, what in enumerate(["weight", "weight_scale", "bias"]):
        bad = [o.copy() for o in outs]
        bad[i].reshape(-1).view(np.uint8)[5] ^= 0x10
        got = host.backwards(layer, src, bad, "bfloat16")
        assert [d for _, d in got] == [j == i for j in range(3)], what
        assert got[i][0] == f"{layer.name}.{what} does not unpack to the checkpoint " + (
            "bytes" if what == "weight" else "scales" if what == "weight_scale" else "bias"
        )


# --- whole conversions ------------------------------------------------------------------------

MODELS = HOST_MODELS


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("host")
    return {name: make_checkpoint(root / name, **kw) for name, kw in MODELS.items()}


def test_requantizing_plans_take_the_torch_path(models, tmp_path):
    r = run_convert(
        models["tensor"], tmp_path / "o", ConvertOptions(profile="w8a8-marlin", tp=2, device="cpu")
    )
    assert "import_torch" in r.seconds and r.backend["name"] == "torch"
    assert "requantizing" in r.backend["refused"]["host (cpu)"]


def test_a_host_conversion_never_imports_torch(models, tmp_path):
    """In a fresh process, the CLI's conversion on the CPU (the scheme check forks its child
    first) leaves torch unimported: Note [host path]."""
    code = (
        "import sys; from mpack.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(json.dumps('torch' in sys.modules))"
    )
    args = ["convert", str(models["bias"]), "-o", str(tmp_path / "o"), "--device", "cpu"]
    out = python_c("import json\n" + code, *args, env=cli_env(), timeout=180)
    assert json.loads(out.strip().splitlines()[-1]) is False, out
    assert (tmp_path / "o" / "mpack.json").is_file()


@pytest.mark.parametrize(
    "cores, cuda_maybe, tried_first",
    [(2, False, []), (16, True, []), (4, True, ["driver (cuda:0)", "torch (cuda:0)"])],
)
def test_auto_device(models, tmp_path, monkeypatch, cores, cuda_maybe, tried_first):
    """Note [auto device]: ``auto`` tries the host backend first where there is surely no GPU,
    or on AUTO_HOST_CORES cores or more; else the GPU's backends first (here no GPU: both
    refuse, and the host backend converts)."""
    from mpack import iokit
    from mpack.convert import backends

    monkeypatch.setattr(iokit, "usable_cores", lambda: cores)
    monkeypatch.setattr(backends, "no_cuda_here", lambda: not cuda_maybe)
    r = run_convert(models["tensor"], tmp_path / "o", ConvertOptions(device="auto"))
    assert r.backend["name"] == "host"
    assert list(r.backend["refused"]) == tried_first


def test_no_cuda_here(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert no_cuda_here()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert no_cuda_here()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert no_cuda_here() is (
        not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/kfd")
    )


# --- recycled buffers (Note [recycled buffers]) -----------------------------------------------


def test_buffers_hand_arrays_round_again():
    b = host.Buffers(keep=2)
    big = host.Buffers.MIN_BYTES
    a = b.take(big)
    b.give(a.view(np.int32).reshape(4, -1))  # any view of it gives the array back
    assert b.take(big) is a
    assert b.take(big) is not a  # taken: a new one
    b.give(a)
    b.give(a)  # twice: cached once
    assert b.take(big) is a and b.take(big) is not a
    b = host.Buffers(keep=2)
    made = [b.take(big) for _ in range(3)]
    for x in made:
        b.give(x)
    got = [b.take(big) for _ in range(3)]
    assert sum(any(g is x for x in made) for g in got) == 2  # at most `keep` of a size
    small = b.take(100)
    b.give(small)
    assert b.take(100) is not small  # small arrays are not cached
    f32 = np.zeros(big, np.float32)
    b.give(f32)
    assert b.take(f32.nbytes) is not f32  # only byte arrays are
    foreign = np.frombuffer(bytearray(big), np.uint8)
    b.give(foreign)
    assert b.take(big) is not foreign  # nor memory that is not numpy's own


def test_recycling_every_array_keeps_the_bytes(models, tmp_path, monkeypatch):
    """With every byte array recycled (no size floor), the sidecar is the torch path's: no
    array is handed out again while something still reads it."""
    monkeypatch.setattr(host.Buffers, "MIN_BYTES", 0)
    given = []
    real_give = host.Buffers.give
    monkeypatch.setattr(host.Buffers, "give", lambda self, a: (given.append(1), real_give(self, a)))
    a = run_convert(
        models["bias"], tmp_path / "host", ConvertOptions(act_dtype="float16", tp=2, device="cpu")
    )
    assert len(given) > 10
    b = run_convert(
        models["bias"],
        tmp_path / "torch",
        ConvertOptions(act_dtype="float16", tp=2, device="cpu", backend="torch"),
    )
    assert safetensors_bytes(a.out) == safetensors_bytes(b.out)
