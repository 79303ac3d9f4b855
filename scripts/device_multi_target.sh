#!/usr/bin/env bash
# issue 25 on the device: the multi-target GPU tests, then the multi-target benchmark.
# Carry .device holding head.tar (git archive HEAD: the tree under test, untouched by work in
# progress) and wheels/ (see device_env.sh). BENCH_S, BENCH_S2 (0 skips the cpu row), LAYERS.
set -u

rm -rf /tmp/head && mkdir -p /tmp/head && tar xf .device/head.tar -C /tmp/head && cp -r .device /tmp/head/ && cd /tmp/head
source scripts/device_env.sh
step multi-gpu-tests 200 python3 -P -m pytest -q -m gpu -rs --require-gpu -p no:cacheprovider tests/convert/test_multi_target.py tests/convert/test_convert.py
nproc | tee -a "$OUT/gpu.txt"
step bench-multi-cuda ${BENCH_S:-300} python3 -P scripts/bench_multi_target.py --workdir /tmp/bm --layers ${LAYERS:-16} --device cuda --json "$OUT/multi-cuda.json"
step bench-multi-cpu ${BENCH_S2:-0} python3 -P scripts/bench_multi_target.py --workdir /tmp/bm --layers ${LAYERS:-16} --device cpu --json "$OUT/multi-cpu.json"
cat "$OUT/steps.txt"
exit $rc
