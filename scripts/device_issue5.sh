#!/usr/bin/env bash
# One device call for the convert fast path: quick GPU checks, the convert benchmark, then the
# whole GPU suite, each under its own time limit so that what ran comes back in $OUT.
#   usage (device tool, carry .device): bash scripts/device_issue5.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mpack-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPACK_GOLDEN=$PWD/.device/golden
SITE=/tmp/mpack-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device/wheels/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" . || exit 1
export PYTHONPATH=$SITE PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
quick="tests/convert/test_stream.py tests/convert/test_convert.py"
timeout "${QUICK_S:-120}" python3 -P -m pytest -q -p no:cacheprovider -m gpu -x $quick 2>&1 | tee "$OUT/quick.log"
if [ "${PIPESTATUS[0]}" -eq 0 ] && [ "${BENCH_S:-420}" -gt 0 ]; then
  timeout "${BENCH_S:-420}" python3 scripts/bench_convert.py --workdir /tmp/mpack-bench \
    --small-layers "${SMALL_LAYERS:-8}" --devices "${DEVICES:-cuda,cpu}" --library-temps "${LIBRARY_TEMPS:-cold,warm}" \
    --json "$OUT/convert.json" --plot "$OUT/bench_convert.png" 2>&1 | tee "$OUT/bench.log"
fi
[ "${SUITE_S:-200}" -gt 0 ] && timeout "${SUITE_S:-200}" make test-gpu SYSTEM_PYTHON="python3 -P" \
  PYTEST_ARGS="-p no:cacheprovider --ignore=tests/test_format_doc.py" 2>&1 | tee "$OUT/test-gpu.log"
