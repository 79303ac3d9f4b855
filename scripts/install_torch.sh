#!/usr/bin/env bash
# Install torch, the CPU build where one is wanted, into a venv before anything that depends on it.
#
#   usage: scripts/install_torch.sh PYTHON CONSTRAINTS
#
# The version is the `torch==X` line of CONSTRAINTS (constraints.txt, constraints-vllm.txt), so
# it is written down once. Why a script: on the public package index, torch for Linux is the CUDA
# build (GBs of nvidia-* wheels), and any later resolver run that finds torch missing pulls it.
# So torch goes in first, on its own:
#   1. nothing, when PYTHON already imports torch X (any build: we never check which one);
#   2. else from $TORCH_INDEX, PyTorch's CPU wheel index by default, with short timeouts: every
#      torch there is a CPU build, and the index also serves torch's own deps;
#   3. else (the index is unreachable, or TORCH_INDEX is empty) plain `pip install torch==X`,
#      whatever the configured index serves: a CPU build where pip is set up with one (find-links,
#      a mirror), the CUDA build on the public index.
# TORCH_INDEX=URL picks another index (a mirror, or a CUDA one for a GPU venv); TORCH_INDEX=
# (empty) skips step 2.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 PYTHON CONSTRAINTS" >&2
  exit 2
fi
py=$1
constraints=$2
index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}

version=$(sed -n 's/^torch==\([^ #;]*\).*/\1/p' "$constraints" | head -n 1)
if [ -z "$version" ]; then
  echo "$constraints: no torch==VERSION line" >&2
  exit 2
fi

installed() {
  "$py" -c "import importlib.metadata as m; print('torch', m.version('torch'), 'installed')"
}

if "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != sys.argv[1])" \
  "$version" 2>/dev/null; then
  echo "torch $version already installed"
  exit 0
fi

if [ -n "$index" ]; then
  # A short timeout and one retry: an unreachable index (no DNS, a firewall) costs seconds, not
  # pip's default of 5 retries at PIP_DEFAULT_TIMEOUT each. Its warnings are shown only if it fails.
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  if "$py" -m pip install -q --timeout 10 --retries 1 --index-url "$index" "torch==$version" \
    >"$log" 2>&1; then
    installed
    exit 0
  fi
  tail -n 5 "$log" >&2
  echo "torch $version: $index failed (above); installing it from the configured index" >&2
fi
"$py" -m pip install -q "torch==$version"
installed
