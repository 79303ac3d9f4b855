#!/usr/bin/env bash
# .device/wheels: the wheels of scripts/device_wheels.txt, for CPython 3.12 on x86-64 Linux, which
# the device scripts install mpack's environment from (device_env.sh; the GPU machine reaches no
# index). Run here, with network access: `make device-wheels` (DEST=DIR for another folder).
# --no-deps: the list names every wheel the device lacks; pip matches each manylinux tag exactly,
# so every tag a listed wheel is built for is named.
#   usage: [DEST=.device/wheels] [PYTHON=python3] bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${DEST:-.device/wheels}
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --dest "$dest" -r scripts/device_wheels.txt
ls "$dest"
