"""Sharding: jit with NamedSharding (auto and explicit axes) and shard_map.

Runs on the CPU backend with 8 fake devices (tests/conftest.py), for the
"cpu" kernel and the pure-JAX "xla" backend, for paged_decode and (fewer
cases) sparse_decode. Every sharded result must equal the unsharded one, and
the compiled HLO must move no query, output or cache data between devices:
each op's Shardy rule lets each device decode its own batch rows and heads.
"""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mla_jax
from mla_jax import _op
from mla_jax.testing import random_paged_inputs, reference_paged_decode

_pd = importlib.import_module("mla_jax.paged_decode")

CPU = jax.devices("cpu")
H = 8
PAGE = 16
LENS = [5, 40, 17, 0, 1, 64, 20, 33]          # B = 8 (0: empty request)
BACKENDS = ["auto", "cpu", "xla"]   # auto: the cpu kernel here, through lax.platform_dependent
_COLLECTIVE = re.compile(r"\s(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                         r"(-start)?\(")

# Layouts: query spec (block_table and seq_lens follow its batch axis).
LAYOUTS = {
    "batch": P("data"),
    "heads": P(None, "model"),
    "both": P("data", "model"),
}


def _plan(backend, num_heads=H):
  return mla_jax.DecodePlan(num_heads=num_heads, page_size=PAGE, sm_scale=192 ** -0.5,
                            backend=backend)


def _collectives(hlo_text):
  return [l.strip()[:160] for l in hlo_text.splitlines() if _COLLECTIVE.search(l)]


def _mesh(axis_type):
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type, axis_type),
                       devices=CPU[:8])


def _decode(plan):
  return jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan,
                                                            return_lse=True))


@pytest.fixture(scope="module")
def data():
  d = random_paged_inputs(np.random.default_rng(0), LENS, num_heads=H, page_size=PAGE,
                          extra_pages=4)             # 20 pages: divisible by the mesh axes
  d["query"] = jnp.asarray(d["query"][:, 0], jnp.bfloat16)     # [B, H, 576]
  d["kv_cache"] = jnp.asarray(d["kv_cache"], jnp.bfloat16)
  return d


@pytest.fixture(scope="module")
def unsharded(data):
  """backend -> (out, lse) on one device, and the float64 reference."""
  on0 = [jax.device_put(data[k], CPU[0]) for k in ("query", "kv_cache", "block_table", "seq_lens")]
  res = {b: tuple(np.asarray(x, np.float32) for x in _decode(_plan(b))(*on0)) for b in BACKENDS}
  ref = reference_paged_decode(np.asarray(data["query"], np.float64)[:, None],
                               np.asarray(data["kv_cache"], np.float64),
                               data["block_table"], data["seq_lens"], _plan("cpu"))
  res["ref"] = (ref[0][:, 0], ref[1][:, 0])
  return res


def _check(got, want, ref):
  out, lse = (np.asarray(x, np.float32) for x in got)
  np.testing.assert_allclose(out, want[0], atol=1e-2, rtol=0)
  np.testing.assert_allclose(lse, want[1], atol=1e-5, rtol=1e-6)
  np.testing.assert_allclose(out, ref[0], atol=2e-2, rtol=0)
  np.testing.assert_allclose(lse, ref[1], atol=1e-3, rtol=0)


def _place(data, mesh, qspec, cache_spec=P()):
  b = qspec[0] if len(qspec) else None
  specs = (qspec, cache_spec, P(b), P(b))
  arrays = (data["query"], data["kv_cache"], data["block_table"], data["seq_lens"])
  return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]


def _expect_sharded(x, mesh, spec):
  want = NamedSharding(mesh, spec)
  assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding, want)


# --- implicit (auto) sharding: Shardy propagates the op's rule ---------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_auto_axes(data, unsharded, backend, layout):
  mesh = _mesh(AxisType.Auto)
  qspec = LAYOUTS[layout]
  args = _place(data, mesh, qspec)
  f = _decode(_plan(backend))
  out, lse = f(*args)
  _check((out, lse), unsharded[backend], unsharded["ref"])
  b, h = (tuple(qspec) + (None, None))[:2]
  _expect_sharded(out, mesh, P(b, h, None))       # the jit result keeps B/H sharded
  _expect_sharded(lse, mesh, P(b, h))
  assert _collectives(f.lower(*args).compile().as_text()) == []


