#!/usr/bin/env bash
# Builds mla_jax with its CUDA kernels and runs the test suite on a GPU machine.
#
#   bash scripts/gpu_tests.sh            # from the repo root
#
# Written for an offline machine that already has python3 with jax[cuda],
# nanobind, scikit-build-core, cmake, ninja, pytest and chex. Whatever else
# the build needs (the nvidia-cutlass headers) is carried as wheels in .whl/
# (e.g. `python3 -m pip download --no-deps -d .whl nvidia-cutlass` beforehand)
# and installed to /tmp/site. When $OUT is set, build.log and pytest.log go
# there; otherwise everything goes to the terminal.
#
# Environment: MLA_JAX_CUDA_ARCHS (default 90a here: H100/H200), PYTHON
# (default python3), PYTEST_ARGS (extra pytest arguments), PYTEST_JOBS (test
# files run at once, one pytest each, test_cuda_kernel.py as 1 + CK_SHARDS
# parts (default 3), sharing the GPU; default 1: one pytest over tests/, as CI
# runs it), SKIP_BUILD=1 (test the installed build, e.g. on
# a machine still warm from an earlier call), TEST_FILES (the test files to
# run, by name, e.g. "test_fp8 test_sparse_decode"; default all), so that a
# suite longer than one call can be split over two. Parallel parts share the
# machine's CPUs and the GPU: on a 16-core machine 6 parts progressed far
# slower than one sequential pytest (why was not measured), so prefer
# PYTEST_JOBS=1 with TEST_FILES split over warm calls.
# Stopped by a signal (a time limit), it still writes what the finished and
# running parts logged to pytest.log, and their last lines. After a build by
# this script, the long randomized run on the GPU alone is
#   python3 -m pytest -q tests/test_differential.py -k "random_cases and cuda" --differential-cases 3000
# The editable install this script makes shadows --target builds: run
# scripts/compare_builds.sh before it on the same machine.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
export MLA_JAX_CUDA_ARCHS=${MLA_JAX_CUDA_ARCHS:-90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
LOG_DIR=${OUT:-}

log() {  # log NAME CMD...: runs CMD, output to $OUT/NAME (and its tail on failure) or the terminal
  local name=$1; shift
  if [ -n "$LOG_DIR" ]; then
    "$@" > "$LOG_DIR/$name" 2>&1 || { local rc=$?; tail -n 60 "$LOG_DIR/$name"; return $rc; }
  else
    "$@"
  fi
}

t_all=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

if compgen -G ".whl/*.whl" > /dev/null; then
  echo "=== installing carried wheels: $(ls .whl)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "${SKIP_BUILD:-0}" = 1 ]; then
  echo "=== SKIP_BUILD=1: testing the mla_jax already installed"
else
  echo "=== building (MLA_JAX_CUDA_ARCHS=$MLA_JAX_CUDA_ARCHS)${LOG_DIR:+, log in \$OUT/build.log}"
  t0=$SECONDS
  # --no-deps: offline; jax and numpy are already installed.
  log build.log $PY -m pip install -q --no-build-isolation --no-deps -e .
  echo "=== build took $((SECONDS - t0)) s"
fi
$PY -m mla_jax info

JOBS=${PYTEST_JOBS:-1}
echo "=== python -m pytest -q ${TEST_FILES:-tests} (${JOBS} at a time)${LOG_DIR:+, log in \$OUT/pytest.log}"
t0=$SECONDS
rc=0
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}  # several processes share the GPU
log_file=${LOG_DIR:-/tmp}/pytest.log
if [ "$JOBS" -le 1 ]; then
  targets=(tests)
  if [ -n "${TEST_FILES:-}" ]; then
    targets=()
    for n in $TEST_FILES; do
      [ -f "tests/$n.py" ] || { echo "TEST_FILES names $n: no tests/$n.py"; exit 2; }
      targets+=("tests/$n.py")
    done
  fi
  # shellcheck disable=SC2086
  $PY -m pytest -q "${targets[@]}" ${PYTEST_ARGS:-} > "$log_file" 2>&1 || rc=$?
  [ -n "$LOG_DIR" ] || cat "$log_file"
  summary=$(tail -n 1 "$log_file")
