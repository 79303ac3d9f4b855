#!/usr/bin/env bash
# The H200 rows of issue 28's direct writes, in one call: scripts/bench_interleaved.py (cp -r &&
# sync, the convert as shipped, the convert with MPACK_NO_DIRECT_WRITE=1, round by round) for
# each of DEVICES on 16 cores, then bench_vs_tools.py's ONLY rows (default: the cold convert and
# the first attach), on the 8B-shaped checkpoint in /tmp/mpack-bench-vs/src (made when missing).
#   usage (device tool, carry .device): [DEVICES="cuda cpu"] [ROUNDS=2] [ONLY=...]
#     bash scripts/device_bench_interleaved.sh
source "$(dirname "$0")/device_env.sh"
src=/tmp/mpack-bench-vs/src
[ -f "$src/config.json" ] || step synth 240 python3 scripts/synth_checkpoint.py --layers 32 "$src"
for dev in ${DEVICES:-cuda cpu}; do
  step "interleaved-$dev" "${IL_S:-240}" python3 scripts/bench_interleaved.py "$src" --cores 16 \
    --device "$dev" --rounds "${ROUNDS:-2}" --json "$OUT/interleaved-$dev.json"
done
if [ -n "${ONLY-convert-cold,first-attach}" ]; then
  step rows "${ROWS_S:-300}" python3 scripts/bench_vs_tools.py --workdir /tmp/mpack-bench-vs \
    --layers 32 --devices cuda --cores 16 --reps 1 --only "${ONLY-convert-cold,first-attach}" \
    --clients 1,8 --json "$OUT/rows.json" --md "$OUT/rows.md"
fi
exit "$rc"
