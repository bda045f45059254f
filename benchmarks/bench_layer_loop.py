#!/usr/bin/env python3
"""Per-layer time of paged decode in a jitted multi-layer program: unrolled and lax.scan.

A decode step calls mla_jax.paged_decode once per layer with the same
block_table and seq_lens. How XLA places what depends on them alone (the
schedule call of schedule "step", docs/design.md) differs between a program
that unrolls its layers (XLA merges the identical calls into one) and one that
runs them in a lax.scan (the call stays in the loop body). This script times
both forms of an L-layer program for each row, with schedule "step" and with
the decode kernel's own schedule (inline up to 32 requests, else block)
forced through the plan, in one process on the same data.

Each layer reads its own query and cache (bf16, page 64, equal lengths,
pages a random permutation of the pool); layer i+1's query depends on layer
i's output, so the layers run in order. block_table and seq_lens go in as
host arrays, fresh device buffers every execution. Per layer = median wall
clock of --reps executions (block_until_ready) / L: a fixed dispatch cost is
spread over the layers, not cancelled, so compare the schedules of one form
and row with each other. The compiled programs' schedule calls are counted.
On a CPU (--smoke --backend cpu) it only checks that the script runs.

  python benchmarks/bench_layer_loop.py --out layer_loop.json
  python benchmarks/bench_layer_loop.py --rows "128,128,1024;1,128,4096" --layers 16
  python benchmarks/bench_layer_loop.py --smoke --backend cpu
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged_decode import git_commit, mla_jax_env, source_digest, write_json  # noqa: E402

PAGE_SIZE = 64
SM_SCALE = 0.07
# (B, H, seq)
ROWS = [(128, 128, 1024), (1, 128, 4096), (128, 16, 4096), (32, 128, 4096)]
SMOKE_ROWS = [(2, 16, 100), (40, 16, 64)]
SCHEDULE_TARGET = 'custom_call_target="mla_jax_paged_decode_schedule_cuda'


def _programs(plan, layers):
  import jax
  import jax.numpy as jnp
  import mla_jax

  def scanned(q, cache, bt, sl):
    def body(c, xs):
      o = mla_jax.paged_decode(xs[0] + c.astype(xs[0].dtype), xs[1], bt, sl, plan=plan)
      return c + o[0, 0, 0].astype(jnp.float32), None   # the next layer waits for this one
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (q, cache))[0]

  def unrolled(q, cache, bt, sl):
    c = jnp.zeros((), jnp.float32)
    for i in range(layers):
      o = mla_jax.paged_decode(q[i] + c.astype(q.dtype), cache[i], bt, sl, plan=plan)
      c = c + o[0, 0, 0].astype(jnp.float32)
    return c

  return dict(scan=jax.jit(scanned), unrolled=jax.jit(unrolled))


def bench_row(b, h, seq, args):
  import jax.numpy as jnp
  import mla_jax
  from mla_jax import KernelChoice
  from mla_jax.testing import scattered_block_table

  rng = np.random.default_rng(0)
  lens = np.full(b, seq, np.int32)
  bt, num_pages = scattered_block_table(rng, lens, PAGE_SIZE, extra_pages=3)
  q = jnp.asarray(rng.standard_normal((args.layers, b, h, 576)), jnp.bfloat16)
  cache = jnp.asarray(rng.standard_normal((args.layers, num_pages, PAGE_SIZE, 576)), jnp.bfloat16)
  own = "inline" if b <= 32 else "block"
  row = dict(b=b, h=h, seq=seq, layers=args.layers, own_schedule=own)
  values = {}
  for name, schedule in (("step", "step"), ("own", own)):
    kernel = KernelChoice(schedule=schedule) if args.backend != "cpu" else "auto"
    plan = mla_jax.DecodePlan(num_heads=h, page_size=PAGE_SIZE, sm_scale=SM_SCALE, backend=args.backend,
                              kernel=kernel)
    for form, fn in _programs(plan, args.layers).items():
      compiled = fn.lower(q, cache, bt, lens).compile()
      row[f"{form}_{name}_schedule_calls"] = compiled.as_text().count(SCHEDULE_TARGET)
      values[(form, name)] = float(compiled(q, cache, bt, lens))
      times = []
      for _ in range(args.reps):
        t = time.perf_counter()
        compiled(q, cache, np.asarray(bt), np.asarray(lens)).block_until_ready()
        times.append(time.perf_counter() - t)
      row[f"{form}_{name}_us_per_layer"] = round(float(np.median(times)) / args.layers * 1e6, 2)
  # The schedules cut the work alike (bit-identical outputs, tests/test_cuda_kernel.py).
  row["same_value"] = len(set(values.values())) == 1
  return row


def parse_rows(text):
  return [tuple(int(x) for x in r.split(",")) for r in text.split(";") if r.strip()]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rows", help='"B,H,SEQ;..." (default: the four committed rows)')
  ap.add_argument("--layers", type=int, default=16)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
  ap.add_argument("--smoke", action="store_true", help="tiny rows, 3 layers, 2 reps (a CPU check of the script)")
  ap.add_argument("--commit", help="commit to record (a device copy of the tree may have no .git)")
  ap.add_argument("--out", type=Path, default=Path("layer_loop.json"))
  args = ap.parse_args(argv)
  if args.smoke:
    args.layers, args.reps = 3, 2
  rows = parse_rows(args.rows) if args.rows else (SMOKE_ROWS if args.smoke else ROWS)

  import jax
  import mla_jax
  commit, dirty = git_commit(args.commit)
  dev = jax.devices()[0]
  meta = dict(
      device=dev.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      commit=commit, dirty=dirty, source_digest=source_digest(), env=mla_jax_env(), jax_version=jax.__version__,
      mla_jax_version=mla_jax.__version__, backend=args.backend,
      method=(f"{args.layers} chained layers of paged_decode (own query and cache each; bf16, page {PAGE_SIZE}, "
              "equal lengths, scattered pages), block_table/seq_lens as fresh host arrays every execution; "
              f"per layer = median of {args.reps} executions (wall clock, block_until_ready) / layers; "
              "forms: unrolled and lax.scan; schedules: step and the decode kernel's own (inline up to 32 "
              "requests, else block), forced through the plan; *_schedule_calls: schedule custom calls in "
              "the compiled program"))
  out = []
  for b, h, seq in rows:
    out.append(bench_row(b, h, seq, args))
    print(out[-1], flush=True)
    write_json(args.out, meta, out, done=False)
  write_json(args.out, meta, out, done=True)


if __name__ == "__main__":
  main()
