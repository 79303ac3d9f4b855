#!/usr/bin/env bash
# Run the GPU suite (and optionally the benchmarks) on the lent GPU machine, in one call.
# The machine has torch and CUDA but not our pure-Python deps: wheels travel in .device/wheels,
# the golden data in .device/golden (both git-ignored, named in the tool's `carry`).
#   usage: bash scripts/device_gpu.sh [extra make targets...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mpack-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPACK_GOLDEN=$PWD/.device/golden
SITE=/tmp/mpack-site
if ls .device/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device/wheels/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" . || exit 1
export PYTHONPATH=$SITE
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# -P: keep the repo root off sys.path so `import mpack` is the installed package.
make test-gpu SYSTEM_PYTHON="python3 -P" PYTEST_ARGS="-p no:cacheprovider ${PYTEST_EXTRA:-}" 2>&1 | tee "$OUT/test-gpu.log"
rc=${PIPESTATUS[0]}
for target in "$@"; do
  make "$target" SYSTEM_PYTHON="python3 -P" 2>&1 | tee "$OUT/$target.log"
done
exit "$rc"
