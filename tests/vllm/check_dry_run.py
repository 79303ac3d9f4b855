"""Fail if a `pip install --dry-run --report FILE` would install torch, a CUDA wheel or vLLM.

`make` runs it on the dry run of .venv-vllm's resolved deps (mpack's own among them), before the
real install: vLLM's dependency tree reaches a CUDA torch (~9 GB of nvidia-* wheels) from many
sides, and one unconstrained resolver run is enough to replace the CPU torch with it.

usage: python tests/vllm/check_dry_run.py REPORT.json
"""

from __future__ import annotations

import json
import sys

FORBIDDEN = ("torch", "nvidia-", "triton", "vllm", "cuda-", "humming")


def main(path: str) -> int:
    with open(path) as f:
        report = json.load(f)
    names = [i["metadata"]["name"].lower() for i in report.get("install", [])]
    bad = sorted(n for n in names if n.startswith(FORBIDDEN))
    if bad:
        print(
            f"{path}: the dry run would install {', '.join(bad)}: pin the package that pulls "
            "it in constraints-vllm.txt, or install it with --no-deps",
            file=sys.stderr,
        )
        return 1
    print(f"dry run: {len(names)} packages to install, none of {', '.join(FORBIDDEN)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
