"""Errors and compilation behaviour of mla_jax.paged_decode.

* trace-time errors for every argument (rank, shape, dtype, plan mismatch),
  each naming the argument;
* DecodePlan validation;
* autodiff is refused (inference-only);
* no recompilation when only the values of seq_lens / block_table change,
  and equal plans share one executable;
* check_inputs names the bad request;
* the compiled HLO of the kernel backends moves no data (no copy, slice,
  concatenate, ...): the query and cache buffers go to the custom call as is.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import random_paged_inputs

DN, DR = 512, 64
D = DN + DR
B, Q, H, S = 2, 2, 4, 16


def plan_(**kw):
  args = dict(num_heads=H, page_size=S, sm_scale=0.1, q_len=Q, backend="xla")
  args.update(kw)
  return mla_jax.DecodePlan(**args)


def good_inputs(seed=0, q_len=Q, num_heads=H, page_size=S, seq_lens=(5, 20), dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  d = random_paged_inputs(rng, list(seq_lens), num_heads=num_heads, page_size=page_size,
                          q_len=q_len)
  return dict(query=d["query"].astype(dtype), kv_cache=d["kv_cache"].astype(dtype),
              block_table=d["block_table"], seq_lens=d["seq_lens"])


def call(inputs, plan=None, **kwargs):
  plan = plan_() if plan is None else plan
  return mla_jax.paged_decode(inputs["query"], inputs["kv_cache"], inputs["block_table"],
                              inputs["seq_lens"], plan=plan, **kwargs)


def split(x):
  return (np.ascontiguousarray(x[..., :DN]), np.ascontiguousarray(x[..., DN:]))


def test_good_inputs_pass():
  """Positive control for the cases below: the unmutated inputs are accepted."""
  inp = good_inputs()
  for q in (inp["query"], split(inp["query"])):
    for kv in (inp["kv_cache"], split(inp["kv_cache"])):
      out = call(dict(inp, query=q, kv_cache=kv))
      chex.assert_shape(out, (B, Q, H, DN))


# --- trace-time argument errors -------------------------------------------------
# Each case: a function (inputs -> inputs) breaking one argument, the
# expected exception and a regex that must name the argument.
bf16 = jnp.bfloat16


def _q(f):
  return lambda i: dict(i, query=f(i["query"]))


def _qt(f):
  return lambda i: dict(i, query=f(*split(i["query"])))


def _kv(f):
  return lambda i: dict(i, kv_cache=f(i["kv_cache"]))


def _kvt(f):
  return lambda i: dict(i, kv_cache=f(*split(i["kv_cache"])))


ARG_ERRORS = {
    # packed query
    "query_rank2": (_q(lambda q: q[:, 0, 0]), ValueError, r"^query: expected rank 3 .* or 4"),
    "query_rank5": (_q(lambda q: q[None]), ValueError, r"^query: expected rank 3"),
    "query_last_dim": (_q(lambda q: q[..., :DN]), ValueError, r"^query: expected last dimension 576"),
    "query_heads": (_q(lambda q: q[:, :, :3]), ValueError, r"^query: expected H = plan.num_heads = 4"),
    "query_q_len": (_q(lambda q: np.concatenate([q, q[:, :1]], 1)), ValueError,
                    r"^query: expected Q = plan.q_len = 2"),
    "query_rank3_needs_q_len_1": (_q(lambda q: q[:, 0]), ValueError,
                                  r"^query: plan.q_len=2 needs a \[B, Q, H, D\] query"),
    "query_float32": (_q(lambda q: q.astype(np.float32)), TypeError,
                      r"^query: expected dtype one of \(bfloat16, float16\), got float32"),
    "query_fp8": (_q(lambda q: q.astype(jnp.float8_e4m3fn)), TypeError, r"^query: expected dtype"),
    # jax.jit itself rejects a non-array leaf, naming the argument's path.
    "query_not_array": (_q(lambda q: "q"), TypeError, r"passed to the function at path query"),
    "query_three_items": (_q(lambda q: split(q) + (q,)), ValueError,
                          r"^query: expected an array or a \(q_nope, q_pe\) pair, got 3"),
    # (q_nope, q_pe)
    "q_nope_last_dim": (_qt(lambda n, p: (n[..., :DN - 1], p)), ValueError,
                        r"^q_nope: expected last dimension 512"),
    "q_pe_last_dim": (_qt(lambda n, p: (n, p[..., :DR // 2])), ValueError,
                      r"^q_pe: expected last dimension 64"),
    "q_nope_q_pe_disagree": (_qt(lambda n, p: (n, p[:1])), ValueError,
                             r"^q_nope \(2, 2, 4, 512\) and q_pe \(1, 2, 4, 64\) must agree"),
    "q_nope_q_pe_dtypes": (_qt(lambda n, p: (n, p.astype(np.float16))), TypeError,
                           r"^q_nope and q_pe dtypes differ"),
    "q_nope_float32": (_qt(lambda n, p: (n.astype(np.float32), p.astype(np.float32))), TypeError,
                       r"^q_nope: expected dtype"),
    "q_nope_rank5": (_qt(lambda n, p: (n[None], p[None])), ValueError, r"^q_nope: expected rank 3"),
    "q_nope_heads": (_qt(lambda n, p: (n[:, :, :2], p[:, :, :2])), ValueError,
                     r"^q_nope: expected H = plan.num_heads"),
    "q_nope_q_len": (_qt(lambda n, p: (n[:, :1], p[:, :1])), ValueError,
                     r"^q_nope: expected Q = plan.q_len"),
    # A Python scalar becomes a rank-0 tracer under jit.
    "q_pe_scalar": (_qt(lambda n, p: (n, 3.0)), ValueError,
                    r"^q_pe: expected last dimension 64, got shape \(\)"),
    "query_rank0": (_q(lambda q: q[0, 0, 0, 0]), ValueError,
                    r"^query: expected last dimension 576, got shape \(\)"),
    # packed cache
    "kv_cache_rank2": (_kv(lambda c: c[0]), ValueError, r"^kv_cache: expected rank 3"),
    "kv_cache_rank4": (_kv(lambda c: c[None]), ValueError, r"^kv_cache: expected rank 3"),
    "kv_cache_last_dim": (_kv(lambda c: c[..., :DN]), ValueError,
                          r"^kv_cache: expected last dimension 576"),
    "kv_cache_page_size": (_kv(lambda c: c[:, :8]), ValueError,
                           r"^kv_cache: expected page_size = plan.page_size = 16"),
    "kv_cache_dtype_mismatch": (_kv(lambda c: c.astype(np.float16)), TypeError,
                                r"^kv_cache: expected dtype bfloat16 \(the query dtype\), got float16"),
    "kv_cache_float32": (_kv(lambda c: c.astype(np.float32)), TypeError, r"^kv_cache: expected dtype"),
    "kv_cache_fp8_without_scale": (_kv(lambda c: c.astype(jnp.float8_e4m3fn)), TypeError,
                                   r"^kv_cache: a float8_e4m3fn cache needs kv_scale="),
    "kv_cache_rank0": (_kv(lambda c: c[0, 0, 0]), ValueError,
                       r"^kv_cache: expected last dimension 576, got shape \(\)"),
    "kv_cache_one_item": (_kv(lambda c: (c,)), ValueError,
                          r"^kv_cache: expected an array or a \(ckv, kpe\) pair, got 1"),
    # (ckv, kpe)
    "ckv_last_dim": (_kvt(lambda c, k: (np.concatenate([c, k], -1), k)), ValueError,
                     r"^ckv: expected last dimension 512"),
    "kpe_last_dim": (_kvt(lambda c, k: (c, k[..., :63])), ValueError,
                     r"^kpe: expected last dimension 64"),
    "ckv_kpe_disagree": (_kvt(lambda c, k: (c, k[:-1])), ValueError,
                         r"^ckv \(\d+, 16, 512\) and kpe \(\d+, 16, 64\) must agree"),
    "ckv_kpe_dtypes": (_kvt(lambda c, k: (c, k.astype(np.float16))), TypeError,
                       r"^ckv and kpe dtypes differ"),
    "ckv_rank2": (_kvt(lambda c, k: (c.reshape(-1, DN), k.reshape(-1, DR))), ValueError,
                  r"^ckv: expected rank 3"),
    "ckv_page_size": (_kvt(lambda c, k: (c[:, :4], k[:, :4])), ValueError,
                      r"^ckv: expected page_size = plan.page_size = 16"),
    "ckv_dtype": (_kvt(lambda c, k: (c.astype(np.float16), k.astype(np.float16))), TypeError,
                  r"^ckv: expected dtype bfloat16"),
    "kpe_not_array": (_kvt(lambda c, k: (c, [1.0])), TypeError, r"^kpe: expected a jax or numpy"),
    # block_table
    "block_table_float": (lambda i: dict(i, block_table=i["block_table"].astype(np.float32)),
                          TypeError, r"^block_table: expected dtype int32, got float32"),
    "block_table_int16": (lambda i: dict(i, block_table=i["block_table"].astype(np.int16)),
                          TypeError, r"^block_table: expected dtype"),
    "block_table_uint32": (lambda i: dict(i, block_table=i["block_table"].astype(np.uint32)),
                           TypeError, r"^block_table: expected dtype"),
    "block_table_rank1": (lambda i: dict(i, block_table=i["block_table"][0]), ValueError,
                          r"^block_table: expected rank 2"),
    "block_table_rank3": (lambda i: dict(i, block_table=i["block_table"][None]), ValueError,
                          r"^block_table: expected rank 2"),
    "block_table_batch": (lambda i: dict(i, block_table=i["block_table"][:1]), ValueError,
                          r"^block_table: expected B = 2 rows"),
    "block_table_list": (lambda i: dict(i, block_table=i["block_table"].tolist()), TypeError,
                         r"^block_table: expected a jax or numpy array"),
    # seq_lens
    "seq_lens_float": (lambda i: dict(i, seq_lens=i["seq_lens"].astype(np.float32)), TypeError,
                       r"^seq_lens: expected dtype int32, got float32"),
    "seq_lens_uint32": (lambda i: dict(i, seq_lens=i["seq_lens"].astype(np.uint32)), TypeError,
                        r"^seq_lens: expected dtype"),
    "seq_lens_rank0": (lambda i: dict(i, seq_lens=i["seq_lens"][0]), ValueError,
                       r"^seq_lens: expected rank 1"),
    "seq_lens_rank2": (lambda i: dict(i, seq_lens=i["seq_lens"][:, None]), ValueError,
                       r"^seq_lens: expected rank 1"),
    "seq_lens_batch": (lambda i: dict(i, seq_lens=np.concatenate([i["seq_lens"]] * 2)), ValueError,
                       r"^seq_lens: expected shape \(2,\)"),
}


@pytest.mark.parametrize("name", sorted(ARG_ERRORS))
def test_argument_errors(name):
  mutate, exc, match = ARG_ERRORS[name]
  bad = mutate(good_inputs())
  with pytest.raises(exc, match=match):
    call(bad)


@pytest.mark.parametrize("name", ["query_heads", "kv_cache_page_size", "seq_lens_batch",
                                  "q_nope_q_pe_dtypes"])
def test_argument_errors_under_outer_jit(name):
  """The same errors surface when paged_decode is traced inside a user's jit."""
  mutate, exc, match = ARG_ERRORS[name]
  bad = mutate(good_inputs())
  f = jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan_()))
  with pytest.raises(exc, match=match):
    f(bad["query"], bad["kv_cache"], bad["block_table"], bad["seq_lens"])