def test_auto_axes_legacy_mesh_constructor(data, unsharded):
  """jax.sharding.Mesh (axis types Auto) and Q > 1 with a split query/cache."""
  mesh = jax.sharding.Mesh(np.array(CPU[:8]).reshape(4, 2), ("data", "model"))
  plan = mla_jax.DecodePlan(num_heads=H, page_size=PAGE, sm_scale=192 ** -0.5, q_len=2,
                            backend="cpu")
  q = jnp.concatenate([data["query"][:, None], data["query"][:, None] * 0.5], axis=1)
  q = (q[..., :512], q[..., 512:])                   # [B, 2, H, 512], [B, 2, H, 64]
  kv = (data["kv_cache"][..., :512], data["kv_cache"][..., 512:])
  qs = P("data", None, "model")
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = ([put(x, qs) for x in q], [put(x, P()) for x in kv],
          put(data["block_table"], P("data")), put(data["seq_lens"], P("data")))
  f = jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan))
  out = f(*args)
  want = mla_jax.paged_decode(*[jax.device_put(x, CPU[0]) for x in (q, kv)],
                              jax.device_put(data["block_table"], CPU[0]),
                              jax.device_put(data["seq_lens"], CPU[0]), plan=plan)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  _expect_sharded(out, mesh, P("data", None, "model", None))
  assert _collectives(f.lower(*args).compile().as_text()) == []


def test_hlo_check_sees_collectives_without_the_rule(data):
  """The no-collective assertions above are not vacuous: the bare kernel call
  (no custom_partitioning) on the same sharded inputs needs gathers."""
  mesh = _mesh(AxisType.Auto)
  plan = _plan("cpu")

  def bare(q, kv, bt, sl):
    i = mla_jax._inputs.normalize(q, kv, bt, sl, plan)
    return _op._local(_pd.SPEC, _op.Call(plan, False), i.q_nope, i.q_pe, i.ckv, i.kpe, i.block_table,
                      i.seq_lens, i.kv_scale)

  args = _place(data, mesh, LAYOUTS["both"])
  assert _collectives(jax.jit(bare).lower(*args).compile().as_text()) != []


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_cache_is_gathered(data, unsharded, backend):
  """Limit: a cache split on its pages over the axis that also splits the
  heads cannot be decoded in place (tests/test_context_parallel.py covers
  other axes): it still gives the right result, but XLA all-gathers it."""
  mesh = _mesh(AxisType.Auto)
  args = _place(data, mesh, LAYOUTS["both"], cache_spec=P("model"))
  f = _decode(_plan(backend))
  _check(f(*args), unsharded[backend], unsharded["ref"])
  assert any("all-gather" in l for l in _collectives(f.lower(*args).compile().as_text()))


