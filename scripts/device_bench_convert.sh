#!/usr/bin/env bash
# One device call for the convert fast path: quick GPU checks, the convert benchmark, then the
# whole GPU suite, each under its own time limit (0 skips a step) so that what ran comes back
# in $OUT. Exits with the first failing step's status.
#   usage (device tool, carry .device): [QUICK_S=120] [BENCH_S=420] [SUITE_S=200] [DEVICES=cuda,cpu]
#     [KINDS=cli,library] [LIBRARY_TEMPS=cold,warm] [SMALL_LAYERS=8] bash scripts/device_bench_convert.sh
source "$(dirname "$0")/device_env.sh"
rc=0
quick="tests/convert/test_stream.py tests/convert/test_convert.py"
if [ "${QUICK_S:-120}" -gt 0 ]; then
  timeout "${QUICK_S:-120}" python3 -P -m pytest -q -p no:cacheprovider -m gpu -x $quick 2>&1 | tee "$OUT/quick.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$rc" -eq 0 ] && [ "${BENCH_S:-420}" -gt 0 ]; then
  timeout "${BENCH_S:-420}" python3 scripts/bench_convert.py --workdir /tmp/mpack-bench \
    --small-layers "${SMALL_LAYERS:-8}" --devices "${DEVICES:-cuda,cpu}" --kinds "${KINDS:-cli,library}" --library-temps "${LIBRARY_TEMPS:-cold,warm}" \
    --json "$OUT/convert.json" --plot "$OUT/bench_convert.png" 2>&1 | tee "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
fi
if [ "${SUITE_S:-200}" -gt 0 ]; then
  timeout "${SUITE_S:-200}" make test-gpu SYSTEM_PYTHON="python3 -P" \
    PYTEST_ARGS="-p no:cacheprovider" 2>&1 | tee "$OUT/test-gpu.log"
  suite=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$suite
fi
exit "$rc"
