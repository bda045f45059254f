"""Summarises the runs of scripts/compare_builds.sh: A against B, per row.

    python scripts/compare_summary.py RUN_DIR [RUN_DIR ...] [--json OUT.json]
        [--a-commit C] [--b-commit C]

Each RUN_DIR holds a_<round>.json and b_<round>.json from
benchmarks/bench_paged_decode.py. A row seen in several RUN_DIRs is reported
per directory. For each row and side: the median over every sample of every
round (wall-clock slope per call, and the GPU time from the profiler trace),
the ratio B/A of those pooled medians, and the ratio of each round's medians
(which shows the run-to-run spread the pooled ratio sits in).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics


def _runs(run_dir: pathlib.Path, side: str) -> dict[int, dict]:
  """Round number -> that round's JSON."""
  return {int(f.stem.split("_")[1]): json.loads(f.read_text()) for f in run_dir.glob(f"{side}_*.json")}


def _pooled(records: list[dict], key: str) -> float | None:
  samples = [s for r in records for s in (r.get(key) or [])]
  return statistics.median(samples) if samples else None


def summarise(run_dir: pathlib.Path) -> list[dict]:
  a_by_round, b_by_round = _runs(run_dir, "a"), _runs(run_dir, "b")
  rounds = sorted(set(a_by_round) & set(b_by_round))   # a round counts when both sides have it
  if not rounds:
    raise SystemExit(f"{run_dir}: no round with both a_<n>.json and b_<n>.json")
  a_runs, b_runs = [a_by_round[r] for r in rounds], [b_by_round[r] for r in rounds]
  files = {side: {r.get("mla_jax_file") for r in runs} for side, runs in (("a", a_runs), ("b", b_runs))}
  if files["a"] & files["b"]:
    raise SystemExit(f"{run_dir}: A and B imported the same mla_jax ({sorted(files['a'] & files['b'])}): "
                     "the comparison compares a build with itself")
  by_name = lambda run: {row["name"]: row for row in run["rows"]}
  a_rows, b_rows = [by_name(r) for r in a_runs], [by_name(r) for r in b_runs]
  rows = []
  for name, row in a_rows[0].items():
    a = [(r.get(name) or {}).get("mla") or {} for r in a_rows]
    b = [(r.get(name) or {}).get("mla") or {} for r in b_rows]
    if not all(x.get("status") == "ok" for x in a + b):
      rows.append(dict(name=name, status="incomplete",
                       errors=[x.get("error") or x.get("status") or "missing" for x in a + b
                               if x.get("status") != "ok"]))
      continue
    out = dict(name=name, b=row["b"], q_len=row["q_len"], h=row["h"], sk=row["sk"],
               varlen=row["varlen"], rounds=len(rounds), status="ok")
    for label, key in (("wall", "samples_us"), ("device", "samples_us_device")):
      pa, pb = _pooled(a, key), _pooled(b, key)
      out[f"{label}_us_a"], out[f"{label}_us_b"] = pa, pb
      out[f"{label}_b_over_a"] = pb / pa if pa and pb else None
    out["wall_b_over_a_per_round"] = [y["us"] / x["us"] for x, y in zip(a, b)]
    out["relerr_max"] = max(x.get("relerr", 0.0) for x in a + b)
    rows.append(out)
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("run_dirs", nargs="+", type=pathlib.Path)
  p.add_argument("--json", type=pathlib.Path, help="write the summary (and run metadata) here")
  p.add_argument("--a-commit", default="a")
  p.add_argument("--b-commit", default="b")
  args = p.parse_args(argv)

  sets = []
  print(f"{'row':<20} {'rounds':>6} {'a us':>8} {'b us':>8} {'b/a':>6}  {'a dev':>8} {'b dev':>8} {'b/a':>6}  "
        "b/a per round (wall)")
  for d in args.run_dirs:
    rows = summarise(d)
    meta = json.loads(sorted(d.glob("a_*.json"))[0].read_text())
    sets.append(dict(run_dir=d.name, date=meta.get("date"), rows=rows))
    for r in rows:
      if r["status"] != "ok":
        print(f"{r['name']:<20} incomplete: {r['errors'][:2]}")
        continue
      per = " ".join(f"{x:.3f}" for x in r["wall_b_over_a_per_round"])
      cell = lambda key, w, f: f"{r[key]:{w}.{f}f}" if r[key] is not None else f"{'-':>{w}}"  # no device time off a GPU
      print(f"{r['name']:<20} {r['rounds']:>6} {cell('wall_us_a', 8, 1)} {cell('wall_us_b', 8, 1)} "
            f"{cell('wall_b_over_a', 6, 3)}  {cell('device_us_a', 8, 1)} {cell('device_us_b', 8, 1)} "
            f"{cell('device_b_over_a', 6, 3)}  {per}")
  if args.json:
    first = json.loads(sorted(args.run_dirs[0].glob("a_*.json"))[0].read_text())
    doc = dict(
        what="the same benchmark rows timed on two builds, alternating A B in one machine session",
        a_commit=args.a_commit, b_commit=args.b_commit, device=first.get("device"),
        jax_version=first.get("jax_version"), date=first.get("date"),
        method=("scripts/compare_builds.sh: both trees built with pip install --target; "
                "benchmarks/bench_paged_decode.py of B run against each build in turn, A B per round; "
                "per row the median over all samples of all rounds. wall: " + first.get("method", "")
                + " device: the same slope from the kernels' timestamps in a profiler trace."),
        sets=sets)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
  main()
