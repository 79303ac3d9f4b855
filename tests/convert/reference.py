"""Independent re-statements of the SPEC used to check mpack's output (not mpack's own code)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

#: SPEC §7.4, written out again here on purpose.
PERM32 = [
    0,
    1,
    8,
    9,
    16,
    17,
    24,
    25,
    2,
    3,
    10,
    11,
    18,
    19,
    26,
    27,
    4,
    5,
    12,
    13,
    20,
    21,
    28,
    29,
    6,
    7,
    14,
    15,
    22,
    23,
    30,
    31,
]
FOLD = {torch.float16: 2.0**8, torch.bfloat16: 2.0**120}


def independent_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Unpack by SPEC §5's *index form* (word -> (n, k) of each byte), not by the reshape.

    Word c of row kt: nt=c//256, p=c%256, t=p>>3, w=(p>>1)&3, h=p&1,
    n = 64nt + 16w + (t>>2) + 8h; byte j holds W[16kt + 2(t&3) + (0, 8, 1, 9)[j]][n].
    """
    kt_count, words = packed.shape
    n_total, k_total = words // 4, kt_count * 16
    by = packed.contiguous().view(torch.uint8).reshape(kt_count, words, 4)
    c = torch.arange(words)
    nt, p = c // 256, c % 256
    t, w, h = p >> 3, (p >> 1) & 3, p & 1
    n = 64 * nt + 16 * w + (t >> 2) + 8 * h  # [words]
    koff = torch.tensor([0, 8, 1, 9])
    kt = torch.arange(kt_count)
    k = 16 * kt[:, None, None] + 2 * (t & 3)[None, :, None] + koff[None, None, :]  # [kt, words, 4]
    out = torch.full((k_total, n_total), -1, dtype=torch.int16)
    out[k, n[None, :, None].expand_as(k)] = by.to(torch.int16)
    assert (out >= 0).all(), "some (k, n) was never written: the index form is not a bijection"
    return out.to(torch.uint8).T.contiguous()  # [N, K]


def expected_scale_row(scale_n: torch.Tensor, dt: torch.dtype, np_: int) -> torch.Tensor:
    """SPEC §7 from its words: cast, zero-pad, permute each 32-group, fold. -> dt [1, Np]."""
    s = torch.zeros(np_, dtype=dt)
    s[: scale_n.numel()] = scale_n.to(torch.float32).to(dt)
    out = torch.empty_like(s)
    for g in range(np_ // 32):
        for m in range(32):
            out[32 * g + m] = s[32 * g + PERM32[m]]
    return (out * FOLD[dt]).reshape(1, np_)


def expected_bias(bias: torch.Tensor, dt: torch.dtype, np_: int) -> torch.Tensor:
    """SPEC §8: cast, zero-pad, permute (no fold). -> dt [Np]."""
    b = torch.zeros(np_, dtype=dt)
    b[: bias.numel()] = bias.to(dt)
    return torch.stack([b[32 * g + PERM32[m]] for g in range(np_ // 32) for m in range(32)])


def load_vectors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A golden vectors file: its tensors and its ``__metadata__["index"]`` (JSON)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(meta.get("index", "{}"))  # noqa: SIM118


def rand_bytes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random fp8 bytes (NaN codes included: the repack only moves bytes), uint8 [N, K]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