# --- explicit sharding (sharding in types; jax.set_mesh) ----------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explicit_axes(data, unsharded, backend, layout):
  mesh = _mesh(AxisType.Explicit)
  qspec = LAYOUTS[layout]
  f = _decode(_plan(backend))
  with jax.set_mesh(mesh):
    args = _place(data, mesh, qspec)
    out, lse = f(*args)
    hlo = f.lower(*args).compile().as_text()
  _check((out, lse), unsharded[backend], unsharded["ref"])
  b, h = (tuple(qspec) + (None, None))[:2]
  assert jax.typeof(out).sharding.spec == P(b, h, None)
  assert jax.typeof(lse).sharding.spec == P(b, h)
  _expect_sharded(out, mesh, P(b, h, None))
  assert _collectives(hlo) == []


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_explicit_axes_mixed_mesh_without_set_mesh(data, unsharded, backend):
  """Explicit types on the inputs but no mesh in context, on a mesh mixing an
  Explicit and an Auto axis. Limit: the kernels run replicated over the Auto
  axis (XLA gathers the query over it); the pure-JAX backend partitions."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto),
                       devices=CPU[:8])
  args = _place(data, mesh, LAYOUTS["both"])
  f = _decode(_plan(backend))
  out, lse = f(*args)
  _check((out, lse), unsharded[backend], unsharded["ref"])
  assert jax.typeof(out).sharding.spec == P("data", None, None)   # 'model' is Auto: untyped
  if backend == "xla":
    _expect_sharded(out, mesh, P("data", "model", None))
    assert _collectives(f.lower(*args).compile().as_text()) == []


@pytest.mark.parametrize("backend", ["auto", "xla"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_vmap_of_sharded_batch(data, backend, axis_type):
  """vmap folds its axis into a sharded B without moving data."""
  mesh = _mesh(axis_type)
  v = 2
  stack = lambda x, f: jnp.stack([x, f(x)])
  q = stack(data["query"], lambda x: -x)                           # [2, B, H, 576]
  bt = stack(jnp.asarray(data["block_table"]), lambda x: x)
  sl = stack(jnp.asarray(data["seq_lens"]), lambda x: jnp.maximum(x - 3, 0))
  f = jax.jit(jax.vmap(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl,
                                                                  plan=_plan(backend)),
                       in_axes=(0, None, 0, 0)))
  want = [mla_jax.paged_decode(*[jax.device_put(x, CPU[0]) for x in (q[i], data["kv_cache"],
                                                                      bt[i], sl[i])],
                               plan=_plan(backend)) for i in range(v)]
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  with jax.set_mesh(mesh):
    args = (put(q, P(None, "data", "model")), put(data["kv_cache"], P()),
            put(bt, P(None, "data")), put(sl, P(None, "data")))
    out = f(*args)
    hlo = f.lower(*args).compile().as_text()
  for i in range(v):
    np.testing.assert_allclose(np.asarray(out[i], np.float32), np.asarray(want[i], np.float32),
                               atol=1e-2, rtol=0)
  _expect_sharded(out, mesh, P(None, "data", "model", None))
  assert _collectives(hlo) == []


# --- shard_map: the op sees local shapes ---------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_shard_map_batch_and_heads(data, unsharded, backend, axis_type):
  mesh = _mesh(axis_type)
  local = _plan(backend, num_heads=H // 2)       # plan.num_heads is the *local* head count
  f = jax.jit(jax.shard_map(
      lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=local, return_lse=True),
      mesh=mesh, in_specs=(P("data", "model"), P(), P("data"), P("data")),
      out_specs=(P("data", "model"), P("data", "model"))))
  args = _place(data, mesh, P("data", "model"))
  out, lse = f(*args)
  _check((out, lse), unsharded[backend], unsharded["ref"])
  _expect_sharded(out, mesh, P("data", "model", None))
  assert _collectives(f.lower(*args).compile().as_text()) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_map_output_types_vary(data, backend):
  """Inside shard_map the result's type varies over the manual axes like the
  inputs, so check_vma rejects out_specs that claim it is replicated (which
  would silently keep one shard's heads)."""
  mesh = _mesh(AxisType.Auto)
  f = jax.jit(jax.shard_map(
      lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=_plan(backend, H // 2)),
      mesh=mesh, in_specs=(P(None, "model"), P(), P(), P()), out_specs=P()))
  with pytest.raises(ValueError, match="replicated"):
    f(*_place(data, mesh, P(None, "model")))


def test_shard_map_global_head_count_is_rejected(data):
  mesh = _mesh(AxisType.Auto)
  f = jax.jit(jax.shard_map(
      lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=_plan("cpu")),
      mesh=mesh, in_specs=(P(None, "model"), P(), P(), P()), out_specs=P(None, "model")))
  with pytest.raises(ValueError, match="num_heads"):
    f(*_place(data, mesh, P(None, "model")))


def _per_shard_caches(rng, shards, lens_per_shard):
  """Each data shard owns its own cache pages; block tables hold local ids."""
  parts = [random_paged_inputs(rng, lens, num_heads=H, page_size=PAGE, extra_pages=2)
           for lens in lens_per_shard]
  pages = max(p["kv_cache"].shape[0] for p in parts)
  cols = max(p["block_table"].shape[1] for p in parts)
  for p in parts:   # pad to one shape; padding pages/columns are never referenced
    p["kv_cache"] = np.pad(p["kv_cache"], ((0, pages - p["kv_cache"].shape[0]), (0, 0), (0, 0)))
    p["block_table"] = np.pad(p["block_table"], ((0, 0), (0, cols - p["block_table"].shape[1])),
                              constant_values=-1)
  cat = lambda k: np.concatenate([p[k] for p in parts])
  return parts, dict(query=jnp.asarray(cat("query")[:, 0], jnp.bfloat16),
                     kv_cache=jnp.asarray(cat("kv_cache"), jnp.bfloat16),   # [shards*pages, ...]
                     block_table=cat("block_table"), seq_lens=cat("seq_lens"))


def _per_shard_reference(parts, plan):
  outs, lses = [], []
  for p in parts:
    q = np.asarray(jnp.asarray(p["query"], jnp.bfloat16), np.float64)
    kv = np.asarray(jnp.asarray(p["kv_cache"], jnp.bfloat16), np.float64)
    o, l = reference_paged_decode(q, kv, p["block_table"], p["seq_lens"], plan)
    outs.append(o[:, 0])
    lses.append(l[:, 0])
  return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_map_data_parallel_per_shard_cache(backend):
  """DP: shard d decodes its own requests against its own cache (local page
  ids), TP inside: heads split over 'model'. No communication at all."""
  mesh = _mesh(AxisType.Auto)
  rng = np.random.default_rng(1)
  parts, d = _per_shard_caches(rng, 4, [[3, 40], [17, 0], [64, 9], [1, 50]])
  local = _plan(backend, num_heads=H // 2)
  f = jax.jit(jax.shard_map(
      lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=local, return_lse=True),
      mesh=mesh, in_specs=(P("data", "model"), P("data"), P("data"), P("data")),
      out_specs=(P("data", "model"), P("data", "model"))))
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (put(d["query"], P("data", "model")), put(d["kv_cache"], P("data")),
          put(d["block_table"], P("data")), put(d["seq_lens"], P("data")))
  out, lse = f(*args)
  ref_out, ref_lse = _per_shard_reference(parts, _plan(backend))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-3, rtol=0)
  _expect_sharded(out, mesh, P("data", "model", None))
  assert _collectives(f.lower(*args).compile().as_text()) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_map_data_only_heads_auto(backend):
  """shard_map manual over 'data' only, heads left to the automatic
  partitioner: correct (the op then runs replicated over 'model')."""
  mesh = _mesh(AxisType.Auto)
  rng = np.random.default_rng(2)
  parts, d = _per_shard_caches(rng, 4, [[3, 40], [17, 0], [64, 9], [1, 50]])

  def body(q, kv, bt, sl):
    q = jax.lax.with_sharding_constraint(q, P(None, "model"))
    return mla_jax.paged_decode(q, kv, bt, sl, plan=_plan(backend))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P("data"),
                            axis_names={"data"}))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
  out = f(*map(put, (d["query"], d["kv_cache"], d["block_table"], d["seq_lens"])))
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             _per_shard_reference(parts, _plan(backend))[0], atol=2e-2, rtol=0)