def test_int64_tables_rejected_with_x64():
  """With x64 enabled int64 block_table / seq_lens are not silently accepted."""
  inp = good_inputs()
  with jax.enable_x64(True):
    with pytest.raises(TypeError, match=r"^block_table: expected dtype int32, got int64"):
      call(dict(inp, block_table=inp["block_table"].astype(np.int64)))
    with pytest.raises(TypeError, match=r"^seq_lens: expected dtype int32, got int64"):
      call(dict(inp, seq_lens=inp["seq_lens"].astype(np.int64)))


@pytest.mark.parametrize("field,value,match", [
    ("num_heads", 8, r"^query: expected H = plan.num_heads = 8"),
    ("page_size", 32, r"^kv_cache: expected page_size = plan.page_size = 32"),
    ("q_len", 4, r"^query: expected Q = plan.q_len = 4"),
    ("q_len", 1, r"^query: expected Q = plan.q_len = 1"),
])
def test_plan_mismatch(field, value, match):
  with pytest.raises(ValueError, match=match):
    call(good_inputs(), plan=plan_(**{field: value}))


def test_plan_not_a_decode_plan():
  with pytest.raises(TypeError, match=r"^plan: expected mla_jax.DecodePlan, got str"):
    call(good_inputs(), plan="xla")


