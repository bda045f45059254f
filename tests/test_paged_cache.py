"""append_kv, block_table_from_csr and merge_states against NumPy loops, and
with paged_decode. Pure JAX: runs on every backend."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import reference_paged_decode, scattered_block_table

SM_SCALE = 1 / 192**0.5


def _append_np(cache, new, block_table, seq_lens, cu=None):
  """Reference: a Python loop over the tokens, writing only what may land."""
  out = cache.copy()
  num_pages, page_size = cache.shape[:2]
  batch, max_pages = block_table.shape
  if cu is None:
    q = new.shape[1]
    jobs = [(b, seq_lens[b] - q + i, new[b, i]) for b in range(batch) for i in range(q)]
  else:
    t_total = new.shape[0]
    jobs, prev_end = [], 0
    for b in range(batch):
      s, e = int(cu[b]), int(cu[b + 1])
      if not (0 <= s <= e <= t_total):
        continue
      if s >= prev_end:
        jobs += [(b, seq_lens[b] - (e - s) + (t - s), new[t]) for t in range(s, e)]
      prev_end = max(prev_end, e)
  for b, p, row in jobs:
    if p < 0 or p >= max_pages * page_size:
      continue
    page = block_table[b, p // page_size]
    if 0 <= page < num_pages:
      out[page, p % page_size] = row
  return out


def _case(rng, batch=5, q=2, page_size=16, max_pages=4, extra=3):
  lens = rng.integers(q, max_pages * page_size + 1, size=batch).astype(np.int32)
  block_table, num_pages = scattered_block_table(rng, lens, page_size, extra_pages=extra)
  block_table = np.pad(block_table, ((0, 0), (0, max_pages - block_table.shape[1])), constant_values=-1)
  cache = rng.standard_normal((num_pages, page_size, 576)).astype(np.float32)
  new = rng.standard_normal((batch, q, 576)).astype(np.float32)
  return cache, new, block_table, lens


def _poison(block_table, lens, q, page_size=16):
  """Bad entries of every kind, one request each; request 4 stays valid."""
  bt, sl = block_table.copy(), lens.copy()
  num_pages = bt.max() + 1
  sl[0] = q - 1                                       # first new token at position -1
  bt[1, (sl[1] - 1) // page_size] = -3                # last token's page negative
  bt[2, (sl[2] - q) // page_size] = num_pages + 7     # first token's page past the cache
  sl[3] = bt.shape[1] * page_size + 1                 # last token past the table
  return bt, sl


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("q", [1, 3])
def test_append_matches_loop(dtype, q):
  rng = np.random.default_rng(10 + q)
  cache, new, bt, lens = _case(rng, q=q)
  bt, lens = _poison(bt, lens, q)
  cache = np.asarray(jnp.asarray(cache, dtype).astype(jnp.float32))
  new = np.asarray(jnp.asarray(new, dtype).astype(jnp.float32))
  got = mla_jax.append_kv(jnp.asarray(cache, dtype), jnp.asarray(new, dtype), bt, lens)
  assert got.dtype == dtype and got.shape == cache.shape
  want = _append_np(cache, new, bt, lens)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
  for i in range(q):  # the valid request's tokens landed where the table says
    p = lens[4] - q + i
    np.testing.assert_array_equal(np.asarray(got[bt[4, p // 16], p % 16].astype(jnp.float32)), new[4, i])
  assert (want != cache).any(axis=-1).sum() < 5 * q  # and some of the others' did not


def test_append_pair_cache_and_pair_input():
  rng = np.random.default_rng(3)
  cache, new, bt, lens = _case(rng, q=2)
  c = jnp.asarray(cache, jnp.bfloat16)
  n = jnp.asarray(new, jnp.bfloat16)
  packed = mla_jax.append_kv(c, n, bt, lens)
  ckv, kpe = mla_jax.append_kv((c[..., :512], c[..., 512:]), (n[..., :512], n[..., 512:]), bt, lens)
  np.testing.assert_array_equal(np.asarray(jnp.concatenate([ckv, kpe], -1)), np.asarray(packed))
  mixed = mla_jax.append_kv(c, (n[..., :512], n[..., 512:]), bt, lens)
  np.testing.assert_array_equal(np.asarray(mixed), np.asarray(packed))


@pytest.mark.parametrize("cu", [
    [0, 1, 4, 4, 6, 8],       # ragged, an empty request
    [0, 2, 1, 5, 6, 8],       # request 1 decreasing; request 2 starts inside request 0: both dropped
    [0, 3, 3, 9, 9, 9],       # request 2 ends past T = 8: dropped
    [1, 2, 4, 6, 7, 7],       # row 0 and row 7 belong to no request
    [-1, 2, 4, 6, 7, 8],      # negative start
])
def test_append_ragged(cu):
  rng = np.random.default_rng(7)
  cache, _, bt, lens = _case(rng, q=3)
  new = rng.standard_normal((8, 576)).astype(np.float32)
  cu = np.asarray(cu, np.int32)
  c, n = jnp.asarray(cache, jnp.bfloat16), jnp.asarray(new, jnp.bfloat16)
  got = mla_jax.append_kv(c, n, bt, lens, cu_seqlens_q=cu)
  want = _append_np(np.asarray(c.astype(jnp.float32)), np.asarray(n.astype(jnp.float32)), bt, lens, cu)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


def test_append_ragged_equals_uniform_when_uniform():
  rng = np.random.default_rng(8)
  cache, new, bt, lens = _case(rng, q=2)
  c, n = jnp.asarray(cache, jnp.bfloat16), jnp.asarray(new, jnp.bfloat16)
  uniform = mla_jax.append_kv(c, n, bt, lens)
  ragged = mla_jax.append_kv(c, n.reshape(-1, 576), bt, lens, cu_seqlens_q=np.arange(0, 11, 2, dtype=np.int32))
  np.testing.assert_array_equal(np.asarray(ragged), np.asarray(uniform))


def test_append_fp8_dense_quantises_with_kv_scale_and_saturates():
  rng = np.random.default_rng(4)
  cache, new, bt, lens = _case(rng, q=2)
  new[0, 0, :4] = [1e6, -1e6, 0.0, 3.0]    # saturate at +-448 instead of becoming NaN
  scale = np.float32(0.05)
  c8 = jnp.asarray(cache).astype(jnp.float8_e4m3fn)
  got = mla_jax.append_kv(c8, jnp.asarray(new, jnp.float32), bt, lens, kv_scale=scale)
  q_new = np.clip(new / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  want = _append_np(np.asarray(c8.astype(jnp.float32)), q_new, bt, lens)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
  assert np.isfinite(np.asarray(got.astype(jnp.float32))).all()
  # Already-quantised tokens go in as they are.
  same = mla_jax.append_kv(c8, jnp.asarray(q_new).astype(jnp.float8_e4m3fn), bt, lens)
  np.testing.assert_array_equal(np.asarray(same.astype(jnp.float32)), want)


@pytest.mark.parametrize("scale_format", ["pow2", "arbitrary"])
def test_append_fp8_ds_mla_quantises_rows(scale_format):
  rng = np.random.default_rng(5)
  cache, new, bt, lens = _case(rng, q=2)
  c_u8 = mla_jax.quantize_latent_fp8(jnp.asarray(cache), scale_format=scale_format)
  n = jnp.asarray(new, jnp.bfloat16)
  got = mla_jax.append_kv(c_u8, n, bt, lens, scale_format=scale_format)
  rows = np.asarray(mla_jax.quantize_latent_fp8(n, scale_format=scale_format))
  want = _append_np(np.asarray(c_u8), rows, bt, lens)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_append_under_jit_with_donation_and_scan():
  rng = np.random.default_rng(6)
  cache, _, bt, lens = _case(rng, q=1)
  steps = 3
  news = jnp.asarray(rng.standard_normal((steps, 5, 1, 576)), jnp.bfloat16)
  base = jnp.asarray(lens - steps).clip(0)

  @jax.jit
  def run(c, news):
    def body(c, x):
      i, n = x
      return mla_jax.append_kv(c, n, bt, base + i + 1), None
    return jax.lax.scan(body, c, (jnp.arange(steps), news))[0]

  c0 = jnp.asarray(cache, jnp.bfloat16)
  want = np.asarray(c0.astype(jnp.float32))
  for i in range(steps):
    want = _append_np(want, np.asarray(news[i].astype(jnp.float32)), bt, np.asarray(base) + i + 1)
  np.testing.assert_array_equal(np.asarray(run(c0, news).astype(jnp.float32)), want)
  given = jnp.asarray(cache, jnp.bfloat16)
  donated = jax.jit(mla_jax.append_kv, donate_argnums=0)(given, news[0], bt, lens)
  want = _append_np(np.asarray(c0.astype(jnp.float32)), np.asarray(news[0].astype(jnp.float32)), bt, lens)
  np.testing.assert_array_equal(np.asarray(donated.astype(jnp.float32)), want)


def test_append_then_decode_equals_reference():
  rng = np.random.default_rng(9)
  q, heads, page_size = 2, 16, 16
  cache, new, bt, lens = _case(rng, q=q, page_size=page_size)
  c = jnp.asarray(cache, jnp.bfloat16)
  n = jnp.asarray(new, jnp.bfloat16)
  query = jnp.asarray(rng.standard_normal((5, q, heads, 576)), jnp.bfloat16)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE, q_len=q, causal=True)
  out, lse = jax.jit(lambda c: mla_jax.paged_decode(query, mla_jax.append_kv(c, n, bt, lens), bt, lens,
                                                    plan=plan, return_lse=True))(c)
  full = _append_np(np.asarray(c.astype(jnp.float32)), np.asarray(n.astype(jnp.float32)), bt, lens)
  ref_out, ref_lse = reference_paged_decode(np.asarray(query.astype(jnp.float32)), full, bt, lens, plan)
  rel = np.linalg.norm(np.asarray(out, np.float32) - ref_out) / np.linalg.norm(ref_out)
  assert rel < 1e-2
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("call,exc,match", [
    (lambda c, n, bt, sl: mla_jax.append_kv(c[..., :500], n, bt, sl), ValueError, "kv_cache: expected last dimension 576"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n[..., :500], bt, sl), ValueError, "new_kv: expected"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n[:3], bt, sl), ValueError, "new_kv: expected batch 5"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n, bt, sl[:3]), ValueError, "seq_lens: expected \\[5\\]"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n, bt.astype(np.float32), sl), TypeError, "block_table: expected an integer"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n.astype(jnp.float16), bt, sl), TypeError, "new_kv: expected the cache's dtype"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n, bt, sl, kv_scale=1.0), TypeError, "kv_scale"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c.astype(jnp.float8_e4m3fn), n, bt, sl), TypeError, "needs kv_scale"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n.reshape(-1, 576), bt, sl, cu_seqlens_q=np.zeros(5, np.int32)),
     ValueError, "cu_seqlens_q: expected \\[6\\]"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, n, bt, sl, cu_seqlens_q=np.zeros(6, np.int32)),
     ValueError, "with cu_seqlens_q"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c, (n[..., :512], n[..., 512:].astype(jnp.float16)), bt, sl),
     TypeError, "ckv dtype bfloat16 and kpe dtype float16 differ"),
    (lambda c, n, bt, sl: mla_jax.append_kv(c.astype(jnp.float8_e4m3fn), n.astype(jnp.float8_e4m3fn), bt, sl,
                                            kv_scale=1.0), TypeError, "already in the cache's dtype"),
])
def test_append_trace_time_errors(call, exc, match):
  rng = np.random.default_rng(1)
  cache, new, bt, lens = _case(rng, q=2)
  with pytest.raises(exc, match=match):
    call(jnp.asarray(cache, jnp.bfloat16), jnp.asarray(new, jnp.bfloat16), bt, lens)


def _csr_np(indptr, indices, last, page_size, max_pages):
  batch = len(last)
  bt = np.full((batch, max_pages), -1, np.int32)
  sl = np.zeros(batch, np.int32)
  for b in range(batch):
    s, e = int(indptr[b]), int(indptr[b + 1])
    n = e - s
    if s < 0 or n < 0 or e > len(indices) or (n > 0 and not 1 <= last[b] <= page_size):
      sl[b] = -1
      continue
    sl[b] = (n - 1) * page_size + last[b] if n > 0 else 0
    k = min(n, max_pages)
    bt[b, :k] = indices[s:s + k]
  return bt, sl


def test_block_table_from_csr_matches_loop_and_decodes():
  rng = np.random.default_rng(12)
  page_size, max_pages, heads = 16, 6, 16
  pages = rng.integers(0, max_pages + 1, size=7)
  pages[3] = 0
  indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
  num_pages = int(indptr[-1]) + 2
  indices = rng.permutation(num_pages)[:indptr[-1]].astype(np.int32)
  last = rng.integers(1, page_size + 1, size=7).astype(np.int32)
  last[3] = 0
  bt, sl = mla_jax.block_table_from_csr(indptr, indices, last, page_size=page_size, max_pages_per_seq=max_pages)
  want_bt, want_sl = _csr_np(indptr, indices, last, page_size, max_pages)
  np.testing.assert_array_equal(np.asarray(bt), want_bt)
  np.testing.assert_array_equal(np.asarray(sl), want_sl)
  kv = jnp.asarray(rng.standard_normal((num_pages, page_size, 576)), jnp.bfloat16)
  query = jnp.asarray(rng.standard_normal((7, heads, 576)), jnp.bfloat16)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE)
  out, lse = mla_jax.paged_decode(query, kv, bt, sl, plan=plan, return_lse=True)
  ref_out, ref_lse = reference_paged_decode(np.asarray(query.astype(jnp.float32))[:, None],
                                            np.asarray(kv.astype(jnp.float32)), want_bt, want_sl, plan)
  ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-2)
  assert np.isneginf(np.asarray(lse)[3]).all()   # the empty request


def test_block_table_from_csr_bad_metadata_gives_nan_in_decode():
  page_size, max_pages = 4, 2
  indptr = np.asarray([0, 3, 2, 4, 6, 9], np.int32)   # r0: 3 pages > max; r1 decreasing; r4 past nnz
  indices = np.arange(7, dtype=np.int32)
  last = np.asarray([2, 1, 5, 4, 1], np.int32)        # r2: last_page_len 5 > page_size
  bt, sl = mla_jax.block_table_from_csr(indptr, indices, last, page_size=page_size, max_pages_per_seq=max_pages)
  want_bt, want_sl = _csr_np(indptr, indices, last, page_size, max_pages)
  np.testing.assert_array_equal(np.asarray(bt), want_bt)
  np.testing.assert_array_equal(np.asarray(sl), [10, -1, -1, 8, -1])
  np.testing.assert_array_equal(np.asarray(sl), want_sl)
  rng = np.random.default_rng(0)
  kv = jnp.asarray(rng.standard_normal((8, page_size, 576)), jnp.bfloat16)
  query = jnp.asarray(rng.standard_normal((5, 16, 576)), jnp.bfloat16)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=page_size, sm_scale=SM_SCALE)
  _, lse = mla_jax.paged_decode(query, kv, bt, sl, plan=plan, return_lse=True)
  nan = np.isnan(np.asarray(lse)).all(axis=-1)
  np.testing.assert_array_equal(nan, [True, True, True, False, True])
  err = mla_jax.check_inputs(query, kv, bt, sl, plan=plan)
  assert "request 0" in err.get()


def test_block_table_from_csr_errors():
  with pytest.raises(ValueError, match="kv_indptr: expected \\[3\\]"):
    mla_jax.block_table_from_csr(np.zeros(4, np.int32), np.zeros(3, np.int32), np.ones(2, np.int32),
                                 page_size=4, max_pages_per_seq=2)
  with pytest.raises(TypeError, match="kv_indices: expected an integer"):
    mla_jax.block_table_from_csr(np.zeros(3, np.int32), np.zeros(3, np.float32), np.ones(2, np.int32),
                                 page_size=4, max_pages_per_seq=2)


def test_merge_states_splits_a_decode_exactly():
  # A request's pages in two halves, each decoded alone (q_len 1: the order
  # of positions does not matter), merged: the whole request's result.
  rng = np.random.default_rng(13)
  heads, page_size = 16, 16
  lens = np.asarray([130, 64, 17, 5], np.int32)
  bt, num_pages = scattered_block_table(rng, lens, page_size)
  kv = jnp.asarray(rng.standard_normal((num_pages, page_size, 576)), jnp.bfloat16)
  query = jnp.asarray(rng.standard_normal((4, heads, 576)), jnp.bfloat16)
  plan = mla_jax.DecodePlan(num_heads=heads, page_size=page_size, sm_scale=SM_SCALE)
  split = np.asarray([2, 4, 0, 1])                # pages in the first half; request 3's second half is empty
  first_len = np.minimum(split * page_size, lens).astype(np.int32)
  bt_a = np.where(np.arange(bt.shape[1])[None] < split[:, None], bt, -1).astype(np.int32)
  bt_b = np.full_like(bt, -1)
  for b in range(4):
    rest = bt[b, split[b]:]
    bt_b[b, :len(rest)] = rest
  run = lambda t, s: mla_jax.paged_decode(query, kv, t, s, plan=plan, return_lse=True)
  out_a, lse_a = run(bt_a, first_len)
  out_b, lse_b = run(bt_b, (lens - first_len).astype(np.int32))
  assert np.isneginf(np.asarray(lse_a)[2]).all() and np.isneginf(np.asarray(lse_b)[3]).all()
  out, lse = mla_jax.merge_states(out_a, lse_a, out_b, lse_b)
  ref_out, ref_lse = reference_paged_decode(np.asarray(query.astype(jnp.float32))[:, None],
                                            np.asarray(kv.astype(jnp.float32)), bt, lens, plan)
  ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  rel = np.linalg.norm(np.asarray(out, np.float32) - ref_out) / np.linalg.norm(ref_out)
  assert rel < 1e-2
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-3, rtol=1e-4)


def test_merge_states_empty_and_invalid_parts():
  inf, nan = np.inf, np.nan
  out_a = np.asarray([[1.0, 2.0], [nan, nan], [3.0, 4.0], [5.0, 6.0], [0.0, 0.0]], np.float32)
  lse_a = np.asarray([-inf, -inf, 0.5, nan, -inf], np.float32)
  out_b = np.asarray([[7.0, 8.0], [9.0, 1.0], [inf, inf], [1.0, 1.0], [0.0, 0.0]], np.float32)
  lse_b = np.asarray([0.25, 1.5, -inf, 0.0, -inf], np.float32)
  out, lse = mla_jax.merge_states(out_a, lse_a, out_b, lse_b)
  out, lse = np.asarray(out), np.asarray(lse)
  np.testing.assert_array_equal(out[0], [7.0, 8.0])      # a empty
  np.testing.assert_array_equal(out[1], [9.0, 1.0])      # a empty, its out NaN
  np.testing.assert_array_equal(out[2], [3.0, 4.0])      # b empty, its out Inf
  assert np.isnan(out[3]).all() and np.isnan(lse[3])     # an invalid part stays invalid
  np.testing.assert_array_equal(out[4], [0.0, 0.0])      # both empty
  np.testing.assert_array_equal(lse[[0, 1, 2, 4]], [0.25, 1.5, 0.5, -inf])


def test_merge_states_matches_float64_and_errors():
  rng = np.random.default_rng(14)
  out_a, out_b = rng.standard_normal((2, 3, 4, 8))
  lse_a, lse_b = rng.standard_normal((2, 3, 4)) * 30
  out, lse = mla_jax.merge_states(out_a.astype(np.float32), lse_a.astype(np.float32),
                                  out_b.astype(np.float32), lse_b.astype(np.float32))
  want_lse = np.logaddexp(lse_a, lse_b)
  want = np.exp(lse_a - want_lse)[..., None] * out_a + np.exp(lse_b - want_lse)[..., None] * out_b
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6)
  with pytest.raises(ValueError, match="lse_b: expected shape \\(3, 4\\)"):
    mla_jax.merge_states(out_a, lse_a, out_b, lse_b[:, :2])
  with pytest.raises(ValueError, match="out_b: expected out_a's shape"):
    mla_jax.merge_states(out_a, lse_a, out_b[..., :4], lse_b)
