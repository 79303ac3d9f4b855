#!/usr/bin/env bash
# `make demo`: the main job on a small built-in example, offline (no network, no GPU needed).
# PY is the interpreter to use (make passes the venv's).
set -euo pipefail
PY=${PY:-.venv/bin/python}
cd "$(dirname "$0")/.."
OUT=demo-out
mpack() { "$PY" -m mpack.cli "$@"; }
mkdir -p "$OUT"

echo "== 1. a tiny compressed-tensors FP8 checkpoint (Llama, per-tensor scales), generated offline"
"$PY" -m mpack.fixtures "$OUT/tiny-llama-fp8" --arch llama --scheme FP8 2>/dev/null

echo; echo "== 2. mpack convert: Marlin sidecar for vLLM 0.33.0, tensor parallel 2"
mpack convert "$OUT/tiny-llama-fp8" -o "$OUT/tiny-llama-marlin-tp2" --tp 2

echo; echo "== 3. mpack inspect"
COLUMNS=${COLUMNS:-120} mpack inspect "$OUT/tiny-llama-marlin-tp2"

echo; echo "== 4. mpack verify: checksums, re-derivation from the source, unpack back to the source bytes"
mpack verify "$OUT/tiny-llama-marlin-tp2"

echo; echo "== 5. run it again: nothing to do"
mpack convert "$OUT/tiny-llama-fp8" -o "$OUT/tiny-llama-marlin-tp2" --tp 2

echo; echo "== 6. serve it (host memory) and attach from two processes, zero-copy and read-only"
COLUMNS=${COLUMNS:-120} "$PY" scripts/demo_runtime.py "$OUT/tiny-llama-marlin-tp2" --rank 0

echo; echo "== 7. the layout itself: pack a built-in example layer and unpack it"
"$PY" scripts/demo_layer.py
