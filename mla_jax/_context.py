"""Context parallelism: a cache sharded on its page axis, decoded where it lives.

Device r of a context axis of n devices holds global pages ``[r*P, (r+1)*P)``
of a cache of ``n*P`` pages (P: its local ``num_pages``); page ids in
``block_table`` (and slots in sparse ``indices``) are global. Each device
decodes, for every request, only the tokens on its own pages and returns a
partial ``(out, lse)``; the partials are merged over the axis by their LSEs
(:func:`merge_states_over_axis`). Only ``[B, Q, H, 512]`` partials and their
LSEs cross devices, never cache bytes.

Paged decode on one device: the kernel runs non-causally over a block table
of the request's own pages, compacted to the front (so its work is
proportional to the local tokens on the kernel backends; the pure-JAX
backend gathers every table column), covering every position that all Q query
tokens see; the last Q - 1 positions, which only some query tokens see
(causal, q_len > 1), are attended here in JAX (at most 7 tokens a request).
Validity (a length out of range, a live page id outside the global
``[0, n*P)``: NaN, as on one device) is decided from the global table, the
same on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ._inputs import is_packed
from ._sharding import axis_names
from .paged_cache import merge_states
from .xla_reference import attend, capacity, request_validity


def explain(explanation, axis, op: str):
  """mla_jax.explain's answer for one device's call, with a first line on
  the context axis when ``axis`` is not None."""
  if axis is None:
    return explanation
  names = ", ".join(repr(a) for a in axis_names(axis))
  tail = (" non-causally, the last q_len - 1 positions of a causal call attended in JAX,"
          if op == "paged_decode" else "")
  line = (f"context_axis {names}: each device decodes the tokens on its own pages{tail} and the partial "
          "outputs are merged over the axis by their LSEs; the lines below are one device's call on its "
          "local shapes")
  return dataclasses.replace(explanation, reasons=(line,) + explanation.reasons)


def join_axes(outer, inner):
  """The context axes of a call whose pages are split over ``outer`` (a
  user's context_axis, or None) and, within each of its shards, over
  ``inner``: device (o, i) holds global pages from (o * |inner| + i) * P,
  which is axis_index((outer..., inner...)) * P."""
  if outer is None:
    return inner
  names = axis_names(outer) + axis_names(inner)
  return names[0] if len(names) == 1 else names


def local_pages(axis, num_local_pages: int):
  """(first global page id of this device, global page count) on ``axis``."""
  axis = axis_names(axis)
  return jax.lax.axis_index(axis) * num_local_pages, jax.lax.axis_size(axis) * num_local_pages


def merge_states_over_axis(out, lse, axis_name):
  """Merges partial attention results held by the devices of a mesh axis.

  Inside ``jax.shard_map`` (or any context where ``axis_name`` is bound),
  each device holds ``(out, lse)`` over its own disjoint set of keys; the
  result is the attention over all of them, the same on every device:

    lse = ln(sum_r e^lse_r),   out = sum_r e^(lse_r - lse) out_r

  computed in float32 against the largest LSE (the split-KV combine of
  FlashDecoding, Dao et al. 2023, over devices). Exact for devices that hold
  none of the keys (lse -inf, whatever their out holds); all empty gives
  out 0, lse -inf; a NaN lse on any device gives NaN. Two all-reduces of
  lse's shape and one of out's move between the devices.

  Args:
    out: ``[..., D]``, any float dtype.
    lse: ``[...]`` (out's shape without its last axis), natural log.
    axis_name: a mesh axis name or a tuple of them.

  Returns:
    ``(out, lse)``: out in out's dtype, lse float32.

  Raises:
    ValueError: lse's shape is not out's without its last axis.
  """
  if out.ndim < 1 or lse.shape != out.shape[:-1]:
    raise ValueError(f"lse: expected shape {tuple(out.shape[:-1])} (out without its last axis), "
                     f"got {tuple(lse.shape)}")
  axis = axis_names(axis_name)
  lse = lse.astype(jnp.float32)
  top = jax.lax.pmax(lse, axis)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  w = jnp.exp(lse - top)                      # 0 for an empty part, NaN for a NaN lse
  # A part of weight exactly 0 adds 0 even where its out holds NaN or Inf.
  part = jnp.where((w == 0)[..., None], 0.0, w[..., None] * out.astype(jnp.float32))
  num, den = jax.lax.psum((part, w), axis)
  empty = den == 0
  merged = jnp.where(empty[..., None], 0.0, num / jnp.where(empty, 1.0, den)[..., None])
  return merged.astype(out.dtype), jnp.where(empty, -jnp.inf, top + jnp.log(den))


def _compact_own_pages(block_table, body_len, lo, num_local_pages: int, page_size: int):
  """(local block table, local lengths): the request's table entries that
  cover positions < body_len and lie in [lo, lo + P), as local page ids in
  their order, at the front of each row; the lengths count their tokens.
  Only a request's last covered page can be partial, and it stays last."""
  b, t = block_table.shape
  col = jnp.arange(t, dtype=jnp.int32)[None, :]
  full, rem = body_len // page_size, body_len % page_size      # body_len >= 0
  covered = col < (full + (rem > 0).astype(jnp.int32))[:, None]
  mine = covered & (block_table >= lo) & (block_table < lo + num_local_pages)
  dest = jnp.where(mine, jnp.cumsum(mine.astype(jnp.int32), axis=1) - 1, t)  # t: dropped
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  local_table = jnp.zeros_like(block_table).at[rows, dest].set(block_table - lo, mode="drop")
  tokens = jnp.where(col < full[:, None], page_size, jnp.where(col == full[:, None], rem[:, None], 0))
  local_len = jnp.sum(jnp.where(mine, tokens, 0), axis=1, dtype=jnp.int32)
  return local_table, local_len


def _tail(plan, q_nope, q_pe, ckv, kpe, block_table, lens, kv_scale, lo, num_tail: int):
  """(out f32, lse) over the last num_tail positions of every request that
  lie on this device's pages; query token i sees the first i of them."""
  dn, ps = plan.kv_lora_rank, plan.page_size
  b, q_len = q_nope.shape[:2]
  num_local, t = ckv.shape[0], block_table.shape[1]
  k = jnp.arange(num_tail, dtype=jnp.int32)
  pos = lens[:, None] - num_tail + k[None, :]                 # [B, K] global positions
  pos_ok = pos >= 0
  pos = jnp.maximum(pos, 0)
  page = jnp.take_along_axis(block_table, jnp.minimum(pos // ps, t - 1), axis=1, mode="clip")
  mine = pos_ok & (page >= lo) & (page < lo + num_local)
  local = jnp.clip(page - lo, 0, num_local - 1)
  slot = pos % ps
  compute = q_nope.dtype
  zero = jnp.zeros((), compute)
  k_nope = jnp.where(mine[..., None], ckv[local, slot][..., :dn].astype(compute), zero)   # [B, K, dn]
  k_pe = kpe[local, slot]
  k_pe = jnp.where(mine[..., None], (k_pe[..., dn:] if is_packed(kpe, plan) else k_pe).astype(compute), zero)
  i = jnp.arange(q_len, dtype=jnp.int32)
  # Position lens - num_tail + k is visible to query token i of a causal
  # plan (num_tail = q_len - 1) exactly when k < i.
  visible = mine[:, None, :] & (k[None, None, :] < i[None, :, None])       # [B, Q, K]
  return attend(q_nope, q_pe, k_nope, k_pe, visible, plan.sm_scale, kv_scale[0])


def paged_decode_local(op_local, call, q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale):
  """One device's share of a context-parallel paged decode, merged over
  call.context_axis. op_local(call, *operands): the one-device op."""
  plan = call.plan
  ps, num_local = plan.page_size, ckv.shape[0]
  lo, num_global = local_pages(call.context_axis, num_local)
  valid = request_validity(block_table, seq_lens, num_global, ps)            # [B], global
  q_len = q_nope.shape[1]
  num_tail = q_len - 1 if plan.causal else 0
  # Clamped so that an invalid request (NaN below) reads nothing out of range.
  lens = jnp.clip(seq_lens, 0, capacity(block_table.shape[1], ps))
  table, local_len = _compact_own_pages(block_table, jnp.maximum(lens - num_tail, 0), lo, num_local, ps)
  body = dataclasses.replace(call, plan=dataclasses.replace(plan, causal=False), context_axis=None)
  out, lse = op_local(body, q_nope, q_pe, ckv, kpe, table, local_len, kv_scale)
  if num_tail > 0 and block_table.shape[1] > 0 and num_local > 0:
    qn, qp = (q_nope[..., :plan.kv_lora_rank], q_nope[..., plan.kv_lora_rank:]) if is_packed(q_nope, plan) \
        else (q_nope, q_pe)
    out_t, lse_t = _tail(plan, qn, qp, ckv, kpe, block_table, lens, kv_scale, lo, num_tail)
    out, lse = merge_states(out.astype(jnp.float32), lse, out_t, lse_t)
  out, lse = merge_states_over_axis(out.astype(jnp.float32), lse, call.context_axis)
  out = jnp.where(valid[:, None, None, None], out, jnp.nan).astype(q_nope.dtype)
  return out, jnp.where(valid[:, None, None], lse, jnp.nan)


def sparse_decode_local(op_local, call, q_nope, q_pe, kv, indices, topk_lens, attn_sink, kv_scale):
  """One device's share of a context-parallel sparse decode: its own slots
  of every row of indices (global slots; the others become padding),
  merged over call.context_axis, then the sink applied once."""
  num_local, ps = kv.shape[0], kv.shape[1]
  lo, _ = local_pages(call.context_axis, num_local)
  first = lo * ps
  mine = (indices >= first) & (indices < first + num_local * ps)
  local = jnp.where(mine, indices - first, -1)
  body = dataclasses.replace(call, has_sink=False, context_axis=None)
  out, lse = op_local(body, q_nope, q_pe, kv, local, topk_lens, attn_sink, kv_scale)
  out, lse = merge_states_over_axis(out.astype(jnp.float32), lse, call.context_axis)
  if call.has_sink:
    # exp(lse) / (exp(lse) + exp(sink)), as on one device; 0 when lse = -inf.
    factor = jnp.where(jnp.isneginf(lse), 0.0, jax.nn.sigmoid(lse - attn_sink[None, None, :]))
    out = out * factor[..., None]
  return out.astype(q_nope.dtype), lse