# --- kv_scale -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kv_scale_with_non_fp8_cache(dtype):
  inp = good_inputs(dtype=dtype)
  with pytest.raises(TypeError, match=r"^kv_scale: only valid with a float8_e4m3fn cache, got a "
                     + jnp.dtype(dtype).name):
    call(inp, kv_scale=np.float32(1.0))


@pytest.mark.parametrize("scale,exc,match", [
    (np.ones((2,), np.float32), ValueError, r"^kv_scale: expected a float32 scalar, got shape \(2,\)"),
    (np.float16(1.0), TypeError, r"^kv_scale: expected dtype float32, got float16"),
])
def test_kv_scale_bad(scale, exc, match):
  inp = good_inputs()
  inp["kv_cache"] = inp["kv_cache"].astype(jnp.float8_e4m3fn)
  with pytest.raises(exc, match=match):
    call(inp, kv_scale=scale)


# --- DecodePlan validation ------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    (dict(page_size=3), ValueError, r"page_size must be a power of two, got 3"),
    (dict(page_size=48), ValueError, r"page_size must be a power of two, got 48"),
    (dict(page_size=0), ValueError, r"page_size must be in \[1, 256\], got 0"),
    (dict(page_size=512), ValueError, r"page_size must be in \[1, 256\], got 512"),
    (dict(page_size=16.0), TypeError, r"page_size must be an int"),
    (dict(num_heads=0), ValueError, r"num_heads must be in \[1, 128\], got 0"),
    (dict(num_heads=129), ValueError, r"num_heads must be in \[1, 128\], got 129"),
    (dict(num_heads=True), TypeError, r"num_heads must be an int, got bool"),
    (dict(q_len=9), ValueError, r"q_len must be in \[1, 8\], got 9"),
    (dict(q_len=0), ValueError, r"q_len must be in \[1, 8\], got 0"),
    (dict(backend="tpu"), ValueError, r"backend must be one of .*'tpu'"),
    (dict(backend="CUDA"), ValueError, r"backend must be one of .*'CUDA'"),
    (dict(sm_scale=0.0), ValueError, r"sm_scale must be finite and > 0"),
    (dict(sm_scale=-1.0), ValueError, r"sm_scale must be finite and > 0"),
    (dict(sm_scale=float("nan")), ValueError, r"sm_scale must be finite and > 0"),
    (dict(sm_scale=float("inf")), ValueError, r"sm_scale must be finite and > 0"),
    (dict(sm_scale="0.1"), TypeError, r"sm_scale must be a float"),
    (dict(sm_scale=1e39), ValueError, r"sm_scale must be finite and > 0 in float32"),   # inf in f32
    (dict(sm_scale=1e-50), ValueError, r"sm_scale must be finite and > 0 in float32"),  # 0 in f32
    (dict(num_heads=np.float32(4)), TypeError, r"num_heads must be an int, got float32"),
    (dict(num_heads=np.bool_(True)), TypeError, r"num_heads must be an int, got bool"),
    (dict(causal=1), TypeError, r"causal must be a bool"),
    (dict(max_num_splits=0), ValueError, r"max_num_splits must be in"),
])
def test_plan_validation(kw, exc, match):
  with pytest.raises(exc, match=r"DecodePlan\." + match):
    plan_(**kw)


@pytest.mark.parametrize("kw", [dict(num_heads=1), dict(num_heads=128), dict(page_size=1),
                                dict(page_size=256), dict(q_len=1), dict(q_len=8),
                                dict(backend="auto"), dict(backend="cuda"), dict(backend="cpu"),
                                dict(max_num_splits=4), dict(sm_scale=1)])
def test_plan_valid_extremes(kw):
  plan = plan_(**kw)
  assert isinstance(plan.sm_scale, float)
  assert plan == plan_(**kw) and hash(plan) == hash(plan_(**kw))


