#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck over mla_jax's CUDA
# decode path, driven by tests/native/kernel_driver.cc (seeded paged and
# sparse cases over every kernel choice, dtype, cache format and layout, bad
# inputs; each checked against the CPU kernel), one tool per process. The
# driver calls the kernels without XLA: the tools crash inside the JAX
# process (docs/kernels.md, "Sanitizer status").
#
#   bash scripts/sanitize.sh OUT_DIR [N_CASES] [TOOL...]   # default 40 cases; memcheck racecheck synccheck
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
[ $# -ge 1 ] || { sed -n 2,18p "$0"; exit 2; }
OUT_DIR=$(mkdir -p "$1" && cd "$1" && pwd); N=${2:-40}; shift $(( $# >= 2 ? 2 : 1 ))
TOOLS=("$@"); [ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck)
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
rc=0
for tool in "${TOOLS[@]}"; do
  extra=(); [ "$tool" = memcheck ] && extra=(--leak-check no)
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  compute-sanitizer --tool "$tool" "${extra[@]}" --kernel-name kns=mla --error-exitcode 99 --print-limit 50 \
    "$DRIVER" "$N" > "$OUT_DIR/$tool.log" 2>&1
  r=$?
  echo "$tool: exit $r; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT_DIR/$tool.log" | tail -n 1); $(grep -E 'cases matched' "$OUT_DIR/$tool.log")"
  [ $r = 0 ] || rc=1
done
exit $rc
