# Sourced by the device scripts: install mpack and the pure-Python wheels it needs (carried in
# .device/wheels, git-ignored) into $SITE, point Python at them, and record the machine in $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mpack-out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/mpack-site}
export PYTHONUNBUFFERED=1 MPACK_GOLDEN=$PWD/.device/golden
if compgen -G '.device/wheels/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device/wheels/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" . || exit 1
# PYTHONSAFEPATH: scripts import the installed mpack, not the checkout beside them.
export PYTHONPATH=$SITE PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