def test_plan_accepts_numpy_scalars():
  # NumPy scalars (e.g. from a config array) are stored as Python numbers, so
  # the plan equals and hashes like the one built from Python numbers.
  plan = plan_(num_heads=np.int64(H), page_size=np.int32(S), sm_scale=np.float32(0.125),
               max_num_splits=np.int64(3))
  assert plan == plan_(sm_scale=0.125, max_num_splits=3)
  assert hash(plan) == hash(plan_(sm_scale=0.125, max_num_splits=3))
  assert type(plan.num_heads) is int and type(plan.sm_scale) is float
  sparse = mla_jax.SparseDecodePlan(num_heads=np.int64(4), page_size=64, sm_scale=np.float64(0.1),
                                    topk=np.int32(8))
  assert sparse == mla_jax.SparseDecodePlan(num_heads=4, page_size=64, sm_scale=0.1, topk=8)


# --- autodiff ---------------------------------------------------------------------
def test_grad_is_refused():
  inp = good_inputs()
  kv = jnp.asarray(inp["kv_cache"])

  def loss(q, kv):
    out = call(dict(inp, query=q, kv_cache=kv))
    return out.astype(jnp.float32).sum()

  q = jnp.asarray(inp["query"])
  for argnums in (0, 1):
    with pytest.raises(TypeError, match="inference-only"):
      jax.grad(loss, argnums=argnums)(q, kv)
  with pytest.raises(TypeError, match="inference-only"):
    jax.jvp(lambda q: call(dict(inp, query=q)), (q,), (q,))
  # The message's advice works: stop_gradient'ed inputs differentiate fine.
  g = jax.grad(lambda q, kv: loss(jax.lax.stop_gradient(q), kv) * 0 + q.astype(jnp.float32).sum())(q, kv)
  chex.assert_trees_all_equal(g, jnp.ones_like(q))


# --- compilation cache ------------------------------------------------------------
def test_no_recompile_when_values_change():
  """New seq_lens / block_table values (same shapes) reuse the executable."""
  plan = plan_(num_heads=3, page_size=8, q_len=1, backend="cpu")
  inp = good_inputs(seed=1, q_len=1, num_heads=3, page_size=8, seq_lens=(9, 1, 30))
  cpu = jax.devices("cpu")[0]
  q, kv, bt0, sl0 = jax.device_put((inp["query"][:, 0], inp["kv_cache"], inp["block_table"],
                                     inp["seq_lens"]), cpu)
  traces = []

  @jax.jit
  def wrapped(q, kv, bt, sl):
    traces.append(1)  # runs once per trace
    return mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True)

  num_pages, width = kv.shape[0], bt0.shape[1]
  rng = np.random.default_rng(0)
  before = mla_jax.paged_decode._cache_size()
  lses = []
  for _ in range(4):
    bt = jax.device_put(rng.integers(0, num_pages, size=(3, width), dtype=np.int32), cpu)
    sl = jax.device_put(rng.integers(0, width * 8 + 1, size=3).astype(np.int32), cpu)
    lses.append(np.asarray(wrapped(q, kv, bt, sl)[1]))
    mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True)
  assert len(traces) == 1, f"traced {len(traces)} times"
  assert wrapped._cache_size() == 1
  assert mla_jax.paged_decode._cache_size() - before == 1
  # The values were really used: the results differ between calls.
  assert not all(np.array_equal(lses[0], x, equal_nan=True) for x in lses[1:])


def test_equal_plans_share_one_executable():
  inp = good_inputs(seed=2, q_len=1, num_heads=5, page_size=8, seq_lens=(3, 12, 7))
  args = jax.device_put((inp["query"][:, 0], inp["kv_cache"], inp["block_table"],
                         inp["seq_lens"]), jax.devices("cpu")[0])
  mk = lambda sm: mla_jax.DecodePlan(num_heads=5, page_size=8, sm_scale=sm, backend="cpu")
  p1, p2 = mk(0.125), mk(0.125)
  assert p1 is not p2 and p1 == p2
  start = mla_jax.paged_decode._cache_size()
  o1 = mla_jax.paged_decode(*args, plan=p1)
  o2 = mla_jax.paged_decode(*args, plan=p2)
  assert mla_jax.paged_decode._cache_size() - start == 1
  chex.assert_trees_all_equal(o1, o2)
  # Control: a different plan is a different executable (the counter works).
  mla_jax.paged_decode(*args, plan=mk(0.25))
  assert mla_jax.paged_decode._cache_size() - start == 2


# --- check_inputs -----------------------------------------------------------------
def _check_inputs_case():
  inp = good_inputs(seed=3, q_len=1, seq_lens=(5, 20, 16, 0))
  inp["query"] = inp["query"][:, 0]
  return inp, plan_(q_len=1)


def _check(inp, plan):
  return mla_jax.check_inputs(inp["query"], inp["kv_cache"], inp["block_table"],
                              inp["seq_lens"], plan=plan)


def test_check_inputs_good():
  inp, plan = _check_inputs_case()
  assert _check(inp, plan).get() is None
  # Garbage in unused table entries is not an error (it is never read).
  bt = inp["block_table"].copy()
  assert bt.shape[1] == 2
  bt[0, 1] = -5          # request 0 has 5 tokens: one live page
  bt[2, 1] = 10**6       # request 2 has 16 tokens: one live page
  bt[3, :] = 2**31 - 1   # request 3 is empty
  assert _check(dict(inp, block_table=bt), plan).get() is None
  # Full table is fine.
  sl = inp["seq_lens"].copy()
  sl[1] = 2 * S
  assert _check(dict(inp, seq_lens=sl), plan).get() is None


