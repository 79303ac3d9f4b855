"""The real model, the CPU half, in one command (``make demo-real``; issue 41).

SmolLM2-135M-Instruct's per-channel FP8 checkpoint (``make real-checkpoints``: llm-compressor's
``FP8_DYNAMIC``) is converted by ``mpack convert`` at TP 3 (its 9 heads and 3 KV heads split;
hidden 576 and intermediate 1536 padded per rank), checked by ``mpack verify --source``, and the
model rebuilt from the three ranks' Marlin bytes answers the chat prompts of
``real_checkpoints.CHAT_PROMPTS`` greedily, beside transformers on the checkpoint itself. The
two must give the same tokens (float32: they differ only in summation order); the run fails
otherwise.

    python scripts/demo_real.py REAL_DIR [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoints import (  # noqa: E402
    CHAT_PROMPTS,
    CHAT_STEPS,
    FP8_CHECKPOINTS,
    answer_text,
    chat_ids,
)

TP, PROFILE = 3, "w8a16"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("real", type=Path, help="the folder `make real-checkpoints` filled")
    ap.add_argument("--out", type=Path, help="keep the sidecar here (default: a temporary one)")
    a = ap.parse_args()
    ck = a.real / FP8_CHECKPOINTS[0]
    if not (ck / "config.json").is_file():
        print(f"{ck}: no checkpoint; make it with `make real-checkpoints`", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or Path(tmp) / "sc"
        mpack = [sys.executable, "-m", "mpack"]
        t = time.perf_counter()
        subprocess.run([*mpack, "convert", str(ck), "-o", str(out), "--tp", str(TP),
                        "--profile", PROFILE, "--force"], check=True)  # fmt: skip
        print(f"converted in {time.perf_counter() - t:.1f} s")
        subprocess.run([*mpack, "verify", str(out), "--source", str(ck)], check=True)
        return generate(ck, out)


def generate(ck: Path, sc: Path) -> int:
    import torch
    from transformers import AutoTokenizer

    from mpack.runtime.loader import load
    from mpack.sidecar import load_manifest
    from mpack.verify.forward import reference_model
    from mpack.verify.model import build_model, greedy_generate

    tok = AutoTokenizer.from_pretrained(ck)
    manifest, _ = load_manifest(sc)
    ref = reference_model(ck, manifest, torch.float32)
    ours = build_model([load(sc, rank=r, device="cpu") for r in range(TP)], sc, dtype=torch.float32)
    same = True
    for p, prompt_ids in zip(CHAT_PROMPTS, chat_ids(tok), strict=True):
        ids = torch.tensor([prompt_ids])
        want, _ = greedy_generate(ref, ids, CHAT_STEPS)
        got, _ = greedy_generate(ours, ids, CHAT_STEPS)
        same &= bool(torch.equal(want, got))
        text = answer_text(tok, got[0].tolist())
        mark = "same tokens" if torch.equal(want, got) else "DIFFERENT tokens"
        print(f"\n> {p}\n  {text}\n  ({mark} as transformers on the checkpoint)")
    print("\nthe sidecar's model says what the checkpoint says" if same else "\nMISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
