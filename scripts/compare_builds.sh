#!/usr/bin/env bash
# Times two source trees of mla_jax side by side on one GPU machine: each is
# built with `pip install --target` (no editable install, whose import hook
# would shadow PYTHONPATH), then benchmarks/bench_paged_decode.py of the
# second tree runs against each build in turn, A B A B, so that both see the
# same machine state. Results: $OUT_DIR/{a,b}_<round>.json, summary.json and a
# table (scripts/compare_summary.py).
#
#   bash scripts/compare_builds.sh A_SRC B_SRC OUT_DIR [bench args...]
#
# A_SRC, B_SRC: source trees (e.g. `git archive <commit> | tar -x -C DIR`).
# Bench args go to every run (default: --no-xla; --flashmla off unless given). Needs what scripts/gpu_tests.sh
# needs (jax[cuda], nanobind, scikit-build-core, cmake, ninja; nvidia-cutlass
# as a wheel in .whl/ when offline). STEPS=build or STEPS=bench runs one half
# (bench reuses the builds in /tmp/mla_a, /tmp/mla_b); default: both. ROUNDS
# (default 2) sets how many A B rounds the bench step runs; A_LABEL, B_LABEL
# (e.g. the commits) are recorded in the results.
set -euo pipefail

[ $# -ge 3 ] || { sed -n 2,17p "$0"; exit 2; }
STEPS=${STEPS:-build,bench}
A_SRC=$(cd "$1" && pwd); B_SRC=$(cd "$2" && pwd); OUT_DIR=$(mkdir -p "$3" && cd "$3" && pwd); shift 3
A_LABEL=${A_LABEL:-a}; B_LABEL=${B_LABEL:-b}   # recorded as each side's commit
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -gt 0 ] || BENCH_ARGS=(--no-xla)
# The peer is the same on both sides: time it (--flashmla auto) only when asked.
[[ " ${BENCH_ARGS[*]} " == *" --flashmla "* ]] || BENCH_ARGS+=(--flashmla off)
PY=${PYTHON:-python3}
export MLA_JAX_CUDA_ARCHS=${MLA_JAX_CUDA_ARCHS:-90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
mkdir -p "$OUT_DIR"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

build() {  # build SRC TARGET
  rm -rf "$2"
  (cd "$1" && $PY -m pip install -q --no-build-isolation --no-deps --target "$2" .) > "$OUT_DIR/build_$(basename "$2").log" 2>&1
}
if [[ $STEPS == *build* ]]; then
  t0=$SECONDS
  build "$A_SRC" /tmp/mla_a & pa=$!
  build "$B_SRC" /tmp/mla_b & pb=$!
  wait $pa || { echo "build of A failed:"; tail -n 40 "$OUT_DIR/build_mla_a.log"; exit 1; }
  wait $pb || { echo "build of B failed:"; tail -n 40 "$OUT_DIR/build_mla_b.log"; exit 1; }
  echo "built A and B in $((SECONDS - t0)) s"
fi
[[ $STEPS == *bench* ]] || exit 0

# An editable install of mla_jax (scripts/gpu_tests.sh makes one) puts an
# import hook ahead of PYTHONPATH: both sides would then time that build.
for side in a b; do
  (cd /tmp && PYTHONPATH=/tmp/mla_$side${PYTHONPATH:+:$PYTHONPATH} $PY -c "
import sys, mla_jax
if not mla_jax.__file__.startswith('/tmp/mla_$side/'):
  sys.exit(f'side $side imports {mla_jax.__file__}, not the build in /tmp/mla_$side: '
           'uninstall the installed mla_jax (pip uninstall mla_jax) and run again')")
done

for round in $(seq "${ROUNDS:-2}"); do
  for side in a b; do
    # From /tmp, so that no source folder named mla_jax is on sys.path.
    (cd /tmp && PYTHONPATH=/tmp/mla_$side${PYTHONPATH:+:$PYTHONPATH} \
      $PY "$B_SRC/benchmarks/bench_paged_decode.py" --out "$OUT_DIR/${side}_$round.json" \
      --commit "$([ $side = a ] && echo "$A_LABEL" || echo "$B_LABEL")" "${BENCH_ARGS[@]}") \
      > "$OUT_DIR/bench_${side}_$round.log" 2>&1 || echo "bench $side round $round failed: see bench_${side}_$round.log"
  done
done

"$PY" "$ROOT/scripts/compare_summary.py" "$OUT_DIR" --json "$OUT_DIR/summary.json" \
  --a-commit "$A_LABEL" --b-commit "$B_LABEL"