@pytest.mark.parametrize("what,expect", [
    ("negative_len", r"^request 2: seq_lens\[2\] = -3 is negative"),
    ("long_len", r"^request 1: seq_lens\[1\] = 33 exceeds max_pages_per_seq \* page_size = 32"),
    ("page_id_negative", r"^request 1: block_table\[1, 1\] = -1 is outside \[0, num_pages = \d+\)"),
    ("page_id_too_big", r"^request 2: block_table\[2, 0\] = (\d+) is outside \[0, num_pages = \1\)"),
])
def test_check_inputs_names_bad_request(what, expect):
  inp, plan = _check_inputs_case()
  bt, sl = inp["block_table"].copy(), inp["seq_lens"].copy()
  num_pages = inp["kv_cache"].shape[0]
  if what == "negative_len":
    sl[2] = -3
  elif what == "long_len":
    sl[1] = 2 * S + 1
  elif what == "page_id_negative":
    bt[1, 1] = -1
  elif what == "page_id_too_big":
    bt[2, 0] = num_pages
  err = _check(dict(inp, block_table=bt, seq_lens=sl), plan)
  msg = err.get()
  assert msg is not None
  assert re.match(expect, msg), msg
  with pytest.raises(Exception, match=re.escape(msg.split(" (")[0])):
    err.throw()
  # paged_decode itself gives that request NaN and the others finite.
  plan_cpu = plan_(q_len=1, backend="cpu")
  with jax.default_device(jax.devices("cpu")[0]):
    out, lse = mla_jax.paged_decode(inp["query"], inp["kv_cache"], bt, sl, plan=plan_cpu,
                                    return_lse=True)
  bad = int(re.match(r"request (\d+)", msg).group(1))
  assert np.isnan(np.asarray(lse[bad])).all()
  others = np.delete(np.asarray(lse), bad, axis=0)
  assert not np.isnan(others).any()


def test_check_inputs_reports_first_bad_request():
  inp, plan = _check_inputs_case()
  sl = inp["seq_lens"].copy()
  sl[1], sl[3] = -1, -2
  assert _check(dict(inp, seq_lens=sl), plan).get().startswith("request 1: ")
  # The lowest bad index wins whatever the reasons: a bad page id in request
  # 0 before a too-long request 2 and a negative length in request 3.
  bt, sl = inp["block_table"].copy(), inp["seq_lens"].copy()
  bt[0, 0] = inp["kv_cache"].shape[0]
  sl[2], sl[3] = 2 * S + 1, -1
  assert _check(dict(inp, block_table=bt, seq_lens=sl), plan).get().startswith(
      "request 0: block_table[0, 0]")


def test_check_inputs_empty_and_huge_tables():
  inp, plan = _check_inputs_case()
  q, kv = inp["query"], inp["kv_cache"]
  empty = mla_jax.check_inputs(q[:0], kv, inp["block_table"][:0], inp["seq_lens"][:0], plan=plan)
  assert empty.get() is None
  no_pages = np.zeros((q.shape[0], 0), np.int32)
  sl = np.zeros(q.shape[0], np.int32)
  assert mla_jax.check_inputs(q, kv, no_pages, sl, plan=plan).get() is None
  sl[1] = 1
  assert mla_jax.check_inputs(q, kv, no_pages, sl, plan=plan).get().startswith(
      "request 1: seq_lens[1] = 1 exceeds max_pages_per_seq * page_size = 0")
  # max_pages_per_seq * page_size above int32: no overflow, the full length is valid.
  big = plan_(q_len=1, page_size=256)
  table = np.zeros((1, 2**23 + 1), np.int32)
  lens = np.array([2**31 - 1], np.int32)
  kv1 = jnp.zeros((2, 256, D), kv.dtype)
  assert mla_jax.check_inputs(q[:1], kv1, table, lens, plan=big).get() is None


def test_check_inputs_accepts_what_paged_decode_accepts():
  # paged_decode runs under jit, where int64 NumPy tables (x64 off) become
  # int32 and a Python float kv_scale float32; check_inputs takes them too.
  if jax.config.jax_enable_x64:
    pytest.skip("with x64 on, int64 tables are rejected by both (test_int64_tables_rejected_with_x64)")
  inp, plan = _check_inputs_case()
  bt64, sl64 = inp["block_table"].astype(np.int64), inp["seq_lens"].astype(np.int64)
  assert _check(dict(inp, block_table=bt64, seq_lens=sl64), plan).get() is None
  kv8 = jnp.asarray(inp["kv_cache"]).astype(jnp.float8_e4m3fn)
  err = mla_jax.check_inputs(inp["query"], kv8, bt64, sl64, plan=plan, kv_scale=0.5)
  assert err.get() is None


def test_check_inputs_under_jit():
  inp, plan = _check_inputs_case()
  f = jax.jit(lambda bt, sl: mla_jax.check_inputs(inp["query"], inp["kv_cache"], bt, sl, plan=plan))
  assert f(inp["block_table"], inp["seq_lens"]).get() is None
  sl = inp["seq_lens"].copy()
  sl[3] = -1
  assert f(inp["block_table"], sl).get().startswith("request 3: seq_lens[3] = -1 is negative")


def test_check_inputs_validates_shapes():
  inp, plan = _check_inputs_case()
  with pytest.raises(ValueError, match=r"^seq_lens: expected shape \(4,\)"):
    _check(dict(inp, seq_lens=inp["seq_lens"][:2]), plan)


# --- compiled HLO: the kernel gets the caller's buffers as is -----------------------
# Instructions that move or duplicate data; none may appear anywhere in the
# optimised module of a kernel backend (fused computations included).
DATA_MOVEMENT = re.compile(
    r"\s(copy|concatenate|slice|dynamic-slice|dynamic-update-slice|gather|transpose|pad|"
    r"copy-start|reverse)\(")
