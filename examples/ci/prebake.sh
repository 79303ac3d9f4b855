#!/usr/bin/env bash
# The CI pre-bake recipe (docs/CI.md): convert one model to every target asked for in one read
# of the source, re-derive every target from the source, and push them all to one Hub repo.
# examples/github-actions/prebake.yml calls it, and so can any other CI system: it needs bash,
# python3 (to read mpack's JSON) and mpack on PATH, installed with CPU torch first.
#
#   usage: prebake.sh [all|build|push]
#
#   build  mpack convert --layout targets, then mpack verify OUT --require-source (every
#          target, from one read of the source)
#   push   mpack push OUT PUSH_REPO, after build: a separate step, so that only it needs the
#          Hub token
#   all    build, then push (the default)
#
# Settings are environment variables, so that a CI system hands over values, never shell code:
#   MODEL          the source: a Hub repo id (org/name) or a checkpoint directory. Required.
#   REVISION       its branch, tag or commit (Hub ids only; default main). A commit makes the
#                  bake repeatable: every manifest records the commit it was made from.
#   TP             tensor-parallel sizes, a comma list (default 1)
#   PROFILE        w8a16 and/or w8a8-marlin, a comma list (default w8a16)
#   ACT_DTYPE      bfloat16 and/or float16, a comma list (default: the checkpoint's dtype)
#   SKIP_INVALID   1: leave out the targets this model cannot have (a TP that does not divide
#                  its heads) instead of failing the run
#   OUT            where the sidecars go (default out): OUT/<target>/, however many targets
#                  (--layout targets: the Hub paths org/repo/<target> stay the same from one
#                  target to several and back)
#   REPORTS        where mpack's JSON documents go (default reports): convert.json,
#                  verify.json, push.json
#   PUSH_REPO      the Hub repo to push to, namespace/name. Required for push.
#   PUSH_REVISION  the branch to push to (default: the repo's main)
#   PUSH_DRY_RUN   1 or true: check the sidecars and print the files and the card; send nothing
# The Hub settings are huggingface_hub's: HF_TOKEN, HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE.
set -euo pipefail

OUT=${OUT:-out}
REPORTS=${REPORTS:-reports}

is_true() {
  case "$1" in 1 | true | True | TRUE | yes) return 0 ;; *) return 1 ;; esac
}

# mpack uses its cache only if the folders and entries are yours and not writable by group or
# others (docs/RUNTIME.md, "mpack's cache"); else it ignores them and redoes the work. A CI cache
# is restored with the modes it was saved with, which a runner's umask may have made wider, so
# take group and other write away. Ownership cannot be fixed here: restore the cache as the user
# that runs mpack. Only restore a cache your own trusted runs saved: entries are not signed.
trust_cache() {
  local dir=${MPACK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mpack}
  if [ -d "$dir" ] && [ ! -L "$dir" ]; then
    chmod -R go-w "$dir" ||
      echo "prebake: could not restrict $dir (not yours?); mpack will not use its entries" >&2
  fi
}

# Reads mpack's JSON documents: python3 has json in its standard library, jq is not everywhere.
report() {
  python3 - "$@" <<'PY'
import json, sys
from pathlib import Path

what, doc = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
if what == "targets":  # convert.json (--layout targets) -> the sidecar of each target
    out = Path(sys.argv[3])
    for t in doc["skipped"]:
        print(f"prebake: skipped {t['name']}: {t['reason']}", file=sys.stderr)
    # A target folder this run did not make (a self-hosted runner's OUT from an earlier run
    # with other targets; convert keeps it, and says so) would go to the Hub with the rest:
    # stop before verifying anything.
    if doc["kept"]:
        sys.exit(f"prebake: {out} holds targets this run did not make: "
                 f"{', '.join(doc['kept'])}; remove them (rm -r {out}/<target>), or start "
                 "from an empty OUT")
    for t in doc["targets"]:
        print(t["out"])
elif what == "verify":  # verify.json: every target of OUT
    for t in doc["targets"]:
        print(f"prebake: verified {t['sidecar']}: {t['tensors_compared']} tensors re-derived "
              f"from {t['source']}")
elif what == "push":
    done = "would send" if doc.get("dry_run") else "sent"
    print(f"prebake: {done} {len(doc['files'])} files, {doc['bytes']} bytes, to "
          f"{doc['repo_id']} ({doc.get('url') or 'dry run'})")
    for f in doc["files"]:
        print(f"  {f['path']}  {f['size']}")
    if doc.get("dry_run"):
        print(doc["card"])
PY
}

build() {
  : "${MODEL:?set MODEL to a Hub repo id (org/name) or a checkpoint directory}"
  trust_cache
  mkdir -p "$REPORTS"
  local args=(convert "$MODEL" -o "$OUT" --layout targets --tp "${TP:-1}"
    --profile "${PROFILE:-w8a16}" --json)
  if [ -n "${ACT_DTYPE:-}" ]; then args+=(--act-dtype "$ACT_DTYPE"); fi
  if [ -n "${REVISION:-}" ]; then args+=(--revision "$REVISION"); fi
  if is_true "${SKIP_INVALID:-0}"; then args+=(--skip-invalid); fi
  echo "+ mpack ${args[*]}" >&2
  mpack "${args[@]}" >"$REPORTS/convert.json"
  report targets "$REPORTS/convert.json" "$OUT" >/dev/null
  # every target of OUT, re-derived from one read of the source (it is in the HF cache by now,
  # and verify --source reads the commit the manifests record, not whatever main is now)
  echo "+ mpack verify $OUT --source $MODEL --require-source --json" >&2
  mpack verify "$OUT" --source "$MODEL" --require-source --json >"$REPORTS/verify.json"
  report verify "$REPORTS/verify.json"
}

push() {
  : "${PUSH_REPO:?set PUSH_REPO to the Hub repo to push to (namespace/name)}"
  mkdir -p "$REPORTS"
  local args=(push "$OUT" "$PUSH_REPO" --json)
  if [ -n "${PUSH_REVISION:-}" ]; then args+=(--revision "$PUSH_REVISION"); fi
  if is_true "${PUSH_DRY_RUN:-0}"; then args+=(--dry-run); fi
  echo "+ mpack ${args[*]}" >&2
  mpack "${args[@]}" >"$REPORTS/push.json"
  report push "$REPORTS/push.json"
}

case "${1:-all}" in
  build) build ;;
  push) push ;;
  all)
    build # not `build && push`: bash ignores set -e inside a && list
    push
    ;;
  *)
    echo "usage: $0 [all|build|push]" >&2
    exit 2
    ;;
esac
