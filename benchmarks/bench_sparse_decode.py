#!/usr/bin/env python3
"""Benchmark of mla_jax.sparse_decode (DeepSeek V3.2 top-k, fp8_ds_mla cache) vs FlashMLA.

Rows follow FlashMLA's sparse FP8 decode anchors on this H200: B=128, top-k
2048 random distinct slots from a 65,536-token pool (page 64), bf16 query,
656-byte fp8_ds_mla cache, (q_len, H) in {(1, 128), (2, 128), (1, 64)}.
FLOPs = 2 * B * q_len * K * H * (576 + 512). Timing reuses the chained-call
slope method of bench_paged_decode.py (see its docstring): the cache copies
rotate so that the rotation set exceeds 2x L2. The op is checked against the
float64 reference on two requests.

  python benchmarks/bench_sparse_decode.py --anchors shared/anchors --out benchmarks/results/h200_sparse.json
  python benchmarks/bench_sparse_decode.py --smoke --backend cpu     # CPU check of the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged_decode import (chain_program, compile_prog, git_commit, mla_jax_env, source_digest,  # noqa: E402
                                time_slope, write_json)

PAGE_SIZE = 64
POOL_TOKENS = 65536
SM_SCALE = 1.0 / math.sqrt(192.0)
ROWS = [(128, 1, 128, 2048), (128, 2, 128, 2048), (128, 1, 64, 2048)]
SMOKE_ROWS = [(2, 1, 16, 64), (2, 2, 16, 64)]


def flashmla_us(anchors_dir, b, q, h, k):
  if anchors_dir is None:
    return None
  path = Path(anchors_dir) / "flashmla_h200.json"
  if not path.exists():
    return None
  for r in json.loads(path.read_text()):
    if (r.get("kind") == "sparse_fp8_v32" and (r["b"], r["s_q"], r["h"], r["topk"]) == (b, q, h, k)):
      return r["us"]
  return None


def bench_row(b, q, h, k, args, pool_tokens):
  import jax
  import jax.numpy as jnp
  import mla_jax
  from mla_jax.testing import reference_sparse_decode

  rng = np.random.default_rng(0)
  num_pages = pool_tokens // PAGE_SIZE
  key = jax.random.key(b * 1000 + q * 100 + h)
  latent = jax.random.normal(key, (num_pages, PAGE_SIZE, 576), jnp.float32).astype(jnp.bfloat16)
  cache = mla_jax.quantize_latent_fp8(latent, scale_format="pow2")
  rot = max(1, math.ceil(2 * 60e6 / cache.nbytes)) if not args.smoke else 1
  caches = [cache] + [jnp.array(cache, copy=True) for _ in range(rot - 1)]
  indices = np.stack([rng.permutation(pool_tokens)[:k] for _ in range(b * q)]).reshape(b, q, k)
  indices = jnp.asarray(indices.astype(np.int32))
  n_lo, n_hi, reps = (1, 2, 2) if args.smoke else (4, 12, 10)
  qs = [jax.random.normal(jax.random.key(100 + i), (b, q, h, 576), jnp.float32).astype(jnp.bfloat16)
        for i in range(n_hi)]
  plan = mla_jax.SparseDecodePlan(num_heads=h, page_size=PAGE_SIZE, sm_scale=SM_SCALE, topk=k,
                                  q_len=q, kv_format="fp8_ds_mla", backend=args.backend)
  step = lambda x, c, idx: mla_jax.sparse_decode(x, c, idx, plan=plan, return_lse=True)
  lo, _ = compile_prog(chain_program(step, n_lo, rot), qs[:n_lo], caches, indices)
  hi, _ = compile_prog(chain_program(step, n_hi, rot), qs, caches, indices)
  lo_args = (qs[:n_lo], caches, indices)
  per_call, wall, _, keep = time_slope(lambda *a: lo(*lo_args), hi, (qs, caches, indices), n_lo, n_hi,
                                       reps)
  out, lse = keep[0]
  sel = slice(0, 2)
  ref_out, ref_lse = reference_sparse_decode(np.asarray(qs[0][sel].astype(jnp.float32)), np.asarray(cache),
                                             np.asarray(indices[sel]), plan)
  got = np.asarray(out[sel].astype(jnp.float32), np.float64)
  relerr = float(np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out))
  us = per_call * 1e6
  flops = 2 * b * q * k * h * (576 + 512)
  return dict(b=b, s_q=q, h=h, topk=k, us=us, us_wall=wall * 1e6, tflops=flops / us / 1e6,
              relerr=relerr, ok=bool(np.isfinite(relerr) and relerr <= 2e-2), rot=rot)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--anchors", default=None, help="folder holding flashmla_h200.json")
  ap.add_argument("--out", default=None, help="JSON results path")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU check of the script")
  args = ap.parse_args(argv)
  import jax
  dev = jax.devices()[0]
  rows_spec = SMOKE_ROWS if args.smoke else ROWS
  pool = 1024 if args.smoke else POOL_TOKENS
  commit, dirty = git_commit(args.commit)
  meta = dict(benchmark="sparse_decode fp8_ds_mla", device=dev.device_kind, platform=dev.platform,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              commit=commit, dirty=dirty, source_digest=source_digest(), env=mla_jax_env(), jax=jax.__version__,
              backend=args.backend,
              method="median slope of chained jitted calls (bench_paged_decode.py), rotating caches",
              flops="2*B*q_len*K*H*(576+512)")
  rows = []
  for (b, q, h, k) in rows_spec:
    try:
      r = bench_row(b, q, h, k, args, pool)
    except Exception as e:  # noqa: BLE001 - record and go on
      r = dict(b=b, s_q=q, h=h, topk=k, error=f"{type(e).__name__}: {e}"[:300])
    r["flashmla_us"] = flashmla_us(args.anchors, b, q, h, k)
    rows.append(r)
    if args.out:
      write_json(Path(args.out), meta, rows, False)
  if args.out:
    write_json(Path(args.out), meta, rows, True)
  print(f"== sparse_decode fp8_ds_mla | {dev.device_kind} | jax {jax.__version__} | commit {commit}")
  if not args.anchors or not (Path(args.anchors) / "flashmla_h200.json").exists():
    print(f"note: no FlashMLA anchors ({'--anchors not given' if not args.anchors else 'no flashmla_h200.json in ' + args.anchors}); "
          "FMLA columns are '-'")
  print(f"{'B':>4} {'q':>2} {'H':>4} {'K':>5} {'us':>9} {'TF/s':>6} {'FMLA us':>8} {'us/FM':>6} {'relerr':>8}")
  for r in rows:
    if "error" in r:
      print(f"{r['b']:>4} {r['s_q']:>2} {r['h']:>4} {r['topk']:>5}  ERROR {r['error']}")
      continue
    fm = r["flashmla_us"]
    fm_cell = f"{fm:.1f}" if fm else "-"  # "-": no anchor for this row (or no --anchors)
    ratio_cell = f"{r['us'] / fm:.2f}" if fm else "-"
    print(f"{r['b']:>4} {r['s_q']:>2} {r['h']:>4} {r['topk']:>5} {r['us']:9.1f} {r['tflops']:6.0f} "
          f"{fm_cell:>8} {ratio_cell:>6} "
          f"{r['relerr']:8.1e} {'ok' if r['ok'] else 'FAIL'}")
  return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
