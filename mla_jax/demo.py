"""`python -m mla_jax demo`: one decode step at DeepSeek-V3 shapes, checked and timed.

Shapes: kv_lora_rank 512, qk_rope_head_dim 64 (576-wide latent cache), page
size 64, sm_scale 1/sqrt(192), q_len 1, for H = 128 (all heads on one GPU)
and H = 16 (the per-GPU slice under 8-way tensor parallelism).

Batches (sequence lengths *including* the new token):
  single   one request of 76,800 tokens
  batch8   8 requests of about 40k tokens each
  mix      32 requests, long-tail (log-uniform) lengths from 1 to 32,768

On a GPU these run at full size. Elsewhere every length is divided by
``--scale`` (default 32 off-GPU) so the demo finishes in well under a minute
on a 2-core CPU. Each result is checked against the float64 NumPy reference
(:func:`mla_jax.testing.reference_paged_decode`); at full size only a few
requests per batch are checked (the longest, the shortest and two others) to
keep the NumPy reference fast.

Metrics follow FlashMLA's convention:
  FLOPs = 2 * q_len * sum(seq) * H * (576 + 512)
  bytes = (sum(seq) * 576 + B * q_len * H * (576 + 512)) * 2
Latency is the median over a few timed trials after warm-up; a trial issues
``inner`` back-to-back calls and waits with ``block_until_ready``, so host
dispatch overlaps device work the way it does in a serving loop.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time

import numpy as np

from .testing import scattered_block_table

KV_LORA_RANK = 512
ROPE_DIM = 64
D_QK = KV_LORA_RANK + ROPE_DIM
PAGE_SIZE = 64
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek-V3: qk_nope_head_dim 128 + rope 64
HEADS = (128, 16)
ERROR_BARS = {"bfloat16": 1e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  description: str
  seq_lens: np.ndarray  # int32 [B], full size


def scenarios(seed: int = 0) -> list[Scenario]:
  rng = np.random.default_rng(seed)
  batch8 = 40_000 + rng.integers(-2_048, 2_049, size=8)
  mix = np.exp(rng.uniform(0.0, math.log(32_768), size=32)).round()
  mix[0], mix[1] = 1, 32_768  # both ends of the tail
  return [
      Scenario("single", "1 request x 76,800 tokens", np.array([76_800], np.int32)),
      Scenario("batch8", "8 requests x ~40k tokens", batch8.astype(np.int32)),
      Scenario("mix", "32 requests, long tail 1..32k", np.clip(mix, 1, 32_768).astype(np.int32)),
  ]


def flops_and_bytes(seq_lens, num_heads: int, q_len: int = 1):
  """FlashMLA's convention for MLA decode FLOPs and bytes moved."""
  total = int(np.sum(seq_lens, dtype=np.int64))
  b = len(seq_lens)
  flops = 2 * q_len * total * num_heads * (D_QK + KV_LORA_RANK)
  nbytes = (total * D_QK + b * q_len * num_heads * (D_QK + KV_LORA_RANK)) * 2
  return flops, nbytes


