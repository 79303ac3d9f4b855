#!/usr/bin/env bash
# One device call for issue 15 ("Faster than a plain copy"): scripts/bench_vs_tools.py on the
# 8B-shaped checkpoint, every row against its peer of the same run, under one time limit, so that
# what ran comes back in $OUT (vs_tools.json after every row; the log; vs_tools.md at the end).
# On the H200 (16 cores) with REPS=1, estimated from issue 15's figures and a LAYERS=2 run there
# (2.5 min, install included): synth ~52 s, the warm rows (cp -r, convert cuda, cpu at 16 and 4
# cores, load, attach) ~2.5 min, the cold ones ~1 min, verify ~40 s, rss (4 layers) ~30 s: about
# 6 minutes of the 8. BENCH_COMMIT names the tree in the record (give it literally: the copy's own
# .git there is not this checkout's).
#   usage (device tool, carry .device): [LAYERS=32] [REPS=1] [ONLY=convert,load,...] [BENCH_S=450]
#     [BENCH_COMMIT=70466d0+changes] bash scripts/device_issue15.sh
source "$(dirname "$0")/device_env.sh"
export BENCH_COMMIT=${BENCH_COMMIT:-unknown}
only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
timeout "${BENCH_S:-450}" python3 scripts/bench_vs_tools.py --workdir /tmp/mpack-bench-vs \
  --layers "${LAYERS:-32}" --devices cuda,cpu --cores 16,4 --cold drop --reps "${REPS:-1}" \
  "${only[@]}" --json "$OUT/vs_tools.json" --md "$OUT/vs_tools.md" 2>&1 | tee "$OUT/vs_tools.log"
rc=${PIPESTATUS[0]}
echo "== bench_vs_tools exit $rc" | tee -a "$OUT/vs_tools.log"
exit "$rc"