# The only instructions the entry computation (and computations it calls,
# e.g. a GPU command buffer) may hold.
ENTRY_ALLOWED = {"parameter", "constant", "bitcast", "custom-call", "get-tuple-element", "tuple",
                 "call"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s=\s.*?\s([a-z][\w\-]*)\((.*)$")
KERNEL_TARGETS = {"cpu": "mla_jax_paged_decode_cpu", "cuda": "mla_jax_paged_decode_cuda_v3"}


def hlo_computations(hlo: str):
  """({computation: {instruction: (opcode, operands, attrs)}}, entry name)."""
  comps, entry, cur = {}, None, None
  for line in hlo.splitlines():
    if not line.startswith(" ") and line.rstrip().endswith("{") and "%" in line.split("(")[0]:
      name = line.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
      comps[name], cur = {}, name
      if line.startswith("ENTRY "):
        entry = name
    elif line.startswith("}"):
      cur = None
    elif cur is not None and line.strip():
      m = _INSTR.match(line)
      assert m, f"cannot parse HLO line: {line}"
      name, op, rest = m.groups()
      depth = 1
      for i, ch in enumerate(rest):  # the operand list up to the matching ')'
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
          break
      args, attrs = rest[:i], rest[i + 1:]
      operands = re.findall(r"%([\w.\-]+)", args) if op != "parameter" else [int(args)]
      comps[cur][name] = (op, operands, attrs)
  assert entry is not None, "no ENTRY computation"
  return comps, entry


def data_movement_problems(hlo: str, target: str):
  """Why this module is not a zero-copy kernel call (empty list: it is)."""
  problems = [f"data movement: {m.group(1)}(" for m in DATA_MOVEMENT.finditer(hlo)]
  comps, entry = hlo_computations(hlo)
  # Walk the entry and the computations it calls; remember who called whom.
  callers, todo, kernel_calls = {entry: None}, [entry], []
  while todo:
    comp = todo.pop()
    for name, (op, operands, attrs) in comps[comp].items():
      if op not in ENTRY_ALLOWED:
        problems.append(f"entry instruction {name} is a {op}")
      if op == "call":
        callee = re.search(r"to_apply=%([\w.\-]+)", attrs).group(1)
        callers[callee] = (comp, operands)
        todo.append(callee)
      if op == "custom-call" and f'custom_call_target="{target}"' in attrs:
        kernel_calls.append((comp, operands))
  if len(kernel_calls) != 1:
    return problems + [f"expected one {target} custom-call, got {len(kernel_calls)}"]

  def source(comp, name):
    """Follows bitcasts and call parameters back to where a value is made."""
    while True:
      op, operands, _ = comps[comp][name]
      if op == "bitcast":
        name = operands[0]
      elif op == "parameter" and callers[comp] is not None:
        comp, name = callers[comp][0], callers[comp][1][operands[0]]
      else:
        return comp, op

  comp, operands = kernel_calls[0]
  for operand in operands[:4]:  # q_nope, q_pe, ckv, kpe
    where, op = source(comp, operand)
    if op != "parameter" or where != entry:
      problems.append(f"kernel operand {operand} is not an entry parameter (it is a {op})")
  return problems


# Query forms: "BHD" [B, H, 576] (the op adds the Q axis); "B1HD" [B, 1, H, 576]
# (q_len 1 with its Q axis); "BQHD" [B, 2, H, 576]; "tuple" a 4-D (q_nope,
# q_pe) pair with Q 2; "BHD-tuple" a 3-D pair.
_Q_LEN = {"BHD": 1, "B1HD": 1, "BHD-tuple": 1, "BQHD": 2, "tuple": 2}


def _compiled_hlo(backend, q_form, kv_form, wrap=None):
  q_len = _Q_LEN[q_form]
  inp = good_inputs(seed=4, q_len=q_len)
  query = inp["query"][:, 0] if q_form.startswith("BHD") else inp["query"]
  if q_form.endswith("tuple"):
    query = split(query)
  kv = inp["kv_cache"] if kv_form == "packed" else split(inp["kv_cache"])
  plan = plan_(q_len=q_len, backend=backend)
  dev = jax.devices("cpu")[0] if backend == "cpu" else jax.devices()[0]
  args = jax.device_put((query, kv, inp["block_table"], inp["seq_lens"]), dev)
  fn = wrap or (lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan,
                                                          return_lse=True))
  fn = jax.jit(fn) if wrap is None else jax.jit(lambda *a: wrap(plan, *a))
  return fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("q_form,kv_form", [
    # A [B, H, 576] query is reshaped to [B, 1, H, 576]; XLA 0.10 lays that
    # out as {3,2,0,1}, so the kernel must accept that layout or the query is
    # copied. A 4-D Q=1 query (row-major parameter) must not be copied either.
    ("BHD", "packed"),
    ("BHD", "tuple"),
    ("BHD-tuple", "packed"),
    ("B1HD", "packed"),
    ("BQHD", "packed"),
    ("tuple", "tuple"),
    ("BQHD", "tuple"),
])
def test_compiled_hlo_moves_no_data(backend, q_form, kv_form):
  hlo = _compiled_hlo(backend, q_form, kv_form)
  assert data_movement_problems(hlo, KERNEL_TARGETS[backend]) == [], hlo


SPARSE_TARGETS = {"cpu": "mla_jax_sparse_decode_cpu", "cuda": "mla_jax_sparse_decode_cuda_v3"}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("q_form", ["BHD", "BHD-tuple", "B1HD", "BQHD"])
def test_sparse_compiled_hlo_moves_no_data(backend, q_form):
  """Same for sparse_decode: query and indices reach the kernel as is."""
  q_len, k = _Q_LEN[q_form], 8
  inp = good_inputs(seed=5, q_len=q_len)
  query = inp["query"][:, 0] if q_form.startswith("BHD") else inp["query"]
  if q_form.endswith("tuple"):
    query = split(query)
  rng = np.random.default_rng(5)
  slots = inp["kv_cache"].shape[0] * S
  idx = rng.integers(-1, slots, (B, q_len, k)).astype(np.int32)
  idx = idx[:, 0] if q_form.startswith("BHD") else idx
  plan = mla_jax.SparseDecodePlan(num_heads=H, page_size=S, sm_scale=0.1, topk=k, q_len=q_len,
                                  backend=backend)
  # topk_lens and attn_sink given: their defaults are (small) broadcasts.
  topk_lens, sink = np.full((B,), k, np.int32), np.zeros((H,), np.float32)
  dev = jax.devices("cpu")[0] if backend == "cpu" else jax.devices()[0]
  args = jax.device_put((query, inp["kv_cache"], idx, topk_lens, sink), dev)
  fn = jax.jit(lambda q, kv, i, tl, sk: mla_jax.sparse_decode(
      q, kv, i, plan=plan, topk_lens=tl, attn_sink=sk, return_lse=True))
  hlo = fn.lower(*args).compile().as_text()
  assert data_movement_problems(hlo, SPARSE_TARGETS[backend]) == [], hlo


def test_hlo_check_detects_copies():
  """Controls: the HLO check fails for modules that do move data."""
  # The caller splits the packed query: two slices before the kernel.
  def sliced(plan, q, kv, bt, sl):
    return mla_jax.paged_decode((q[..., :DN], q[..., DN:]), kv, bt, sl, plan=plan)
  problems = data_movement_problems(_compiled_hlo("cpu", "BQHD", "packed", wrap=sliced),
                                    KERNEL_TARGETS["cpu"])
  assert any("slice" in p or "copy" in p for p in problems), problems
  assert any("not an entry parameter" in p for p in problems), problems

  # The caller concatenates a split cache.
  def concat(plan, q, kv, bt, sl):
    return mla_jax.paged_decode(q, jnp.concatenate(kv, -1), bt, sl, plan=plan)
  problems = data_movement_problems(_compiled_hlo("cpu", "BQHD", "tuple", wrap=concat),
                                    KERNEL_TARGETS["cpu"])
  assert any("concatenate" in p or "copy" in p or "fusion" in p for p in problems), problems

  # The pure-JAX backend gathers pages: no kernel call, lots of data movement.
  problems = data_movement_problems(_compiled_hlo("xla", "BQHD", "packed"), KERNEL_TARGETS["cpu"])
  assert any("gather" in p for p in problems) and any("custom-call, got 0" in p for p in problems), problems


_CALL_HLO = """HloModule m, entry_computation_layout={(bf16[2,2,4,576]{3,2,1,0})->bf16[2,2,4,512]{3,2,1,0}}

%command_buffer (p0: bf16[2,2,4,576], p1: bf16[6,16,576], p2: s32[2,2], p3: s32[2], p4: f32[1]) -> (bf16[2,2,4,512], f32[2,2,4]) {
  %p0 = bf16[2,2,4,576]{3,2,1,0} parameter(0)
  %p1 = bf16[6,16,576]{2,1,0} parameter(1)
  %p2 = s32[2,2]{1,0} parameter(2)
  %p3 = s32[2]{0} parameter(3)
  %p4 = f32[1]{0} parameter(4)
  ROOT %cc = (bf16[2,2,4,512]{3,2,1,0}, f32[2,2,4]{2,1,0}) custom-call(%p0, %p0, %p1, %p1, %p2, /*index=5*/%p3, %p4), custom_call_target="mla_jax_paged_decode_cuda_v3"
}

ENTRY %main (q: bf16[2,2,4,576], kv: bf16[6,16,576], bt: s32[2,2], sl: s32[2]) -> (bf16[2,2,4,512], f32[2,2,4]) {
  %q = bf16[2,2,4,576]{3,2,1,0} parameter(0)
  %kv = bf16[6,16,576]{2,1,0} parameter(1)
  %bt = s32[2,2]{1,0} parameter(2)
  %sl = s32[2]{0} parameter(3)
  %c = f32[1]{0} constant({1})
  %kvb = bf16[6,16,576]{2,1,0} bitcast(%kv)
  ROOT %call = (bf16[2,2,4,512]{3,2,1,0}, f32[2,2,4]{2,1,0}) call(%q, %kvb, %bt, %sl, %c), to_apply=%command_buffer
}
"""


def test_hlo_check_follows_calls():
  """A kernel inside a called computation (a GPU command buffer) is traced back."""
  assert data_movement_problems(_CALL_HLO, KERNEL_TARGETS["cuda"]) == []
  copied = _CALL_HLO.replace("%kvb = bf16[6,16,576]{2,1,0} bitcast(%kv)",
                             "%kvb = bf16[6,16,576]{2,1,0} copy(%kv)")
  problems = data_movement_problems(copied, KERNEL_TARGETS["cuda"])
  assert "data movement: copy(" in problems
  assert any("kernel operand p1 is not an entry parameter (it is a copy)" in p for p in problems)
  assert data_movement_problems(_CALL_HLO, KERNEL_TARGETS["cpu"]) == [
      "expected one mla_jax_paged_decode_cpu custom-call, got 0"]


def test_check_inputs_fp8_cache_with_kv_scale():
  """check_inputs accepts the same FP8 call paged_decode does."""
  inp, plan = _check_inputs_case()
  kv = jnp.asarray(inp["kv_cache"], jnp.float8_e4m3fn)
  err = mla_jax.check_inputs(inp["query"], kv, inp["block_table"], inp["seq_lens"], plan=plan,
                             kv_scale=jnp.float32(0.5))
  assert err.get() is None
  sl = inp["seq_lens"].copy()
  sl[0] = -1
  err = mla_jax.check_inputs(inp["query"], kv, inp["block_table"], sl, plan=plan,
                             kv_scale=jnp.float32(0.5))
  assert re.match(r"^request 0: seq_lens\[0\] = -1 is negative", err.get())


def test_auto_backend_other_widths_on_cpu():
  """backend "auto" serves widths the CUDA kernels do not support (cpu/xla):
  the GPU branch, traced but not lowered on a CPU, must not raise."""
  rng = np.random.default_rng(3)
  d = random_paged_inputs(rng, [5, 40], num_heads=4, page_size=16, kv_lora_rank=256,
                          qk_rope_head_dim=32)
  plan = mla_jax.DecodePlan(num_heads=4, page_size=16, sm_scale=0.1, kv_lora_rank=256,
                            qk_rope_head_dim=32)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    q = jax.device_put(jnp.asarray(d["query"], jnp.bfloat16), cpu)
    kv = jax.device_put(jnp.asarray(d["kv_cache"], jnp.bfloat16), cpu)
    out, lse = mla_jax.paged_decode(q, kv, d["block_table"], d["seq_lens"], plan=plan,
                                    return_lse=True)
  ref_out, ref_lse = mla_jax.testing.reference_paged_decode(
      np.asarray(q.astype(jnp.float32)), np.asarray(kv.astype(jnp.float32)), d["block_table"],
      d["seq_lens"], plan)
  out = np.asarray(out.astype(jnp.float32))
  assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-2)


