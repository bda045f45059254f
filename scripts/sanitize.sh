#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck over mla_jax's CUDA
# decode path, driven by tests/native/kernel_driver.cc (seeded paged and
# sparse cases over every kernel choice, dtype, cache format and layout, bad
# inputs; each checked against the CPU kernel), one tool per process. The
# driver calls the kernels without XLA: the tools crash inside the JAX
# process (docs/kernels.md, "Sanitizer status").
#
#   bash scripts/sanitize.sh OUT_DIR [N_CASES] [TOOL...]
#   # default 40 cases; tools memcheck racecheck synccheck racecheck-seesaw racecheck-swapab
#
# racecheck checks every kernel but the seesaw and swap-AB ones (kernel
# names containing "decode_s") and fails on any hazard. racecheck-seesaw runs
# racecheck on the seesaw kernel alone and only lists the source lines of
# the pairs it reports, without failing: racecheck reports pairs there that
# scripts/racecheck_probe.cu shows to be artefacts of the tool
# (docs/kernels.md, "Sanitizer status"); compare the list with the two named
# there. racecheck-swapab does the same for the swap-AB kernel, whose
# epilogue draws reports of the same kind, not yet explained.
#
# SEED (default the driver's) picks the cases; KERNEL (auto, portable,
# sm90_lockstep, sm90_seesaw, sm90_swapab) draws every case for that kernel
# request (the driver's --kernel), e.g. KERNEL=sm90_seesaw for a run aimed
# at one kernel.
#
# DRIVER names a built driver; otherwise it is built with CMake into
# BUILD_DIR (default /tmp/mla_jax_driver_build), which needs what the
# extension's build needs (python3 with nanobind and jax, the nvidia-cutlass
# headers, nvcc; MLA_JAX_CUDA_ARCHS, default 90a). A pip build leaves one
# too: pip install -e . --config-settings=cmake.define.MLA_JAX_KERNEL_DRIVER=ON
#   --config-settings=build-dir=DIR  ->  DIR/mla_jax_kernel_driver.
# OUT_DIR/<tool>.log holds each tool's report; the summary line printed per
# tool gives its error count and how many cases matched.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,28p "$0"; exit 2; }
OUT_DIR=$(mkdir -p "$1" && cd "$1" && pwd); N=${2:-40}; shift $(( $# >= 2 ? 2 : 1 ))
TOOLS=("$@"); [ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck racecheck-seesaw racecheck-swapab)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${DRIVER:-}" ]; then
  BUILD_DIR=${BUILD_DIR:-/tmp/mla_jax_driver_build}
  export MLA_JAX_CUDA_ARCHS=${MLA_JAX_CUDA_ARCHS:-90a}
  cmake -S "$ROOT" -B "$BUILD_DIR" -DMLA_JAX_KERNEL_DRIVER=ON -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" \
    > "$OUT_DIR/driver_build.log" 2>&1 &&
    cmake --build "$BUILD_DIR" --target mla_jax_kernel_driver -j "$(nproc)" >> "$OUT_DIR/driver_build.log" 2>&1 ||
    { tail -n 40 "$OUT_DIR/driver_build.log"; exit 1; }
  DRIVER=$BUILD_DIR/mla_jax_kernel_driver
fi
DRIVER_ARGS=("$N")
if [ -n "${SEED:-}" ] || [ -n "${KERNEL:-}" ]; then DRIVER_ARGS+=("${SEED:-20261202}"); fi
if [ -n "${KERNEL:-}" ]; then DRIVER_ARGS+=(--kernel "$KERNEL"); fi
rc=0
for tool in "${TOOLS[@]}"; do
  log=$OUT_DIR/$tool.log
  case $tool in
    memcheck) args=(--tool memcheck --leak-check no --kernel-name kns=mla) ;;
    racecheck) args=(--tool racecheck --racecheck-report hazard --kernel-name kns=mla --kernel-name-exclude kns=decode_s) ;;
    racecheck-seesaw) args=(--tool racecheck --racecheck-report analysis --kernel-name kns=seesaw) ;;
    racecheck-swapab) args=(--tool racecheck --racecheck-report analysis --kernel-name kns=swapab) ;;
    *) args=(--tool "$tool" --kernel-name kns=mla) ;;
  esac
  compute-sanitizer "${args[@]}" --error-exitcode 99 --print-limit 200 "$DRIVER" "${DRIVER_ARGS[@]}" > "$log" 2>&1
  r=$?
  echo "$tool: exit $r; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1); $(grep -E 'cases matched' "$log")"
  if [ "$tool" = racecheck-seesaw ] || [ "$tool" = racecheck-swapab ]; then
    # The source lines of the reported pairs, with how often each shows.
    grep -E 'Race reported|and (Read|Write) access' "$log" | grep -oE '(Read|Write) access at .* in [a-z_0-9.]+:[0-9]+' |
      sed -E 's/^(Read|Write) access at .* in ([a-z_0-9.]+:[0-9]+)$/\1 \2/' | sort | uniq -c
    grep -q 'cases matched' "$log" && ! grep -q FAIL "$log" || rc=1
  else
    [ $r = 0 ] || rc=1
  fi
done
exit $rc
