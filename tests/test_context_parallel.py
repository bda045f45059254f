"""Context parallelism: a cache sharded on its page axis, decoded where it lives.

On the CPU backend with 8 fake devices (tests/conftest.py), for the "cpu"
kernel, "auto" (the cpu kernel through lax.platform_dependent) and the
pure-JAX "xla" backend. Every result must equal the unsharded one and the
float64 reference, and the compiled HLO must move no cache bytes: no
all-gather, all-to-all or permute, and all-reduces of the [B, Q, H, 512]
partials and their [B, Q, H] LSEs only.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mla_jax
from mla_jax.testing import random_paged_inputs, reference_paged_decode, reference_sparse_decode

CPU = jax.devices("cpu")
H = 8
PAGE = 16
BACKENDS = ["auto", "cpu", "xla"]
# B = 8: empty, one-token, page-boundary, ragged and long requests.
LENS = [5, 40, 17, 0, 1, 64, 300, 33]
_OP = re.compile(r"=\s*(\([^)]*\)|\S+)\s+(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                 r"(-start)?\(")


def _collectives(hlo_text):
  """[(kind, result shape text)] of every collective in compiled HLO."""
  return [(m.group(2), m.group(1)) for m in map(_OP.search, hlo_text.splitlines()) if m]


def _assert_partials_only(hlo_text, b, q, h):
  """Only all-reduces, of f32 [b, q, h, 512] and [b, q, h] arrays."""
  allowed = {f"f32[{b},{q},{h},512]", f"f32[{b},{q},{h}]"}
  found = _collectives(hlo_text)
  assert found, "expected the partials' all-reduce"
  for kind, shape in found:
    assert kind == "all-reduce", (kind, shape)
    shapes = set(re.findall(r"f32\[[\d,]*\]|[a-z0-9]+\[[\d,]*\]", shape))
    assert shapes <= allowed, (shape, allowed)


def _pad_pages(rng, kv, multiple):
  pad = (-kv.shape[0]) % multiple
  return np.concatenate([kv, rng.standard_normal((pad,) + kv.shape[1:]).astype(kv.dtype)])


def _inputs(seed, lens, q_len, page_size=PAGE, num_pages_multiple=8):
  rng = np.random.default_rng(seed)
  d = random_paged_inputs(rng, lens, num_heads=H, page_size=page_size, q_len=q_len, extra_pages=5)
  d["kv_cache"] = _pad_pages(rng, d["kv_cache"], num_pages_multiple)
  d["query"] = jnp.asarray(d["query"], jnp.bfloat16)
  d["kv_cache"] = jnp.asarray(d["kv_cache"], jnp.bfloat16)
  return d


def _plan(backend, q_len=1, page_size=PAGE, causal=True):
  return mla_jax.DecodePlan(num_heads=H, page_size=page_size, q_len=q_len, causal=causal,
                            sm_scale=192 ** -0.5, backend=backend)


def _decode(plan, **kw):
  return jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True, **kw))


def _reference(d, plan):
  q = np.asarray(d["query"], np.float64)
  return reference_paged_decode(q, np.asarray(d["kv_cache"], np.float64), d["block_table"], d["seq_lens"],
                                plan)


def _check(got, want, ref):
  out, lse = (np.asarray(x, np.float32) for x in got)
  np.testing.assert_allclose(out, np.asarray(want[0], np.float32), atol=2e-2, rtol=0)
  np.testing.assert_allclose(lse, np.asarray(want[1], np.float32), atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(out, ref[0], atol=2e-2, rtol=0)
  np.testing.assert_allclose(lse, ref[1], atol=1e-3, rtol=0)


def _unsharded(d, plan):
  on0 = [jax.device_put(d[k], CPU[0]) for k in ("query", "kv_cache", "block_table", "seq_lens")]
  return _decode(plan)(*on0)


def _place(d, mesh, qspec, cache_axis):
  b = qspec[0] if len(qspec) else None
  specs = (qspec, P(cache_axis), P(b), P(b))
  arrays = (d["query"], d["kv_cache"], d["block_table"], d["seq_lens"])
  return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]


# Meshes: (8,) all context; (2, 4) with batch or heads on the second axis.
MESHES = {
    "cp8": ((8,), ("cp",), P(None, None, None, None)),
    "cp2_batch4": ((2, 4), ("cp", "data"), P("data")),
    "cp2_heads4": ((2, 4), ("cp", "model"), P(None, None, "model")),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_page_sharded_cache_is_decoded_in_place(backend, mesh_name, q_len, axis_type):
  shape, names, qspec = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=CPU[:8])
  d = _inputs(1, LENS, q_len)
  plan = _plan(backend, q_len)
  want, ref = _unsharded(d, plan), _reference(d, plan)
  f = _decode(plan)
  with jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext():
    args = _place(d, mesh, qspec, "cp")
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
  _check(got, want, ref)
  b = len(LENS) // (4 if "data" in names else 1)
  h = H // (4 if "model" in names else 1)
  _assert_partials_only(hlo, b, q_len, h)
  spec = tuple(qspec) + (None,) * 4
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P(spec[0], None, spec[2], None)), 4)


@pytest.mark.parametrize("page_size", [1, 2, 16])
@pytest.mark.parametrize("q_len", [2, 3, 8])
def test_causal_tail_across_pages_and_devices(page_size, q_len):
  """The last q_len - 1 positions (seen by only some query tokens) may
  straddle pages held by different devices; requests shorter than q_len
  leave early query tokens empty (out 0, lse -inf)."""
  lens = [q_len - 1, 1, 0, q_len, 37, 2 * page_size + 1, 9, 64]
  d = _inputs(2, lens, q_len, page_size=page_size)
  plan = _plan("cpu", q_len, page_size)
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  got = _decode(plan)(*_place(d, mesh, P(), "cp"))
  _check(got, _unsharded(d, plan), _reference(d, plan))
  assert np.isneginf(np.asarray(got[1])[2]).all()   # the empty request


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_non_causal_multi_token(backend):
  d = _inputs(3, LENS, 3)
  plan = _plan(backend, 3, causal=False)
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  _check(_decode(plan)(*_place(d, mesh, P(), "cp")), _unsharded(d, plan), _reference(d, plan))


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_invalid_requests_give_nan_on_every_device(backend):
  """A live page id outside the global [0, num_pages), a negative length or
  one past the table's capacity: NaN, as unsharded; the others unaffected."""
  d = _inputs(4, LENS, 2)
  bt, sl = d["block_table"].copy(), d["seq_lens"].copy()
  num_pages = d["kv_cache"].shape[0]
  bt[1, 1] = num_pages          # just past the global cache (the last device's range ends there)
  bt[6, 0] = -3
  sl[2] = -1
  sl[7] = bt.shape[1] * PAGE + 1
  d = dict(d, block_table=bt, seq_lens=sl)
  plan = _plan(backend, 2)
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  out, lse = (np.asarray(x, np.float32) for x in _decode(plan)(*_place(d, mesh, P(), "cp")))
  bad = [1, 2, 6, 7]
  assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all()
  good = [0, 3, 4, 5]
  want = _unsharded(d, plan)
  np.testing.assert_allclose(out[good], np.asarray(want[0], np.float32)[good], atol=2e-2, rtol=0)
  np.testing.assert_allclose(lse[good], np.asarray(want[1])[good], atol=1e-4, rtol=1e-5)


