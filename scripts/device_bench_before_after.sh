#!/usr/bin/env bash
# bench_vs_tools rows on the H200 for an earlier commit and for this tree, in back-to-back calls
# on one warm machine, on the same checkpoint (/tmp/mpack-bench-vs/src, made by the first call):
# "behaviour and speed unchanged" shown row by row. PHASE=before installs .device/before.tar.gz
# (`git archive -o .device/before.tar.gz <commit>`) into a site of its own, ahead of this tree's,
# and runs that commit's bench_vs_tools.py; PHASE=after runs this tree's. ONLY: the rows
# (default convert,verify,load). Writes $OUT/<phase>.json, <phase>.md and the log.
#   usage (device tool, carry .device): PHASE=before|after [ONLY=...] [CLIENTS=1,8] [BENCH_S=540]
#     bash scripts/device_bench_before_after.sh
source "$(dirname "$0")/device_env.sh"
phase=${PHASE:-after}
bench=scripts/bench_vs_tools.py
if [ "$phase" = before ]; then
  rm -rf /tmp/before && mkdir -p /tmp/before && tar -xzf .device/before.tar.gz -C /tmp/before || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site-before /tmp/before || exit 1
  export PYTHONPATH=/tmp/site-before:$SITE
  bench=/tmp/before/scripts/bench_vs_tools.py
fi
python3 -c "import mpack, sys; print('$phase: mpack from', mpack.__file__)" | tee -a "$OUT/gpu.txt"
step "$phase" "${BENCH_S:-540}" python3 "$bench" --workdir /tmp/mpack-bench-vs --layers 32 \
  --devices cuda,cpu --cores 16 --reps 1 --only "${ONLY:-convert,verify,load}" \
  --clients "${CLIENTS:-1,8}" --json "$OUT/$phase.json" --md "$OUT/$phase.md"
exit "$rc"