else
  # One pytest per test file, JOBS at a time, the slow GPU-heavy files
  # first so that they do not start last; test_cuda_kernel.py, the longest,
  # as -k fp8 and CK_SHARDS lists of its other tests (dealt round-robin from
  # the collected ids) so that no single part holds the run back. Each
  # part's log goes to /tmp/mla_jax_pytest_parts/<part>.log, all of them
  # into pytest.log (one file: the device tool brings back few).
  parts=/tmp/mla_jax_pytest_parts
  rm -rf "$parts" && mkdir -p "$parts"
  CK_SHARDS=${CK_SHARDS:-3}
  "$PY" -m pytest -q --collect-only -p no:cacheprovider tests/test_cuda_kernel.py -k "not fp8" 2>/dev/null |
    grep "::" | awk -v n="$CK_SHARDS" -v d="$parts" '{print > (d "/ck_ids." (NR - 1) % n)}'
  first="test_cuda_kernel test_differential test_sparse_decode test_serving test_context_parallel test_fp8"
  files=$(for f in $first; do echo "tests/$f.py"; done; ls tests/test_*.py | grep -v -E "/($(echo $first | tr ' ' '|'))\.py$")
  if [ -n "${TEST_FILES:-}" ]; then
    # Every name must be a test file, as in the one-at-a-time path (a typo
    # would otherwise drop that file from the run without a word).
    for n in $TEST_FILES; do
      [ -f "tests/$n.py" ] || { echo "TEST_FILES names $n: no tests/$n.py"; exit 2; }
    done
    files=$(for f in $files; do n=$(basename "$f" .py); if [[ " $TEST_FILES " == *" $n "* ]]; then echo "$f"; fi; done)
    [ -n "$files" ] || { echo "TEST_FILES ($TEST_FILES) names no test file of the run"; exit 2; }
  fi
  # A time limit's signal: keep what the parts have logged so far.
  partial() {
    [ -z "${xargs_pid:-}" ] || { pkill -TERM -P "$xargs_pid" 2>/dev/null; kill "$xargs_pid" 2>/dev/null; } || true
    cat "$parts"/test_*.log > "$log_file" 2>/dev/null || true
    echo "=== stopped by a signal after $((SECONDS - t0)) s; last line of each part:"
    for f in "$parts"/test_*.log; do echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
    exit 124
  }
  trap partial TERM INT
  # Lines "FILE|NAME|KEXPR" (KEXPR empty: the whole file; FILE "@LIST": the
  # test ids in LIST, one a line).
  jobs=$(for f in $files; do
           n=$(basename "$f" .py)
           if [ "$n" = test_cuda_kernel ]; then
             echo "$f|$n.fp8|fp8"
             if compgen -G "$parts/ck_ids.*" > /dev/null; then
               for ids in "$parts"/ck_ids.*; do echo "@$ids|$n.other${ids##*.}|"; done
             else echo "$f|$n.other|not fp8"; fi  # collection failed: one part, which reports why
           else echo "$f|$n|"; fi
         done)
  export PY parts PYTEST_ARGS
  # In the background, so that a signal's trap runs at once (bash runs traps
  # only between foreground commands, and `wait` is interrupted by them).
  printf '%s\n' "$jobs" | xargs -P "$JOBS" -I{} bash -c \
    'IFS="|" read -r f n k <<< "{}"; sel=(); [ -n "$k" ] && sel=(-k "$k")
     if [[ $f == @* ]]; then mapfile -t targets < "${f#@}"; else targets=("$f"); fi
     # shellcheck disable=SC2086
     "$PY" -m pytest -q -p no:cacheprovider "${targets[@]}" "${sel[@]}" ${PYTEST_ARGS:-} > "$parts/$n.log" 2>&1
     echo "$? $n" >> "$parts/rc"' &
  xargs_pid=$!
  wait "$xargs_pid"
  trap - TERM INT
  cat "$parts"/test_*.log > "$log_file"
  awk '$1 != 0 && $1 != 5 {bad = 1} END {exit bad}' "$parts/rc" || rc=1
  # "N passed, M skipped ..." per file, summed (a shard's deselected tests
  # are the other shard's)
  summary=$(for f in "$parts"/test_*.log; do
              case $f in *.fp8.log|*.other.log) tail -n 1 "$f" | sed -E 's/[0-9]+ deselected//' ;; *) tail -n 1 "$f" ;; esac
            done |
            awk '{for (i = 2; i <= NF; i++) if ($i ~ /^(passed|failed|skipped|errors?|deselected)/) {
                    k = $i; sub(/[,;]$/, "", k); n[k] += $(i - 1) } }
                 END {for (k in n) printf "%d %s, ", n[k], k; print ""}')
fi
grep -E "^(FAILED|ERROR) " "$log_file" | head -n 40 || true
passed=$(grep -oE "[0-9]+ passed" <<< "$summary" | grep -oE "[0-9]+" || echo 0)
echo "=== pytest: $summary"
echo "=== passed: $passed (rc $rc; tests $((SECONDS - t0)) s, total $((SECONDS - t_all)) s)"
exit "$rc"