def test_fp8_cache_and_split_layouts():
  """float8_e4m3fn cache with kv_scale, query and cache given as pairs."""
  d = _inputs(5, LENS, 2)
  kv8 = jnp.asarray(np.asarray(d["kv_cache"], np.float32) / 2.0, jnp.float8_e4m3fn)
  scale = jnp.float32(2.0)
  q = (d["query"][..., :512], d["query"][..., 512:])
  kv = (kv8[..., :512], kv8[..., 512:])
  plan = _plan("cpu", 2)
  f = jax.jit(lambda q, kv, bt, sl, s: mla_jax.paged_decode(q, kv, bt, sl, plan=plan, kv_scale=s,
                                                            return_lse=True))
  on0 = lambda x: jax.device_put(x, CPU[0])
  want = f(jax.tree.map(on0, q), jax.tree.map(on0, kv), on0(d["block_table"]), on0(d["seq_lens"]), on0(scale))
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
  got = f(jax.tree.map(put, q), jax.tree.map(lambda x: put(x, "cp"), kv), put(d["block_table"]),
          put(d["seq_lens"]), put(scale))
  ref = reference_paged_decode(np.asarray(d["query"], np.float64),
                               np.asarray(kv8, np.float64) * 2.0, d["block_table"], d["seq_lens"], plan)
  _check(got, want, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_map_context_axis(backend):
  """Inside shard_map, context_axis= names the axis the pages are split
  over; the block table holds global page ids; the merged result is the
  same on every device of the axis."""
  d = _inputs(6, LENS, 4)
  plan = _plan(backend, 4)
  mesh = jax.make_mesh((2, 4), ("data", "cp"), axis_types=(AxisType.Explicit,) * 2, devices=CPU[:8])

  def body(q, kv, bt, sl):
    return mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True, context_axis="cp")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("cp"), P("data"), P("data")),
                            out_specs=(P("data"), P("data"))))
  with jax.set_mesh(mesh):
    args = _place(d, mesh, P("data"), "cp")
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
  _check(got, _unsharded(d, plan), _reference(d, plan))
  _assert_partials_only(hlo, len(LENS) // 2, 4, H)


def test_tuple_of_axes():
  """Pages split over two mesh axes at once, P(("a", "b")): device (a, b)
  holds the (a * 4 + b)-th share."""
  d = _inputs(13, LENS, 2)
  plan = _plan("cpu", 2)
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=CPU[:8])
  f = _decode(plan)
  args = _place(d, mesh, P(), ("a", "b"))
  _check(f(*args), _unsharded(d, plan), _reference(d, plan))
  _assert_partials_only(f.lower(*args).compile().as_text(), len(LENS), 2, H)