# --- sparse_decode: B (query, indices, topk_lens) and H (query, attn_sink) ------
_sd = importlib.import_module("mla_jax.sparse_decode")

SPARSE_BACKENDS = ["cpu", "xla"]
TOPK = 24
SPARSE_PAGES = 6


def _sparse_plan(backend, num_heads=H, q_len=1, kv_format="bf16"):
  return mla_jax.SparseDecodePlan(num_heads=num_heads, page_size=PAGE, sm_scale=192 ** -0.5,
                                  topk=TOPK, q_len=q_len, kv_format=kv_format, backend=backend)


def _sparse(plan):
  return jax.jit(lambda q, kv, i, tl, s: mla_jax.sparse_decode(
      q, kv, i, plan=plan, topk_lens=tl, attn_sink=s, return_lse=True))


@pytest.fixture(scope="module")
def sparse_data():
  rng = np.random.default_rng(3)
  slots = SPARSE_PAGES * PAGE
  b = len(LENS)
  idx = np.stack([rng.choice(slots, TOPK, replace=False) for _ in range(b)]).astype(np.int32)
  idx[1, 3:7] = -1                                   # padding in the middle
  idx[2, -2:] = slots                                # and past the cache
  return dict(query=jnp.asarray(rng.standard_normal((b, H, 576)), jnp.bfloat16),
              kv_cache=jnp.asarray(rng.standard_normal((SPARSE_PAGES, PAGE, 576)), jnp.bfloat16),
              indices=idx,
              topk_lens=np.array([TOPK, 20, TOPK, 0, 1, 9, TOPK, 17], np.int32),  # 0: empty
              attn_sink=np.linspace(-2, 2, H).astype(np.float32))


