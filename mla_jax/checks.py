"""Run-time input checks the kernels cannot report themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from ._inputs import normalize
from .plan import DecodePlan


def _first(mask):
  """Index of the first True of a bool vector (0 if none)."""
  return jnp.argmax(mask)


def check_inputs(query, kv_cache, block_table, seq_lens, *, plan: DecodePlan, kv_scale=None):
  """Checks the data the kernels cannot validate at trace time.

  The kernels never read out of bounds: a bad request only turns its own
  output into NaN. This function says which request is bad and why, built on
  ``jax.experimental.checkify`` so it works under ``jax.jit``.

  Args: as :func:`mla_jax.paged_decode` (shapes and dtypes are validated the
    same way, at trace time).

  Returns:
    A ``checkify.Error``: ``err.get()`` is None when every request is valid,
    else a message naming the first bad request and the reason (negative
    length, length above ``max_pages_per_seq * page_size``, or a live page id
    outside ``[0, num_pages)``); ``err.throw()`` raises it.

  Raises:
    TypeError, ValueError: as :func:`mla_jax.paged_decode` for bad shapes.
  """
  inputs = normalize(query, kv_cache, block_table, seq_lens, plan, kv_scale)
  num_pages = inputs.ckv.shape[0]

  def checks(block_table, seq_lens):
    max_pages = block_table.shape[1]
    capacity = max_pages * plan.page_size
    neg = seq_lens < 0
    b = _first(neg)
    checkify.check(~jnp.any(neg), "request {b}: seq_lens[{b}] = {v} is negative",
                   b=b, v=seq_lens[b])
    long = seq_lens > capacity
    b = _first(long)
    checkify.check(~jnp.any(long),
                   "request {b}: seq_lens[{b}] = {v} exceeds max_pages_per_seq * page_size = {c}",
                   b=b, v=seq_lens[b], c=jnp.int32(capacity))
    live = jnp.arange(max_pages)[None, :] * plan.page_size < seq_lens[:, None]
    bad = live & ((block_table < 0) | (block_table >= num_pages))
    flat = _first(bad.reshape(-1))
    b, j = flat // max_pages, flat % max_pages
    checkify.check(~jnp.any(bad),
                   "request {b}: block_table[{b}, {j}] = {v} is outside [0, num_pages = {n})",
                   b=b, j=j, v=block_table[b, j], n=jnp.int32(num_pages))

  err, _ = jax.jit(checkify.checkify(checks))(inputs.block_table, inputs.seq_lens)
  return err
