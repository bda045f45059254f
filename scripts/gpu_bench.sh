#!/usr/bin/env bash
# Builds mla_jax (and FlashMLA, when its source is given) on a GPU machine and
# runs the benchmarks behind benchmarks/results/, so that the committed results
# can be refreshed in one call of a machine that is lent for a few minutes.
#
#   OUT=DIR bash scripts/gpu_bench.sh [dense] [sparse] [fp8]    # default: all three
#
# Writes DIR/<gpu>.json (dense bf16, bench_paged_decode.py), DIR/<gpu>_sparse.json
# (bench_sparse_decode.py, each request's own 8,192 tokens, the lock-step kernel
# beside) and DIR/<gpu>_fp8.json (bench_fp8_decode.py, the lock-step kernel
# beside), <gpu> being h200 or h100 from nvidia-smi, with each one's log beside.
# Environment:
#   PEER=DIR       FlashMLA's source folder with its build.sh (e.g. a copy of
#                  ../shared/peers/flashmla carried to the machine); built into
#                  /tmp/flashmla beside mla_jax's build and timed in the same process
#   NATIVE=PATH    the native timer (benchmarks/native/decode_timing.cc, built where
#                  nvcc is), passed to the dense benchmark as --native-timing
#   COMMIT=SHA     commit to record (a device copy of the tree may have no .git)
#   SKIP_BUILD=1   use the mla_jax already installed (a machine still warm)
#   LIMIT_S=N      seconds for the whole script (default 590); each benchmark gets
#                  the share of what is left that its weight gives it, and one
#                  stopped at its share keeps the rows it finished
# The nvidia-cutlass headers come from wheels in .whl/ when there are any (an
# offline machine), as in scripts/gpu_tests.sh.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
OUT=${OUT:?set OUT to the output folder}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-590}
export MLA_JAX_CUDA_ARCHS=${MLA_JAX_CUDA_ARCHS:-90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # torch (FlashMLA, ceilings) shares the GPU
benches=("$@"); [ ${#benches[@]} -gt 0 ] || benches=(dense sparse fp8)
commit_args=(); [ -z "${COMMIT:-}" ] || commit_args=(--commit "$COMMIT")
t0=$SECONDS
left() { echo $((LIMIT_S - (SECONDS - t0))); }

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
case "$gpu" in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
echo "=== $gpu -> $tag"

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${PEER:-}" ]; then
  # Half the cores each, so that neither build waits for the other to finish.
  wheel=$(ls .whl/nvidia_cutlass-*.whl "$PEER"/../nvidia_cutlass-*.whl 2>/dev/null | head -n 1)
  (MAX_JOBS=$(( $(nproc) / 4 + 1 )) bash "$PEER/build.sh" "$wheel" /tmp/flashmla > "$OUT/peer_build.log" 2>&1
   echo "peer build rc $? at $((SECONDS - t0)) s" >> "$OUT/peer_build.log") &
  peer_pid=$!
  export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 ))
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  $PY -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 ||
    { tail -n 40 "$OUT/build.log"; exit 1; }
  echo "=== mla_jax built at $((SECONDS - t0)) s"
fi
if [ -n "${peer_pid:-}" ]; then
  wait "$peer_pid"; tail -n 1 "$OUT/peer_build.log"
  export PYTHONPATH=/tmp/flashmla${PYTHONPATH:+:$PYTHONPATH}
fi

# Relative weights: the share of the remaining time each benchmark gets.
declare -A weight=([dense]=5 [sparse]=3 [fp8]=3)
rc=0
for i in "${!benches[@]}"; do
  b=${benches[$i]}
  total=0; for r in "${benches[@]:$i}"; do total=$((total + ${weight[$r]:-1})); done
  share=$(( $(left) * ${weight[$b]:-1} / total ))
  [ "$share" -gt 20 ] || { echo "=== $b skipped: ${share} s left for it"; rc=1; continue; }
  case $b in
    dense)  cmd=(benchmarks/bench_paged_decode.py --out "$OUT/$tag.json")
            [ -z "${NATIVE:-}" ] || cmd+=(--native-timing "$NATIVE") ;;
    sparse) cmd=(benchmarks/bench_sparse_decode.py --tokens-per-request 8192 --compare sm90_lockstep
                 --out "$OUT/${tag}_sparse.json") ;;
    fp8)    cmd=(benchmarks/bench_fp8_decode.py --compare sm90_lockstep --out "$OUT/${tag}_fp8.json") ;;
    *) echo "unknown benchmark $b (dense, sparse, fp8)"; exit 2 ;;
  esac
  echo "=== $b: ${share} s"
  PYTHONUNBUFFERED=1 timeout "$share" "$PY" "${cmd[@]}" "${commit_args[@]}" > "$OUT/$b.log" 2>&1
  r=$?; echo "=== $b rc $r at $((SECONDS - t0)) s"; [ $r -eq 0 ] || rc=1
  tail -n 25 "$OUT/$b.log"
done
exit $rc
