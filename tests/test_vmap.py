"""JAX transformations of paged_decode: vmap folds into the batch; autodiff is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import random_paged_inputs

CPU = jax.devices("cpu")
H = 4
PAGE = 8
B = 3


def _plan(backend="cpu", q_len=1):
  return mla_jax.DecodePlan(num_heads=H, page_size=PAGE, sm_scale=0.125, q_len=q_len,
                            backend=backend)


def _op(plan):
  return lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan, return_lse=True)


@pytest.fixture(scope="module")
def data():
  """A shared cache and, for V = 2 x 3 variants, B requests each."""
  rng = np.random.default_rng(0)
  lens = rng.integers(0, 5 * PAGE, size=(6 * B,))
  d = random_paged_inputs(rng, lens, num_heads=H, page_size=PAGE, q_len=2)
  put = lambda x: jax.device_put(x, CPU[0])
  q = jnp.asarray(d["query"], jnp.bfloat16)                      # [6B, 2, H, 576]
  return dict(
      q1=put(q[:, 0].reshape(2, 3, B, H, 576)),                  # q_len 1: [2, 3, B, H, 576]
      q2=put(q.reshape(2, 3, B, 2, H, 576)),                     # q_len 2
      kv=put(jnp.asarray(d["kv_cache"], jnp.bfloat16)),
      bt=put(d["block_table"].reshape(2, 3, B, -1)),
      sl=put(d["seq_lens"].reshape(2, 3, B)))


def _assert_same(got, want):
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _loop(f, args, in_axes):
  """Reference: Python loop over the leading axis of the batched args."""
  n = next(a.shape[0] for a, ax in zip(args, in_axes) if ax is not None)
  outs = [f(*[a if ax is None else a[i] for a, ax in zip(args, in_axes)]) for i in range(n)]
  return tuple(jnp.stack(o) for o in zip(*outs))


@pytest.mark.parametrize("backend", ["auto", "cpu", "xla"])
@pytest.mark.parametrize("q_len", [1, 2])
def test_vmap_folds_into_batch(data, backend, q_len):
  f = _op(_plan(backend, q_len))
  q = data["q1"][0] if q_len == 1 else data["q2"][0]
  args, axes = (q, data["kv"], data["bt"][0], data["sl"][0]), (0, None, 0, 0)
  got = jax.jit(jax.vmap(f, in_axes=axes))(*args)
  _assert_same(got, _loop(f, args, axes))
  # One kernel call on a batch of 3 * B requests, no loop.
  hlo = jax.jit(jax.vmap(f, in_axes=axes)).lower(*args).as_text()
  assert "stablehlo.while" not in hlo
  if backend != "xla":
    assert hlo.count("custom_call @mla_jax_paged_decode_cpu") == 1
    assert f"tensor<{3 * B}x{q_len}x{H}x576xbf16>" in hlo


@pytest.mark.parametrize("backend", ["auto", "cpu", "xla"])
def test_vmap_over_an_empty_axis(data, backend):
  # A mapped axis of size 0 folds into a batch of 0 requests and unfolds back.
  f = _op(_plan(backend))
  args = (data["q1"][0][:0], data["kv"], data["bt"][0][:0], data["sl"][0][:0])
  out, lse = jax.vmap(f, in_axes=(0, None, 0, 0))(*args)
  assert out.shape == (0, B, H, 512) and lse.shape == (0, B, H)


def test_nested_vmap(data):
  f = _op(_plan())
  inner = jax.vmap(f, in_axes=(0, None, 0, 0))
  got = jax.jit(jax.vmap(inner, in_axes=(0, None, 0, 0)))(data["q1"], data["kv"], data["bt"],
                                                         data["sl"])
  want = [_loop(f, (data["q1"][i], data["kv"], data["bt"][i], data["sl"][i]), (0, None, 0, 0))
          for i in range(2)]
  _assert_same(got, tuple(jnp.stack(w) for w in zip(*want)))
  assert got[0].shape == (2, 3, B, H, 512) and got[1].shape == (2, 3, B, H)


@pytest.mark.parametrize("in_axes", [(0, None, None, None), (None, None, 0, 0),
                                     (0, None, 0, None), (None, None, None, 0)],
                         ids=["query", "table+lens", "query+table", "lens"])
def test_vmap_some_args_batched(data, in_axes):
  f = _op(_plan())
  full = (data["q1"][0], data["kv"], data["bt"][0], data["sl"][0])
  args = tuple(a if ax is not None else (a if i == 1 else a[0]) for i, (a, ax) in
               enumerate(zip(full, in_axes)))
  got = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
  _assert_same(got, _loop(f, args, in_axes))


def test_vmap_over_cache_loops(data):
  """A batched cache cannot fold into B: the op maps over it (still correct)."""
  f = _op(_plan())
  kvs = jnp.stack([data["kv"], data["kv"][::-1]])
  args, axes = (data["q1"][0, :2], kvs, data["bt"][0, :2], data["sl"][0, :2]), (0, 0, 0, 0)
  _assert_same(jax.jit(jax.vmap(f, in_axes=axes))(*args), _loop(f, args, axes))


def test_vmap_out_axes_and_split_inputs(data):
  """(q_nope, q_pe) / (ckv, kpe) pairs under vmap, result batched on axis 1."""
  plan = _plan()

  def f(q, bt, sl):
    return mla_jax.paged_decode((q[..., :512], q[..., 512:]),
                                (data["kv"][..., :512], data["kv"][..., 512:]), bt, sl, plan=plan)

  q, bt, sl = data["q1"][0], data["bt"][0], data["sl"][0]
  got = jax.jit(jax.vmap(f, out_axes=1))(q, bt, sl)
  want = jnp.stack([f(q[i], bt[i], sl[i]) for i in range(3)], axis=1)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- autodiff: inference-only -------------------------------------------------
@pytest.fixture(scope="module")
def single(data):
  return data["q1"][0, 0], data["kv"], data["bt"][0, 0], data["sl"][0, 0]


def _loss(plan):
  return lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan).astype(
      jnp.float32).sum()


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_grad_is_refused(single, backend):
  loss = _loss(_plan(backend))
  with pytest.raises(TypeError, match="inference-only"):
    jax.grad(loss)(*single)
  with pytest.raises(TypeError, match="inference-only"):
    jax.grad(loss, argnums=1)(*single)                            # w.r.t. the cache


def test_jvp_and_vjp_are_refused(single):
  f = lambda q: mla_jax.paged_decode(q, *single[1:], plan=_plan())
  q = single[0]
  with pytest.raises(TypeError, match="inference-only"):
    jax.jvp(f, (q,), (jnp.ones_like(q),))
  with pytest.raises(TypeError, match="inference-only"):
    jax.vjp(f, q)
  with pytest.raises(TypeError, match="inference-only"):
    jax.jit(jax.grad(lambda q: f(q).astype(jnp.float32).sum()))(q)


def test_stop_gradient_workaround(single):
  """Inside a differentiated function, stop_gradient on the inputs works."""
  plan = _plan()

  def loss(q):
    out = mla_jax.paged_decode(jax.lax.stop_gradient(q), *single[1:], plan=plan)
    return out.astype(jnp.float32).sum() + (q.astype(jnp.float32) ** 2).sum()

  g = jax.grad(loss)(single[0])
  np.testing.assert_allclose(np.asarray(g, np.float32),
                             2 * np.asarray(single[0], np.float32), rtol=1e-2)
