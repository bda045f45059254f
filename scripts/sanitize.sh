#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck over mla_jax's CUDA
# kernels (scripts/sanitize_cases.py: seeded dense cases over all kernel
# choices, sparse formats), one tool per process.
#
#   bash scripts/sanitize.sh OUT_DIR [N_CASES] [TOOL...]   # default 24 cases; memcheck racecheck synccheck
#
# Needs mla_jax with its CUDA kernels importable (an install, or PYTHONPATH
# set to a --target build). OUT_DIR/<tool>.log holds each tool's report;
# the last line of each says how many errors it found. Only kernels whose
# names contain "mla" (all of ours, none of XLA's) are checked; JAX's
# platform allocator gives every buffer its own allocation, so that an
# access past a buffer is not hidden inside a larger pool.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,13p "$0"; exit 2; }
OUT_DIR=$(mkdir -p "$1" && cd "$1" && pwd); N=${2:-24}; shift $(( $# >= 2 ? 2 : 1 ))
TOOLS=("$@"); [ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false
rc=0
for tool in "${TOOLS[@]}"; do
  extra=(); [ "$tool" = memcheck ] && extra=(--leak-check no)
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  (cd /tmp && compute-sanitizer --tool "$tool" "${extra[@]}" --kernel-name kns=mla --error-exitcode 99 \
     --print-limit 50 "$PY" "$ROOT/scripts/sanitize_cases.py" "$N") > "$OUT_DIR/$tool.log" 2>&1
  r=$?
  echo "$tool: exit $r; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT_DIR/$tool.log" | tail -n 1); $(grep -E 'cases matched' "$OUT_DIR/$tool.log")"
  [ $r = 0 ] || rc=1
done
exit $rc