_SPARSE_KEYS = ("query", "kv_cache", "indices", "topk_lens", "attn_sink")


@pytest.fixture(scope="module")
def sparse_unsharded(sparse_data):
  on0 = [jax.device_put(sparse_data[k], CPU[0]) for k in _SPARSE_KEYS]
  res = {b: tuple(np.asarray(x, np.float32) for x in _sparse(_sparse_plan(b))(*on0))
         for b in SPARSE_BACKENDS}
  ref = mla_jax.testing.reference_sparse_decode(
      np.asarray(sparse_data["query"], np.float64)[:, None],
      np.asarray(sparse_data["kv_cache"], np.float64), sparse_data["indices"][:, None],
      _sparse_plan("cpu"), topk_lens=sparse_data["topk_lens"], attn_sink=sparse_data["attn_sink"])
  res["ref"] = (ref[0][:, 0], ref[1][:, 0])
  return res


def _sparse_place(d, mesh, qspec, cache_spec=P()):
  b, h = (tuple(qspec) + (None, None))[:2]
  specs = (qspec, cache_spec, P(b), P(b), P(h))
  return [jax.device_put(d[k], NamedSharding(mesh, s)) for k, s in zip(_SPARSE_KEYS, specs)]


@pytest.mark.parametrize("backend", SPARSE_BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sparse_auto_axes(sparse_data, sparse_unsharded, backend, layout):
  mesh = _mesh(AxisType.Auto)
  qspec = LAYOUTS[layout]
  args = _sparse_place(sparse_data, mesh, qspec)
  f = _sparse(_sparse_plan(backend))
  out, lse = f(*args)
  _check((out, lse), sparse_unsharded[backend], sparse_unsharded["ref"])
  b, h = (tuple(qspec) + (None, None))[:2]
  _expect_sharded(out, mesh, P(b, h, None))
  _expect_sharded(lse, mesh, P(b, h))
  assert _collectives(f.lower(*args).compile().as_text()) == []


def test_sparse_auto_axes_q_len2_fp8_split_query():
  """Q = 2, a (q_nope, q_pe) pair, an fp8_ds_mla cache, no topk_lens/sink,
  on a jax.sharding.Mesh (axis types Auto)."""
  mesh = jax.sharding.Mesh(np.array(CPU[:8]).reshape(4, 2), ("data", "model"))
  plan = _sparse_plan("cpu", q_len=2, kv_format="fp8_ds_mla")
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((8, 2, H, 576)), jnp.bfloat16)
  q = (q[..., :512], q[..., 512:])
  kv = mla_jax.quantize_latent_fp8(jnp.asarray(rng.standard_normal((SPARSE_PAGES, PAGE, 576)),
                                               jnp.float32))
  idx = rng.integers(-1, SPARSE_PAGES * PAGE, (8, 2, TOPK)).astype(np.int32)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = ([put(x, P("data", None, "model")) for x in q], put(kv, P()), put(idx, P("data")))
  f = jax.jit(lambda q, kv, i: mla_jax.sparse_decode(q, kv, i, plan=plan))
  out = f(*args)
  want = mla_jax.sparse_decode(*jax.device_put((q, kv, idx), CPU[0]), plan=plan)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  _expect_sharded(out, mesh, P("data", None, "model", None))
  assert _collectives(f.lower(*args).compile().as_text()) == []


