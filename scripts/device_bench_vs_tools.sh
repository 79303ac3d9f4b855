#!/usr/bin/env bash
# mpack against the plain tools on the device (scripts/bench_vs_tools.py, issue 15 "Faster than a
# plain copy"), with the GPU tests, the repack kernels and the CPU profile around it. Each step
# runs under its own time limit (0 skips it) so that what ran comes back in $OUT:
#   - test-gpu: the whole GPU suite (make test-gpu), ~4 min on the H200;
#   - host: the host path's CPU tests (tests/convert/test_host.py), on the extension built there;
#   - driver: the driver path's tests and the kernel's (tests/convert/test_driver.py, test_cuda_repack.py);
#   - kernels: the host repack's kernels, one thread each (scripts/bench_repack.py --kernels);
#   - profile (after the bench, on its checkpoint): scripts/cpu_by_thread.py per PROFILE_CASES;
#   - bench: scripts/bench_vs_tools.py on the 8B-shaped checkpoint, every row against its peer of
#     the same run (vs_tools.json after every row; the log; vs_tools.md at the end). With REPS=1
#     on the H200 (16 cores): synth ~50 s, the warm rows (cp -r, convert cuda, cpu at 16 and 4
#     cores, load, attach) ~2.5 min, the cold ones ~1 min, verify, rss (4 layers) and the import
#     costs ~1.5 min: about 5.5 minutes.
# BENCH_COMMIT names the tree in the record (give it literally: the copy's own .git there is not
# this checkout's). Exits with the first failing step's status.
#   usage (device tool, carry .device): [SUITE_S=0] [HOST_S=0] [DRIVER_S=0] [KERNELS_S=0] [BENCH_S=450] [PROFILE_S=0] [LAYERS=32] [REPS=1]
#     [ONLY=convert,load,...] [BENCH_COMMIT=abc1234] bash scripts/device_bench_vs_tools.sh
source "$(dirname "$0")/device_env.sh"
export BENCH_COMMIT=${BENCH_COMMIT:-unknown}
only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
python3 -c "from mpack.convert import host_repack as h; print('native host repack:', h.available())" | tee -a "$OUT/gpu.txt"
step test-gpu "${SUITE_S:-0}" make test-gpu SYSTEM_PYTHON="python3 -P" PYTEST_ARGS="-p no:cacheprovider"
step host "${HOST_S:-0}" python3 -P -m pytest -q -p no:cacheprovider tests/convert/test_host.py
# driver: the torch-free CUDA path's tests (Note [driver path]) and the kernel's, on the GPU
step driver "${DRIVER_S:-0}" python3 -P -m pytest -q -p no:cacheprovider --require-gpu \
  tests/convert/test_driver.py tests/convert/test_cuda_repack.py
step kernels "${KERNELS_S:-0}" python3 scripts/bench_repack.py --kernels tile,rows:16,rows:0 \
  --cpu-reps 3 --json "$OUT/repack-kernels.json"
step vs_tools "${BENCH_S:-450}" python3 scripts/bench_vs_tools.py --workdir /tmp/mpack-bench-vs \
  --layers "${LAYERS:-32}" --devices cuda,cpu --cores 16,4 --cold drop --reps "${REPS:-1}" \
  "${only[@]}" --json "$OUT/vs_tools.json" --md "$OUT/vs_tools.md"
# profile: CPU seconds per thread group of a warm conversion (scripts/cpu_by_thread.py), for each
# CORES:DEVICE case of PROFILE_CASES, on the bench's checkpoint
profile() {
  local case cores dev
  for case in ${PROFILE_CASES:-0-3:cpu 0-15:cpu 0-3:cuda 0-15:cuda}; do
    cores=${case%%:*} dev=${case#*:}
    taskset -c "$cores" python3 scripts/cpu_by_thread.py --label "$cores $dev" \
      --json "$OUT/cpu_by_thread.jsonl" -- convert /tmp/mpack-bench-vs/src \
      -o /tmp/mpack-bench-vs/prof-out --device "$dev" --force --quiet || return 1
  done
}
if [ "${PROFILE_S:-0}" -gt 0 ] && [ ! -f /tmp/mpack-bench-vs/src/config.json ]; then
  python3 scripts/synth_checkpoint.py /tmp/mpack-bench-vs/src --layers "${LAYERS:-32}" >/dev/null
  cat /tmp/mpack-bench-vs/src/*.safetensors >/dev/null
fi
export -f profile
export OUT
step profile "${PROFILE_S:-0}" bash -c profile
exit "$rc"