def test_ragged_query_with_context_parallelism():
  """cu_seqlens_q on a page-sharded cache, both ragged layouts (left-padded
  below 64 heads, per token at 64): the causal tails of requests of
  different lengths cross devices."""
  for heads in (8, 64):
    rng = np.random.default_rng(14)
    lens, counts = [5, 40, 17, 1, 64, 33], [3, 1, 4, 2, 0, 4]
    d = random_paged_inputs(rng, lens, num_heads=heads, page_size=4, extra_pages=3)
    kv = jnp.asarray(_pad_pages(rng, d["kv_cache"], 8), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 1, heads, 576)), jnp.bfloat16)
    plan = mla_jax.DecodePlan(num_heads=heads, page_size=4, q_len=4, sm_scale=0.1, backend="cpu")
    f = jax.jit(lambda q, kv, bt, sl, cu: mla_jax.paged_decode(q, kv, bt, sl, plan=plan, cu_seqlens_q=cu,
                                                               return_lse=True))
    want = f(*jax.device_put((q, kv, d["block_table"], d["seq_lens"], cu), CPU[0]))
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
    put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
    got = f(put(q), put(kv, "cp"), put(d["block_table"]), put(d["seq_lens"]), put(cu))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=2e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-4, rtol=1e-5)
    assert not np.isnan(np.asarray(got[1])).any()


def test_uneven_page_split_is_gathered():
  """A page count the axis does not divide (a sharding constraint inside
  jit pads the last shards): decoded after a gather, ids past the cache
  still NaN."""
  d = _inputs(15, LENS, 1, num_pages_multiple=1)
  d["kv_cache"] = d["kv_cache"][:(d["kv_cache"].shape[0] // 8) * 8 + 3]     # 8 does not divide it
  bt = d["block_table"].copy()
  bt[0, 0] = d["kv_cache"].shape[0] + 2                                       # past the cache
  d = dict(d, block_table=bt)
  plan = _plan("cpu")
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  shard = NamedSharding(mesh, P("cp"))
  f = jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, jax.lax.with_sharding_constraint(kv, shard), bt, sl,
                                                         plan=plan, return_lse=True))
  got = f(d["query"][:, 0], d["kv_cache"], bt, d["seq_lens"])
  want = _unsharded(dict(d, query=d["query"][:, 0]), plan)
  out, lse = (np.asarray(x, np.float32) for x in got)
  assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
  np.testing.assert_allclose(out[1:], np.asarray(want[0], np.float32)[1:], atol=2e-2, rtol=0)


def test_user_context_axis_with_an_inner_explicit_split():
  """context_axis="x" inside a shard_map over x, on a cache whose pages are
  also split over an Explicit axis y within each x shard: both axes merge."""
  d = _inputs(16, LENS, 2)
  plan = _plan("cpu", 2)
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2, devices=CPU[:8])

  def body(q, kv, bt, sl):
    kv = jax.sharding.reshard(kv, P("y"))          # this x shard's pages, split again over y
    return mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True, context_axis="x")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x"), P(), P()), out_specs=(P(), P()),
                            axis_names={"x"}))
  with jax.set_mesh(mesh):
    args = _place(d, mesh, P(), "x")
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
  _check(got, _unsharded(d, plan), _reference(d, plan))
  _assert_partials_only(hlo, len(LENS), 2, H)


def test_context_axis_outside_shard_map_is_refused():
  d = _inputs(7, LENS, 1)
  with pytest.raises(ValueError, match="context_axis='cp'.*not a manual axis"):
    mla_jax.paged_decode(d["query"][:, 0], d["kv_cache"], d["block_table"], d["seq_lens"],
                         plan=_plan("cpu"), context_axis="cp")