@pytest.mark.parametrize("bad", [None, "q_pe_rows", "q_pe_dtype", "kv_scale_empty", "page_size_0",
                                 "negative_rope"])
def test_cpu_handler_checks_operands_itself(bad):
  """The FFI handler re-checks what paged_decode validates at trace time, for
  callers of the registered target itself: a q_pe with fewer rows than q_nope
  or another dtype, an empty kv_scale, a cache with page_size 0 or widths
  that only add up (kv_lora_rank 640, qk_rope_head_dim -64) is an error, not
  an out-of-bounds access or a crash (None: the same call with good operands
  runs)."""
  from mla_jax import _ffi  # pylint: disable=g-import-not-at-top
  if not _ffi.has_extension():
    pytest.skip("compiled extension not available")
  _ffi.register()
  inp = good_inputs()
  q_nope, q_pe = split(inp["query"])
  ckv, kpe = split(inp["kv_cache"])
  scale = np.ones((1,), np.float32)
  if bad == "q_pe_rows":
    q_pe = np.ascontiguousarray(q_pe[:, :, :1])
  elif bad == "q_pe_dtype":
    q_pe = q_pe.astype(jnp.float16)
  elif bad == "kv_scale_empty":
    scale = np.ones((0,), np.float32)
  elif bad == "page_size_0":
    ckv, kpe = ckv[:, :0], kpe[:, :0]
  attrs = dict(sm_scale=np.float32(0.1), causal=True, kv_lora_rank=DN, qk_rope_head_dim=DR)
  dv = DN
  if bad == "negative_rope":  # packed operands: 640 + (-64) = 576 matches their width
    q_nope = q_pe = inp["query"]
    ckv = kpe = inp["kv_cache"]
    attrs.update(kv_lora_rank=640, qk_rope_head_dim=-64)
    dv = 640
  out_types = (jax.ShapeDtypeStruct(q_nope.shape[:3] + (dv,), q_nope.dtype),
               jax.ShapeDtypeStruct(q_nope.shape[:3], jnp.float32))
  call = jax.ffi.ffi_call(_ffi.CPU_TARGET, out_types)
  args = (q_nope, q_pe, ckv, kpe, inp["block_table"], inp["seq_lens"], scale)
  with jax.default_device(jax.devices("cpu")[0]):
    if bad is None:
      out, lse = jax.block_until_ready(call(*args, **attrs))
      assert np.isfinite(np.asarray(lse)).all()
      return
    match = {"kv_scale_empty": "kv_scale", "page_size_0": "page_size >= 1",
             "negative_rope": "must be positive"}.get(bad, "q_pe")
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
      jax.block_until_ready(call(*args, **attrs))


