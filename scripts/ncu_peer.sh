#!/usr/bin/env bash
# Profiles mla_jax's kernels and FlashMLA's on the same shapes with ncu, so
# that the gap between the two is accounted for by measurement (duration at
# locked clocks, DRAM throughput, instructions, stall reasons, tensor-pipe
# use, occupancy) rather than guessed.
#
#   bash scripts/ncu_peer.sh OUT_DIR ROW...      # ROW: B,Q,H,SEQ, e.g. 128,1,16,4096
#   CACHE=fp8_ds_mla bash scripts/ncu_peer.sh OUT_DIR 128,1,128,2048   # sparse: SEQ is top-k
#   IMPLS=mla_jax CACHE=fp8 bash scripts/ncu_peer.sh OUT_DIR ...      # dense FP8: no FlashMLA peer
#   PROFILE_ARGS="--tokens-per-request 8192 --kernel sm90_seesaw" ...   # more profile_kernel.py options
#
# Needs mla_jax importable (installed, or PYTHONPATH=/tmp/mla_b after
# scripts/compare_builds.sh STEPS=build) and FlashMLA on PYTHONPATH (see
# benchmarks/README.md). Writes OUT_DIR/<impl>_<row>.csv (ncu --csv --page
# details: every metric of the sections below, per kernel launch) and
# OUT_DIR/<impl>_<row>.ncu-rep (the same launches, for ncu-ui).
set -euo pipefail

[ $# -ge 2 ] || { sed -n 2,14p "$0"; exit 2; }
OUT_DIR=$(mkdir -p "$1" && cd "$1" && pwd); shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats
          --section InstructionStats)
# mla_jax: scheduler, decode, combine; FlashMLA: metadata, split-KV decode, combine.
KERNELS='regex:schedule|decode|seesaw|combine|mla|sparse|metadata'

for row in "$@"; do
  IFS=, read -r b q h seq <<< "$row"
  name="${CACHE:-bf16}_b${b}q${q}h${h}s${seq}"
  for impl in ${IMPLS:-mla_jax flashmla}; do
    # From /tmp, so that no source folder named mla_jax is on sys.path; the
    # first calls (compilation, first touches) are skipped.
    (cd /tmp && ncu "${SECTIONS[@]}" -f -o "$OUT_DIR/${impl}_$name" --kernel-name "$KERNELS" \
      --launch-skip 9 --launch-count 6 \
      "$PY" "$ROOT/benchmarks/profile_kernel.py" --impl "$impl" --b "$b" --q-len "$q" --h "$h" --seq "$seq" \
      --calls 8 --cache "${CACHE:-bf16}" ${PROFILE_ARGS:-}) > "$OUT_DIR/${impl}_$name.log" 2>&1 || echo "ncu $impl $name failed (see ${impl}_$name.log)"
    ncu --import "$OUT_DIR/${impl}_$name.ncu-rep" --csv --page details > "$OUT_DIR/${impl}_$name.csv" 2>/dev/null || true
  done
done