def test_sparse_hlo_check_sees_collectives_without_the_rule(sparse_data):
  """The bare sparse kernel call on the same sharded inputs needs gathers."""
  mesh = _mesh(AxisType.Auto)
  plan = _sparse_plan("cpu")

  def bare(q, kv, i, tl, s):
    i = mla_jax._inputs.normalize_sparse(q, kv, i, tl, s, plan)
    return _op._local(_sd.SPEC, _op.Call(plan, True, i.has_sink), *i.operands)

  args = _sparse_place(sparse_data, mesh, LAYOUTS["both"])
  assert _collectives(jax.jit(bare).lower(*args).compile().as_text()) != []


@pytest.mark.parametrize("backend", SPARSE_BACKENDS)
@pytest.mark.parametrize("layout", ["heads", "both"])
def test_sparse_explicit_axes(sparse_data, sparse_unsharded, backend, layout):
  mesh = _mesh(AxisType.Explicit)
  qspec = LAYOUTS[layout]
  f = _sparse(_sparse_plan(backend))
  with jax.set_mesh(mesh):
    args = _sparse_place(sparse_data, mesh, qspec)
    out, lse = f(*args)
    hlo = f.lower(*args).compile().as_text()
  _check((out, lse), sparse_unsharded[backend], sparse_unsharded["ref"])
  b, h = (tuple(qspec) + (None, None))[:2]
  assert jax.typeof(out).sharding.spec == P(b, h, None)
  assert jax.typeof(lse).sharding.spec == P(b, h)
  _expect_sharded(out, mesh, P(b, h, None))
  assert _collectives(hlo) == []


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sparse_vmap_of_sharded_batch(sparse_data, axis_type):
  """vmap folds its axis into a sharded B without moving data."""
  mesh = _mesh(axis_type)
  plan = _sparse_plan("cpu")
  q = jnp.stack([sparse_data["query"], -sparse_data["query"]])               # [2, B, H, 576]
  idx = np.stack([sparse_data["indices"], sparse_data["indices"][::-1]])      # [2, B, K]
  f = jax.jit(jax.vmap(lambda q, kv, i, s: mla_jax.sparse_decode(q, kv, i, plan=plan,
                                                                  attn_sink=s),
                       in_axes=(0, None, 0, None)))
  kv, sink = sparse_data["kv_cache"], sparse_data["attn_sink"]
  want = [mla_jax.sparse_decode(*jax.device_put((q[i], kv, idx[i]), CPU[0]), plan=plan,
                                attn_sink=jax.device_put(sink, CPU[0])) for i in range(2)]
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  with jax.set_mesh(mesh):
    args = (put(q, P(None, "data", "model")), put(kv, P()), put(idx, P(None, "data")),
            put(sink, P("model")))
    out = f(*args)
    hlo = f.lower(*args).compile().as_text()
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(want[i], np.float32))
  _expect_sharded(out, mesh, P(None, "data", "model", None))
  assert _collectives(hlo) == []


@pytest.mark.parametrize("backend", SPARSE_BACKENDS + ["auto"])
def test_sparse_shard_map_batch_and_heads(sparse_data, sparse_unsharded, backend):
  mesh = _mesh(AxisType.Auto)
  local = _sparse_plan(backend, num_heads=H // 2)   # plan.num_heads is the *local* head count
  f = jax.jit(jax.shard_map(
      lambda q, kv, i, tl, s: mla_jax.sparse_decode(q, kv, i, plan=local, topk_lens=tl,
                                                    attn_sink=s, return_lse=True),
      mesh=mesh, in_specs=(P("data", "model"), P(), P("data"), P("data"), P("model")),
      out_specs=(P("data", "model"), P("data", "model"))))
  args = _sparse_place(sparse_data, mesh, P("data", "model"))
  out, lse = f(*args)
  _check((out, lse), sparse_unsharded["cpu" if backend == "auto" else backend],
         sparse_unsharded["ref"])
  _expect_sharded(out, mesh, P("data", "model", None))
  assert _collectives(f.lower(*args).compile().as_text()) == []
