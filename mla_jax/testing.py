"""Float64 NumPy reference and input generators for tests, demo and benchmarks."""

from __future__ import annotations

import numpy as np

from .plan import DecodePlan


def reference_paged_decode(query, kv_cache, block_table, seq_lens, plan: DecodePlan, kv_scale=1.0):
  """Float64 reference of :func:`mla_jax.paged_decode` on host arrays.

  Args:
    query: ``[B, Q, H, 576]`` or a (q_nope, q_pe) pair with a Q axis, any float dtype.
    kv_cache: ``[P, S, 576]`` or a (ckv, kpe) pair.
    block_table, seq_lens: as for paged_decode.
  Returns:
    out ``[B, Q, H, 512]`` and lse ``[B, Q, H]`` as float64; invalid requests NaN.
  """
  dn = plan.kv_lora_rank
  if isinstance(query, (tuple, list)):
    q = np.concatenate([np.asarray(query[0], np.float64), np.asarray(query[1], np.float64)], -1)
  else:
    q = np.asarray(query, np.float64)
  if isinstance(kv_cache, (tuple, list)):
    kv = np.concatenate([np.asarray(kv_cache[0], np.float64), np.asarray(kv_cache[1], np.float64)], -1)
  else:
    kv = np.asarray(kv_cache, np.float64)
  block_table = np.asarray(block_table)
  seq_lens = np.asarray(seq_lens)
  b_sz, q_len, h = q.shape[:3]
  num_pages, page_size = kv.shape[:2]
  out = np.zeros((b_sz, q_len, h, dn))
  lse = np.full((b_sz, q_len, h), -np.inf)
  for b in range(b_sz):
    n = int(seq_lens[b])
    live_pages = -(-n // page_size) if n > 0 else 0
    ids = block_table[b, :live_pages] if n >= 0 else None
    if n < 0 or n > block_table.shape[1] * page_size or np.any((ids < 0) | (ids >= num_pages)):
      out[b], lse[b] = np.nan, np.nan
      continue
    pos = np.arange(n)
    keys = kv[ids[pos // page_size], pos % page_size] if n else np.zeros((0, kv.shape[-1]))
    keys = keys * kv_scale
    for i in range(q_len):
      limit = n - q_len + i + 1 if plan.causal else n
      if limit <= 0:
        continue
      k = keys[:limit]
      s = q[b, i] @ k.T * plan.sm_scale                       # [H, limit]
      m = s.max(-1, keepdims=True)
      w = np.exp(s - m)
      lse[b, i] = (m[:, 0] + np.log(w.sum(-1)))
      out[b, i] = (w / w.sum(-1, keepdims=True)) @ k[:, :dn]
  return out, lse


def scattered_block_table(rng: np.random.Generator, seq_lens, page_size: int,
                          extra_pages: int = 0, scatter: bool = True):
  """A block table giving each request its own pages, without reuse.

  Pages are a random permutation of the cache (``scatter``) or in order;
  unused entries are -1. Returns (int32 [B, max(1, max pages)], num_pages),
  num_pages = pages used + ``extra_pages``.
  """
  pages_per_seq = [max(0, -(-int(n) // page_size)) for n in seq_lens]
  max_pages = max([1] + pages_per_seq)
  num_pages = sum(pages_per_seq) + extra_pages
  order = rng.permutation(num_pages) if scatter else np.arange(num_pages)
  block_table = np.full((len(pages_per_seq), max_pages), -1, np.int32)
  k = 0
  for i, n in enumerate(pages_per_seq):
    block_table[i, :n] = order[k:k + n]
    k += n
  return block_table, num_pages


def random_paged_inputs(rng: np.random.Generator, seq_lens, *, num_heads: int, page_size: int,
                        q_len: int = 1, dtype=np.float32, extra_pages: int = 3,
                        scatter: bool = True, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64):
  """Random query/cache/block table for the given lengths (host arrays).

  Pages are assigned without reuse, scattered over the cache when
  ``scatter``; unused table entries hold -1 and unused cache slots NaN-free
  random values (tests plant NaN themselves where they want it).

  Returns:
    dict with query [B, Q, H, 576], kv_cache [P, S, 576], block_table
    int32 [B, T], seq_lens int32 [B] (all NumPy, float32 values rounded to
    ``dtype`` when it is a JAX dtype name is applied by the caller).
  """
  seq_lens = np.asarray(seq_lens, np.int32)
  b = len(seq_lens)
  d = kv_lora_rank + qk_rope_head_dim
  block_table, num_pages = scattered_block_table(rng, seq_lens, page_size, extra_pages, scatter)
  query = rng.standard_normal((b, q_len, num_heads, d)).astype(dtype)
  kv_cache = rng.standard_normal((num_pages, page_size, d)).astype(dtype)
  return dict(query=query, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)


def dequantize_latent_fp8_np(kv_u8) -> np.ndarray:
  """Exact float64 dequantisation of uint8 ``[..., 656]`` fp8_ds_mla rows -> ``[..., 576]``."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top  (ships with jaxlib)
  kv_u8 = np.ascontiguousarray(np.asarray(kv_u8, np.uint8))
  if kv_u8.shape[-1] != 656:
    raise ValueError(f"expected last dimension 656, got shape {kv_u8.shape}")
  lead = kv_u8.shape[:-1]
  ckv = np.ascontiguousarray(kv_u8[..., :512]).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  scales = np.ascontiguousarray(kv_u8[..., 512:528]).view("<f4").astype(np.float64)   # [..., 4]
  kpe = np.ascontiguousarray(kv_u8[..., 528:]).view(ml_dtypes.bfloat16).astype(np.float64)
  ckv = (ckv.reshape(lead + (4, 128)) * scales[..., None]).reshape(lead + (512,))
  return np.concatenate([ckv, kpe], axis=-1)


def reference_sparse_decode(query, kv_cache, indices, plan, topk_lens=None, attn_sink=None):
  """Float64 reference of :func:`mla_jax.sparse_decode` on host arrays.

  Args:
    query: ``[B, Q, H, 576]`` or a (q_nope, q_pe) pair with a Q axis, any float dtype.
    kv_cache: float ``[P, S, 576]`` (values used as given) or uint8
      ``[P, S, 656]`` fp8_ds_mla rows (dequantised exactly in float64).
    indices: int ``[B, Q, K]`` global slots; topk_lens ``[B]`` or None;
      attn_sink ``[H]`` or None. plan: anything with ``sm_scale`` (and
      ``kv_lora_rank``, default 512).
  Returns:
    out ``[B, Q, H, 512]`` and lse ``[B, Q, H]`` as float64; a token with no
    valid index has out 0 and lse -inf.
  """
  dn = getattr(plan, "kv_lora_rank", 512)
  if isinstance(query, (tuple, list)):
    q = np.concatenate([np.asarray(query[0], np.float64), np.asarray(query[1], np.float64)], -1)
  else:
    q = np.asarray(query, np.float64)
  kv = np.asarray(kv_cache)
  kv = dequantize_latent_fp8_np(kv) if kv.dtype == np.uint8 else kv.astype(np.float64)
  flat = kv.reshape(-1, kv.shape[-1])
  indices = np.asarray(indices, np.int64)
  b_sz, q_len, h = q.shape[:3]
  k = indices.shape[-1]
  lens = np.full((b_sz,), k) if topk_lens is None else np.clip(np.asarray(topk_lens, np.int64), 0, k)
  out = np.zeros((b_sz, q_len, h, dn))
  lse = np.full((b_sz, q_len, h), -np.inf)
  for b in range(b_sz):
    for i in range(q_len):
      idx = indices[b, i, :lens[b]]
      idx = idx[(idx >= 0) & (idx < flat.shape[0])]
      if idx.size == 0:
        continue
      keys = flat[idx]                                   # duplicates count twice
      s = q[b, i] @ keys.T * plan.sm_scale               # [H, n]
      m = s.max(-1, keepdims=True)
      w = np.exp(s - m)
      lse[b, i] = m[:, 0] + np.log(w.sum(-1))
      out[b, i] = (w / w.sum(-1, keepdims=True)) @ keys[:, :dn]
      if attn_sink is not None:
        sink = np.asarray(attn_sink, np.float64)
        out[b, i] *= (1.0 / (1.0 + np.exp(sink - lse[b, i])))[:, None]
  return out, lse
