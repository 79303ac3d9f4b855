#!/usr/bin/env bash
# Run the GPU suite (and optionally other make targets) on the lent GPU machine, in one call.
# The machine has torch and CUDA but not our pure-Python deps: wheels travel in .device/wheels
# (git-ignored, named in the tool's `carry`); the golden data is in the tree (tests/data/golden).
#   usage: bash scripts/device_gpu.sh [extra make targets...]
source "$(dirname "$0")/device_env.sh"
# -P: keep the repo root off sys.path so `import mpack` is the installed package.
make test-gpu SYSTEM_PYTHON="python3 -P" PYTEST_ARGS="-p no:cacheprovider ${PYTEST_EXTRA:-}" 2>&1 | tee "$OUT/test-gpu.log"
rc=${PIPESTATUS[0]}
for target in "$@"; do
  make "$target" SYSTEM_PYTHON="python3 -P" 2>&1 | tee "$OUT/$target.log"
done
exit "$rc"
