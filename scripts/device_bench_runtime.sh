#!/usr/bin/env bash
# One device call after the structure change (issue 14): the whole GPU suite, then the convert
# and runtime benchmarks on the 8B-shaped checkpoint, each under its own time limit (0 skips a
# step), so that what ran comes back in $OUT. Exits with the first failing step's status.
#   usage (device tool, carry .device): [SUITE_S=300] [CONVERT_S=200] [RUNTIME_S=90] bash scripts/device_bench_runtime.sh
source "$(dirname "$0")/device_env.sh"
step test-gpu "${SUITE_S:-300}" make test-gpu SYSTEM_PYTHON="python3 -P" PYTEST_ARGS="-p no:cacheprovider"
step bench-convert "${CONVERT_S:-200}" python3 scripts/bench_convert.py --workdir /tmp/mpack-bench \
  --small-layers 0 --devices cuda --kinds cli,library --library-temps warm --json "$OUT/convert.json"
step bench-runtime "${RUNTIME_S:-90}" python3 scripts/bench_runtime.py --sidecar /tmp/mpack-bench/out-cuda \
  --device cuda:0 --cold fadvise --warm-reps 2 --skip torch_mp --json "$OUT/runtime.json"
exit "$rc"
