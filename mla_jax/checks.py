"""Run-time input checks the kernels cannot report themselves."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ._inputs import normalize
from ._ragged import ragged_requests
from .paged_decode import ragged_inputs
from .plan import DecodePlan
from .xla_reference import bad_live_pages, capacity


def _canonical(x):
  """A host array or Python/NumPy scalar as jax would see it inside jit (so an
  int64 NumPy table with x64 off, or a plain float kv_scale, is accepted here
  exactly when paged_decode accepts it); device arrays pass unchanged."""
  return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic, int, float)) else x


def check_inputs(query, kv_cache, block_table, seq_lens, *, plan: DecodePlan, kv_scale=None,
                 cu_seqlens_q=None):
  """Checks the data the kernels cannot validate at trace time.

  The kernels never read out of bounds: a bad request only turns its own
  output into NaN. This function says which request is bad and why, built on
  ``jax.experimental.checkify`` so it works under ``jax.jit``.

  Args: as :func:`mla_jax.paged_decode` (shapes and dtypes are validated the
    same way, at trace time).

  Returns:
    A ``checkify.Error``: ``err.get()`` is None when every request is valid,
    else a message naming the first bad request (lowest index) and the reason
    (negative length, length above ``max_pages_per_seq * page_size``, or a
    live page id outside ``[0, num_pages)``, the first such entry; with
    ``cu_seqlens_q``, first a range outside the packed rows, decreasing or
    overlapping an earlier one, or more than ``plan.q_len`` tokens);
    ``err.throw()`` raises it.

  Raises:
    TypeError, ValueError: as :func:`mla_jax.paged_decode` for bad shapes.
  """
  block_table, seq_lens = _canonical(block_table), _canonical(seq_lens)
  kv_scale = None if kv_scale is None else _canonical(kv_scale)
  if cu_seqlens_q is not None:
    inputs, cu, tokens = ragged_inputs(query, kv_cache, block_table, seq_lens, _canonical(cu_seqlens_q), plan,
                                       kv_scale)
    err, _ = _ragged_checker(tokens, plan.q_len)(cu)
    if err.get() is not None:
      return err
  else:
    inputs = normalize(query, kv_cache, block_table, seq_lens, plan, kv_scale)
  err, _ = _paged_checker(inputs.ckv.shape[0], plan.page_size)(inputs.block_table, inputs.seq_lens)
  return err


# One jitted checker per static configuration, reused across calls: a serving
# loop that checks every step must not trace and compile a checker each time.
@functools.lru_cache(maxsize=64)
def _ragged_checker(tokens, q_len: int):
  return jax.jit(checkify.checkify(lambda cu: _check_ragged(cu, tokens, q_len)))


@functools.lru_cache(maxsize=64)
def _paged_checker(num_pages, page_size: int):

  def checks(block_table, seq_lens):
    batch, max_pages = block_table.shape
    if batch == 0:
      return
    cap = capacity(max_pages, page_size)
    neg = seq_lens < 0
    long = seq_lens > cap
    if max_pages:
      bad_page = bad_live_pages(block_table, seq_lens, num_pages, page_size)
    else:  # no table entries: any positive length is already too long
      bad_page = jnp.zeros((batch, 1), bool)
    bad = neg | long | jnp.any(bad_page, axis=1)
    b = jnp.argmax(bad)  # the first bad request (0 when none; then no check fails)
    j = jnp.argmax(bad_page[b])
    v = seq_lens[b]
    checkify.check(~(bad[b] & neg[b]), "request {b}: seq_lens[{b}] = {v} is negative", b=b, v=v)
    checkify.check(~(bad[b] & long[b]),
                   "request {b}: seq_lens[{b}] = {v} exceeds max_pages_per_seq * page_size = {c}",
                   b=b, v=v, c=jnp.int32(cap))
    page_id = block_table[b, j] if max_pages else jnp.int32(0)
    checkify.check(~(bad[b] & ~neg[b] & ~long[b]),
                   "request {b}: block_table[{b}, {j}] = {v} is outside [0, num_pages = {n})",
                   b=b, j=j, v=page_id, n=jnp.int32(num_pages))

  return jax.jit(checkify.checkify(checks))


def _check_ragged(cu, tokens: int, q_len: int):
  """The first request of cu_seqlens_q that paged_decode drops or turns into NaN."""
  batch = cu.shape[0] - 1
  if batch == 0:
    return
  _, kept = ragged_requests(cu, tokens)
  starts, ends = cu[:-1], cu[1:]
  in_range = (starts >= 0) & (starts <= ends) & (ends <= tokens)
  too_long = kept & (ends - starts > q_len)
  bad = ~kept | too_long
  b = jnp.argmax(bad)
  s, e = starts[b], ends[b]
  checkify.check(~(bad[b] & ~in_range[b]),
                 "request {b}: cu_seqlens_q[{b}:{b}+2] = ({s}, {e}) is not a range 0 <= start <= end <= T = {t}",
                 b=b, s=s, e=e, t=jnp.int32(tokens))
  checkify.check(~(bad[b] & in_range[b] & ~kept[b]),
                 "request {b}: cu_seqlens_q[{b}:{b}+2] = ({s}, {e}) overlaps an earlier request's rows", b=b, s=s, e=e)
  checkify.check(~(bad[b] & too_long[b]),
                 "request {b}: cu_seqlens_q gives it {n} query tokens, more than plan.q_len = {q}",
                 b=b, n=e - s, q=jnp.int32(q_len))
