#!/usr/bin/env bash
# `make demo`: the main job on a small built-in example, offline. PY is the interpreter to use.
set -euo pipefail
PY=${PY:-.venv/bin/python}
cd "$(dirname "$0")/.."
echo "== mpack layout 96 128  (what the kernel stores for a [96, 128] fp8 layer)"
"$PY" -m mpack.cli layout 96 128
echo
echo "== pack and unpack a built-in example layer"
"$PY" scripts/demo_layer.py
