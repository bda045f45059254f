#!/usr/bin/env bash
# Times two source trees of mla_jax side by side on one GPU machine: each is
# built with `pip install --target` (no editable install, whose import hook
# would shadow PYTHONPATH), then benchmarks/bench_paged_decode.py of the
# second tree runs against each build in turn, A B A B, so that both see the
# same machine state. Results: $OUT_DIR/{a,b}_{1,2}.json and a summary table.
#
#   bash scripts/compare_builds.sh A_SRC B_SRC OUT_DIR [bench args...]
#
# A_SRC, B_SRC: source trees (e.g. `git archive <commit> | tar -x -C DIR`).
# Bench args go to every run (default: --no-xla). Needs what scripts/gpu_tests.sh
# needs (jax[cuda], nanobind, scikit-build-core, cmake, ninja; nvidia-cutlass
# as a wheel in .whl/ when offline).
set -euo pipefail

[ $# -ge 3 ] || { sed -n 2,13p "$0"; exit 2; }
A_SRC=$(cd "$1" && pwd); B_SRC=$(cd "$2" && pwd); OUT_DIR=$3; shift 3
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -gt 0 ] || BENCH_ARGS=(--no-xla)
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
build "$A_SRC" /tmp/mla_a
build "$B_SRC" /tmp/mla_b

for round in 1 2; do
  for side in a b; do
    # From /tmp, so that no source folder named mla_jax is on sys.path.
    (cd /tmp && PYTHONPATH=/tmp/mla_$side${PYTHONPATH:+:$PYTHONPATH} \
      $PY "$B_SRC/benchmarks/bench_paged_decode.py" --out "$OUT_DIR/${side}_$round.json" \
      --commit "$side" "${BENCH_ARGS[@]}") > "$OUT_DIR/bench_${side}_$round.log" 2>&1 || true
  done
done

$PY - "$OUT_DIR" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
runs = {s: [json.loads((out / f"{s}_{r}.json").read_text()) for r in (1, 2) if (out / f"{s}_{r}.json").exists()]
        for s in "ab"}
def us(run, i, key):
  mla = run["rows"][i].get("mla") or {}
  return mla.get(key)
names = [r["name"] for r in runs["a"][0]["rows"]] if runs["a"] else []
print(f"{'row':<20} {'a us':>9} {'b us':>9} {'b/a':>6}   {'a dev':>9} {'b dev':>9} {'b/a':>6}")
for i, name in enumerate(names):
  cells = []
  for key in ("us", "us_device"):
    a = [v for v in (us(r, i, key) for r in runs["a"]) if v]
    b = [v for v in (us(r, i, key) for r in runs["b"]) if v]
    ma, mb = (statistics.median(a) if a else None), (statistics.median(b) if b else None)
    cells += [f"{ma:9.1f}" if ma else f"{'-':>9}", f"{mb:9.1f}" if mb else f"{'-':>9}",
              f"{mb / ma:6.3f}" if ma and mb else f"{'-':>6}"]
  print(f"{name:<20} " + " ".join(cells[:3]) + "   " + " ".join(cells[3:]))
EOF
