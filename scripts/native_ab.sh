#!/usr/bin/env bash
# A/B of two kernel builds with the native timer (benchmarks/native/decode_timing.cc:
# CUDA-graph replay, no XLA), for a GPU machine lent for a few minutes: the
# timers are built where nvcc is (no GPU needed) and only run on the GPU.
#
#   bash scripts/native_ab.sh build REV OUT_BIN     # where nvcc is: the timer of commit REV
#   bash scripts/native_ab.sh run A_BIN B_BIN OUT_DIR ROWS [timer args...]   # on the GPU
#
# build: checks REV out into a temporary git worktree, configures it with
# MLA_JAX_KERNEL_DRIVER=ON (the timer and mla_jax_kernel_driver) for
# MLA_JAX_CUDA_ARCHS (default 90a) and writes OUT_BIN and OUT_BIN.gz (about a
# quarter of the size, for a device copy's size limit; `gunzip -k` restores
# it), and the driver beside them as OUT_BIN.driver(.gz). Needs what the
# extension's build needs (python3 with nanobind and the nvidia-cutlass
# headers, cmake, ninja, nvcc); PYTHON names the interpreter.
# run: ROWS as the timer's --rows ("B,Q,H,SEQ;..."); A and B alternate
# ROUNDS times (default 2), A B A B, each with the same arguments (e.g.
# --fp8 --reps 3); a run stops after RUN_LIMIT_S seconds (default 60) and
# keeps nothing. Writes OUT_DIR/{a,b}_<round>.json and prints, per row, each
# side's graph_us per round, the ratio of the medians (B / A) and whether
# every run passed the timer's check against the CPU kernel; exit status 1
# when a row failed a check or is missing from a run.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,21p "$0"; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

case "$1" in
  build)
    [ $# -eq 3 ] || { sed -n 2,21p "$0"; exit 2; }
    rev=$2; out=$(mkdir -p "$(dirname "$3")" && cd "$(dirname "$3")" && pwd)/$(basename "$3")
    tree=$(mktemp -d /tmp/mla_jax_ab_tree.XXXXXX); rmdir "$tree"
    git -C "$ROOT" worktree add --detach "$tree" "$rev" > /dev/null || exit 1
    trap 'git -C "$ROOT" worktree remove --force "$tree"' EXIT
    MLA_JAX_CUDA_ARCHS=${MLA_JAX_CUDA_ARCHS:-90a} cmake -S "$tree" -B "$tree/build" -G Ninja \
      -DMLA_JAX_KERNEL_DRIVER=ON -DPython_EXECUTABLE="$(command -v "$PY")" > "$out.build.log" 2>&1 &&
      ninja -C "$tree/build" mla_jax_decode_timing mla_jax_kernel_driver >> "$out.build.log" 2>&1 ||
      { tail -n 30 "$out.build.log"; exit 1; }
    cp "$tree/build/mla_jax_decode_timing" "$out" && cp "$tree/build/mla_jax_kernel_driver" "$out.driver" &&
      gzip -kf "$out" && gzip -kf "$out.driver" || { echo "copying the built tools to $out failed"; exit 1; }
    echo "built $(git -C "$ROOT" rev-parse --short "$rev"): $out ($(du -h "$out.gz" | cut -f1) gzipped), $out.driver"
    ;;
  run)
    [ $# -ge 5 ] || { sed -n 2,21p "$0"; exit 2; }
    out_dir=$(mkdir -p "$4" && cd "$4" && pwd); rows=$5
    for bin in "$2" "$3"; do
      [ -f "$bin" ] && [ -x "$bin" ] || { echo "not an executable: $bin (gunzip -k a .gz first)"; exit 2; }
    done
    a=$(readlink -f "$2"); b=$(readlink -f "$3"); shift 5
    rm -f "$out_dir"/[ab]_*.json "$out_dir"/[ab]_*.log  # a table of this run only
    rounds=${ROUNDS:-2}; limit=${RUN_LIMIT_S:-60}
    for ((r = 1; r <= rounds; ++r)); do
      for side in a b; do
        bin=$a; [ $side = b ] && bin=$b
        rm -f "$out_dir/${side}_$r.json"
        timeout "$limit" "$bin" --rows "$rows" "$@" --json "$out_dir/${side}_$r.json" \
          > "$out_dir/${side}_$r.log" 2>&1
        echo "round $r $side: rc $?"
      done
    done
    $PY - "$out_dir" <<'PY'
import glob, json, statistics, sys

out = sys.argv[1]
runs = {"a": {}, "b": {}}  # side -> row name -> [(graph_us, check_ok)]
for side in runs:
    for path in sorted(glob.glob(f"{out}/{side}_*.json")):
        try:
            rows = json.load(open(path))["rows"]
        except (OSError, ValueError, KeyError):
            continue
        for r in rows:
            runs[side].setdefault(r["name"], []).append((r["graph_us"], r["check_ok"]))
names = list(dict.fromkeys(list(runs["a"]) + list(runs["b"])))
failed = False
print(f"{'row':<24} {'A graph_us':<24} {'B graph_us':<24} B/A    checks")
for n in names:
    a, b = runs["a"].get(n, []), runs["b"].get(n, [])
    ratio = statistics.median(x for x, _ in b) / statistics.median(x for x, _ in a) if a and b else float("nan")
    ok = all(c for _, c in a + b) and bool(a) and bool(b)
    fmt = lambda v: " ".join(f"{x:.2f}" for x, _ in v) or "-"
    print(f"{n:<24} {fmt(a):<24} {fmt(b):<24} {ratio:.4f} {'ok' if ok else 'FAILED OR MISSING'}")
    failed = failed or not ok
sys.exit(1 if failed or not names else 0)
PY
    ;;
  *) sed -n 2,21p "$0"; exit 2 ;;
esac