def _pages(seq_lens):
  return [-(-int(n) // PAGE_SIZE) for n in seq_lens]


def make_inputs(seq_lens, num_heads: int, dtype, device, seed: int):
  """Random query, scattered paged cache and block table, generated on ``device``."""
  import jax
  import jax.numpy as jnp

  rng = np.random.default_rng(seed)
  block_table, num_pages = scattered_block_table(rng, seq_lens, PAGE_SIZE, extra_pages=1)
  with jax.default_device(device):
    kq, kc = jax.random.split(jax.random.key(seed))
    gen = jax.jit(lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype),
                  static_argnums=1)
    query = gen(kq, (len(seq_lens), num_heads, D_QK))
    kv_cache = gen(kc, (num_pages, PAGE_SIZE, D_QK))
  put = lambda x: jax.device_put(x, device)
  return query, kv_cache, put(block_table), put(np.asarray(seq_lens, np.int32))


def _check_subset(seq_lens, full: bool) -> np.ndarray:
  b = len(seq_lens)
  if not full or b <= 4:
    return np.arange(b)
  order = np.argsort(seq_lens, kind="stable")
  return np.unique(np.array([order[-1], order[0], order[b // 2], order[b // 4]]))


def reference_subset(query, kv_cache, block_table, seq_lens, idx, plan):
  """float64 reference for requests ``idx`` on a compacted copy of their pages."""
  import jax.numpy as jnp

  from .testing import reference_paged_decode

  bt = np.asarray(block_table)[idx]
  sl = np.asarray(seq_lens)[idx]
  pages = _pages(sl)
  ids = np.concatenate([bt[i, :n] for i, n in enumerate(pages)]).astype(np.int32)
  cache = np.asarray(jnp.take(kv_cache, ids, axis=0).astype(jnp.float32))
  new_bt = np.full((len(idx), max(pages)), -1, np.int32)
  k = 0
  for i, n in enumerate(pages):
    new_bt[i, :n] = np.arange(k, k + n)
    k += n
  q = np.asarray(query[idx].astype(jnp.float32))[:, None]  # [b, 1, H, 576]
  out, lse = reference_paged_decode(q, cache, new_bt, sl, plan)
  return out[:, 0], lse[:, 0]


def rel_err(x, ref) -> float:
  x = np.asarray(x, np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(x - ref) / denom) if denom > 0 else float(np.linalg.norm(x))


def _num(x: float) -> str:
  """Three significant digits without exponent noise for table cells."""
  return f"{x:.1f}" if x >= 100 else f"{x:.3g}"


def _time(fn, args, warmup: int, trials: int, inner: int) -> float:
  """Median seconds per call."""
  for _ in range(warmup):
    fn(*args)[0].block_until_ready()
  samples = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(inner):
      res = fn(*args)
    res[0].block_until_ready()
    samples.append((time.perf_counter() - t0) / inner)
  return statistics.median(samples)


def _pick_device(backend: str):
  import jax

  if backend == "cpu":
    return jax.devices("cpu")[0]
  if backend == "cuda":
    try:
      return jax.devices("cuda")[0]
    except RuntimeError as e:
      raise SystemExit(f"--backend cuda: no CUDA device visible to JAX ({e})") from None
  return jax.devices()[0]


def run(backend: str = "auto", scale: int | None = None, dtype: str = "bfloat16",
        heads=HEADS, only=None, seed: int = 0, out=sys.stdout) -> int:
  """Runs the demo; returns the exit status (0 when every error is inside its bar)."""
  import jax
  import jax.numpy as jnp

  import mla_jax
  from mla_jax import _ffi

  device = _pick_device(backend)
  on_gpu = device.platform == "gpu" or device.platform == "cuda"
  if scale is None:
    scale = 1 if on_gpu else 32
  full = scale == 1
  jdtype = jnp.dtype(dtype)
  bar = ERROR_BARS[jdtype.name]
  warmup, trials, inner = (3, 5, 10) if on_gpu else (1, 3, 1)
  kernel = backend
  if backend == "auto":
    kernel = ("cuda" if _ffi.has_cuda_kernels() else "xla") if on_gpu else (
        "cpu" if device.platform == "cpu" else "xla")

  p = lambda *a: print(*a, file=out, flush=True)
  p(f"mla_jax {mla_jax.__version__} demo: paged MLA decode, DeepSeek-V3 shapes "
    f"(kv_lora_rank {KV_LORA_RANK}, rope {ROPE_DIM}, page {PAGE_SIZE}, q_len 1, {jdtype.name})")
  p(f"device: {device.device_kind} ({device.platform}); backend {backend!r} -> {kernel}; "
    f"lengths scaled 1/{scale}; error bar {bar:g}")
  p(f"timing: median of {trials} trials x {inner} call(s) after {warmup} warm-up call(s)")
  header = (f"{'scenario':<8} {'H':>4} {'B':>3} {'sum(seq)':>9} {'max':>6} {'latency us':>11} "
            f"{'GB/s':>8} {'TFLOP/s':>8} {'rel err':>9} {'checked':>8}  ok")
  p(header)
  p("-" * len(header))

  failures = 0
  t_start = time.perf_counter()
  for sc in scenarios(seed):
    if only and sc.name not in only:
      continue
    seq_lens = np.maximum(1, np.round(sc.seq_lens / scale)).astype(np.int32)
    for h in heads:
      plan = mla_jax.DecodePlan(num_heads=h, page_size=PAGE_SIZE, sm_scale=SM_SCALE,
                                backend=backend)
      args = make_inputs(seq_lens, h, jdtype, device, seed)
      fn = jax.jit(lambda q, kv, bt, sl, plan=plan: mla_jax.paged_decode(
          q, kv, bt, sl, plan=plan, return_lse=True))
      seconds = _time(fn, args, warmup, trials, inner)
      o, lse = fn(*args)
      idx = _check_subset(seq_lens, full)
      ref_out, ref_lse = reference_subset(*args, idx, plan)
      got = np.asarray(o[idx].astype(jnp.float32))
      err = max(rel_err(got, ref_out), rel_err(np.asarray(lse)[idx], ref_lse))
      ok = math.isfinite(err) and err <= bar
      failures += not ok
      flops, nbytes = flops_and_bytes(seq_lens, h)
      p(f"{sc.name:<8} {h:>4} {len(seq_lens):>3} {int(seq_lens.sum()):>9} {int(seq_lens.max()):>6} "
        f"{seconds * 1e6:>11.1f} {_num(nbytes / seconds / 1e9):>8} {_num(flops / seconds / 1e12):>8} "
        f"{err:>9.2e} {len(idx):>4}/{len(seq_lens):<3}  {'yes' if ok else 'NO'}")
  p(f"rel err = max(||out - ref|| / ||ref||, same for lse) vs the float64 reference; "
    f"total {time.perf_counter() - t_start:.1f} s")
  if failures:
    p(f"FAILED: {failures} result(s) above the error bar {bar:g}")
    return 1
  p("all results within the error bar")
  return 0
