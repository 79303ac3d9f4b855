# Sourced by the device scripts: install mpack and the wheels it needs (carried in .device/wheels,
# git-ignored, made by `make device-wheels`) into $SITE, point Python at them
# (device_python_env.sh), record the machine in $OUT, and define step (below).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mpack-out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/mpack-site}
# The golden data travels with the tree (tests/data/golden); no MPACK_GOLDEN needed.
# .device/wheels: `make device-wheels` (scripts/device_wheels.sh) makes it; the list is one file.
if compgen -G '.device/wheels/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --find-links .device/wheels --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" -r scripts/device_wheels.txt || exit 1
fi
# --upgrade: a machine still warm from an earlier call keeps $SITE, and without it pip leaves that
# call's mpack in place (it only warns), so this tree would not be the one measured.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" . || exit 1
for f in convert/scheme_check.py convert/pipeline.py; do
  cmp -s "$f" "$SITE/mpack/$f" || { echo "$SITE/mpack/$f is not this tree's $f" >&2; exit 1; }
done
cmp -s mpack/cli.py "$SITE/mpack/cli.py" || { echo "$SITE/mpack/cli.py is stale" >&2; exit 1; }
source scripts/device_python_env.sh "$SITE"  # the Python environment, PYTHONPATH=$SITE
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# step NAME SECONDS COMMAND...: run COMMAND under a time limit (0 skips it), its output in
# $OUT/NAME.log and its exit status in $OUT/steps.txt; $rc keeps the first failing status.
rc=0
step() {
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 0 ] || return 0
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  local s=${PIPESTATUS[0]}
  echo "== $name exit $s" | tee -a "$OUT/steps.txt"
  [ "$rc" -eq 0 ] && rc=$s
}
