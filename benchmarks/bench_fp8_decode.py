#!/usr/bin/env python3
"""Benchmark of mla_jax.paged_decode over a dense FP8 cache against the same cache in bf16.

Every row times, in one process on the same data (page 64, bf16 query unless --query-dtype,
scattered block table, method of bench_paged_decode.py: a jitted program of n
chained calls, each on its own query, block_table/seq_lens fed as fresh host
arrays; per call = median wall-clock slope between two n; GPU time = slope of
the profiler trace's kernel span):

  fp8       the float8_e4m3fn cache with kv_scale, the kernel auto-selection picks;
  bf16      the bf16 cache holding the same dequantised values (what FP8 must beat);
  portable  the FP8 cache on the portable mma.sync kernel (forced through the plan;
            --compare KERNEL forces another, e.g. sm90_lockstep, recorded under its name;
            KERNEL:SCHEDULE forces the split schedule too, e.g. sm90_seesaw:block).

Each variant's output is checked against the float64 reference on two requests.
Bytes follow FlashMLA's convention with the cache's element size (1 for FP8):
(sum_seq * 576 * kv_bytes + B * q_len * H * (576 + 512) * 2).

  python benchmarks/bench_fp8_decode.py --out my_gpu_fp8.json     # scripts/gpu_bench.sh: the committed runs
  python benchmarks/bench_fp8_decode.py --smoke --backend cpu     # CPU check of the script
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged_decode import (PAGE_SIZE, SM_SCALE, git_commit, kernel_request, make_block_table,  # noqa: E402
                                mla_jax_env, pick_n, source_digest, time_chained, write_json)

KV_SCALE = 0.05
# (B, q_len, H, seq)
ROWS = [(128, 1, 16, 8192), (128, 1, 128, 4096), (8, 1, 16, 42000), (128, 1, 64, 8192), (32, 1, 128, 4096),
        (128, 2, 128, 4096), (128, 1, 32, 8192), (128, 2, 16, 8192), (8, 1, 32, 42000)]
SMOKE_ROWS = [(2, 1, 16, 200), (2, 2, 64, 130)]


def counts(b, q, h, seq, kv_bytes):
  sum_seq = b * seq
  flops = 2 * q * sum_seq * h * (576 + 512)
  nbytes = sum_seq * 576 * kv_bytes + b * q * h * (576 + 512) * 2
  return flops, nbytes


def bench_row(b, q, h, seq, args, ceilings):
  import jax
  import jax.numpy as jnp
  import mla_jax
  from mla_jax.testing import reference_paged_decode

  lens = np.full(b, seq, np.int32)
  bt, num_pages = make_block_table(np.random.default_rng(b + q + h), lens)
  key = jax.random.key(b * 7 + h)
  latent = jax.random.normal(key, (num_pages, PAGE_SIZE, 576), jnp.float32)
  fp8 = (latent / KV_SCALE).astype(jnp.float8_e4m3fn)
  qdt = jnp.dtype(args.query_dtype)
  bf16 = (fp8.astype(jnp.float32) * KV_SCALE).astype(qdt)  # the same values, dequantised (the query's dtype)
  del latent
  kv_scale = jnp.asarray(KV_SCALE, jnp.float32)
  rot = 1 if args.smoke else max(1, math.ceil(120e6 / fp8.nbytes))
  est_us = counts(b, q, h, seq, 1)[1] / 4e12 * 1e6
  n_lo, n_hi = (1, 2) if args.smoke else pick_n(1.5 * est_us, 6000, 6, 40)
  reps = 2 if args.smoke else 10
  qs = [jax.random.normal(jax.random.key(100 + i), (b, q, h, 576), jnp.float32).astype(qdt)
        for i in range(n_hi)]
  rec = dict(b=b, q_len=q, h=h, seq=seq, kv_scale=KV_SCALE, n_lo=n_lo, n_hi=n_hi, reps=reps, cache_copies=rot)
  sel = np.arange(min(2, b))
  live = -(-seq // PAGE_SIZE)
  for variant in [v for v in ("fp8", "bf16", args.compare) if v in args.variants]:
    cache = bf16 if variant == "bf16" else fp8
    caches = [cache] + [jnp.array(cache, copy=True) for _ in range(rot - 1)]
    kernel = args.compare if variant == args.compare else "auto"
    plan = mla_jax.DecodePlan(num_heads=h, page_size=PAGE_SIZE, sm_scale=SM_SCALE, q_len=q, causal=q > 1,
                              backend=args.backend, kernel=kernel_request(kernel))
    scale = None if variant == "bf16" else kv_scale

    def step(x, c, shared, plan=plan, scale=scale):
      return mla_jax.paged_decode(x, c, shared[0], shared[1], plan=plan, return_lse=True, kv_scale=scale)

    try:
      e = mla_jax.explain(plan, qs[0], cache, bt, lens, kv_scale=scale)
      chosen = e.kernel.kernel if e.kernel is not None else e.backend
      a = (tuple(qs), tuple(caches), (bt, lens))
      per_call, wall, slopes, gpu_s, keep = time_chained(step, a, n_lo, n_hi, reps, rot, not args.no_device_time)
      out, lse = keep[0]
      ids = bt[sel, :live]
      sub_bt = np.arange(ids.size, dtype=np.int32).reshape(ids.shape)
      ref_cache = np.asarray(cache[ids.reshape(-1)].astype(jnp.float32))
      ref_out, _ = reference_paged_decode(np.asarray(qs[0][sel].astype(jnp.float32)), ref_cache, sub_bt, lens[sel],
                                          plan, kv_scale=1.0 if scale is None else KV_SCALE)
      got = np.asarray(out[sel].astype(jnp.float32), np.float64)
      relerr = float(np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out))
      flops, nbytes = counts(b, q, h, seq, 1 if variant != "bf16" else 2)
      us = per_call * 1e6
      r = dict(kernel=chosen, us=us, us_wall=wall * 1e6, samples_us=[round(s * 1e6, 2) for s in slopes],
               tflops=flops / us / 1e6, gbs=nbytes / us / 1e3, relerr=relerr,
               ok=bool(np.isfinite(relerr) and relerr <= 1e-2))
      if gpu_s:
        r["gpu_us"] = gpu_s * 1e6
      if ceilings:
        r["pct_copy"] = 100 * nbytes / (us * 1e-6) / ceilings["memcpy"]["bw_Bps"]
      del keep
    except Exception as e:  # noqa: BLE001 - record and go on
      r = dict(error=f"{type(e).__name__}: {e}"[:400], ok=False)
    rec[variant] = r
    del caches
  f, bf, pt = (rec.get(v, {}) for v in ("fp8", "bf16", args.compare))
  rec.update(kind="dense_fp8", mla_jax_us=f.get("us"), mla_jax_gpu_us=f.get("gpu_us"), bf16_us=bf.get("us"))
  rec[f"{args.compare}_us"] = pt.get("us")
  if "us" in f and "us" in bf:
    rec["bf16_over_fp8"] = bf["us"] / f["us"]
  if "us" in f and "us" in pt:
    rec[f"{args.compare}_over_fp8"] = pt["us"] / f["us"]
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--out", default=None, help="JSON results path")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--rows", default="", help="comma list of row indices")
  ap.add_argument("--compare", default="portable",
                  help="kernel forced on the FP8 cache for the third variant (default portable); "
                       "KERNEL:SCHEDULE forces the split schedule too, e.g. sm90_seesaw:block")
  ap.add_argument("--variants", default=None,
                  help="comma list of the variants to time among fp8, bf16 and the --compare kernel (default all; "
                       "fp8 alone times a build against another)")
  ap.add_argument("--query-dtype", default="bfloat16", choices=("bfloat16", "float16"),
                  help="the query's dtype; the 16-bit cache of variant bf16 is in it too (default bfloat16)")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU check of the script")
  ap.add_argument("--no-device-time", action="store_true")
  args = ap.parse_args(argv)
  args.variants = ["fp8", "bf16", args.compare] if args.variants is None else args.variants.split(",")
  bad = [v for v in args.variants if v not in ("fp8", "bf16", args.compare)]
  if bad:
    ap.error(f"--variants: {bad} is none of fp8, bf16, {args.compare}")
  # torch (FlashMLA, the copy ceiling) shares the GPU: JAX must not take 75 % of it up front.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import jax
  dev = jax.devices()[0]
  rows_spec = SMOKE_ROWS if args.smoke else ROWS
  if args.rows:
    rows_spec = [rows_spec[int(i)] for i in args.rows.split(",")]
  ceilings = None
  if dev.platform == "gpu" and not args.smoke:
    import flashmla_peer
    peer, why = flashmla_peer.load()
    ceilings = peer.ceilings() if peer is not None else flashmla_peer.torch_ceilings()
  commit, dirty = git_commit(args.commit)
  meta = dict(benchmark="paged_decode dense FP8 vs bf16", device=dev.device_kind, platform=dev.platform,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              commit=commit, dirty=dirty, source_digest=source_digest(), env=mla_jax_env(), jax=jax.__version__,
              backend=args.backend, compare=args.compare, query_dtype=args.query_dtype, ceilings=ceilings,
              method="median wall-clock slope of chained jitted calls (bench_paged_decode.py); gpu_us: "
                     "profiler-trace slope; block_table/seq_lens fed as host arrays every execution",
              flops="2*q_len*sum_seq*H*(576+512)",
              bytes="sum_seq*576*kv_bytes + B*q_len*H*(576+512)*2")
  rows = []
  for spec in rows_spec:
    rows.append(bench_row(*spec, args, ceilings))
    if args.out:
      write_json(Path(args.out), meta, rows, False)
  if args.out:
    write_json(Path(args.out), meta, rows, True)
  print(f"== paged_decode FP8 cache | {dev.device_kind} | jax {jax.__version__} | commit {commit}")
  if ceilings:
    print(f"copy ceiling {ceilings['memcpy']['bw_Bps'] / 1e12:.2f} TB/s (torch memcpy, same run)")
  print(f"{'B':>4} {'q':>2} {'H':>4} {'seq':>6} | {'fp8 us':>8} {'gpu':>8} {'GB/s':>6} {'kernel':>14} | "
        f"{'bf16 us':>8} {'bf16/fp8':>8} | {args.compare[:8]:>8} {'/fp8':>8} | relerr fp8")
  ok = True
  for r in rows:
    f, bf, pt = (r.get(v, {}) for v in ("fp8", "bf16", args.compare))
    ok &= all(r[v].get("ok", False) for v in args.variants)
    cell = lambda v, k, fmt: format(v[k], fmt) if k in v else "-"
    print(f"{r['b']:>4} {r['q_len']:>2} {r['h']:>4} {r['seq']:>6} | {cell(f, 'us', '8.1f'):>8} "
          f"{cell(f, 'gpu_us', '8.1f'):>8} {cell(f, 'gbs', '6.0f'):>6} {f.get('kernel', 'ERROR'):>14} | "
          f"{cell(bf, 'us', '8.1f'):>8} {cell(r, 'bf16_over_fp8', '8.2f'):>8} | {cell(pt, 'us', '8.1f'):>8} "
          f"{cell(r, args.compare + '_over_fp8', '8.2f'):>8} | {cell(f, 'relerr', '.1e')}")
    for name in args.variants:
      if "error" in r[name]:
        print(f"     {name}: {r[name]['error']}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
