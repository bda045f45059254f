"""Trace-time validation and normalisation of paged-decode inputs.

Every check here runs on static shapes and dtypes, so a bad call fails while
tracing with a message naming the argument, the expected and the actual
value. Normalisation never copies: a packed query or cache is passed to the
kernels as is (the same buffer for both halves), a missing Q axis is added
with a reshape, which XLA lowers to a bitcast.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .plan import DecodePlan, SparseDecodePlan

QUERY_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
  """Normalised operands: query 4-D [B, Q, H, *], cache 3-D [P, S, *]."""
  q_nope: Any        # [B, Q, H, 512] or packed [B, Q, H, 576]
  q_pe: Any          # [B, Q, H, 64], or the packed query again
  ckv: Any           # [P, S, 512] or packed [P, S, 576]
  kpe: Any           # [P, S, 64], or the packed cache again
  block_table: Any   # int32 [B, T]
  seq_lens: Any      # int32 [B]
  kv_scale: Any      # float32 [1]
  query_had_q_axis: bool

  def q_packed(self, plan) -> bool:
    return is_packed(self.q_nope, plan)

  def kv_packed(self, plan) -> bool:
    return is_packed(self.ckv, plan)


def is_packed(nope, plan) -> bool:
  """A packed operand (passed as both halves) has the full width
  kv_lora_rank + qk_rope_head_dim. (Comparing the two halves' widths is not
  enough: with kv_lora_rank == qk_rope_head_dim split halves match too.)"""
  return nope.shape[-1] == plan.kv_lora_rank + plan.qk_rope_head_dim


def _shape(x) -> tuple:
  return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def _check_dtype(name, x, allowed):
  dt = jnp.dtype(x.dtype)
  if dt not in allowed:
    want = (str(jnp.dtype(allowed[0])) if len(allowed) == 1
            else "one of (" + ", ".join(str(jnp.dtype(a)) for a in allowed) + ")")
    raise TypeError(f"{name}: expected dtype {want}, got {dt}")


def _check_last_dim(name, x, want):
  if not _shape(x) or _shape(x)[-1] != want:  # a rank-0 array has no last dimension
    raise ValueError(f"{name}: expected last dimension {want}, got shape {_shape(x)}")


def _as_array(name, x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name}: expected a jax or numpy array, got {type(x).__name__}")
  return x


def normalize_query(query, plan: DecodePlan):
  """Returns (q_nope, q_pe, had_q_axis) with 4-D [B, Q, H, *] arrays."""
  dn, dr, h, q = plan.kv_lora_rank, plan.qk_rope_head_dim, plan.num_heads, plan.q_len
  if isinstance(query, (tuple, list)):
    if len(query) != 2:
      raise ValueError(f"query: expected an array or a (q_nope, q_pe) pair, got {len(query)} items")
    q_nope = _as_array("q_nope", query[0])
    q_pe = _as_array("q_pe", query[1])
    _check_last_dim("q_nope", q_nope, dn)
    _check_last_dim("q_pe", q_pe, dr)
    if _shape(q_nope)[:-1] != _shape(q_pe)[:-1]:
      raise ValueError(f"q_nope {_shape(q_nope)} and q_pe {_shape(q_pe)} must agree on all but the last dimension")
    parts = [("q_nope", q_nope), ("q_pe", q_pe)]
  else:
    query = _as_array("query", query)
    _check_last_dim("query", query, dn + dr)
    parts = [("query", query)]

  name0, x0 = parts[0]
  if jnp.dtype(parts[0][1].dtype) != jnp.dtype(parts[-1][1].dtype):
    raise TypeError(f"q_nope and q_pe dtypes differ: {x0.dtype} vs {parts[-1][1].dtype}")
  _check_dtype(name0, x0, QUERY_DTYPES)
  shape = _shape(x0)
  if len(shape) == 3:
    if q != 1:
      raise ValueError(f"{name0}: plan.q_len={q} needs a [B, Q, H, D] query, got shape {shape}")
    had_q_axis = False
  elif len(shape) == 4:
    if shape[1] != q:
      raise ValueError(f"{name0}: expected Q = plan.q_len = {q} at axis 1, got shape {shape}")
    had_q_axis = True
  else:
    raise ValueError(f"{name0}: expected rank 3 [B, H, D] or 4 [B, Q, H, D], got shape {shape}")
  if shape[-2] != h:
    raise ValueError(f"{name0}: expected H = plan.num_heads = {h} at axis {len(shape) - 2}, got shape {shape}")

  def to4(x):
    return x if had_q_axis else jnp.reshape(x, (x.shape[0], 1) + tuple(x.shape[1:]))

  if len(parts) == 1:
    packed = to4(parts[0][1])
    return packed, packed, had_q_axis
  return to4(parts[0][1]), to4(parts[1][1]), had_q_axis


def normalize_cache(kv_cache, plan: DecodePlan, query_dtype, kv_scale_given: bool):
  """Returns (ckv, kpe) 3-D arrays (the same array twice when packed)."""
  dn, dr, s = plan.kv_lora_rank, plan.qk_rope_head_dim, plan.page_size
  if isinstance(kv_cache, (tuple, list)):
    if len(kv_cache) != 2:
      raise ValueError(f"kv_cache: expected an array or a (ckv, kpe) pair, got {len(kv_cache)} items")
    ckv = _as_array("ckv", kv_cache[0])
    kpe = _as_array("kpe", kv_cache[1])
    _check_last_dim("ckv", ckv, dn)
    _check_last_dim("kpe", kpe, dr)
    parts = [("ckv", ckv), ("kpe", kpe)]
    if _shape(ckv)[:-1] != _shape(kpe)[:-1]:
      raise ValueError(f"ckv {_shape(ckv)} and kpe {_shape(kpe)} must agree on all but the last dimension")
    if jnp.dtype(ckv.dtype) != jnp.dtype(kpe.dtype):
      raise TypeError(f"ckv and kpe dtypes differ: {ckv.dtype} vs {kpe.dtype}")
  else:
    kv_cache = _as_array("kv_cache", kv_cache)
    _check_last_dim("kv_cache", kv_cache, dn + dr)
    parts = [("kv_cache", kv_cache)]
  name0, x0 = parts[0]
  shape = _shape(x0)
  if len(shape) != 3:
    raise ValueError(f"{name0}: expected rank 3 [num_pages, page_size, D], got shape {shape}")
  if shape[1] != s:
    raise ValueError(f"{name0}: expected page_size = plan.page_size = {s} at axis 1, got shape {shape}")
  dt = jnp.dtype(x0.dtype)
  if dt in FP8_DTYPES:
    if not kv_scale_given:
      raise TypeError(f"{name0}: a {dt} cache needs kv_scale= (its float32 dequantisation scale)")
  else:
    if kv_scale_given:
      raise TypeError(f"kv_scale: only valid with a float8_e4m3fn cache, got a {dt} cache")
    if dt != jnp.dtype(query_dtype):
      raise TypeError(f"{name0}: expected dtype {jnp.dtype(query_dtype)} (the query dtype), got {dt}")
  return (x0, x0) if len(parts) == 1 else (parts[0][1], parts[1][1])


def normalize(query, kv_cache, block_table, seq_lens, plan: DecodePlan, kv_scale=None) -> DecodeInputs:
  """Validates every operand against the plan and each other."""
  if not isinstance(plan, DecodePlan):
    raise TypeError(f"plan: expected mla_jax.DecodePlan, got {type(plan).__name__}")
  q_nope, q_pe, had_q_axis = normalize_query(query, plan)
  ckv, kpe = normalize_cache(kv_cache, plan, q_nope.dtype, kv_scale is not None)
  block_table = _as_array("block_table", block_table)
  seq_lens = _as_array("seq_lens", seq_lens)
  _check_dtype("block_table", block_table, (jnp.dtype(jnp.int32),))
  _check_dtype("seq_lens", seq_lens, (jnp.dtype(jnp.int32),))
  b = _shape(q_nope)[0]
  if len(_shape(block_table)) != 2:
    raise ValueError(f"block_table: expected rank 2 [B, max_pages_per_seq], got shape {_shape(block_table)}")
  if len(_shape(seq_lens)) != 1:
    raise ValueError(f"seq_lens: expected rank 1 [B], got shape {_shape(seq_lens)}")
  if _shape(block_table)[0] != b:
    raise ValueError(f"block_table: expected B = {b} rows (the query batch), got shape {_shape(block_table)}")
  if _shape(seq_lens)[0] != b:
    raise ValueError(f"seq_lens: expected shape ({b},) (the query batch), got {_shape(seq_lens)}")
  if kv_scale is None:
    scale = jnp.ones((1,), jnp.float32)
  else:
    kv_scale = _as_array("kv_scale", kv_scale)
    _check_dtype("kv_scale", kv_scale, (jnp.dtype(jnp.float32),))
    if _shape(kv_scale) not in ((), (1,)):
      raise ValueError(f"kv_scale: expected a float32 scalar, got shape {_shape(kv_scale)}")
    scale = jnp.reshape(kv_scale, (1,))
  return DecodeInputs(q_nope, q_pe, ckv, kpe, block_table, seq_lens, scale, had_q_axis)


# --- sparse top-k decode (DeepSeek V3.2) ----------------------------------------
@dataclasses.dataclass(frozen=True)
class SparseInputs:
  """Normalised sparse-decode operands, in the FFI operand order."""
  q_nope: Any        # [B, Q, H, 512] or packed [B, Q, H, 576]
  q_pe: Any          # [B, Q, H, 64], or the packed query again
  kv: Any            # packed [P, S, 576] (query dtype) or uint8 [P, S, 656]
  indices: Any       # int32 [B, Q, K]
  topk_lens: Any     # int32 [B] (K everywhere when the caller gave None)
  attn_sink: Any     # float32 [H] (zeros when the caller gave None)
  kv_scale: Any      # float32 [1] (ones; reserved)
  has_sink: bool
  query_had_q_axis: bool

  @property
  def operands(self) -> tuple:
    return (self.q_nope, self.q_pe, self.kv, self.indices, self.topk_lens, self.attn_sink,
            self.kv_scale)


def normalize_sparse_cache(kv_cache, plan, query_dtype):
  """Checks the packed sparse cache against plan.kv_format; returns it."""
  if isinstance(kv_cache, (tuple, list)):
    raise TypeError("kv_cache: sparse_decode takes one packed cache array ([P, S, 576] or "
                    "uint8 [P, S, 656]), not a (ckv, kpe) pair")
  kv_cache = _as_array("kv_cache", kv_cache)
  shape = _shape(kv_cache)
  if len(shape) != 3:
    raise ValueError(f"kv_cache: expected rank 3 [num_pages, page_size, D], got shape {shape}")
  if shape[1] != plan.page_size:
    raise ValueError(f"kv_cache: expected page_size = plan.page_size = {plan.page_size} at axis 1, "
                     f"got shape {shape}")
  dt = jnp.dtype(kv_cache.dtype)
  if plan.kv_format == "fp8_ds_mla":
    if dt != jnp.dtype(jnp.uint8):
      raise TypeError(f"kv_cache: kv_format 'fp8_ds_mla' needs a uint8 cache (from "
                      f"mla_jax.quantize_latent_fp8), got {dt}")
    _check_last_dim("kv_cache", kv_cache, plan.kv_row_width)
  else:
    if dt != jnp.dtype(query_dtype):
      raise TypeError(f"kv_cache: kv_format 'bf16' needs dtype {jnp.dtype(query_dtype)} "
                      f"(the query dtype), got {dt}")
    _check_last_dim("kv_cache", kv_cache, plan.kv_row_width)
  if shape[0] * shape[1] == 0:
    raise ValueError(f"kv_cache: needs at least one slot, got shape {shape}")
  return kv_cache


def normalize_sparse(query, kv_cache, indices, topk_lens, attn_sink, plan) -> SparseInputs:
  """Validates every sparse-decode operand against the plan and each other."""
  if not isinstance(plan, SparseDecodePlan):
    raise TypeError(f"plan: expected mla_jax.SparseDecodePlan, got {type(plan).__name__}")
  q_nope, q_pe, had_q_axis = normalize_query(query, plan)
  kv = normalize_sparse_cache(kv_cache, plan, q_nope.dtype)
  b, q_len, h = _shape(q_nope)[:3]
  k = plan.topk

  indices = _as_array("indices", indices)
  _check_dtype("indices", indices, (jnp.dtype(jnp.int32),))
  want = (b, q_len, k) if had_q_axis else (b, k)
  if _shape(indices) != want:
    form = "[B, Q, K]" if had_q_axis else "[B, K] (the query has no Q axis)"
    raise ValueError(f"indices: expected shape {want} = {form} with K = plan.topk = {k}, "
                     f"got {_shape(indices)}")
  if not had_q_axis:
    indices = jnp.reshape(indices, (b, 1, k))

  if topk_lens is None:
    topk_lens = jnp.full((b,), k, jnp.int32)
  else:
    topk_lens = _as_array("topk_lens", topk_lens)
    _check_dtype("topk_lens", topk_lens, (jnp.dtype(jnp.int32),))
    if _shape(topk_lens) != (b,):
      raise ValueError(f"topk_lens: expected shape ({b},) (the query batch), got {_shape(topk_lens)}")

  has_sink = attn_sink is not None
  if attn_sink is None:
    attn_sink = jnp.zeros((h,), jnp.float32)
  else:
    attn_sink = _as_array("attn_sink", attn_sink)
    _check_dtype("attn_sink", attn_sink, (jnp.dtype(jnp.float32),))
    if _shape(attn_sink) != (h,):
      raise ValueError(f"attn_sink: expected shape ({h},) (one per head), got {_shape(attn_sink)}")

  return SparseInputs(q_nope, q_pe, kv, indices, topk_lens, attn_sink,
                      jnp.ones((1,), jnp.float32), has_sink, had_q_axis)
