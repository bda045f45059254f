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
# (default python3), PYTEST_ARGS (extra pytest arguments). After a build by
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

echo "=== building (MLA_JAX_CUDA_ARCHS=$MLA_JAX_CUDA_ARCHS)${LOG_DIR:+, log in \$OUT/build.log}"
t0=$SECONDS
# --no-deps: offline; jax and numpy are already installed.
log build.log $PY -m pip install -q --no-build-isolation --no-deps -e .
echo "=== build took $((SECONDS - t0)) s"
$PY -m mla_jax info

echo "=== python -m pytest -q tests${LOG_DIR:+ (log in \$OUT/pytest.log)}"
t0=$SECONDS
rc=0
if [ -n "$LOG_DIR" ]; then
  # shellcheck disable=SC2086
  $PY -m pytest -q tests ${PYTEST_ARGS:-} > "$LOG_DIR/pytest.log" 2>&1 || rc=$?
  grep -E "^(FAILED|ERROR) " "$LOG_DIR/pytest.log" | head -n 40 || true
  summary=$(tail -n 1 "$LOG_DIR/pytest.log")
else
  # shellcheck disable=SC2086
  $PY -m pytest -q tests ${PYTEST_ARGS:-} 2>&1 | tee /tmp/mla_jax_pytest.log || rc=${PIPESTATUS[0]}
  summary=$(tail -n 1 /tmp/mla_jax_pytest.log)
fi
passed=$(grep -oE "[0-9]+ passed" <<< "$summary" | grep -oE "[0-9]+" || echo 0)
echo "=== pytest: $summary"
echo "=== passed: $passed (rc $rc; tests $((SECONDS - t0)) s, total $((SECONDS - t_all)) s)"
exit "$rc"
