"""Runs one paged-decode configuration a few times, for a profiler to attach to.

  ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 \
      --launch-count 1 --set full -o prof python3 benchmarks/profile_kernel.py --b 128 --h 128

Random data generated on the device, page_size 64, contiguous pages; --cache
picks the cache: bf16, fp8 (float8_e4m3fn with a kv_scale) or fp8_ds_mla
(sparse top-k decode: --seq is then top-k, distinct random slots from a
65,536-token pool, or from each request's own --tokens-per-request N).
--impl flashmla runs FlashMLA's decode (torch and flash_mla importable, see
benchmarks/README.md) on the same shapes instead, so that ncu can profile the
peer's kernels beside ours (scripts/ncu_peer.sh). Prints the median wall time
of one call (synchronised; launch overhead included: use bench_paged_decode.py
for the reported figures).
"""
import argparse
import time

import numpy as np


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--b", type=int, default=128, help="requests")
  p.add_argument("--h", type=int, default=128, help="query heads")
  p.add_argument("--q-len", type=int, default=1)
  p.add_argument("--seq", type=int, default=4096, help="tokens per request")
  p.add_argument("--page-size", type=int, default=64)
  p.add_argument("--calls", type=int, default=6)
  p.add_argument("--impl", choices=("mla_jax", "flashmla"), default="mla_jax")
  p.add_argument("--kernel", default="auto", help="mla_jax: the plan's kernel (e.g. sm90_seesaw), for A/B profiles")
  p.add_argument("--cache", choices=("bf16", "fp8", "fp8_ds_mla"), default="bf16")
  p.add_argument("--tokens-per-request", type=int, default=0,
                 help="fp8_ds_mla: each request selects among its own N tokens (as bench_sparse_decode.py's "
                      "option); default: one shared 65,536-token pool")
  a = p.parse_args(argv)
  if a.tokens_per_request and a.cache != "fp8_ds_mla":
    p.error("--tokens-per-request applies to --cache fp8_ds_mla only")
  if a.cache == "fp8_ds_mla":
    return run_sparse(a)
  if a.impl == "flashmla":
    return run_flashmla(a)

  import jax
  import jax.numpy as jnp
  import mla_jax

  pages_per_seq = -(-a.seq // a.page_size)
  num_pages = a.b * pages_per_seq
  k1, k2 = jax.random.split(jax.random.key(0))
  shape_q = (a.b, a.q_len, a.h, 576) if a.q_len > 1 else (a.b, a.h, 576)
  query = jax.random.normal(k1, shape_q, jnp.bfloat16)
  cache = jax.random.normal(k2, (num_pages, a.page_size, 576), jnp.bfloat16)
  kv_scale = None
  if a.cache == "fp8":
    if a.impl == "flashmla":
      raise SystemExit("FlashMLA has no dense FP8 decode on sm_90")
    cache, kv_scale = (cache * 8).astype(jnp.float8_e4m3fn), jnp.float32(0.125)
  block_table = jnp.asarray(np.arange(num_pages, dtype=np.int32).reshape(a.b, pages_per_seq))
  seq_lens = jnp.full((a.b,), a.seq, jnp.int32)
  plan = mla_jax.DecodePlan(num_heads=a.h, page_size=a.page_size, sm_scale=576 ** -0.5,
                            q_len=a.q_len, causal=a.q_len > 1, kernel=a.kernel)
  fn = jax.jit(lambda q, c, bt, sl, s: mla_jax.paged_decode(q, c, bt, sl, plan=plan, kv_scale=s))
  time_calls("mla_jax", a, lambda: fn(query, cache, block_table, seq_lens, kv_scale).block_until_ready())


def run_sparse(a):
  """Sparse decode over an fp8_ds_mla cache (--seq = top-k), either implementation."""
  import jax
  import jax.numpy as jnp
  import mla_jax
  own = a.tokens_per_request
  if own and own < a.seq:
    raise SystemExit(f"--tokens-per-request {own} is below top-k {a.seq}")
  pool = a.b * own if own else 65536
  pool = -(-pool // a.page_size) * a.page_size
  rng = np.random.default_rng(0)
  latent = jax.random.normal(jax.random.key(0), (pool // a.page_size, a.page_size, 576), jnp.bfloat16)
  cache = mla_jax.quantize_latent_fp8(latent, scale_format="pow2")
  if own:
    indices = np.stack([(i // a.q_len) * own + rng.permutation(own)[:a.seq] for i in range(a.b * a.q_len)])
  else:
    indices = np.stack([rng.permutation(pool)[:a.seq] for _ in range(a.b * a.q_len)])
  indices = jnp.asarray(indices.reshape(a.b, a.q_len, a.seq).astype(np.int32))
  query = jax.random.normal(jax.random.key(1), (a.b, a.q_len, a.h, 576), jnp.bfloat16)
  if a.impl == "flashmla":
    import torch
    import flash_mla
    jax.block_until_ready((cache, indices, query))
    q_t, idx_t = torch.from_dlpack(query), torch.from_dlpack(indices)
    c_t = torch.from_dlpack(cache).view(torch.float8_e4m3fn).unsqueeze(2)
    meta, _ = flash_mla.get_mla_metadata()

    def call():
      flash_mla.flash_mla_with_kvcache(q_t, c_t, None, None, 512, meta, None, softmax_scale=576 ** -0.5,
                                       is_fp8_kvcache=True, indices=idx_t)
      torch.cuda.synchronize()

    return time_calls("FlashMLA sparse", a, call)
  plan = mla_jax.SparseDecodePlan(num_heads=a.h, page_size=a.page_size, sm_scale=576 ** -0.5, topk=a.seq,
                                  q_len=a.q_len, kv_format="fp8_ds_mla", kernel=a.kernel)
  fn = jax.jit(lambda q, c, i: mla_jax.sparse_decode(q, c, i, plan=plan))
  time_calls("mla_jax sparse", a, lambda: fn(query, cache, indices).block_until_ready())


def time_calls(label, a, call):
  """Runs call() a.calls times; prints the median wall time, the first (compiling) call left out."""
  times = []
  for _ in range(a.calls):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
  print(f"{label} b={a.b} h={a.h} q_len={a.q_len} seq={a.seq}: median {np.median(times[1:]) * 1e6:.1f} us "
        f"over {a.calls - 1} calls (wall, synchronised)")


def run_flashmla(a):
  import torch
  import flash_mla
  dev = torch.device("cuda", 0)
  pages_per_seq = -(-a.seq // a.page_size)
  num_pages = a.b * pages_per_seq
  g = torch.Generator(device=dev).manual_seed(0)
  q = torch.randn(a.b, a.q_len, a.h, 576, generator=g, device=dev, dtype=torch.bfloat16)
  cache = torch.randn(num_pages, a.page_size, 1, 576, generator=g, device=dev, dtype=torch.bfloat16)
  block_table = torch.arange(num_pages, dtype=torch.int32, device=dev).reshape(a.b, pages_per_seq)
  seq_lens = torch.full((a.b,), a.seq, dtype=torch.int32, device=dev)
  meta, _ = flash_mla.get_mla_metadata()

  def call():
    flash_mla.flash_mla_with_kvcache(q, cache, block_table, seq_lens, 512, meta, None,
                                     softmax_scale=576 ** -0.5, causal=a.q_len > 1)
    torch.cuda.synchronize()

  time_calls("FlashMLA", a, call)


if __name__ == "__main__":
  main()