@pytest.mark.parametrize("op", ["paged", "sparse"])
def test_handler_errors_name_the_op(op):
  """A malformed direct call of a registered target fails with a message
  that names the op it belongs to (mla_jax.paged_decode or
  mla_jax.sparse_decode)."""
  from mla_jax import _ffi  # pylint: disable=g-import-not-at-top
  if not _ffi.has_extension():
    pytest.skip("compiled extension not available")
  inp = good_inputs()
  q = inp["query"]
  out_types = (jax.ShapeDtypeStruct(q.shape[:3] + (DN,), q.dtype), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
  scale = np.ones((1,), np.float32)
  if op == "paged":
    call = jax.ffi.ffi_call(_ffi.CPU_TARGET, out_types)
    args = (q, q, inp["kv_cache"], inp["kv_cache"], inp["block_table"][:1], inp["seq_lens"], scale)
    attrs = dict(sm_scale=np.float32(0.1), causal=True, kv_lora_rank=DN, qk_rope_head_dim=DR)
  else:
    b, q_len, h = q.shape[:3]
    call = jax.ffi.ffi_call(_ffi.SPARSE_CPU_TARGET, out_types)
    indices = np.zeros((b, q_len + 1, 4), np.int32)  # one index row too many
    args = (q, q, inp["kv_cache"], indices, np.full((b,), 4, np.int32), np.zeros((h,), np.float32), scale)
    attrs = dict(sm_scale=np.float32(0.1), kv_format=0, has_sink=False, kv_lora_rank=DN, qk_rope_head_dim=DR)
  with jax.default_device(jax.devices("cpu")[0]):
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"mla_jax.{op}_decode: "):
      jax.block_until_ready(call(*args, **attrs))
