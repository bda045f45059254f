#!/usr/bin/env python3
"""The serving engine's decode step with mla_jax's kernels against the XLA attention path.

For each shape (DeepSeek-V3 attention: kv_lora_rank 512, rope 64; heads,
batch, context, layers), two :class:`mla_jax.serving.Engine` instances with
the same random weights run one decode step with every slot at the same
context length: backend "auto" (on a GPU the CUDA kernels) and backend "xla"
(mla_jax's gather-and-einsum formulation, what a JAX model does without a
kernel). Reported per backend: the step's wall time (jitted step, cache
donated, host metadata sent as a serving loop sends it, block_until_ready;
median of --reps after one compiling call), the time of the same layers'
paged_decode calls alone in one jitted program (``Engine.attention_share``),
attention's share of the step, tokens/s (batch / step), and the step
speedup of "auto" over "xla".

    python benchmarks/bench_serving.py                    # full shapes (a GPU)
    python benchmarks/bench_serving.py --smoke            # tiny shapes (any host)
    python benchmarks/bench_serving.py --out my_serving.json

Without --out nothing is written; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Shape:
  heads: int
  batch: int
  context: int
  layers: int

  @property
  def name(self) -> str:
    return f"h{self.heads}b{self.batch}s{self.context}l{self.layers}"


FULL = [Shape(16, 32, 4096, 2), Shape(16, 128, 4096, 2), Shape(16, 32, 32768, 2),
        Shape(128, 32, 4096, 2), Shape(128, 128, 4096, 2), Shape(128, 16, 32768, 2)]
SMOKE = [Shape(16, 4, 256, 2), Shape(128, 2, 256, 1)]
PAGE_SIZE = 64


def git_commit():
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          timeout=10)
    return head.stdout.strip() if head.returncode == 0 else "unknown"
  except Exception:  # noqa: BLE001
    return "unknown"


def run_shape(shape: Shape, backend: str, reps: int, hidden: int):
  import jax
  from mla_jax import serving
  cfg = serving.ModelConfig(vocab_size=1024, hidden=hidden, num_layers=shape.layers, num_heads=shape.heads,
                            mlp_hidden=2 * hidden, original_max_position=4096)
  params = serving.init_params(cfg, seed=0)
  pages = -(-shape.context // PAGE_SIZE)
  engine = serving.Engine(cfg, params, num_pages=shape.batch * pages, page_size=PAGE_SIZE,
                          max_slots=shape.batch, max_pages_per_seq=pages, backend=backend)
  step_s, attn_s = engine.attention_share(seq_len=shape.context, reps=reps)
  del engine, params
  jax.clear_caches()
  return dict(step_ms=1e3 * step_s, attention_ms=1e3 * attn_s, attention_share=attn_s / step_s,
              tokens_per_s=shape.batch / step_s)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes, for a check on any host")
  p.add_argument("--reps", type=int, default=5, help="timed steps per backend and shape (median)")
  p.add_argument("--hidden", type=int, default=1024, help="model width (the MLA projections' input)")
  p.add_argument("--backends", nargs="+", default=["auto", "xla"], choices=("auto", "cuda", "cpu", "xla"))
  p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
  p.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse HEAD)")
  args = p.parse_args(argv)

  import jax
  import mla_jax
  shapes = SMOKE if args.smoke else FULL
  dev = jax.devices()[0]
  meta = dict(what="mla_jax.serving Engine decode step: kernels against the XLA attention path",
              device=f"{getattr(dev, 'device_kind', dev.platform)} ({dev.platform})", commit=args.commit or git_commit(),
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              jax_version=jax.__version__, mla_jax_file=mla_jax.__file__, page_size=PAGE_SIZE, hidden=args.hidden,
              method=("per backend: Engine.attention_share(seq_len=context): the jitted decode step (cache "
                      "donated, every slot at `context` tokens, host block table and lengths sent per step) and "
                      "a jitted program of the same layers' paged_decode calls; wall clock with "
                      "block_until_ready, median of reps after one compiling call"),
              reps=args.reps, smoke=args.smoke)
  rows = []
  print(f"{'shape':<22} {'backend':<6} {'step ms':>9} {'attn ms':>9} {'share':>6} {'tok/s':>9}")
  for shape in shapes:
    row = dict(name=shape.name, **dataclasses.asdict(shape))
    for backend in args.backends:
      t0 = time.perf_counter()
      try:
        r = run_shape(shape, backend, args.reps, args.hidden)
      except Exception as e:  # noqa: BLE001 - an out-of-memory XLA path is a result, not a crash
        r = dict(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        print(f"{shape.name:<22} {backend:<6} {r['error']}")
      else:
        print(f"{shape.name:<22} {backend:<6} {r['step_ms']:9.2f} {r['attention_ms']:9.2f} "
              f"{100 * r['attention_share']:5.0f}% {r['tokens_per_s']:9.0f}")
      r["row_s"] = time.perf_counter() - t0
      row[backend] = r
    if "step_ms" in row.get("auto", {}) and "step_ms" in row.get("xla", {}):
      row["step_speedup_auto_over_xla"] = row["xla"]["step_ms"] / row["auto"]["step_ms"]
    rows.append(row)
    sys.stdout.flush()
    # After every shape, so that a run cut short keeps what it measured.
    if args.out:
      write_results(args.out, dict(meta, complete=len(rows) == len(shapes), rows=rows))
  if args.out:
    print(f"wrote {args.out}")
  return 0


def write_results(path: Path, results: dict):
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(results, indent=1))
  os.replace(tmp, path)


if __name__ == "__main__":
  sys.exit(main())
