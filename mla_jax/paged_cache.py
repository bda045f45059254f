"""What a serving loop needs around paged_decode: writing new latents into the
paged cache, converting CSR page metadata to a block table, and merging two
partial attention results by their LSEs.

Everything here is pure JAX, jittable, and runs on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import fp8_cache
from ._inputs import _as_array
from ._ragged import ragged_requests

_D_NOPE = fp8_cache.KV_LORA_RANK      # 512
_D_ROPE = fp8_cache.ROPE_DIM          # 64
_D_QK = _D_NOPE + _D_ROPE             # 576
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_CACHE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))


def _array(name, x):
  return jnp.asarray(_as_array(name, x))


def _int32(name, x, rank):
  x = _array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
  if x.ndim != rank:
    raise ValueError(f"{name}: expected rank {rank}, got shape {tuple(x.shape)}")
  return x.astype(jnp.int32)


def _cache_parts(kv_cache):
  """(parts, kind): the cache arrays [P, S, D_i] and 'packed', 'pair' or 'fp8_ds_mla'."""
  if isinstance(kv_cache, (tuple, list)):
    if len(kv_cache) != 2:
      raise ValueError(f"kv_cache: expected an array or a (ckv, kpe) pair, got {len(kv_cache)} items")
    ckv, kpe = _array("ckv", kv_cache[0]), _array("kpe", kv_cache[1])
    for name, x, d in (("ckv", ckv, _D_NOPE), ("kpe", kpe, _D_ROPE)):
      if x.ndim != 3 or x.shape[-1] != d:
        raise ValueError(f"{name}: expected [num_pages, page_size, {d}], got shape {tuple(x.shape)}")
    if ckv.shape[:2] != kpe.shape[:2] or ckv.dtype != kpe.dtype:
      raise ValueError(f"kv_cache: ckv {tuple(ckv.shape)} {ckv.dtype} and kpe {tuple(kpe.shape)} {kpe.dtype} "
                       "must agree in num_pages, page_size and dtype")
    if jnp.dtype(ckv.dtype) not in _CACHE_DTYPES:
      raise TypeError(f"ckv: expected dtype bfloat16, float16 or float8_e4m3fn, got {ckv.dtype}")
    return (ckv, kpe), "pair"
  kv = _array("kv_cache", kv_cache)
  if kv.ndim != 3:
    raise ValueError(f"kv_cache: expected rank 3 [num_pages, page_size, D], got shape {tuple(kv.shape)}")
  if jnp.dtype(kv.dtype) == jnp.dtype(jnp.uint8):
    if kv.shape[-1] != fp8_cache.ROW_BYTES:
      raise ValueError(f"kv_cache: a uint8 (fp8_ds_mla) cache has rows of {fp8_cache.ROW_BYTES} bytes, "
                       f"got shape {tuple(kv.shape)}")
    return (kv,), "fp8_ds_mla"
  if jnp.dtype(kv.dtype) not in _CACHE_DTYPES:
    raise TypeError(f"kv_cache: expected dtype bfloat16, float16, float8_e4m3fn or uint8 (fp8_ds_mla), "
                    f"got {kv.dtype}")
  if kv.shape[-1] != _D_QK:
    raise ValueError(f"kv_cache: expected last dimension {_D_QK} (ckv then kpe), got shape {tuple(kv.shape)}")
  return (kv,), "packed"


def _new_parts(new_kv, lead_rank):
  """(ckv [..., 512], kpe [..., 64]) of the new tokens; lead_rank = 2 ([B, Q]) or 1 ([T])."""
  want = "[B, Q, ...]" if lead_rank == 2 else "[T, ...] (with cu_seqlens_q)"
  if isinstance(new_kv, (tuple, list)):
    if len(new_kv) != 2:
      raise ValueError(f"new_kv: expected an array or a (ckv, kpe) pair, got {len(new_kv)} items")
    ckv, kpe = _array("new_kv ckv", new_kv[0]), _array("new_kv kpe", new_kv[1])
    for name, x, d in (("new_kv ckv", ckv, _D_NOPE), ("new_kv kpe", kpe, _D_ROPE)):
      if x.ndim != lead_rank + 1 or x.shape[-1] != d:
        raise ValueError(f"{name}: expected {want} with last dimension {d}, got shape {tuple(x.shape)}")
    if ckv.shape[:-1] != kpe.shape[:-1]:
      raise ValueError(f"new_kv: ckv {tuple(ckv.shape)} and kpe {tuple(kpe.shape)} differ in their token axes")
    if ckv.dtype != kpe.dtype:
      raise TypeError(f"new_kv: ckv dtype {ckv.dtype} and kpe dtype {kpe.dtype} differ")
  else:
    kv = _array("new_kv", new_kv)
    if kv.ndim != lead_rank + 1 or kv.shape[-1] != _D_QK:
      raise ValueError(f"new_kv: expected {want} with last dimension {_D_QK}, got shape {tuple(kv.shape)}")
    ckv, kpe = kv[..., :_D_NOPE], kv[..., _D_NOPE:]
  return ckv, kpe


def _encode(ckv, kpe, kind, cache_dtype, kv_scale, scale_format):
  """The new tokens' rows in the cache's encoding: a list matching the cache parts."""
  new_dtype = jnp.dtype(ckv.dtype)
  cache_dtype = jnp.dtype(cache_dtype)
  if kind == "fp8_ds_mla":
    if kv_scale is not None:
      raise TypeError("kv_scale: an fp8_ds_mla cache carries its own scales; pass kv_scale=None")
    if new_dtype not in _FLOAT_DTYPES:
      raise TypeError(f"new_kv: expected bfloat16, float16 or float32 for an fp8_ds_mla cache, got {new_dtype}")
    joined = jnp.concatenate([ckv, kpe.astype(ckv.dtype)], axis=-1)
    return [fp8_cache.quantize_latent_fp8(joined, scale_format=scale_format)]
  if cache_dtype == jnp.dtype(jnp.float8_e4m3fn) and new_dtype != cache_dtype:
    if kv_scale is None:
      raise TypeError("kv_scale: a float8_e4m3fn cache needs kv_scale to quantise new_kv of dtype "
                      f"{new_dtype} (or pass new_kv already in float8_e4m3fn)")
    if new_dtype not in _FLOAT_DTYPES:
      raise TypeError(f"new_kv: expected a float dtype, got {new_dtype}")
    scale = jnp.asarray(kv_scale, jnp.float32)
    if scale.shape != ():
      raise ValueError(f"kv_scale: expected a scalar, got shape {tuple(scale.shape)}")
    lim = jnp.float32(fp8_cache.FP8_MAX)  # e4m3fn has no infinity: saturate instead of turning into NaN
    ckv, kpe = (jnp.clip(x.astype(jnp.float32) / scale, -lim, lim).astype(cache_dtype) for x in (ckv, kpe))
  else:
    if kv_scale is not None:
      raise TypeError("kv_scale: new_kv is already in the cache's dtype " + str(cache_dtype) +
                      "; a scale only applies when quantising a float new_kv into a float8_e4m3fn cache")
    if new_dtype != cache_dtype:
      raise TypeError(f"new_kv: expected the cache's dtype {cache_dtype}, got {new_dtype}")
  if kind == "pair":
    return [ckv, kpe]
  return [jnp.concatenate([ckv, kpe], axis=-1)]


def _slots(positions, owner, block_table, num_pages, page_size):
  """Flat slot (page * page_size + slot) of each position, or num_pages * page_size
  (out of range, dropped by the scatter) where nothing may be written."""
  max_pages = block_table.shape[1]
  batch = block_table.shape[0]
  owner_ok = (owner >= 0) & (owner < batch)
  pos_ok = (positions >= 0) & (positions < max_pages * page_size)
  entry = jnp.clip(positions // page_size, 0, max_pages - 1)
  page = block_table[jnp.clip(owner, 0, batch - 1), entry]
  ok = owner_ok & pos_ok & (page >= 0) & (page < num_pages)
  flat = page.astype(jnp.int32) * page_size + positions % page_size
  return jnp.where(ok, flat, num_pages * page_size)


@functools.partial(jax.jit, static_argnames=("scale_format",))
def append_kv(kv_cache, new_kv, block_table, seq_lens, *, cu_seqlens_q=None, kv_scale=None,
              scale_format: str = "pow2"):
  """Writes new latent tokens into a paged cache.

  The convention is :func:`mla_jax.paged_decode`'s: ``seq_lens`` already
  counts the new tokens, so request b's token i of Q is written at position
  ``seq_lens[b] - Q + i``: page ``block_table[b, p // page_size]``, slot
  ``p % page_size``. Call it before the decode of the same step.

  Inside a jitted step, donate the cache (``jax.jit(step, donate_argnums=...)``)
  and the write happens in place; on its own, ``jax.jit(mla_jax.append_kv,
  donate_argnums=0)`` does the same.

  Args:
    kv_cache: packed ``[num_pages, page_size, 576]`` (bfloat16, float16 or
      float8_e4m3fn), a pair ``(ckv [P, S, 512], kpe [P, S, 64])``, or a uint8
      ``[P, S, 656]`` ``fp8_ds_mla`` cache (see :func:`quantize_latent_fp8`).
    new_kv: the new tokens' latents, ``[B, Q, 576]`` (or a ``(ckv, kpe)`` pair
      of ``[B, Q, 512]`` / ``[B, Q, 64]``); with ``cu_seqlens_q``, packed
      ``[T, 576]`` (or a pair of ``[T, 512]`` / ``[T, 64]``). The cache's dtype,
      or a float dtype to be quantised: into an ``fp8_ds_mla`` cache (with
      ``scale_format``, as :func:`quantize_latent_fp8`) or into a
      float8_e4m3fn cache (divided by ``kv_scale``, saturated at ±448).
    block_table: int32 ``[B, max_pages_per_seq]``.
    seq_lens: int32 ``[B]``: each request's length including its new tokens.
    cu_seqlens_q: optional int32 ``[B + 1]`` (FlashInfer's ``qo_indptr``,
      vLLM's ``query_start_loc``): request b's new tokens are rows
      ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of ``new_kv``.
    kv_scale: float32 scalar, only for quantising into a float8_e4m3fn cache.
    scale_format: "pow2" or "arbitrary", only for an ``fp8_ds_mla`` cache.

  Returns:
    The cache with the tokens written, in its dtype: an array, or a
    ``(ckv, kpe)`` tuple for a pair.

  Writes that cannot land are dropped, and nothing else changes: a position
  below 0 (``seq_lens[b]`` smaller than the request's new-token count) or at
  or past ``max_pages_per_seq * page_size``, a table entry outside
  ``[0, num_pages)``, and with ``cu_seqlens_q`` every token of a request
  whose range is not ``0 <= cu_seqlens_q[b] <= cu_seqlens_q[b + 1] <= T``
  or overlaps an earlier request's range, and every row no request holds.
  Two tokens mapped to the same slot (a page listed twice) leave one of
  them, unspecified which.

  Raises:
    TypeError, ValueError: at trace time, naming the argument, for a wrong
      dtype, rank or shape, or a ``kv_scale`` where none applies.
  """
  parts, kind = _cache_parts(kv_cache)
  block_table = _int32("block_table", block_table, 2)
  seq_lens = _int32("seq_lens", seq_lens, 1)
  num_pages, page_size = parts[0].shape[0], parts[0].shape[1]
  batch = block_table.shape[0]
  if seq_lens.shape[0] != batch:
    raise ValueError(f"seq_lens: expected [{batch}] (block_table's batch), got shape {tuple(seq_lens.shape)}")
  if block_table.shape[1] < 1:
    raise ValueError(f"block_table: needs at least one column, got shape {tuple(block_table.shape)}")
  if scale_format not in fp8_cache.SCALE_FORMATS:
    raise ValueError(f"scale_format must be one of {fp8_cache.SCALE_FORMATS}, got {scale_format!r}")

  if cu_seqlens_q is None:
    ckv, kpe = _new_parts(new_kv, lead_rank=2)
    if ckv.shape[0] != batch:
      raise ValueError(f"new_kv: expected batch {batch} (block_table's) at axis 0, got shape {tuple(ckv.shape)}")
    q = ckv.shape[1]
    owner = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, q)).reshape(-1)
    positions = (seq_lens[:, None] - q + jnp.arange(q, dtype=jnp.int32)[None, :]).reshape(-1)
    ckv, kpe = ckv.reshape((batch * q, _D_NOPE)), kpe.reshape((batch * q, _D_ROPE))
  else:
    ckv, kpe = _new_parts(new_kv, lead_rank=1)
    cu = _int32("cu_seqlens_q", cu_seqlens_q, 1)
    if cu.shape[0] != batch + 1:
      raise ValueError(f"cu_seqlens_q: expected [{batch + 1}] (block_table's batch + 1), got shape {tuple(cu.shape)}")
    tokens = ckv.shape[0]
    owner, _ = ragged_requests(cu, tokens)   # the same rule as paged_decode's ragged form
    starts, ends = cu[:-1], cu[1:]
    o = jnp.clip(owner, 0, batch - 1)
    t = jnp.arange(tokens, dtype=jnp.int32)
    positions = jnp.where(owner >= 0, seq_lens[o] - (ends[o] - starts[o]) + (t - starts[o]), -1)

  rows = _encode(ckv, kpe, kind, parts[0].dtype, kv_scale, scale_format)
  flat = _slots(positions, owner, block_table, num_pages, page_size)
  out = []
  for part, new in zip(parts, rows):
    width = part.shape[-1]
    written = part.reshape((num_pages * page_size, width)).at[flat].set(new.reshape((-1, width)), mode="drop")
    out.append(written.reshape(part.shape))
  return tuple(out) if kind == "pair" else out[0]


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages_per_seq"))
def block_table_from_csr(kv_indptr, kv_indices, kv_last_page_len, *, page_size: int, max_pages_per_seq: int):
  """FlashInfer / vLLM CSR page metadata to ``(block_table, seq_lens)``.

  Request b holds pages ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`` in
  order; its last page holds ``kv_last_page_len[b]`` tokens (1 to
  page_size), so its length is ``(n_b - 1) * page_size +
  kv_last_page_len[b]`` for n_b > 0 pages, and 0 for none.

  Args:
    kv_indptr: int32 ``[B + 1]``.
    kv_indices: int32 ``[nnz]`` page ids (nnz may exceed ``kv_indptr[B]``).
    kv_last_page_len: int32 ``[B]``.
    page_size: tokens per page (static).
    max_pages_per_seq: columns of the block table (static).

  Returns:
    ``block_table`` int32 ``[B, max_pages_per_seq]`` (unused entries -1) and
    ``seq_lens`` int32 ``[B]``, ready for :func:`mla_jax.paged_decode`.

  Requests the table cannot describe come out so that ``paged_decode``
  returns NaN for them (and :func:`mla_jax.check_inputs` names them): more
  than ``max_pages_per_seq`` pages keep their true length (above the table's
  capacity), and a malformed range (``kv_indptr`` decreasing, negative or
  past nnz) or ``kv_last_page_len`` outside ``[1, page_size]`` for a
  non-empty request gets length -1. Page ids are copied as given; one
  outside the cache gives NaN in the decode.

  Raises:
    TypeError, ValueError: at trace time for wrong dtypes, ranks or shapes.
  """
  indptr = _int32("kv_indptr", kv_indptr, 1)
  indices = _int32("kv_indices", kv_indices, 1)
  last = _int32("kv_last_page_len", kv_last_page_len, 1)
  batch = last.shape[0]
  if indptr.shape[0] != batch + 1:
    raise ValueError(f"kv_indptr: expected [{batch + 1}] (kv_last_page_len's batch + 1), got shape "
                     f"{tuple(indptr.shape)}")
  if page_size < 1 or max_pages_per_seq < 1:
    raise ValueError(f"page_size and max_pages_per_seq must be >= 1, got {page_size} and {max_pages_per_seq}")
  nnz = indices.shape[0]
  starts, ends = indptr[:-1], indptr[1:]
  n = ends - starts
  range_ok = (starts >= 0) & (n >= 0) & (ends <= nnz)
  last_ok = (n == 0) | ((last >= 1) & (last <= page_size))
  ok = range_ok & last_ok
  seq_lens = jnp.where(n > 0, (n - 1) * page_size + last, 0)
  seq_lens = jnp.where(ok, seq_lens, -1)
  j = jnp.arange(max_pages_per_seq, dtype=jnp.int32)[None, :]
  idx = starts[:, None] + j
  live = ok[:, None] & (j < n[:, None])
  if nnz == 0:
    block_table = jnp.full((batch, max_pages_per_seq), -1, jnp.int32)
  else:
    block_table = jnp.where(live, indices[jnp.clip(idx, 0, nnz - 1)], -1)
  return block_table.astype(jnp.int32), seq_lens.astype(jnp.int32)


@jax.jit
def merge_states(out_a, lse_a, out_b, lse_b):
  """Merges two partial attention results over disjoint key sets.

  With ``lse`` the natural-log sum of exponentiated scores of each part
  (what :func:`mla_jax.paged_decode` returns with ``return_lse=True``):

    lse = ln(e^lse_a + e^lse_b)
    out = (e^(lse_a - lse) out_a + e^(lse_b - lse) out_b)

  computed in float32 against the larger of the two LSEs (the split-KV
  combine of FlashDecoding, Dao et al. 2023). The LSEs are
  natural logarithms, as mla_jax returns them; base-2 LSEs (FlashInfer's
  kernels return those) must be multiplied by ln 2 first. Exact for empty
  parts: a part with lse -inf contributes nothing (whatever its out holds),
  and both empty give out 0, lse -inf. A NaN lse (an invalid request) gives
  NaN.

  Args:
    out_a, out_b: ``[..., D]`` of one shape (any float dtype).
    lse_a, lse_b: ``[...]``, out's shape without its last axis.

  Returns:
    ``(out, lse)``: out in the promoted dtype of out_a and out_b, lse
    float32.

  Raises:
    ValueError: shapes that do not match.
  """
  out_a, out_b = _array("out_a", out_a), _array("out_b", out_b)
  lse_a, lse_b = _array("lse_a", lse_a), _array("lse_b", lse_b)
  if out_a.shape != out_b.shape:
    raise ValueError(f"out_b: expected out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
  for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
    if out_a.ndim < 1 or lse.shape != out_a.shape[:-1]:
      raise ValueError(f"{name}: expected shape {tuple(out_a.shape[:-1])} (out without its last axis), "
                       f"got {tuple(lse.shape)}")
  la, lb = lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)
  m = jnp.maximum(la, lb)
  empty = m == -jnp.inf
  m_safe = jnp.where(empty, 0.0, m)
  wa, wb = jnp.exp(la - m_safe), jnp.exp(lb - m_safe)
  total = wa + wb
  lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(total))
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))

  def part(w, out):  # a part with weight exactly 0 adds 0, even where its out is NaN or Inf
    return jnp.where((w == 0.0)[..., None], 0.0, (w * inv)[..., None] * out.astype(jnp.float32))

  out = part(wa, out_a) + part(wb, out_b)
  return out.astype(jnp.promote_types(out_a.dtype, out_b.dtype)), lse
