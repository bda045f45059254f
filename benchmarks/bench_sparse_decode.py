#!/usr/bin/env python3
"""Benchmark of mla_jax.sparse_decode (DeepSeek V3.2 top-k) vs FlashMLA, same run.

Rows: B=128 (fewer for q_len 4), top-k random distinct slots from a 65,536-token
pool (page 64), bf16 query, 656-byte fp8_ds_mla cache (pow2 scales; --kv-format
bf16: 576 bf16 values a row), heads 128/64 (FlashMLA's sparse decode takes only
these) and 32/16/8 (tensor-parallel slices, FlashMLA run padded to 64 heads).
FLOPs = 2 * B * q_len * K * H * (576 + 512); bytes = B * q_len * K * 656 (1,152
for bf16; every selected row read once per query token) + B * q_len * H * (576 +
512) * 2. The shared pool (43 MB in fp8_ds_mla) mostly stays in a Hopper GPU's 50 MB
L2 and each row is selected by several requests; --tokens-per-request N gives each
request N tokens of its own (no row shared across requests), which reads from DRAM
as a serving batch does.

In one process on the same data: mla_jax as a JAX user runs it (the kernel
auto-selection picks; method of bench_paged_decode.py: jitted program of n chained
calls, own query each, median wall-clock slope between two n; GPU time from the
profiler trace), the portable kernel forced through the plan (the one the Hopper
kernels replaced; --compare KERNEL forces another, e.g. sm90_lockstep, recorded under
its name; KERNEL:SCHEDULE forces the split schedule too, e.g. sm90_seesaw:block), and
FlashMLA when importable (flashmla_peer.py: CUDA-graph replay slope) on the same
bytes: our cache layout is FlashMLA's. Each result is checked
against the float64 reference on two requests.

  python benchmarks/bench_sparse_decode.py --out my_gpu_sparse.json     # scripts/gpu_bench.sh: the committed runs
  python benchmarks/bench_sparse_decode.py --tokens-per-request 8192 --rows 0,4
  python benchmarks/bench_sparse_decode.py --shape 32,4,128,1024 --compare sm90_seesaw
  python benchmarks/bench_sparse_decode.py --smoke --backend cpu     # CPU check of the script
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
from bench_paged_decode import (git_commit, kernel_request, mla_jax_env, source_digest, time_chained,  # noqa: E402
                                write_json)

PAGE_SIZE = 64
POOL_TOKENS = 65536
SM_SCALE = 1.0 / math.sqrt(192.0)
# (B, q_len, H, topk)
ROWS = [(128, 1, 128, 2048), (128, 2, 128, 2048), (128, 1, 64, 2048), (128, 1, 32, 2048), (128, 1, 16, 2048),
        (32, 4, 128, 512), (128, 2, 16, 2048), (128, 1, 8, 2048)]
SMOKE_ROWS = [(2, 1, 16, 64), (2, 2, 64, 64)]


def _relerr(out, ref_out):
  got = np.asarray(out, np.float64)
  return float(np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out))


def bench_row(b, q, h, k, args, pool_tokens, peer):
  import jax
  import jax.numpy as jnp
  import mla_jax
  from mla_jax.testing import reference_sparse_decode

  rng = np.random.default_rng(0)
  tpr = args.tokens_per_request
  if tpr:
    pool_tokens = b * tpr
  num_pages = pool_tokens // PAGE_SIZE
  key = jax.random.key(b * 1000 + q * 100 + h)
  latent = jax.random.normal(key, (num_pages, PAGE_SIZE, 576), jnp.float32).astype(jnp.bfloat16)
  fp8 = args.kv_format == "fp8_ds_mla"
  cache = mla_jax.quantize_latent_fp8(latent, scale_format="pow2") if fp8 else latent
  del latent
  rot = max(1, math.ceil(2 * 60e6 / cache.nbytes)) if not args.smoke else 1
  caches = [cache] + [jnp.array(cache, copy=True) for _ in range(rot - 1)]
  if tpr:  # request r selects among its own tokens [r tpr, (r + 1) tpr): no row shared across requests
    indices = np.stack([r * tpr + rng.choice(tpr, k, replace=False) for r in range(b) for _ in range(q)])
  else:
    indices = np.stack([rng.permutation(pool_tokens)[:k] for _ in range(b * q)])
  indices = indices.reshape(b, q, k)
  indices = jnp.asarray(indices.astype(np.int32))
  n_lo, n_hi, reps = (1, 2, 2) if args.smoke else (4, 12, 10)
  qs = [jax.random.normal(jax.random.key(100 + i), (b, q, h, 576), jnp.float32).astype(jnp.bfloat16)
        for i in range(n_hi)]
  sel = slice(0, 2)
  flops = 2 * b * q * k * h * (576 + 512)
  nbytes = b * q * k * (656 if fp8 else 1152) + b * q * h * (576 + 512) * 2
  rec = dict(kind=f"sparse_{'fp8_ds_mla' if fp8 else 'bf16'}", b=b, q_len=q, h=h, topk=k,
             tokens_per_request=tpr or None, pool_tokens=pool_tokens, rot=rot, flops=flops, bytes=nbytes)
  ref = None
  for variant in ("auto",) if args.compare == "none" else ("auto", args.compare):
    plan = mla_jax.SparseDecodePlan(num_heads=h, page_size=PAGE_SIZE, sm_scale=SM_SCALE, topk=k, q_len=q,
                                    kv_format=args.kv_format, backend=args.backend, kernel=kernel_request(variant))
    step = lambda x, c, idx, plan=plan: mla_jax.sparse_decode(x, c, idx, plan=plan, return_lse=True)
    try:
      e = mla_jax.explain(plan, qs[0], cache, indices)
      chosen = e.kernel.kernel if e.kernel is not None else e.backend
      a = (qs, caches, indices)
      per_call, wall, slopes, gpu_s, keep = time_chained(step, a, n_lo, n_hi, reps, rot, not args.no_device_time)
      out, lse = keep[0]
      if ref is None:
        ref = reference_sparse_decode(np.asarray(qs[0][sel].astype(jnp.float32)), np.asarray(cache),
                                      np.asarray(indices[sel]), plan)
      relerr = _relerr(out[sel].astype(jnp.float32), ref[0])
      us = per_call * 1e6
      r = dict(kernel=chosen, us=us, us_wall=wall * 1e6, samples_us=[round(x * 1e6, 2) for x in slopes],
               tflops=flops / us / 1e6, gbs=nbytes / us / 1e3, relerr=relerr,
               ok=bool(np.isfinite(relerr) and relerr <= 2e-2))
      if gpu_s:
        r["gpu_us"] = gpu_s * 1e6
      if args.ceilings:
        r["pct_copy"] = 100 * nbytes / (us * 1e-6) / args.ceilings["memcpy"]["bw_Bps"]
      del keep
    except Exception as e:  # noqa: BLE001 - record and go on
      r = dict(error=f"{type(e).__name__}: {e}"[:300], ok=False)
    rec[variant] = r
  if peer is not None:
    # FlashMLA takes 64 or 128 heads: fewer run padded to 64 with zero
    # queries, as serving stacks run their 16- and 32-head slices (the
    # padded heads' outputs are dropped).
    pad = 0 if h in (64, 128) else 64 - h
    try:
      if pad < 0:
        raise ValueError(f"FlashMLA's sparse decode takes 64 or 128 heads; {h} cannot be padded to 64")
      qs_peer = qs if not pad else [jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in qs]
      fr = peer.sparse_decode(qs_peer, caches, indices, sm_scale=SM_SCALE, n_lo=n_lo, n_hi=n_hi, reps=reps)
      out0, _ = fr.pop("result")
      out0 = out0[:, :, :h]
      fr["padded_heads"] = pad
      fr["relerr"] = _relerr(out0[sel], ref[0]) if ref is not None else None
      fr["ok"] = fr["relerr"] is not None and fr["relerr"] <= 2e-2
      fr["tflops"] = flops / fr["us"] / 1e6
      if args.ceilings:
        fr["pct_copy"] = 100 * nbytes / (fr["us"] * 1e-6) / args.ceilings["memcpy"]["bw_Bps"]
    except Exception as e:  # noqa: BLE001 - the peer's failure is a result
      fr = dict(error=f"{type(e).__name__}: {e}"[:300], ok=False)
    rec["flashmla"] = fr
  m, pt, fm = rec["auto"], rec.get(args.compare, {}), rec.get("flashmla", {})
  rec.update({"mla_jax_us": m.get("us"), "mla_jax_gpu_us": m.get("gpu_us"),
              "flashmla_us": fm.get("us") if fm.get("ok") else None})
  if args.compare != "none":
    rec[f"{args.compare}_us"] = pt.get("us")
  if rec["flashmla_us"] and m.get("us"):
    rec["mla_over_flashmla"] = m["us"] / rec["flashmla_us"]
  if pt.get("us") and m.get("us"):
    rec[f"{args.compare}_over_mla"] = pt["us"] / m["us"]
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--out", default=None, help="JSON results path")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--rows", default="", help="comma list of row indices")
  ap.add_argument("--shape", action="append", default=[], metavar="B,Q_LEN,H,TOPK",
                  help="a row of this shape instead of the listed rows (repeatable)")
  ap.add_argument("--flashmla", default="auto", choices=("auto", "off"))
  ap.add_argument("--no-device-time", action="store_true")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU check of the script")
  ap.add_argument("--kv-format", default="fp8_ds_mla", choices=("fp8_ds_mla", "bf16"),
                  help="the cache: 656-byte fp8_ds_mla rows, or bf16 rows of 576 values (1,152 bytes)")
  ap.add_argument("--compare", default="portable",
                  help="the kernel forced beside the auto-selected one (default portable; none: no other; "
                       "KERNEL:SCHEDULE forces the split schedule too, e.g. sm90_seesaw:block)")
  ap.add_argument("--tokens-per-request", type=int, default=0,
                  help="each request selects among its own N tokens (a pool of B * N, no row shared "
                       "across requests, as in serving); default: one shared 65,536-token pool")
  args = ap.parse_args(argv)
  if args.compare == "auto":
    ap.error("--compare names a kernel to force beside the auto-selected one, not auto")
  shapes = []
  for spec in args.shape:
    try:
      shape = tuple(int(v) for v in spec.split(","))
    except ValueError:
      shape = ()
    if len(shape) != 4 or min(shape) < 1:
      ap.error(f"--shape takes four positive integers B,Q_LEN,H,TOPK, got {spec!r}")
    shapes.append(shape)
  if shapes and args.rows:
    ap.error("--shape and --rows both choose the rows: give one of them")
  if args.tokens_per_request % PAGE_SIZE:
    ap.error(f"--tokens-per-request must be a multiple of the page size {PAGE_SIZE}")
  pool = 1024 if args.smoke else POOL_TOKENS
  selectable = args.tokens_per_request or pool
  for shape in shapes:
    if shape[3] > selectable:
      ap.error(f"--shape {','.join(map(str, shape))}: top-k {shape[3]} exceeds the {selectable} tokens "
               f"each request selects among")
  # torch (FlashMLA, the copy ceiling) shares the GPU: JAX must not take 75 % of it up front.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import jax
  dev = jax.devices()[0]
  rows_spec = SMOKE_ROWS if args.smoke else ROWS
  if args.rows:
    rows_spec = [rows_spec[int(i)] for i in args.rows.split(",")]
  if shapes:
    rows_spec = shapes
  peer, why = None, "--flashmla off"
  ceilings = None
  if dev.platform == "gpu":
    import flashmla_peer
    if args.flashmla == "auto":
      peer, why = flashmla_peer.load()
    if not args.smoke:  # copy and matmul ceilings, same run
      ceilings = peer.ceilings() if peer is not None else flashmla_peer.torch_ceilings()
  commit, dirty = git_commit(args.commit)
  meta = dict(benchmark=f"sparse_decode {args.kv_format}", device=dev.device_kind, platform=dev.platform,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              commit=commit, dirty=dirty, source_digest=source_digest(), env=mla_jax_env(), jax=jax.__version__,
              backend=args.backend, ceilings=ceilings, flashmla=(f"same run, {peer.version}" if peer else f"not run: {why}"),
              compare=args.compare,
              method="mla_jax: median slope of chained jitted calls (bench_paged_decode.py), rotating caches; "
                     "gpu_us: profiler-trace slope; FlashMLA: CUDA-graph replay slope (flashmla_peer.py)",
              flops="2*B*q_len*K*H*(576+512)",
              bytes=f"B*q_len*K*{656 if args.kv_format == 'fp8_ds_mla' else 1152} + B*q_len*H*(576+512)*2",
              pool=(f"{args.tokens_per_request} tokens of its own per request" if args.tokens_per_request
                    else f"one shared {pool}-token pool"))
  args.ceilings = ceilings
  rows = []
  for (b, q, h, k) in rows_spec:
    rows.append(bench_row(b, q, h, k, args, pool, peer))
    if args.out:
      write_json(Path(args.out), meta, rows, False)
  if args.out:
    write_json(Path(args.out), meta, rows, True)
  print(f"== sparse_decode {args.kv_format}, {meta['pool']} | {dev.device_kind} | jax {jax.__version__} | commit {commit} | "
        f"FlashMLA: {meta['flashmla']}")
  if ceilings:
    print(f"copy ceiling {ceilings['memcpy']['bw_Bps'] / 1e12:.2f} TB/s (torch memcpy, same run); GB/s below "
          f"are the convention's bytes per call time")
  print(f"{'B':>4} {'q':>2} {'H':>4} {'K':>5} | {'us':>8} {'gpu':>8} {'TF/s':>5} {'GB/s':>5} {'kernel':>14} | "
        f"{'FMLA us':>8} {'TF/s':>5} {'us/FM':>6} | {args.compare[:13]:>13} {'it/us':>6} | relerr")
  ok = True
  for r in rows:
    m, pt, fm = r["auto"], r.get(args.compare, {}), r.get("flashmla", {})
    ok &= bool(m.get("ok")) and (args.compare == "none" or bool(pt.get("ok")))
    cell = lambda v, key, fmt: format(v[key], fmt) if v.get(key) is not None else "-"
    print(f"{r['b']:>4} {r['q_len']:>2} {r['h']:>4} {r['topk']:>5} | {cell(m, 'us', '8.1f'):>8} "
          f"{cell(m, 'gpu_us', '8.1f'):>8} {cell(m, 'tflops', '5.0f'):>5} {cell(m, 'gbs', '5.0f'):>5} "
          f"{m.get('kernel', 'ERROR'):>14} | {cell(fm, 'us', '8.1f'):>8} {cell(fm, 'tflops', '5.0f'):>5} "
          f"{cell(r, 'mla_over_flashmla', '6.2f'):>6} | {cell(pt, 'us', '13.1f'):>13} "
          f"{cell(r, f'{args.compare}_over_mla', '6.2f'):>6} | {cell(m, 'relerr', '.1e')}")
    for name in ("auto", args.compare, "flashmla"):
      if "error" in r.get(name, {}):
        print(f"     {name}: {r[name]['error']}")
    if fm.get("padded_heads"):
      print(f"     flashmla: {r['h']} heads padded to 64 with zero queries")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
