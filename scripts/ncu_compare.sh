#!/usr/bin/env bash
# Profiles the mla_jax kernels of two builds with ncu on the same shapes, so
# that a timing difference between builds can be traced to a kernel (its
# duration at locked clocks, registers, instructions, DRAM bytes) or to the
# gaps between kernels (no kernel differs).
#
#   bash scripts/ncu_compare.sh OUT_DIR ROW...      # ROW: B,Q,H,SEQ, e.g. 1,1,128,4096
#
# Uses the builds scripts/compare_builds.sh leaves in /tmp/mla_a and /tmp/mla_b
# (run it first with STEPS=build). Writes OUT_DIR/<side>_<row>.csv (ncu
# --csv, one line per metric and kernel launch) and OUT_DIR/summary.txt
# (per kernel and side: the median of each metric over the profiled calls).
# FULL=1 also writes a full-set report per side and row (<side>_<row>.ncu-rep).
set -euo pipefail

[ $# -ge 2 ] || { sed -n 2,14p "$0"; exit 2; }
OUT_DIR=$(mkdir -p "$1" && cd "$1" && pwd); shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
METRICS=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum
# Every kernel of mla_jax's CUDA path: scheduler, decode, combine.
KERNELS='regex:schedule|decode|seesaw|combine'

for row in "$@"; do
  IFS=, read -r b q h seq <<< "$row"
  name="b${b}q${q}h${h}s${seq}"
  for side in a b; do
    # From /tmp, so that no source folder named mla_jax is on sys.path. Calls
    # 1-3 (compile, first touches) are skipped; calls 4-8 are profiled.
    (cd /tmp && PYTHONPATH=/tmp/mla_$side${PYTHONPATH:+:$PYTHONPATH} ncu --csv --metrics "$METRICS" \
      --kernel-name "$KERNELS" --launch-skip 9 --launch-count 15 \
      "$PY" "$ROOT/benchmarks/profile_kernel.py" --b "$b" --q-len "$q" --h "$h" --seq "$seq" --calls 12) \
      > "$OUT_DIR/${side}_$name.csv" 2> "$OUT_DIR/${side}_$name.err" || echo "ncu $side $name failed (see ${side}_$name.err)"
    if [ "${FULL:-0}" = 1 ]; then
      (cd /tmp && PYTHONPATH=/tmp/mla_$side${PYTHONPATH:+:$PYTHONPATH} ncu --set full -f -o "$OUT_DIR/${side}_$name" \
        --kernel-name "$KERNELS" --launch-skip 9 --launch-count 3 \
        "$PY" "$ROOT/benchmarks/profile_kernel.py" --b "$b" --q-len "$q" --h "$h" --seq "$seq" --calls 8) \
        > "$OUT_DIR/${side}_$name.full.log" 2>&1 || echo "ncu --set full $side $name failed"
    fi
  done
done

"$PY" - "$OUT_DIR" <<'EOF' | tee "$OUT_DIR/summary.txt"
import csv, glob, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
table = defaultdict(lambda: defaultdict(list))  # (row, kernel, metric) -> side -> values
for path in sorted(glob.glob(os.path.join(out, "*.csv"))):
  side, row = os.path.basename(path)[:-4].split("_", 1)
  lines = [l for l in open(path) if l.startswith('"')]
  for rec in csv.DictReader(lines):
    found = re.search(r"(\w+_kernel)\b", rec["Kernel Name"])
    kernel = found.group(1) if found else rec["Kernel Name"][:28]
    try:
      v = float(rec["Metric Value"].replace(",", ""))
    except ValueError:
      continue
    table[(row, kernel, rec["Metric Name"] + " [" + rec["Metric Unit"] + "]")][side].append(v)
for (row, kernel, metric), sides in sorted(table.items()):
  a, b = (statistics.median(sides[s]) if sides[s] else float("nan") for s in "ab")
  ratio = b / a if a else float("nan")
  print(f"{row:18s} {kernel:28s} {metric:60s} a {a:14.1f} b {b:14.1f} b/a {ratio:.4f} (n {len(sides['a'])}/{len(sides['b'])})")
EOF
