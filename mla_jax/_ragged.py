"""Ragged queries for paged_decode: per-request query lengths under cu_seqlens_q.

Request b's query tokens are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1``
of a packed ``[T, H, D]`` query (FlashInfer's ``qo_indptr``, vLLM's
``query_start_loc``); ``plan.q_len`` is the largest count. Token i of a
request of n sees positions ``0 .. seq_len - n + i`` (causal) or all
``seq_len``. Two exact mappings onto the uniform op, chosen from static
facts (:func:`layout`):

* ``"per_token"`` (``num_heads >= 64``): every token is its own q_len-1
  request with the length it sees and its request's table row. The kernels
  tile a request's rows 64 at a time, so at 64 heads or more a token already
  fills its own row tiles and reads the latent tiles for them alone: this
  is the uniform path's work less the padding.
* ``"padded"`` (fewer heads, or the ``xla`` backend, whose gather is per
  request): each request is left-padded to ``[q_len]`` so that its tokens sit
  in the last n slots, where the uniform causal rule gives each exactly its
  own visible range; the padding rows are computed and dropped. With
  ``q_len * num_heads <= 64`` they share the one row tile a request needs
  anyway.

Malformed metadata never reads or writes out of bounds: request b is kept
when ``0 <= cu[b] <= cu[b+1] <= T`` and it starts at or after the end of
every earlier in-bounds request (so kept ranges are disjoint); a kept request
of more than ``q_len`` tokens, or one the uniform op rejects (a bad length
or page id), gives NaN rows; the rows of a request that is not kept (its
range clipped to ``[0, T)``) and held by no kept request give NaN; every other
row no request holds (past ``cu[B]``) gives out 0, lse -inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .xla_reference import request_validity

PER_TOKEN_MIN_HEADS = 64   # rows per token that fill one kernel row tile


def layout(plan) -> str:
  """"per_token" or "padded" (see the module docstring)."""
  return "per_token" if plan.num_heads >= PER_TOKEN_MIN_HEADS and plan.backend != "xla" else "padded"


def ragged_requests(cu, tokens: int):
  """(owner [T], kept [B]): the request holding each of ``tokens`` packed rows
  (-1 for none) and which requests are kept (see the module docstring)."""
  starts, ends = cu[:-1], cu[1:]
  batch = starts.shape[0]
  range_ok = (starts >= 0) & (starts <= ends) & (ends <= tokens)
  prev_end = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              jax.lax.cummax(jnp.where(range_ok, ends, 0))[:-1]])
  kept = range_ok & (starts >= prev_end)
  # +(b + 1) at each start, -(b + 1) at each end: the running sum is b + 1
  # inside request b's range and 0 elsewhere (kept ranges are disjoint).
  tag = jnp.arange(1, batch + 1, dtype=jnp.int32)
  owner = _range_sum(jnp.where(kept, starts, tokens), jnp.where(kept, ends, tokens), tag, tokens) - 1
  return owner, kept


def _range_sum(starts, ends, values, tokens: int):
  """[tokens]: the sum of values[b] over the ranges [starts[b], ends[b]) that
  cover each row (a range with start == tokens adds nothing)."""
  drop = tokens + 1
  marks = (jnp.zeros((tokens + 1,), jnp.int32)
           .at[jnp.where(starts < tokens, starts, drop)].add(values, mode="drop")
           .at[jnp.where(starts < tokens, ends, drop)].add(-values, mode="drop"))
  return jnp.cumsum(marks)[:tokens]


def _row_status(cu, tokens: int, q_len: int):
  """(owner [T] clipped to [0, B), counts [B], good_row [T], nan_row [T])."""
  starts, ends = cu[:-1], cu[1:]
  batch = starts.shape[0]
  owner, kept = ragged_requests(cu, tokens)
  counts = ends - starts
  good_request = kept & (counts <= q_len)
  o = jnp.clip(owner, 0, batch - 1)
  good_row = (owner >= 0) & good_request[o]
  # Rows of a request not kept, clipped to the packed rows, unless a kept
  # request holds them; and every row of a kept request that is too long.
  lo, hi = jnp.clip(starts, 0, tokens), jnp.clip(ends, 0, tokens)
  dropped = _range_sum(jnp.where(kept, tokens, lo), jnp.maximum(lo, hi),
                       jnp.ones((batch,), jnp.int32), tokens) > 0
  nan_row = ((owner < 0) & dropped) | ((owner >= 0) & ~good_request[o])
  return o, counts, good_row, nan_row


def ragged_paged_decode(run_uniform, plan, q_nope, q_pe, block_table, seq_lens, cu, num_pages: int):
  """(out [T, H, dv], lse [T, H]) of a ragged call.

  run_uniform(plan, query, block_table, seq_lens) -> (out, lse): the uniform
  op on the same cache, for a [B', Q, H, *] query pair (or [B', H, *] with
  plan.q_len 1). q_nope, q_pe: [T, H, *] (the packed query passed twice).
  """
  tokens, q_len = q_nope.shape[0], plan.q_len
  batch = block_table.shape[0]
  if batch == 0:  # no request holds any row
    dv = plan.kv_lora_rank
    return (jnp.zeros((tokens, plan.num_heads, dv), q_nope.dtype),
            jnp.full((tokens, plan.num_heads), -jnp.inf, jnp.float32))
  owner, counts, good_row, nan_row = _row_status(cu, tokens, q_len)
  starts = cu[:-1]
  t = jnp.arange(tokens, dtype=jnp.int32)
  i = t - starts[owner]                                   # position of the row in its request
  n = counts[owner]

  if layout(plan) == "per_token":
    # Each row is a q_len-1 request with the length it sees and its
    # request's table row; -1 (NaN) for rows of bad requests, 0 (out 0, lse
    # -inf) for rows no request holds.
    lens = seq_lens[owner]
    ok = request_validity(block_table, seq_lens, num_pages, plan.page_size)[owner]
    seen = jnp.maximum(lens - n + i + 1, 0) if plan.causal else lens
    row_lens = jnp.where(good_row & ok, seen, jnp.where(good_row | nan_row, -1, 0))
    table = jnp.take(block_table, owner, axis=0, mode="clip")
    one = dataclasses.replace(plan, q_len=1)
    q = (q_nope, q_pe) if q_nope is not q_pe else q_nope
    return run_uniform(one, q, table, row_lens.astype(jnp.int32))

  # Left-padded: slot j of request b holds its token j - (q_len - n_b).
  j = jnp.arange(q_len, dtype=jnp.int32)[None, :]
  pad = q_len - counts[:, None]
  src = jnp.clip(starts[:, None] + j - pad, 0, max(tokens - 1, 0))          # [B, Q]
  live = (j >= pad) & (counts[:, None] <= q_len)

  def to_padded(x):
    if tokens == 0:
      return jnp.zeros((batch, q_len) + x.shape[1:], x.dtype)
    return jnp.where(live[..., None, None], jnp.take(x, src, axis=0, mode="clip"), jnp.zeros((), x.dtype))

  q = to_padded(q_nope) if q_nope is q_pe else (to_padded(q_nope), to_padded(q_pe))
  out_p, lse_p = run_uniform(plan, q, block_table, seq_lens)                    # [B, Q, H, dv], [B, Q, H]
  slot = jnp.clip(q_len - n + i, 0, q_len - 1)
  out = out_p[owner, slot]
  lse = lse_p[owner, slot]
  out = jnp.where(good_row[:, None, None], out, jnp.where(nan_row[:, None, None], jnp.nan, 0.0)).astype(out.dtype)
  lse = jnp.where(good_row[:, None], lse, jnp.where(nan_row[:, None], jnp.nan, -jnp.inf))
  return out, lse
