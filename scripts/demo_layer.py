"""Pack the SPEC §10 example layer into Marlin's layout and unpack it again (no network, no GPU)."""

from __future__ import annotations

import torch

from mpack.convert import marlin


def main() -> None:
    k, n = torch.meshgrid(torch.arange(128), torch.arange(96), indexing="ij")
    w_kn = ((131 * k + 29 * n + 7) % 256).to(torch.uint8)  # W[k][n], the SPEC's mixed pattern
    wck = w_kn.T.contiguous().view(torch.float8_e4m3fn)  # the checkpoint's [N, K] fp8 rows
    packed = marlin.pack_weight(wck)
    np_, kp = marlin.marlin_padded_nk(*wck.shape)
    print(
        f"checkpoint weight {tuple(wck.shape)} fp8 -> padded ({np_}, {kp}) "
        f"-> packed {tuple(packed.shape)} int32"
    )
    print("first words:", " ".join(f"0x{int(x) & 0xFFFFFFFF:08x}" for x in packed[0, :4]))
    scales = marlin.pack_scales(
        marlin.broadcast_scales(torch.tensor([0.0012345]), 96), torch.bfloat16, np_
    )
    print(
        f"weight_scale {tuple(scales.shape)} bf16, "
        f"folded bits 0x{int(scales.view(torch.int16)[0, 0]) & 0xFFFF:04x}"
    )
    back = marlin.unpack_weight(packed, *wck.shape)
    assert torch.equal(back, wck.view(torch.uint8)), "unpack did not give the checkpoint bytes back"
    print("unpack(pack(W)) == W: the checkpoint bytes come back exactly")


if __name__ == "__main__":
    main()
