"""One pipeline stage of an engine, as its own process: takes its rank's tensors the way the
vLLM loader does (``mpack.runtime.vllm.source.rank_weights``), prints one JSON line, exits.

    python stage_client.py SIDECAR --rank R [--pp-rank P --split 3,2] [--attach require]
                           [--socket PATH]

``{"ok": true, "tensors": {name: sha256 of its bytes}, "nbytes", "backend", "daemon_pid",
"stage": [pp_rank, split] or null}``, or ``{"ok": false, "type", "message", "exit_code"}`` for
an ``MpackError``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sidecar")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--pp-rank", type=int, default=None)
    ap.add_argument("--split", default=None, help="each stage's layer count: 3,2")
    ap.add_argument("--attach", default="require")
    ap.add_argument("--socket", default=None)
    a = ap.parse_args()

    import torch

    from mpack.arch import Stage
    from mpack.errors import MpackError
    from mpack.runtime.vllm.checks import Options
    from mpack.runtime.vllm.source import rank_weights

    stage = None
    if a.pp_rank is not None:
        stage = Stage(a.pp_rank, tuple(int(n) for n in a.split.split(",")))
    try:
        w = rank_weights(a.sidecar, Options(attach=a.attach, socket=a.socket), a.rank, "cpu", stage)
    except MpackError as e:
        doc = {"ok": False, "type": type(e).__name__, "message": e.message}
        print(json.dumps({**doc, "hint": e.hint, "exit_code": e.exit_code}), flush=True)
        return 1
    tensors = {
        name: hashlib.sha256(w[name].reshape(-1).view(torch.uint8).numpy()).hexdigest()
        for name in w
    }
    held = None if w.stage is None else [w.stage.rank, list(w.stage.split)]
    doc = {"ok": True, "tensors": tensors, "nbytes": w.nbytes, "backend": w.backend}
    print(json.dumps({**doc, "daemon_pid": w.daemon_pid, "stage": held}), flush=True)
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