def test_page_axis_shared_with_batch_is_gathered():
  """Limit: pages split over the axis that also splits the batch cannot be
  decoded in place (a device's requests may use any page): the cache is
  gathered first, as without context parallelism; the result is right."""
  d = _inputs(8, LENS, 1)
  plan = _plan("cpu")
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  f = _decode(plan)
  args = _place(d, mesh, P("data"), "data")
  _check(f(*args), _unsharded(d, plan), _reference(d, plan))
  assert any(kind == "all-gather" for kind, _ in _collectives(f.lower(*args).compile().as_text()))


def test_interleaved_allocation_spreads_a_long_request():
  """examples/context_parallel.py's allocator: every device holds a share of
  a long request's pages, and the decode over them matches the reference."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"
  spec = importlib.util.spec_from_file_location("context_parallel_example", path)
  ex = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ex)
  lens = np.array([4000, 17, 0, 513], np.int32)
  bt = ex.interleaved_block_table(lens, page_size=PAGE, num_shards=8, pages_per_shard=40)
  owner = np.where(bt >= 0, bt // 40, -1)
  assert set(owner[0][owner[0] >= 0]) == set(range(8))
  counts = np.bincount(owner[0][owner[0] >= 0], minlength=8)
  assert counts.max() - counts.min() <= 1
  live = np.concatenate([bt[b, :-(-n // PAGE)] for b, n in enumerate(lens) if n > 0])
  assert len(set(live)) == len(live)                         # no page used twice
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((4, H, 576)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((8 * 40, PAGE, 576)), jnp.bfloat16)
  plan = _plan("cpu")
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=CPU[:8])
  put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
  got = _decode(plan)(put(q), put(kv, "cp"), put(bt), put(lens))
  ref = reference_paged_decode(np.asarray(q, np.float64)[:, None], np.asarray(kv, np.float64), bt, lens, plan)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), ref[0][:, 0], atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(got[1]), ref[1][:, 0], atol=1e-3, rtol=0)


# --- sparse decode --------------------------------------------------------------
def test_explain_names_the_context_axis():
  """explain(..., context_axis=) says the pages are split and the partials merged, then
  explains one device's call; without it, no such line."""
  d = _inputs(7, LENS, 2)
  args = (d["query"], d["kv_cache"], d["block_table"], d["seq_lens"])
  e = mla_jax.explain(_plan("cpu", 2), *args, context_axis=("a", "b"))
  assert e.reasons[0].startswith("context_axis 'a', 'b': each device decodes the tokens on its own pages"), e
  assert "causal call attended in JAX" in e.reasons[0]
  assert e.backend == "cpu" and e.reasons[1:] == mla_jax.explain(_plan("cpu", 2), *args).reasons
  q, cache, idx, topk, sink = _sparse_inputs(12)
  e = mla_jax.explain(_sparse_plan("cpu"), q, cache, idx, topk_lens=topk, context_axis="cp")
  assert e.reasons[0].startswith("context_axis 'cp':") and "causal" not in e.reasons[0], e
  assert not any("context_axis" in r for r in mla_jax.explain(_sparse_plan("cpu"), q, cache, idx).reasons)


def _sparse_inputs(seed, q_len=2, k=64, fmt="bf16"):
  rng = np.random.default_rng(seed)
  num_pages = 32
  kv = rng.standard_normal((num_pages, PAGE, 576)).astype(np.float32)
  if fmt == "fp8_ds_mla":
    cache = mla_jax.quantize_latent_fp8(jnp.asarray(kv))
  else:
    cache = jnp.asarray(kv, jnp.bfloat16)
  b = 8
  idx = rng.integers(-2, num_pages * PAGE + 3, size=(b, q_len, k)).astype(np.int32)  # padding too
  idx[3] = -1                                           # a request with no valid index
  topk = rng.integers(0, k + 1, size=(b,)).astype(np.int32)
  sink = rng.standard_normal((H,)).astype(np.float32)
  q = jnp.asarray(rng.standard_normal((b, q_len, H, 576)), jnp.bfloat16)
  return q, cache, idx, topk, sink


