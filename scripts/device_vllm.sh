#!/usr/bin/env bash
# `--load-format mpack` on the device with vLLM 0.33.0's compiled ops, in two back-to-back calls
# to the same warm machine (call 1 leaves its work in /tmp for call 2). vLLM does not fit in one
# call: a call carries at most 64 MiB, the tree's 17 MiB included, and the compiled ops alone are
# 60 MiB as xz; see docs/VLLM.md "How it is tested" and scripts/vllm_pack.py.
#   PHASE=1 (carry .vllmdev/p1 .vllmdev/w .vllmdev/vllm-py.tar.xz .vllmdev/so.sha256):
#       unpack vLLM's Python files and the wheels its import needs into /tmp/vllm-site, and
#       the wheels mpack's environment shares with it (w/msite.txt) into /tmp/mpack-site
#   PHASE=2 (carry .vllmdev/p2): join the compiled ops, the rest of mpack's environment
#       (p2/mw: what .device/wheels holds beyond w/), install mpack into both environments,
#       run scripts/vllm_gpu.py (the comparison of all 16 layer kinds, then the 8B-shaped
#       benchmark) and leave its JSON in $OUT.
# Prepare .vllmdev/ here with: bash scripts/device_vllm.sh --pack  (downloads the vllm wheel into
# /tmp/vllmwhl if it is not there; needs .device/wheels; prints each call's size, refuses > 60 MiB)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --pack ]; then
  shift; exec python3 scripts/vllm_pack.py "$@"
fi
OUT=${OUT:-/tmp/mpack-out}; mkdir -p "$OUT"
VSITE=/tmp/vllm-site; MSITE=/tmp/mpack-site
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
case "${PHASE:-}" in
1)
  mkdir -p /tmp/vso "$VSITE"
  cp .vllmdev/p1/part00 .vllmdev/so.sha256 /tmp/vso/ || exit 1
  pipi "$VSITE" .vllmdev/w/*.whl || exit 1
  tar xJf .vllmdev/vllm-py.tar.xz -C "$VSITE" || exit 1
  mapfile -t shared < .vllmdev/w/msite.txt  # mpack's environment: what it shares with vLLM's
  [ "${#shared[@]}" -eq 0 ] || pipi "$MSITE" "${shared[@]/#/.vllmdev/w/}" || exit 1
  ls "$VSITE" | head -50 > "$OUT/vllm-site.txt"; echo "phase 1 done" ;;
2)
  cat /tmp/vso/part00 .vllmdev/p2/part01 > /tmp/vso/_C_stable_libtorch.abi3.so.xz || exit 1
  (cd /tmp/vso && sha256sum -c so.sha256) || exit 1
  xz -dc /tmp/vso/_C_stable_libtorch.abi3.so.xz > "$VSITE/vllm/_C_stable_libtorch.abi3.so" || exit 1
  cp scripts/vllm_fa_standin.py "$VSITE/vllm/vllm_flash_attn/__init__.py" || exit 1  # see its docstring
  if compgen -G '.vllmdev/p2/mw/*.whl' >/dev/null; then pipi "$MSITE" .vllmdev/p2/mw/*.whl || exit 1; fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$MSITE" . || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$VSITE" . || exit 1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  PYTHONPATH=$VSITE python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
  timeout "${RUN_S:-480}" python3 scripts/vllm_gpu.py run --out "$OUT" --mpack-env "$MSITE" --vllm-env "$VSITE" \
      --bench-layers "${BENCH_LAYERS:-32}" ${VLLM_GPU_ARGS:-} 2>&1 | tee "$OUT/vllm_gpu.log"
  exit "${PIPESTATUS[0]}" ;;
*)
  echo "PHASE=1 or PHASE=2 (see the header)"; exit 2 ;;
esac
