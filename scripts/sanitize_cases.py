"""A short, pytest-free run of the CUDA kernels for compute-sanitizer.

  compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py [N [BACKEND]]

Runs N seeded cases of tests/test_differential.py on the cuda backend (all
four kernel choices, every dtype and layout, invalid requests, NaN in every
slot no valid request may see) and the sparse-decode format, padding and
top-k-length tests, each checked against the float64 reference. One process
and few calls: the sanitizer's slowdown and its memory for shadow state stay
bounded (memcheck crashed inside a long pytest run of the whole file).
BACKEND (default cuda) is for a check of this script on a CPU host. Exit
status 1 when a case fails its check. scripts/sanitize.sh runs it under each
tool.
"""
import pathlib
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import test_differential as diff  # noqa: E402
import test_sparse_decode as sparse  # noqa: E402


def main() -> int:
  n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
  be = sys.argv[2] if len(sys.argv) > 2 else "cuda"
  runs = [(f"dense seed {diff.DEFAULT_SEED + i}", lambda i=i: diff.run_case(be, diff.draw(diff.DEFAULT_SEED + i)))
          for i in range(n)]
  for fmt, scale in sparse.FORMATS:
    runs.append((f"sparse formats {fmt}/{scale}", lambda f=fmt, s=scale: sparse.test_formats(be, f, s)))
    runs.append((f"sparse padding {fmt}/{scale}", lambda f=fmt, s=scale: sparse.test_padding(be, f, s)))
    runs.append((f"sparse topk_lens {fmt}/{scale}", lambda f=fmt, s=scale: sparse.test_topk_lens(be, f, s)))
  failed = 0
  for name, run in runs:
    try:
      run()
      print(f"ok   {name}", flush=True)
    except Exception:  # noqa: BLE001 - report every case, then fail
      failed += 1
      print(f"FAIL {name}\n{traceback.format_exc(limit=3)}", flush=True)
  print(f"{len(runs) - failed} of {len(runs)} cases matched the reference")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
