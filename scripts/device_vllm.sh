#!/usr/bin/env bash
# vLLM 0.33.0 with its compiled ops on the device, in back-to-back calls to the same warm
# machine (each call leaves its work in /tmp for the next). vLLM does not fit in one call: a
# call carries at most 64 MiB, the tree's 17 MiB included, and the compiled ops alone are
# 60 MiB as xz; see docs/VLLM.md "How it is tested" and scripts/vllm_pack.py.
#   PHASE=1 (carry .vllmdev/p1 .vllmdev/w .vllmdev/vllm-py.tar.xz .vllmdev/so.sha256):
#       unpack vLLM's Python files and the wheels its import needs into /tmp/vllm-site, and
#       the wheels mpack's environment shares with it (w/msite.txt) into /tmp/mpack-site
#   PHASE=fa (carry .vllmdev/fa .vllmdev/mw .vllmdev/mm; after 1): vLLM's FlashAttention 3 build,
#       the rest of mpack's environment (mw: what .device/wheels holds beyond w/), and what vLLM's
#       multimodal wrappers import into vLLM's (mm: mistral_common and its deps); carrying
#       .vllmdev/serve too installs what RUN=serve needs (it does not fit beside PHASE=2's load)
#   PHASE=2 (carry .vllmdev/p2): join the compiled ops, install mpack into both environments,
#       check which platform vLLM resolves (adding scripts/vllm_platform_standin.py where its
#       probe fails) and whether its flash attention imports (else scripts/vllm_fa_standin.py),
#       then run RUN (below) and leave its JSON in $OUT.
#   PHASE=moe (carry .vllmdev/moe; after 1): vLLM's MoE ops (_moe_C_stable_libtorch: topk_softmax,
#       the Marlin MoE GEMM), which the MoE engines of RUN=tokens need.
#   PHASE=data (carry .vllmdev/data/NN; after 1): one piece of an archive of checkpoints (the
#       real model's: scripts/vllm_pack.py --data); the call that brings the last piece joins
#       them, checks the archive's digest and unpacks it into /tmp/real (REAL_DIR).
#   PHASE=run (carry nothing): run RUN again on what the calls before left.
# RUN: gpu (default): scripts/vllm_gpu.py, all 16 layer kinds, then the 8B-shaped load bench;
#      tokens: scripts/vllm_engine.py tokens (engines generate: ordinary, private, attached);
#      restart: scripts/vllm_engine.py restart (8B-shaped: two engines, SIGKILL, time to ready);
#      real: scripts/vllm_real.py (the real model of /tmp/real: ordinary, private, attached);
#      serve: scripts/vllm_serve.py (`vllm serve` to the first completion: vLLM's loads, the fast
#      loaders, mpack private and attached; carry .vllmdev/serve, scripts/vllm_pack.py
#      --serve-only; SERVE_ARGS="--starts a,b" splits the starts over calls).
# Prepare .vllmdev/ here with: bash scripts/device_vllm.sh --pack  (downloads the vllm wheel into
# /tmp/vllmwhl if it is not there; needs .device/wheels (make device-wheels); prints each call's
# size, refuses > 60 MiB)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --pack ]; then
  shift; exec python3 scripts/vllm_pack.py "$@"