def _sparse_plan(backend, q_len=2, k=64, fmt="bf16"):
  return mla_jax.SparseDecodePlan(num_heads=H, page_size=PAGE, topk=k, q_len=q_len, sm_scale=192 ** -0.5,
                                  kv_format=fmt, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sparse_page_sharded_cache(backend, fmt, with_sink, axis_type):
  q, cache, idx, topk, sink = _sparse_inputs(10, fmt=fmt)
  sink = sink if with_sink else None
  plan = _sparse_plan(backend, fmt=fmt)
  f = jax.jit(lambda q, kv, i, t, s: mla_jax.sparse_decode(q, kv, i, plan=plan, topk_lens=t, attn_sink=s,
                                                           return_lse=True))
  on0 = lambda x: None if x is None else jax.device_put(x, CPU[0])
  want = f(*map(on0, (q, cache, idx, topk, sink)))
  mesh = jax.make_mesh((2, 4), ("cp", "data"), axis_types=(axis_type,) * 2, devices=CPU[:8])
  put = lambda x, *s: None if x is None else jax.device_put(x, NamedSharding(mesh, P(*s)))
  with jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext():
    args = (put(q, "data"), put(cache, "cp"), put(idx, "data"), put(topk, "data"), put(sink))
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
  ref = reference_sparse_decode(np.asarray(q, np.float64), np.asarray(cache), idx, plan, topk, sink)
  _check(got, want, ref)
  _assert_partials_only(hlo, 2, 2, H)


def test_sparse_shard_map_context_axis():
  q, cache, idx, topk, sink = _sparse_inputs(11, q_len=1)
  plan = _sparse_plan("cpu", q_len=1)
  q, idx = q[:, 0], idx[:, 0]
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Explicit,), devices=CPU[:8])

  def body(q, kv, i, t, s):
    return mla_jax.sparse_decode(q, kv, i, plan=plan, topk_lens=t, attn_sink=s, return_lse=True,
                                 context_axis="cp")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("cp"), P(), P(), P()), out_specs=(P(), P())))
  with jax.set_mesh(mesh):
    put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
    got = f(put(q), put(cache, "cp"), put(idx), put(topk), put(sink))
  ref = reference_sparse_decode(np.asarray(q, np.float64)[:, None], np.asarray(cache, np.float64),
                                idx[:, None], plan, topk, sink)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), ref[0][:, 0], atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(got[1]), ref[1][:, 0], atol=1e-3, rtol=0)


# --- merge_states_over_axis ---------------------------------------------------
def test_merge_states_over_axis_exact_for_empty_and_nan():
  mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Explicit,), devices=CPU[:8])
  rng = np.random.default_rng(12)
  out = rng.standard_normal((8, 3, 4)).astype(np.float32)       # device r holds row r
  lse = rng.standard_normal((8, 3)).astype(np.float32)
  lse[:, 0] = -np.inf                  # column 0: empty everywhere
  lse[2:, 1] = -np.inf                 # column 1: only devices 0 and 1
  out[2:, 1] = np.nan                  # ... whatever the empty ones hold
  lse[5, 2] = np.nan                   # column 2: a NaN part
  f = jax.jit(jax.shard_map(lambda o, l: mla_jax.merge_states_over_axis(o[0], l[0], "cp"), mesh=mesh,
                            in_specs=(P("cp"), P("cp")), out_specs=(P(), P())))
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("cp")))
    got_out, got_lse = (np.asarray(x) for x in f(put(out), put(lse)))
  assert (got_out[0] == 0).all() and np.isneginf(got_lse[0])
  want_lse = np.logaddexp(lse[0, 1], lse[1, 1])
  want = np.exp(lse[0, 1] - want_lse) * out[0, 1] + np.exp(lse[1, 1] - want_lse) * out[1, 1]
  np.testing.assert_allclose(got_out[1], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_lse[1], want_lse, rtol=1e-6)
  assert np.isnan(got_out[2]).all() and np.isnan(got_lse[2])


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_cuda_kernels_under_context_axis_on_one_gpu(q_len):
  """The CUDA path of a context-parallel call (non-causal body through the
  kernels, causal tail in JAX, merge) on a one-GPU axis."""
  d = _inputs(17, LENS, q_len, page_size=64, num_pages_multiple=1)
  plan = _plan("cuda", q_len, page_size=64)
  gpu = jax.devices("cuda")[:1]
  mesh = jax.make_mesh((1,), ("cp",), axis_types=(AxisType.Explicit,), devices=gpu)

  def body(q, kv, bt, sl):
    return mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True, context_axis="cp")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("cp"), P(), P()), out_specs=(P(), P())))
  with jax.set_mesh(mesh):
    put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
    got = f(put(d["query"]), put(d["kv_cache"], "cp"), put(d["block_table"]), put(d["seq_lens"]))
  ref = _reference(d, plan)
  out, lse = (np.asarray(x, np.float32) for x in got)
  np.testing.assert_allclose(out, ref[0], atol=2e-2, rtol=0)
  np.testing.assert_allclose(lse, ref[1], atol=1e-3, rtol=0)
