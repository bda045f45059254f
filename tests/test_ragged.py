"""Per-request query lengths: paged_decode with cu_seqlens_q.

Every ragged result is checked against the float64 reference run request by
request with that request's own q_len, on fresh random data, for both
mappings onto the kernels (per-token at >= 64 heads, left-padded below) and
every backend; malformed metadata must give the documented NaN / empty rows
and never crash.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mla_jax
from mla_jax import _ragged
from mla_jax.testing import random_paged_inputs, reference_paged_decode

BACKENDS = ["auto", "cpu", "xla", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _cpu_kernel_on_a_cpu_device(request):
  """Backend "cpu" is the C++ CPU kernel, which runs on a CPU device only:
  its cases (a backend parameter "cpu", or none: those tests plan "cpu")
  make and run their arrays there, also on a GPU host."""
  spec = getattr(request.node, "callspec", None)
  backend = spec.params.get("backend", "cpu") if spec is not None else "cpu"
  if backend != "cpu":
    yield
    return
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def _case(seed, counts, lens, num_heads, page_size=16, spare_rows=2, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  d = random_paged_inputs(rng, lens, num_heads=num_heads, page_size=page_size)
  cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  tokens = int(cu[-1]) + spare_rows
  query = jnp.asarray(rng.standard_normal((tokens, num_heads, 576)), dtype)
  return query, jnp.asarray(d["kv_cache"], dtype), d["block_table"], d["seq_lens"], cu


def _reference(query, kv, bt, lens, cu, plan, kv_scale=1.0):
  """float64 (out [T, H, 512], lse [T, H]); rows no request holds: 0, -inf."""
  q = np.asarray(query, np.float64)
  kv = np.asarray(kv, np.float64)
  out = np.zeros(q.shape[:2] + (512,))
  lse = np.full(q.shape[:2], -np.inf)
  for b in range(len(lens)):
    n = int(cu[b + 1] - cu[b])
    if n == 0:
      continue
    p = mla_jax.DecodePlan(num_heads=plan.num_heads, page_size=plan.page_size, q_len=n, causal=plan.causal,
                           sm_scale=plan.sm_scale)
    o, l = reference_paged_decode(q[None, cu[b]:cu[b + 1]], kv, bt[b:b + 1], lens[b:b + 1], p, kv_scale)
    out[cu[b]:cu[b + 1]], lse[cu[b]:cu[b + 1]] = o[0], l[0]
  return out, lse


def _check(got, want):
  out, lse = (np.asarray(x, np.float32) for x in got)
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  np.testing.assert_allclose(out, want[0], atol=2e-2, rtol=0)
  np.testing.assert_allclose(lse, want[1], atol=1e-3, rtol=0)


def _plan(backend, heads, q_len, causal=True, page_size=16):
  return mla_jax.DecodePlan(num_heads=heads, page_size=page_size, q_len=q_len, causal=causal,
                            sm_scale=192 ** -0.5, backend=backend)


def _decode(plan, **kw):
  return jax.jit(lambda q, kv, bt, sl, cu: mla_jax.paged_decode(q, kv, bt, sl, plan=plan, cu_seqlens_q=cu,
                                                                return_lse=True, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_per_request_reference(backend, heads, causal):
  counts = [3, 1, 4, 0, 2, 4, 1]
  lens = [40, 17, 5, 64, 1, 3, 100]          # 5 and 3 < count: early tokens see little or nothing
  query, kv, bt, sl, cu = _case(heads + causal, counts, lens, heads)
  plan = _plan(backend, heads, 4, causal)
  got = _decode(plan)(query, kv, bt, sl, cu)
  assert got[0].shape == (query.shape[0], heads, 512) and got[1].shape == query.shape[:2]
  _check(got, _reference(query, kv, bt, sl, cu, plan))


@pytest.mark.parametrize("seed,backend", [(s, ["cpu", "xla", "auto"][s % 3]) for s in range(12)])
def test_random_ragged_cases(seed, backend):
  rng = np.random.default_rng(100 + seed)
  b = int(rng.integers(1, 9))
  q_len = int(rng.choice([1, 2, 3, 8]))
  heads = int(rng.choice([8, 16, 64, 128]))
  page_size = int(rng.choice([1, 4, 16, 64]))
  counts = rng.integers(0, q_len + 1, size=b)
  lens = rng.integers(0, 200, size=b)
  query, kv, bt, sl, cu = _case(seed, counts, lens, heads, page_size=page_size,
                                spare_rows=int(rng.integers(0, 3)))
  plan = _plan(backend, heads, q_len, causal=bool(seed % 2), page_size=page_size)
  _check(_decode(plan)(query, kv, bt, sl, cu), _reference(query, kv, bt, sl, cu, plan))


def test_uniform_counts_equal_the_uniform_call():
  """All counts == q_len: the same numbers as the [B, Q, H, D] call."""
  for heads in (16, 64):
    counts, lens = [2, 2, 2], [30, 2, 77]
    query, kv, bt, sl, cu = _case(3, counts, lens, heads, spare_rows=0)
    plan = _plan("cpu", heads, 2)
    got = _decode(plan)(query, kv, bt, sl, cu)
    want = mla_jax.paged_decode(query.reshape(3, 2, heads, 576), kv, bt, sl, plan=plan, return_lse=True)
    np.testing.assert_allclose(np.asarray(got[0], np.float32).reshape(3, 2, heads, 512),
                               np.asarray(want[0], np.float32), atol=1e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(got[1]).reshape(3, 2, heads), np.asarray(want[1]), atol=1e-4)


@pytest.mark.parametrize("heads", [16, 64])
def test_split_query_and_fp8_cache(heads):
  counts, lens = [1, 3, 2], [9, 40, 70]
  query, kv, bt, sl, cu = _case(4, counts, lens, heads)
  kv8 = jnp.asarray(np.asarray(kv, np.float32) / 4.0, jnp.float8_e4m3fn)
  plan = _plan("cpu", heads, 3)
  f = jax.jit(lambda q, kv, bt, sl, cu, s: mla_jax.paged_decode(q, kv, bt, sl, plan=plan, cu_seqlens_q=cu,
                                                                kv_scale=s, return_lse=True))
  got = f((query[..., :512], query[..., 512:]), (kv8[..., :512], kv8[..., 512:]), bt, sl, cu, jnp.float32(4.0))
  _check(got, _reference(query, np.asarray(kv8, np.float64) * 4.0, bt, sl, cu, plan))


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_malformed_cu_seqlens_give_nan_rows(heads, backend):
  """Rows of requests paged_decode drops (out of range, decreasing,
  overlapping) or cannot serve (more than q_len tokens, a bad length or
  page id) are NaN; rows no request holds are out 0, lse -inf; the good
  requests are unaffected."""
  rng = np.random.default_rng(5)
  lens = [20, 30, 40, 50, 60, 70, 80, 90]
  d = random_paged_inputs(rng, lens, num_heads=heads, page_size=16)
  kv = jnp.asarray(d["kv_cache"], jnp.bfloat16)
  bt, sl = d["block_table"].copy(), d["seq_lens"].copy()
  tokens = 18
  # req 0 (0, 2): good.  req 1 (2, 7): 5 tokens > q_len 4, NaN.
  # req 2 (7, 9): negative length, NaN.  req 3 (9, 8): decreasing, dropped (no rows).
  # req 4 (8, 11): starts inside req 2, dropped: rows 9-10 NaN (row 8 is req 2's).
  # req 5 (11, 12): a bad page id, NaN.  req 6 (12, 14): good.
  # req 7 (14, 20): past T = 18, dropped: rows 14-17 NaN.
  cu = np.array([0, 2, 7, 9, 8, 11, 12, 14, 20], np.int32)
  sl[2] = -5
  bt[5, 0] = 10_000
  query = jnp.asarray(rng.standard_normal((tokens, heads, 576)), jnp.bfloat16)
  plan = _plan(backend, heads, 4)
  out, lse = (np.asarray(x, np.float32) for x in _decode(plan)(query, kv, bt, sl, cu))
  nan_rows = list(range(2, 12)) + list(range(14, 18))
  assert np.isnan(out[nan_rows]).all() and np.isnan(lse[nan_rows]).all(), np.isnan(lse).all(axis=1)
  good = [0, 1, 12, 13]
  assert not np.isnan(out[good]).any() and not np.isnan(lse[good]).any()
  for rows, b in (([0, 1], 0), ([12, 13], 6)):
    want = _reference(query[rows[0]:rows[-1] + 1], kv, bt[b:b + 1], sl[b:b + 1], np.array([0, 2]), plan)
    np.testing.assert_allclose(out[rows], want[0], atol=2e-2, rtol=0)
    np.testing.assert_allclose(lse[rows], want[1], atol=1e-3, rtol=0)
  assert mla_jax.check_inputs(query, kv, bt, sl, plan=plan, cu_seqlens_q=cu).get() is not None


def test_rows_past_the_last_request_are_empty():
  query, kv, bt, sl, cu = _case(6, [2, 1], [10, 20], 16, spare_rows=5)
  out, lse = (np.asarray(x, np.float32) for x in _decode(_plan("cpu", 16, 2))(query, kv, bt, sl, cu))
  assert (out[3:] == 0).all() and np.isneginf(lse[3:]).all()


def test_check_inputs_names_the_request():
  query, kv, bt, sl, _ = _case(7, [1, 1, 1], [10, 20, 30], 16)
  plan = _plan("cpu", 16, 2)
  for cu, want in (([0, 1, 4, 5], "request 1: cu_seqlens_q gives it 3 query tokens"),
                   ([0, 2, 1, 3], "request 1: cu_seqlens_q[1:1+2] = (2, 1) is not a range"),
                   ([0, 2, 3, 9], "request 2: cu_seqlens_q[2:2+2] = (3, 9) is not a range"),
                   ([0, 2, 2, 3], None)):
    err = mla_jax.check_inputs(query, kv, bt, sl, plan=plan, cu_seqlens_q=np.array(cu, np.int32))
    msg = err.get()
    assert (msg is None) if want is None else (want in msg), (cu, msg)
  sl_bad = sl.copy()
  sl_bad[1] = -1
  msg = mla_jax.check_inputs(query, kv, bt, sl_bad, plan=plan, cu_seqlens_q=np.array([0, 1, 2, 3], np.int32)).get()
  assert "request 1: seq_lens[1] = -1 is negative" in msg


def test_trace_time_errors_name_the_argument():
  query, kv, bt, sl, cu = _case(8, [1, 2], [10, 20], 16)
  plan = _plan("cpu", 16, 2)
  with pytest.raises(ValueError, match=r"query: with cu_seqlens_q, expected a packed \[T, H, D\] query"):
    mla_jax.paged_decode(query[None], kv, bt, sl, plan=plan, cu_seqlens_q=cu)
  with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype int32"):
    mla_jax.paged_decode(query, kv, bt, sl, plan=plan, cu_seqlens_q=cu.astype(np.float32))
  with pytest.raises(ValueError, match=r"cu_seqlens_q: expected shape \(2 \+ 1,\)"):
    mla_jax.paged_decode(query, kv, bt, sl, plan=plan, cu_seqlens_q=cu[:2])
  with pytest.raises(ValueError, match="seq_lens"):
    mla_jax.paged_decode(query, kv, bt, sl[:1], plan=plan, cu_seqlens_q=cu)


def test_layout_rule_and_explain():
  assert _ragged.layout(_plan("auto", 64, 4)) == "per_token"
  assert _ragged.layout(_plan("auto", 32, 4)) == "padded"
  assert _ragged.layout(_plan("xla", 128, 4)) == "padded"
  sds = jax.ShapeDtypeStruct
  e = mla_jax.explain(_plan("cpu", 128, 4), sds((9, 128, 576), jnp.bfloat16), sds((10, 16, 576), jnp.bfloat16),
                      sds((3, 5), jnp.int32), sds((3,), jnp.int32), cu_seqlens_q=sds((4,), jnp.int32))
  assert "each of its 9 rows is a q_len-1 request" in str(e)


def test_heads_sharded():
  """A ragged call under jax.jit with the heads sharded over 8 devices."""
  query, kv, bt, sl, cu = _case(9, [2, 0, 3], [33, 5, 70], 64)
  plan = _plan("cpu", 64, 3)
  mesh = jax.make_mesh((8,), ("model",), devices=jax.devices("cpu")[:8])
  got = _decode(plan)(jax.device_put(query, NamedSharding(mesh, P(None, "model"))), kv, bt, sl, cu)
  _check(got, _reference(query, kv, bt, sl, cu, plan))
