"""One engine-like process: attach every rank of a served sidecar, run the model, save results.

    python equivalence_client.py SIDECAR TP DEVICE PROMPTS.pt OUT.pt

PROMPTS.pt holds ``input_ids`` and, per dtype name, the reference's greedy ``tokens``. OUT.pt gets,
per dtype, our free-running greedy tokens and our logits along the reference tokens, plus whether
every weight the model reads is the attached memory itself (no copies).
"""

from __future__ import annotations

import sys

import torch

from mpack.runtime import attach
from mpack.verify.forward import teacher_forced_logits
from mpack.verify.model import build_model, greedy_generate


def main() -> None:
    sidecar, tp, device, prompts_path, out_path = (
        sys.argv[1],
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    prompts = torch.load(prompts_path)
    ranks = [attach(sidecar, rank=r, device=device) for r in range(tp)]
    shared_ptrs = {t.data_ptr() for w in ranks for t in w.values()}
    ids = prompts["input_ids"].to(device)
    out = {"pid": __import__("os").getpid()}
    for name, ref_tokens in prompts["tokens"].items():
        dt = getattr(torch, name)
        model = build_model(ranks, sidecar, dtype=dt)
        reads = []
        for mod in model.modules():
            for w, s, b, _n, _k in getattr(mod, "parts", []):
                reads += [w, s] + ([b] if b is not None else [])
        if dt == ranks[0]["model.embed_tokens.weight"].dtype:
            reads += [model.get_input_embeddings().weight, model.model.norm.weight]
        tokens, _ = greedy_generate(model, ids, ref_tokens.shape[1])
        tf = teacher_forced_logits(model, ids, ref_tokens.to(device))
        out[name] = {
            "tokens": tokens.cpu(),
            "tf_logits": tf.cpu(),
            "zero_copy": bool(reads) and all(t.data_ptr() in shared_ptrs for t in reads),
        }
    torch.save(out, out_path)
    for w in ranks:
        w.close()


if __name__ == "__main__":
    main()