fi
OUT=${OUT:-/tmp/mpack-out}; mkdir -p "$OUT"
VSITE=/tmp/vllm-site; MSITE=/tmp/mpack-site
source scripts/device_python_env.sh  # the Python environment of every step
run_step() {
  case "${RUN:-gpu}" in
  gpu) timeout "${RUN_S:-480}" python3 scripts/vllm_gpu.py run --out "$OUT" --mpack-env "$MSITE" \
         --vllm-env "$VSITE" --bench-layers "${BENCH_LAYERS:-32}" ${VLLM_GPU_ARGS:-} 2>&1 | tee "$OUT/vllm_gpu.log"
       return "${PIPESTATUS[0]}" ;;
  tokens|restart) timeout "${RUN_S:-560}" python3 scripts/vllm_engine.py "$RUN" --out "$OUT" \
         --mpack-env "$MSITE" --vllm-env "$VSITE" ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine-$RUN.txt"
       return "${PIPESTATUS[0]}" ;;
  real) timeout "${RUN_S:-560}" python3 scripts/vllm_real.py run --out "$OUT" --real "${REAL_DIR:-/tmp/real}" \
         --mpack-env "$MSITE" --vllm-env "$VSITE" 2>&1 | tee "$OUT/engine-real.txt"
       return "${PIPESTATUS[0]}" ;;
  serve) serve_wheels || return 1
       timeout "${RUN_S:-570}" python3 scripts/vllm_serve.py --out "$OUT" --mpack-env "$MSITE" \
         --vllm-env "$VSITE" --layers "${BENCH_LAYERS:-32}" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve.txt"
       return "${PIPESTATUS[0]}" ;;
  *) echo "RUN=gpu, tokens, restart, real or serve"; return 2 ;;
  esac
}
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
# what `vllm serve` needs beyond the device image (RUN=serve), where this call carries it
serve_wheels() { if [ -d .vllmdev/serve ]; then pipi "$VSITE" .vllmdev/serve/*.whl; fi; }
case "${PHASE:-}" in
1)
  mkdir -p /tmp/vso "$VSITE"
  cp .vllmdev/p1/part00 .vllmdev/so.sha256 /tmp/vso/ || exit 1
  pipi "$VSITE" .vllmdev/w/*.whl || exit 1
  tar xJf .vllmdev/vllm-py.tar.xz -C "$VSITE" || exit 1
  mapfile -t shared < .vllmdev/w/msite.txt  # mpack's environment: what it shares with vLLM's
  [ "${#shared[@]}" -eq 0 ] || pipi "$MSITE" "${shared[@]/#/.vllmdev/w/}" || exit 1
  ls "$VSITE" | head -50 > "$OUT/vllm-site.txt"; echo "phase 1 done" ;;
2)
  cat /tmp/vso/part00 .vllmdev/p2/part01 > /tmp/vso/_C_stable_libtorch.abi3.so.xz || exit 1
  (cd /tmp/vso && sha256sum -c so.sha256) || exit 1
  xz -dc /tmp/vso/_C_stable_libtorch.abi3.so.xz > "$VSITE/vllm/_C_stable_libtorch.abi3.so" || exit 1
  if ! PYTHONPATH=$MSITE python3 -c "import compressed_tensors" 2>/dev/null; then
    echo "mpack's environment is incomplete: run PHASE=fa (carry .vllmdev/fa .vllmdev/mw .vllmdev/mm) first"; exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$MSITE" . || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$VSITE" . || exit 1
  # flash attention: vLLM's own module where its FA3 build came (PHASE=fa) and imports
  if ! PYTHONPATH=$VSITE python3 -c "import vllm.vllm_flash_attn" 2>"$OUT/fa-import.txt"; then
    cp scripts/vllm_fa_standin.py "$VSITE/vllm/vllm_flash_attn/__init__.py" || exit 1  # see its docstring
    echo "flash attention: stand-in (scripts/vllm_fa_standin.py)" | tee -a "$OUT/fa-import.txt"
  fi
  # the platform: vLLM's own probe first; its CUDA class through its plugin group if that fails
  probe='from vllm.platforms import current_platform as p; print(type(p).__name__, p.is_cuda())'
  PYTHONPATH=$VSITE python3 -c "$probe" 2>/dev/null | tail -1 | tee "$OUT/platform.txt"
  if ! grep -q " True$" "$OUT/platform.txt"; then
    cp scripts/vllm_platform_standin.py "$VSITE/mpack_vllm_platform_standin.py" || exit 1
    d="$VSITE/mpack_vllm_platform_standin-0.dist-info"; mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: mpack-vllm-platform-standin\nVersion: 0\n' > "$d/METADATA"
    printf '[vllm.platform_plugins]\nmpack_cuda = mpack_vllm_platform_standin:cuda\n' > "$d/entry_points.txt"
    : > "$d/RECORD"
    echo "with scripts/vllm_platform_standin.py:" | tee -a "$OUT/platform.txt"
    PYTHONPATH=$VSITE python3 -c "$probe" 2>/dev/null | tail -1 | tee -a "$OUT/platform.txt"
  fi
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  PYTHONPATH=$VSITE python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
  run_step ;;
fa)
  mkdir -p /tmp/vfa && cp .vllmdev/fa/* /tmp/vfa/ || exit 1
  (cd /tmp/vfa && sha256sum -c fa.sha256) || exit 1
  pipi "$MSITE" .vllmdev/mw/*.whl || exit 1
  pipi "$VSITE" .vllmdev/mm/*.whl || exit 1
  serve_wheels || exit 1  # no room for them beside PHASE=2's compiled ops and the tree
  xz -dc /tmp/vfa/_vllm_fa3_C.abi3.so.xz > "$VSITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" || exit 1
  PYTHONPATH=$VSITE python3 -c "import torch; torch.ops.load_library('$VSITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so'); print('FA3 loads on torch', torch.__version__)" 2>&1 | tail -3 | tee "$OUT/fa3.txt"
  ;;
moe)
  mkdir -p /tmp/vmoe && cp .vllmdev/moe/* /tmp/vmoe/ || exit 1
  (cd /tmp/vmoe && sha256sum -c moe.sha256) || exit 1
  xz -dc /tmp/vmoe/_moe_C_stable_libtorch.abi3.so.xz > "$VSITE/vllm/_moe_C_stable_libtorch.abi3.so" || exit 1
  PYTHONPATH=$VSITE python3 -c "import torch, vllm._moe_C_stable_libtorch; print('MoE ops:', hasattr(torch.ops._moe_C, 'topk_softmax'))" 2>&1 | tail -2
  ;;
data)
  # every piece this tree holds (an earlier call's may still be here); an archive whose pieces
  # have all come is joined, checked against its digest and unpacked
  VDATA=${VDATA:-/tmp/vdata}; REAL=${REAL_DIR:-/tmp/real}
  for d in .vllmdev/data/*/; do
    read -r digest name count < "$d/data.sha256"
    grep -qx "$digest" "$VDATA/unpacked" 2>/dev/null && continue  # an earlier call's, done
    mkdir -p "$VDATA/$name" && cp "$d/piece" "$VDATA/$name/$(basename "$d")" || exit 1
    echo "$digest $count" > "$VDATA/$name.want"
  done
  for want in "$VDATA"/*.want; do
    [ -f "$want" ] || { [ -s "$VDATA/unpacked" ] && break; echo "no piece came"; exit 2; }
    name=$(basename "$want" .want); read -r digest count < "$want"
    have=$(ls "$VDATA/$name" | wc -l); echo "$name: $have of $count pieces"
    [ "$have" -eq "$count" ] || continue
    cat "$VDATA/$name"/* > "$VDATA/$name.whole" || exit 1
    echo "$digest  $VDATA/$name.whole" | sha256sum -c || exit 1
    mkdir -p "$REAL" && tar xf "$VDATA/$name.whole" -C "$REAL" || exit 1
    rm -rf "$VDATA/$name" "$VDATA/$name.whole" "$want" && echo "$digest" >> "$VDATA/unpacked"
    ls "$REAL" | tee "$OUT/real.txt"
  done ;;
run)
  run_step ;;
*)
  echo "PHASE=1, fa, 2, moe, data or run (see the header)"; exit 2 ;;
esac
