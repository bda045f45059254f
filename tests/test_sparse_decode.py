"""mla_jax.sparse_decode (DeepSeek V3.2 sparse top-k MLA decode).

Every backend ("cpu", "xla", and "cuda" on a GPU machine) is compared with
:func:`mla_jax.testing.reference_sparse_decode`, a float64 NumPy evaluation
on the exact cache values the kernels see (the bf16/fp16 cache as stored,
or the fp8_ds_mla rows dequantised exactly: e4m3 * group scale, bf16 rope).

Checks made on every result (``assert_matches``):
  * shapes and dtypes; no NaN anywhere, no +inf lse;
  * lse is -inf exactly where the reference's is (no valid index) and out
    is exactly 0 there;
  * ||out - ref|| / ||ref|| <= 1e-2 over the other rows, and <= 2e-2 per row;
  * |lse - ref_lse| <= 2e-2 where finite.

The cache's four ckv groups get different magnitudes (and tokens random
ones) so that a wrong group scale shows. Sizes are small: CI has 2 cores.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import reference_sparse_decode

DN, DR = 512, 64
D = DN + DR
SM_SCALE = 1.0 / np.sqrt(192.0)  # DeepSeek-V3's softmax scale
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

GPU = pytest.mark.gpu
BACKENDS = ["cpu", "xla", pytest.param("cuda", marks=GPU)]
# (kv_format, scale_format): the cache layouts, fp8 with both scale rules.
FORMATS = [("bf16", None), ("fp8_ds_mla", "pow2"), ("fp8_ds_mla", "arbitrary")]
FORMAT_IDS = ["bf16", "fp8-pow2", "fp8-arbitrary"]

OUT_REL_TOL = 1e-2
ROW_REL_TOL = 2e-2
LSE_ABS_TOL = 2e-2
GROUP_MAGNITUDES = np.array([0.25, 1.0, 2.0, 0.5], np.float32)


# --- helpers ------------------------------------------------------------------
def device_for(backend: str):
  """CPU-backend inputs live on the CPU device (also on a GPU machine)."""
  if backend == "cpu":
    return jax.devices("cpu")[0]
  if backend == "cuda":
    return jax.devices("cuda")[0]
  return jax.devices()[0]


def make_plan(backend, num_heads, page_size, topk, q_len=1, kv_format="bf16"):
  return mla_jax.SparseDecodePlan(num_heads=num_heads, page_size=page_size, sm_scale=SM_SCALE,
                                  topk=topk, q_len=q_len, kv_format=kv_format, backend=backend)


def run_sparse(backend, query, kv_cache, indices, plan, **kwargs):
  """sparse_decode(..., return_lse=True) with every array on backend's device."""
  dev = device_for(backend)
  query, kv_cache, indices, kwargs = jax.device_put((query, kv_cache, indices, kwargs), dev)
  with jax.default_device(dev):
    res = mla_jax.sparse_decode(query, kv_cache, indices, plan=plan, return_lse=True, **kwargs)
    return jax.block_until_ready(res)


def random_latent(rng, shape):
  """float32 [..., 576] latents whose ckv groups have different magnitudes."""
  kv = rng.standard_normal(shape + (D,)).astype(np.float32)
  token_mag = rng.uniform(0.5, 2.0, shape + (1,)).astype(np.float32)
  kv[..., :DN] *= np.repeat(GROUP_MAGNITUDES, DN // 4) * token_mag
  return kv


def make_cache(kv_f32, kv_format, scale_format, dtype):
  """The cache operand: kv in dtype ("bf16"), or quantised uint8 rows."""
  if kv_format == "bf16":
    return kv_f32.astype(dtype)
  return np.asarray(mla_jax.quantize_latent_fp8(jnp.asarray(kv_f32), scale_format=scale_format))


class Case:
  """Random query, cache and distinct in-range indices (host arrays)."""

  def __init__(self, seed, *, batch, q_len, num_heads, topk, num_pages, page_size,
               kv_format="bf16", scale_format="pow2", dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    self.rng = rng
    self.dtype = jnp.dtype(dtype)
    self.kv_format = kv_format
    self.num_heads, self.page_size, self.topk, self.q_len = num_heads, page_size, topk, q_len
    self.num_slots = num_pages * page_size
    assert topk <= self.num_slots
    self.query = rng.standard_normal((batch, q_len, num_heads, D)).astype(dtype)
    self.kv_f32 = random_latent(rng, (num_pages, page_size))
    self.kv_cache = make_cache(self.kv_f32, kv_format, scale_format, dtype)
    self.indices = np.stack([rng.choice(self.num_slots, topk, replace=False)
                             for _ in range(batch * q_len)]).reshape(batch, q_len, topk)
    self.indices = self.indices.astype(np.int32)

  def plan(self, backend):
    return make_plan(backend, self.num_heads, self.page_size, self.topk, self.q_len,
                     self.kv_format)

  def reference(self, indices=None, topk_lens=None, attn_sink=None, kv_cache=None):
    return reference_sparse_decode(
        self.query.astype(np.float32), self.kv_cache if kv_cache is None else kv_cache,
        self.indices if indices is None else indices, self.plan("xla"), topk_lens=topk_lens,
        attn_sink=attn_sink)

  def run(self, backend, indices=None, kv_cache=None, **kwargs):
    return run_sparse(backend, self.query, self.kv_cache if kv_cache is None else kv_cache,
                      self.indices if indices is None else indices, self.plan(backend), **kwargs)


def assert_matches(out, lse, ref_out, ref_lse, dtype):
  """The comparison every numerics test makes (see the module docstring)."""
  assert out.dtype == jnp.dtype(dtype), out.dtype
  assert lse.dtype == jnp.float32, lse.dtype
  assert out.shape == ref_out.shape, (out.shape, ref_out.shape)
  assert lse.shape == ref_lse.shape, (lse.shape, ref_lse.shape)
  out = np.asarray(out.astype(jnp.float32), np.float64)
  lse = np.asarray(lse, np.float64)
  assert not np.any(np.isnan(out)), "NaN in out"
  assert not np.any(np.isnan(lse)), "NaN in lse"
  assert not np.any(np.isposinf(lse)), "lse is +inf somewhere"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="-inf pattern of lse")
  empty = np.isneginf(ref_lse)
  assert np.all(out[empty] == 0), "out is not 0 for a token with no valid index"
  assert np.all(np.isfinite(out)), "non-finite out"
  fin = ~empty
  if fin.any():
    err = np.abs(lse[fin] - ref_lse[fin]).max()
    assert err <= LSE_ABS_TOL, f"lse abs error {err:.3g} > {LSE_ABS_TOL}"
    rows_out, rows_ref = out[fin], ref_out[fin]
    nz = np.linalg.norm(rows_ref, axis=-1) > 0
    diff = rows_out[nz] - rows_ref[nz]
    rel = np.linalg.norm(diff) / np.linalg.norm(rows_ref[nz])
    assert rel <= OUT_REL_TOL, f"relative error {rel:.3g} > {OUT_REL_TOL}"
    worst = (np.linalg.norm(diff, axis=-1) / np.linalg.norm(rows_ref[nz], axis=-1)).max()
    assert worst <= ROW_REL_TOL, f"worst row relative error {worst:.3g} > {ROW_REL_TOL}"
    assert np.all(rows_out[~nz] == 0)


def seed_of(*parts) -> int:
  return zlib.crc32("/".join(map(str, parts)).encode())


# --- numerics -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_format,scale_format", FORMATS, ids=FORMAT_IDS)
def test_formats(backend, kv_format, scale_format):
  case = Case(seed_of("formats", kv_format, scale_format), batch=3, q_len=1, num_heads=16,
              topk=64, num_pages=12, page_size=16, kv_format=kv_format, scale_format=scale_format)
  out, lse = case.run(backend)
  assert_matches(out, lse, *case.reference(), case.dtype)


# (num_heads, q_len, format, dtype)
HEAD_CASES = [
    (1, 1, "bf16", "bf16"),
    (1, 2, "fp8-pow2", "bf16"),
    (16, 2, "fp8-arbitrary", "bf16"),
    (16, 1, "bf16", "fp16"),
    (16, 2, "fp8-pow2", "fp16"),
    (96, 1, "fp8-pow2", "bf16"),
    (96, 2, "bf16", "bf16"),
    (128, 1, "fp8-arbitrary", "bf16"),
    (128, 2, "fp8-pow2", "bf16"),
    (128, 1, "bf16", "fp16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,q_len,fmt,dtype", HEAD_CASES)
def test_heads_q_len_dtypes(backend, num_heads, q_len, fmt, dtype):
  kv_format, scale_format = FORMATS[FORMAT_IDS.index(fmt)]
  case = Case(seed_of("heads", num_heads, q_len, fmt, dtype), batch=2, q_len=q_len,
              num_heads=num_heads, topk=48, num_pages=8, page_size=64, kv_format=kv_format,
              scale_format=scale_format or "pow2",
              dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float16)
  out, lse = case.run(backend)
  assert_matches(out, lse, *case.reference(), case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_format,scale_format", FORMATS[:2], ids=FORMAT_IDS[:2])
def test_long_topk(backend, kv_format, scale_format):
  """K = 2048 (DeepSeek V3.2's index_topk) on a small batch / head count."""
  case = Case(seed_of("long", kv_format), batch=1, q_len=1, num_heads=16, topk=2048,
              num_pages=36, page_size=64, kv_format=kv_format, scale_format=scale_format)
  indices = case.indices.copy()
  indices[0, 0, 100:160] = -1          # some padding in the middle
  indices[0, 0, -5:] = case.num_slots  # and past the cache at the end
  out, lse = case.run(backend, indices=indices)
  assert_matches(out, lse, *case.reference(indices=indices), case.dtype)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_arbitrary_scales_applied_in_float(backend, dtype):
  """fp8_ds_mla with arbitrary (not power-of-two) scales at K = 2048: e4m3 * scale is
  not exact in the query dtype, so a backend that rounded the dequantised cache to it
  would move lse by about 1e-2 here with a bf16 query (1e-3 with fp16); the cpu and xla
  backends apply the scales in float32 and stay far inside the usual bounds."""
  case = Case(seed_of("arbitrary-float", jnp.dtype(dtype).name), batch=4, q_len=1, num_heads=16,
              topk=2048, num_pages=40, page_size=64, kv_format="fp8_ds_mla",
              scale_format="arbitrary", dtype=dtype)
  out, lse = case.run(backend)
  ref_out, ref_lse = case.reference()
  assert_matches(out, lse, ref_out, ref_lse, case.dtype)
  assert np.abs(np.asarray(lse, np.float64) - ref_lse).max() <= 1e-4
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) <= 4e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_format,scale_format", FORMATS, ids=FORMAT_IDS)
def test_padding(backend, kv_format, scale_format):
  """-1 at the start / middle / end, whole rows of -1, out-of-range values."""
  case = Case(seed_of("padding", kv_format, scale_format), batch=4, q_len=2, num_heads=16,
              topk=32, num_pages=6, page_size=16, kv_format=kv_format,
              scale_format=scale_format or "pow2")
  idx = case.indices.copy()
  n = case.num_slots
  idx[0, 0, :7] = -1                              # leading padding
  idx[0, 1, 10:20] = -1                           # padding in the middle
  idx[1, 0, :] = -1                               # a whole row of -1 ...
  idx[1, 1, ::2] = -1                             # ... next to a half-padded one
  idx[2, :, :] = -1                               # a whole request
  idx[3, 0, :4] = [n, n + 1, INT32_MAX, -2]       # >= P*S and negatives other than -1
  idx[3, 0, 4:8] = [INT32_MIN, -1000, 10**9, -1]
  idx[3, 1, :] = np.tile([n, -2, INT32_MIN, INT32_MAX], case.topk // 4)  # all invalid
  ref_out, ref_lse = case.reference(indices=idx)
  assert np.isneginf(ref_lse[1, 0]).all() and np.isneginf(ref_lse[2]).all()
  assert np.isneginf(ref_lse[3, 1]).all() and np.isfinite(ref_lse[3, 0]).all()
  out, lse = case.run(backend, indices=idx)
  assert_matches(out, lse, ref_out, ref_lse, case.dtype)
  # Sinks do not turn an empty row into NaN either.
  out_s, lse_s = case.run(backend, indices=idx, attn_sink=jnp.full((16,), 0.5, jnp.float32))
  assert_matches(out_s, lse_s, *case.reference(indices=idx, attn_sink=np.full(16, 0.5)), case.dtype)


def nan_page_cache(case, page):
  """The case's cache with every slot of `page` holding NaN."""
  if case.kv_format == "bf16":
    kv = np.array(case.kv_cache)
    kv[page] = np.nan
    return kv
  kv = np.array(case.kv_cache)
  kv[page, :, :DN] = 0x7F                                           # e4m3 NaN
  kv[page, :, DN:DN + 16] = np.frombuffer(np.full(4, np.nan, "<f4").tobytes(), np.uint8)
  kv[page, :, DN + 16:] = np.frombuffer(np.full(64, np.nan, np.float32).astype(
      jnp.bfloat16).tobytes(), np.uint8)
  return kv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_format,scale_format", FORMATS, ids=FORMAT_IDS)
def test_topk_lens(backend, kv_format, scale_format):
  """Entries past topk_lens[b] are ignored, even when they hit a NaN page."""
  b, q_len, k, s = 5, 2, 32, 16
  case = Case(seed_of("topk_lens", kv_format, scale_format), batch=b, q_len=q_len,
              num_heads=16, topk=k, num_pages=8, page_size=s, kv_format=kv_format,
              scale_format=scale_format or "pow2")
  nan_page = 7
  kv = nan_page_cache(case, nan_page)
  idx = case.indices.copy()
  # Live entries avoid the NaN page; the garbage after them hits it.
  idx = np.where(idx // s == nan_page, idx % s, idx).astype(np.int32)
  lens = np.array([k, 13, 0, -3, 1], np.int32)
  for r in range(b):
    n = max(0, min(lens[r], k))
    garbage = np.array([nan_page * s + 3, 10**9, INT32_MAX, -1, nan_page * s, -7], np.int32)
    idx[r, :, n:] = np.resize(garbage, k - n)
  idx[0, 1, 5] = -1                     # padding before topk_lens still counts as padding
  ref_out, ref_lse = case.reference(indices=idx, topk_lens=lens, kv_cache=kv)
  assert np.isneginf(ref_lse[2]).all() and np.isneginf(ref_lse[3]).all()
  out, lse = case.run(backend, indices=idx, kv_cache=kv, topk_lens=lens)
  assert_matches(out, lse, ref_out, ref_lse, case.dtype)
  # topk_lens > K means all K.
  lens_big = np.array([k + 1, INT32_MAX, k, k, 1000], np.int32)
  clean = case.indices
  out, lse = case.run(backend, indices=clean, topk_lens=lens_big)
  assert_matches(out, lse, *case.reference(indices=clean), case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_format,scale_format", FORMATS[:2], ids=FORMAT_IDS[:2])
def test_attn_sink(backend, kv_format, scale_format):
  """out *= exp(lse) / (exp(lse) + exp(sink[h])); lse unchanged."""
  h = 16
  case = Case(seed_of("sink", kv_format), batch=2, q_len=2, num_heads=h, topk=40, num_pages=6,
              page_size=16, kv_format=kv_format, scale_format=scale_format)
  rng = np.random.default_rng(7)
  sink = rng.normal(0.0, 3.0, h).astype(np.float32)
  sink[0], sink[1], sink[2] = -np.inf, 30.0, -30.0   # no sink, a dominating one, a negligible one
  out, lse = case.run(backend, attn_sink=sink)
  ref_out, ref_lse = case.reference(attn_sink=sink)
  assert_matches(out, lse, ref_out, ref_lse, case.dtype)
  out0, lse0 = case.run(backend)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse0), rtol=0, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out[:, :, 0]), np.asarray(out0[:, :, 0]))
  # The factor itself, on the kernel's own lse.
  lse64 = np.asarray(lse, np.float64)
  factor = 1.0 / (1.0 + np.exp(sink[None, None, :].astype(np.float64) - lse64))
  want = np.asarray(out0.astype(jnp.float32), np.float64) * factor[..., None]
  got = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_indices_count_each_time(backend):
  case = Case(seed_of("dups"), batch=1, q_len=1, num_heads=16, topk=16, num_pages=2,
              page_size=16)
  idx = np.array([[[3, 3, 3, 9, 9, 1, 2, 3, 31, 0, 0, 5, 6, 7, 8, 3]]], np.int32)
  out, lse = case.run(backend, indices=idx)
  assert_matches(out, lse, *case.reference(indices=idx), case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_layout", ["packed", "tuple"])
@pytest.mark.parametrize("with_q_axis", [True, False])
def test_query_layouts(backend, q_layout, with_q_axis):
  """[B, H, 576] + indices [B, K], [B, Q, H, 576] + [B, Q, K], and (q_nope, q_pe)."""
  case = Case(seed_of("layouts", q_layout, with_q_axis), batch=3, q_len=1, num_heads=16,
              topk=24, num_pages=4, page_size=16, kv_format="fp8_ds_mla")
  q = case.query if with_q_axis else case.query[:, 0]
  if q_layout == "tuple":
    q = (np.ascontiguousarray(q[..., :DN]), np.ascontiguousarray(q[..., DN:]))
  idx = case.indices if with_q_axis else case.indices[:, 0]
  out, lse = run_sparse(backend, q, case.kv_cache, idx, case.plan(backend))
  ref_out, ref_lse = case.reference()
  if not with_q_axis:
    ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert_matches(out, lse, ref_out, ref_lse, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_lse_false(backend):
  case = Case(seed_of("nolse"), batch=2, q_len=1, num_heads=16, topk=8, num_pages=2, page_size=16)
  dev = device_for(backend)
  with jax.default_device(dev):
    out = mla_jax.sparse_decode(*jax.device_put((case.query[:, 0], case.kv_cache, case.indices[:, 0]), dev),
                                plan=case.plan(backend))
  assert out.shape == (2, 16, DN)


def test_backends_agree_and_auto():
  case = Case(seed_of("agree"), batch=2, q_len=2, num_heads=16, topk=32, num_pages=4,
              page_size=16, kv_format="fp8_ds_mla")
  sink = np.linspace(-2, 2, 16).astype(np.float32)
  res = {b: case.run(b, attn_sink=sink) for b in ("cpu", "xla", "auto")}
  for b in ("xla", "auto"):
    np.testing.assert_allclose(np.asarray(res[b][0], np.float32), np.asarray(res["cpu"][0], np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(res[b][1]), np.asarray(res["cpu"][1]), rtol=0, atol=1e-3)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_vmap_and_jit(backend):
  """vmap over an extra request axis folds into B; values do not recompile."""
  case = Case(seed_of("vmap"), batch=2, q_len=1, num_heads=16, topk=16, num_pages=4, page_size=16)
  plan = case.plan(backend)
  dev = device_for(backend)
  q2 = np.stack([case.query[:, 0], case.query[::-1, 0]])          # [2, B, H, 576]
  i2 = np.stack([case.indices[:, 0], case.indices[::-1, 0]])      # [2, B, K]
  with jax.default_device(dev):
    f = jax.vmap(lambda q, i: mla_jax.sparse_decode(q, case.kv_cache, i, plan=plan, return_lse=True))
    out, lse = f(*jax.device_put((q2, i2), dev))
  ref_out, ref_lse = case.reference()
  assert_matches(out[0], lse[0], ref_out[:, 0], ref_lse[:, 0], case.dtype)
  assert_matches(out[1], lse[1], ref_out[::-1, 0], ref_lse[::-1, 0], case.dtype)


def test_not_differentiable():
  case = Case(seed_of("grad"), batch=1, q_len=1, num_heads=16, topk=8, num_pages=1, page_size=16)
  plan = case.plan("xla")
  q = jnp.asarray(case.query[:, 0])
  f = lambda q: mla_jax.sparse_decode(q, case.kv_cache, case.indices[:, 0], plan=plan).astype(
      jnp.float32).sum()
  with pytest.raises(TypeError, match="inference-only"):
    jax.grad(f)(q)


# --- plan and trace-time validation -------------------------------------------------------
def test_plan_validation():
  ok = dict(num_heads=16, page_size=64, sm_scale=0.1, topk=2048)
  plan = mla_jax.SparseDecodePlan(**ok)
  assert hash(plan) == hash(mla_jax.SparseDecodePlan(**ok)) and plan == mla_jax.SparseDecodePlan(**ok)
  assert plan.kv_format == "bf16" and plan.q_len == 1 and plan.backend == "auto"
  assert plan.kv_lora_rank == 512 and plan.qk_rope_head_dim == 64
  assert mla_jax.SparseDecodePlan(**{**ok, "sm_scale": 1}).sm_scale == 1.0
  with pytest.raises(dataclasses_frozen_error()):
    plan.topk = 3
  for field, bad, err in [("topk", 0, ValueError), ("topk", 65537, ValueError),
                          ("topk", 2.0, TypeError), ("topk", True, TypeError),
                          ("num_heads", 129, ValueError), ("num_heads", 0, ValueError),
                          ("page_size", 48, ValueError), ("page_size", 512, ValueError),
                          ("q_len", 0, ValueError), ("q_len", 9, ValueError),
                          ("sm_scale", 0.0, ValueError), ("sm_scale", float("nan"), ValueError),
                          ("sm_scale", "1", TypeError), ("kv_format", "fp8", ValueError),
                          ("kv_format", "fp8_e4m3", ValueError), ("backend", "gpu", ValueError)]:
    with pytest.raises(err, match=field):
      mla_jax.SparseDecodePlan(**{**ok, field: bad})
  assert mla_jax.SparseDecodePlan(**{**ok, "topk": 65536}).topk == 65536


def dataclasses_frozen_error():
  import dataclasses
  return dataclasses.FrozenInstanceError


def _bad_call(**over):
  """Traces sparse_decode with one argument replaced (shapes only: eval_shape)."""
  b, h, k, p, s = 2, 16, 8, 3, 16
  args = dict(query=jax.ShapeDtypeStruct((b, h, D), jnp.bfloat16),
              kv_cache=jax.ShapeDtypeStruct((p, s, D), jnp.bfloat16),
              indices=jax.ShapeDtypeStruct((b, k), jnp.int32),
              plan=make_plan("xla", h, s, k), topk_lens=None, attn_sink=None)
  args.update(over)
  return jax.eval_shape(lambda *a: mla_jax.sparse_decode(*a[:3], plan=args["plan"],
                                                        topk_lens=a[3], attn_sink=a[4]),
                        args["query"], args["kv_cache"], args["indices"], args["topk_lens"],
                        args["attn_sink"])


def test_shape_only_call_works():
  out = _bad_call()
  assert out.shape == (2, 16, DN) and out.dtype == jnp.bfloat16
  fp8 = _bad_call(kv_cache=jax.ShapeDtypeStruct((3, 16, 656), jnp.uint8),
                  plan=make_plan("xla", 16, 16, 8, kv_format="fp8_ds_mla"))
  assert fp8.shape == (2, 16, DN)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("over,err,match", [
    (dict(indices=S((2, 9), jnp.int32)), ValueError, "indices.*plan.topk = 8"),
    (dict(indices=S((2, 8), jnp.int64 if jax.config.jax_enable_x64 else jnp.int16)), TypeError, "indices"),
    (dict(indices=S((2, 1, 8), jnp.int32)), ValueError, "indices"),
    (dict(indices=S((3, 8), jnp.int32)), ValueError, "indices"),
    (dict(topk_lens=S((3,), jnp.int32)), ValueError, "topk_lens"),
    (dict(topk_lens=S((2,), jnp.float32)), TypeError, "topk_lens"),
    (dict(attn_sink=S((15,), jnp.float32)), ValueError, "attn_sink"),
    (dict(attn_sink=S((16,), jnp.bfloat16)), TypeError, "attn_sink"),
    (dict(kv_cache=S((3, 16, D), jnp.float16)), TypeError, "kv_cache"),
    (dict(kv_cache=S((3, 16, 656), jnp.uint8)), TypeError, "kv_cache"),
    (dict(kv_cache=S((3, 16, 512), jnp.bfloat16)), ValueError, "kv_cache"),
    (dict(kv_cache=S((3, 32, D), jnp.bfloat16)), ValueError, "page_size"),
    (dict(kv_cache=S((48, D), jnp.bfloat16)), ValueError, "kv_cache"),
    (dict(kv_cache=S((3, 16, D), jnp.bfloat16), plan=make_plan("xla", 16, 16, 8, kv_format="fp8_ds_mla")),
     TypeError, "uint8"),
    (dict(kv_cache=S((3, 16, 576), jnp.uint8), plan=make_plan("xla", 16, 16, 8, kv_format="fp8_ds_mla")),
     ValueError, "656"),
    (dict(query=S((2, 8, D), jnp.bfloat16)), ValueError, "num_heads"),
    (dict(query=S((2, 16, D), jnp.float32)), TypeError, "query"),
    (dict(query=S((2, 2, 16, D), jnp.bfloat16)), ValueError, "q_len"),
    (dict(plan=mla_jax.DecodePlan(num_heads=16, page_size=16, sm_scale=0.1)), TypeError, "SparseDecodePlan"),
])
def test_trace_time_errors(over, err, match):
  with pytest.raises(err, match=match):
    _bad_call(**over)


def test_cache_pair_rejected():
  with pytest.raises(TypeError, match="pair"):
    _bad_call(kv_cache=(S((3, 16, DN), jnp.bfloat16), S((3, 16, DR), jnp.bfloat16)))


def test_ffi_handler_validates():
  """The CPU handler itself rejects inconsistent operands with a clear message."""
  from mla_jax import _ffi
  b, q, h, k = 1, 1, 16, 8
  query = jnp.zeros((b, q, h, D), jnp.bfloat16)
  kv = jnp.zeros((2, 16, D), jnp.bfloat16)
  ops = dict(indices=jnp.zeros((b, q, k), jnp.int32), topk_lens=jnp.full((b,), k, jnp.int32),
             attn_sink=jnp.zeros((h,), jnp.float32), kv_scale=jnp.ones((1,), jnp.float32))
  outs = (jax.ShapeDtypeStruct((b, q, h, DN), jnp.bfloat16), jax.ShapeDtypeStruct((b, q, h), jnp.float32))
  attrs = dict(sm_scale=np.float32(0.1), has_sink=False, kv_lora_rank=512, qk_rope_head_dim=64)
  cpu = jax.devices("cpu")[0]

  def call(kv_format, kv, ops=ops):
    with jax.default_device(cpu):
      f = jax.ffi.ffi_call(_ffi.SPARSE_CPU_TARGET, outs)
      return jax.block_until_ready(f(query, query, kv, ops["indices"], ops["topk_lens"],
                                     ops["attn_sink"], ops["kv_scale"], kv_format=kv_format, **attrs))

  out, lse = call(0, kv)  # all-zero inputs: uniform softmax over 8 zero rows
  assert np.all(np.asarray(out, np.float32) == 0) and np.allclose(np.asarray(lse), np.log(8))
  with pytest.raises(Exception, match="kv_format must be 0"):
    call(7, kv)
  with pytest.raises(Exception, match="uint8"):
    call(1, kv)
  with pytest.raises(Exception, match="656"):
    call(1, jnp.zeros((2, 16, 600), jnp.uint8))
  with pytest.raises(Exception, match="topk_lens"):
    call(0, kv, {**ops, "topk_lens": jnp.zeros((2,), jnp.int32)})
  with pytest.raises(Exception, match="attn_sink"):
    call(0, kv, {**ops, "attn_sink": jnp.zeros((3,), jnp.float32)})


def test_inside_shard_map_with_auto_backend():
  """backend "auto" joins the kernel and pure-JAX branches inside shard_map
  (the kernel results must carry the inputs' varying-axes type)."""
  from jax.sharding import PartitionSpec as P
  cpu = jax.devices("cpu")
  mesh = jax.sharding.Mesh(np.array(cpu[:4]), ("data",))
  case = Case(seed_of("shard_map"), batch=4, q_len=1, num_heads=8, topk=32, num_pages=6,
              page_size=16)
  plan = case.plan("auto")
  put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  query, kv, indices = put(case.query, P("data")), put(case.kv_cache, P()), put(case.indices, P("data"))

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P("data"), P("data")))
  def decode(q, kv, idx):
    return mla_jax.sparse_decode(q, kv, idx, plan=plan, return_lse=True)

  with jax.default_device(cpu[0]):
    out, lse = decode(query, kv, indices)
  assert_matches(out, lse, *case.reference(), case.dtype)


# --- the Hopper kernel for fp8_ds_mla (sm_90) ---------------------------------------
def _hopper():
  device = mla_jax.kernels.visible_cuda_device()
  return device is not None and device.arch // 10 == 9 and mla_jax._ffi.ext().has_sm90a()


# (num_heads, q_len, topk, scale_format, dtype)
HOPPER_CASES = [
    (128, 1, 2048, "pow2", jnp.bfloat16),
    (128, 2, 2049, "arbitrary", jnp.bfloat16),   # one index past a whole number of 64-token tiles
    (128, 1, 700, "pow2", jnp.float16),          # 128 heads, fp16 query: two row blocks, the bf16 rope converted
    (64, 4, 64, "pow2", jnp.float16),             # fp16 query: the bf16 rope is converted on chip
    (96, 1, 1, "arbitrary", jnp.bfloat16),
    (64, 1, 300, "arbitrary", jnp.float16),
    (32, 2, 2048, "pow2", jnp.bfloat16),          # 17-32 heads: the swap-AB kernel, 32 rows a CTA (seesaw, lock-step forced: one 64-row block)
    (24, 1, 2049, "arbitrary", jnp.bfloat16),     # 17-32 heads, rows past 24 of the 32-row block zero
    (17, 2, 64, "pow2", jnp.bfloat16),
    (64, 1, 1023, "pow2", jnp.bfloat16),          # one below kSeesawSparseMinTopk: auto keeps the lock-step kernel
    (128, 1, 1024, "arbitrary", jnp.bfloat16),    # kSeesawSparseMinTopk itself: auto takes the seesaw kernel
    (20, 1, 300, "arbitrary", jnp.float16),
    (16, 1, 2048, "pow2", jnp.bfloat16),          # 16 heads or fewer, bf16 query: the swap-AB kernel, 16 rows a CTA
    (16, 2, 2049, "arbitrary", jnp.bfloat16),
    (12, 4, 64, "pow2", jnp.bfloat16),
    (8, 1, 300, "arbitrary", jnp.bfloat16),
    (1, 1, 1, "arbitrary", jnp.bfloat16),
    (16, 1, 300, "pow2", jnp.float16),            # fp16 query: the portable kernel
]


def _hopper_kernel(num_heads, dtype, topk):
  """The kernel auto-selection picks on an sm_90 GPU for fp8_ds_mla."""
  if dtype == jnp.bfloat16 and num_heads <= 32:
    return "sm90_swapab"
  if num_heads > 16:
    return "sm90_seesaw" if dtype == jnp.bfloat16 and topk >= 1024 else "sm90_lockstep"
  return "portable"


@GPU
@pytest.mark.parametrize("kernel", ["auto", "portable", "sm90_lockstep", "sm90_seesaw"])
@pytest.mark.parametrize("num_heads,q_len,topk,scale_format,dtype", HOPPER_CASES)
def test_hopper_fp8_ds_mla(kernel, num_heads, q_len, topk, scale_format, dtype):
  """On an sm_90 GPU (auto) 32 heads or fewer with a bf16 query run the
  swap-AB kernel (the scales applied to the S^T group sums and the V^T
  values; 16 or 32 rows a CTA); more than 32 the seesaw kernel with a bf16
  query and top-k 1024 or more (rows gathered by index into the halves each
  warpgroup frees, dequantised on chip), else (and with an fp16 query above
  16 heads) the lock-step kernel. The Hopper kernels are also forced on
  every shape they serve. Padding and out-of-range indices anywhere,
  topk_lens with garbage (a NaN page) after it, and sinks, against the
  float64 reference, and a second run bit for bit."""
  if kernel.startswith("sm90") and not _hopper():
    pytest.skip("needs an sm_90 GPU and a build with sm_90a code")
  if kernel == "sm90_seesaw" and dtype != jnp.bfloat16:
    pytest.skip("sm90_seesaw gathers fp8_ds_mla rows for a bf16 query only")
  b, s = 3, 64
  case = Case(seed_of("hopper", num_heads, q_len, topk, scale_format), batch=b, q_len=q_len,
              num_heads=num_heads, topk=topk, num_pages=max(40, -(-topk // s) + 8), page_size=s,
              kv_format="fp8_ds_mla", scale_format=scale_format, dtype=dtype)
  nan_page = case.num_slots // s - 1
  kv = nan_page_cache(case, nan_page)
  idx = np.where(case.indices // s == nan_page, case.indices % s, case.indices).astype(np.int32)
  n = case.num_slots
  if topk > 8:
    idx[0, 0, :5] = -1                                  # leading padding
    idx[0, -1, topk // 2: topk // 2 + 7] = [n, -1, INT32_MAX, -2, INT32_MIN, n + 64, -1]
  idx[1, -1, :] = -1                                    # a whole row of padding
  lens = np.array([topk, max(1, topk - 70), topk + 5], np.int32)
  for r in range(b):
    m = max(0, min(lens[r], topk))
    idx[r, :, m:] = np.resize(np.array([nan_page * s + 1, 10**9, -1], np.int32), topk - m)
  sink = np.random.default_rng(3).normal(0.0, 2.0, num_heads).astype(np.float32)
  plan = dataclasses.replace(case.plan("cuda"), kernel=kernel)
  if kernel == "auto" and _hopper():
    assert mla_jax.explain(plan, case.query, kv, idx).kernel.kernel == _hopper_kernel(num_heads, dtype, topk)
  if kernel.startswith("sm90"):
    assert mla_jax.explain(plan, case.query, kv, idx).kernel.kernel == kernel
  ref = case.reference(indices=idx, topk_lens=lens, kv_cache=kv, attn_sink=sink)
  out, lse = run_sparse("cuda", case.query, kv, idx, plan, topk_lens=lens, attn_sink=sink)
  assert_matches(out, lse, *ref, case.dtype)
  out2, lse2 = run_sparse("cuda", case.query, kv, idx, plan, topk_lens=lens, attn_sink=sink)
  np.testing.assert_array_equal(np.asarray(out2.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def _long_items_case(seed, b, h, scale_format, rng_seed, full_every, short):
  """Inputs of the long-items tests: b entries x q_len 2, top-k 2048 over 72 pages of 64, one
  of them NaN. topk_lens random, every full_every-th full, entry 3 zero and the `short` ones
  set as given ({entry: length}); garbage after them pointing at the NaN page (never read);
  nine padding and out-of-range entries in the middle of each entry's first query token."""
  q_len, topk, s = 2, 2048, 64
  case = Case(seed, batch=b, q_len=q_len, num_heads=h, topk=topk, num_pages=72, page_size=s,
              kv_format="fp8_ds_mla", scale_format=scale_format, dtype=jnp.bfloat16)
  nan_page = case.num_slots // s - 1
  kv = nan_page_cache(case, nan_page)
  idx = np.where(case.indices // s == nan_page, case.indices % s, case.indices).astype(np.int32)
  rng = np.random.default_rng(rng_seed)
  lens = rng.integers(1, topk + 1, b).astype(np.int32)
  lens[::full_every] = topk
  lens[3] = 0
  for r, n in short.items():
    lens[r] = n
  for r in range(b):
    idx[r, :, lens[r]:] = nan_page * s + 2
    pad = rng.choice(topk, 9, replace=False)
    idx[r, 0, pad] = np.array([-1, case.num_slots, -7, INT32_MAX, -1, -1, case.num_slots + 3, -2, -1], np.int32)
  return case, kv, idx, lens


def _matches_reference_twice(case, kv, idx, plan, lens):
  """Every entry against the float64 reference on the dequantised values, and a second run
  bit for bit against the first."""
  out, lse = run_sparse("cuda", case.query, kv, idx, plan, topk_lens=lens)
  ref_out, ref_lse = reference_sparse_decode(case.query.astype(np.float32), kv, idx, case.plan("xla"),
                                             topk_lens=lens)
  assert_matches(out, lse, ref_out, ref_lse, case.dtype)
  out2, lse2 = run_sparse("cuda", case.query, kv, idx, plan, topk_lens=lens)
  np.testing.assert_array_equal(np.asarray(out2.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@GPU
@pytest.mark.parametrize("schedule,h", [("auto", 64), ("kernel", 64), ("block", 64), ("block", 128), ("step", 128)])
def test_hopper_seesaw_long_items(schedule, h):
  """The seesaw kernel's gathers over items of many tiles: 48 entries x
  q_len 2 with top-k 2048 (96 requests: schedule "step" unless forced)
  give whole requests of up to 32 tiles, so every half of both stages is
  gathered and converted many times and the half barriers' parities carry
  across items; at 128 heads over two row blocks. Mixed topk_lens (0,
  short, odd, full), garbage after them pointing at a NaN page, padding
  and out-of-range entries in the middle, a tile of nothing but padding.
  pow2 scales: with arbitrary ones the e4m3 x scale products rounded to
  bf16 move lse by up to ~0.025 at this top-k (docs/kernels.md)."""
  if not _hopper():
    pytest.skip("needs an sm_90 GPU and a build with sm_90a code")
  case, kv, idx, lens = _long_items_case(seed_of("seesaw-long", schedule, h), 48, h, "pow2", 11, 5, {4: 65})
  idx[0, 1, 128:192] = -1                                   # a whole tile of padding
  choice = mla_jax.KernelChoice(kernel="sm90_seesaw", schedule=schedule)
  plan = dataclasses.replace(case.plan("cuda"), kernel=choice)
  got = mla_jax.explain(plan, case.query, kv, idx).kernel
  assert got.kernel == "sm90_seesaw" and got.schedule == ("step" if schedule == "auto" else schedule), str(got)
  _matches_reference_twice(case, kv, idx, plan, lens)


@GPU
@pytest.mark.parametrize("heads", [16, 24, 32])
def test_hopper_swapab_long_items(heads):
  """Items of many tiles: 64 entries x q_len 2 with top-k 2048 give the scheduler whole
  requests of up to 32 tiles per partition, so the swap-AB kernel refills every stage of its
  ring many times and its barrier parities carry across items (the small cases above end
  before a refill); 16 heads run its 16-row form, 24 and 32 the 32-row one (rows 24..31
  zero). Mixed topk_lens (0, short, full), garbage after them pointing at a NaN
  page, padding in the middle; every entry against the float64 reference (not against the
  portable kernel, whose cache rounded to bf16 moves lse by up to ~0.025 at this top-k), and a
  second run bit for bit against the first."""
  case, kv, idx, lens = _long_items_case(seed_of("swapab-long", heads), 64, heads, "arbitrary", 5, 7, {})
  plan = case.plan("cuda")
  if _hopper():
    assert mla_jax.explain(plan, case.query, kv, idx).kernel.kernel == "sm90_swapab"
  _matches_reference_twice(case, kv, idx, plan, lens)


@GPU
@pytest.mark.parametrize("heads", [16, 32])
def test_hopper_swapab_inline_schedule_matches_scheduler_kernel(heads):
  """Up to 32 requests (entries x q_len) the swap-AB kernel schedules itself (warp 0 of every
  CTA); schedule "kernel" runs the scheduler kernel first: the same items in the same order, so
  the outputs agree bit for bit. 12 entries x q_len 2 of the long-items inputs (zero, short and
  full topk_lens, garbage after them, padding in the middle), against the float64 reference."""
  if not _hopper():
    pytest.skip("needs an sm_90 GPU and a build with sm_90a code")
  case, kv, idx, lens = _long_items_case(seed_of("swapab-inline", heads), 12, heads, "pow2", 13, 4, {5: 65})
  results = []
  for schedule in ("inline", "kernel"):
    plan = dataclasses.replace(case.plan("cuda"), kernel=mla_jax.KernelChoice(kernel="sm90_swapab", schedule=schedule))
    got = mla_jax.explain(plan, case.query, kv, idx).kernel
    assert (got.kernel, got.schedule) == ("sm90_swapab", schedule), str(got)
    results.append(run_sparse("cuda", case.query, kv, idx, plan, topk_lens=lens))
  ref_out, ref_lse = reference_sparse_decode(case.query.astype(np.float32), kv, idx, case.plan("xla"),
                                             topk_lens=lens)
  assert_matches(*results[0], ref_out, ref_lse, case.dtype)
  (out, lse), (out_k, lse_k) = results
  np.testing.assert_array_equal(np.asarray(out_k.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(lse_k), np.asarray(lse))


@GPU
@pytest.mark.parametrize("kernel,heads,others", [
    ("sm90_seesaw", 128, ("block", "kernel")),   # two row blocks
    ("sm90_seesaw", 64, ("block",)),
    ("sm90_swapab", 16, ("kernel",)),
])
def test_hopper_sparse_step_schedule_matches_the_kernels_own(kernel, heads, others):
  """Above 32 query tokens auto takes schedule "step": the op's schedule call, over topk_lens
  alone, computes the items that the decode reads. The scheduler kernel and the seesaw kernel's
  block schedule run the same scheduling code on the same lengths: the same items in the same
  order, so the outputs agree bit for bit. 24 entries x q_len 2 (48 query tokens) of the
  long-items inputs (zero, short and full topk_lens, garbage after them, padding in the
  middle), against the float64 reference."""
  if not _hopper():
    pytest.skip("needs an sm_90 GPU and a build with sm_90a code")
  case, kv, idx, lens = _long_items_case(seed_of("sparse-step", kernel, heads), 24, heads, "pow2", 17, 6, {2: 65})
  auto = mla_jax.explain(case.plan("cuda"), case.query, kv, idx).kernel
  assert (auto.kernel, auto.schedule) == (kernel, "step"), str(auto)
  results = []
  for schedule in ("step",) + others:
    plan = dataclasses.replace(case.plan("cuda"), kernel=mla_jax.KernelChoice(kernel=kernel, schedule=schedule))
    got = mla_jax.explain(plan, case.query, kv, idx).kernel
    assert (got.kernel, got.schedule) == (kernel, schedule), str(got)
    results.append(run_sparse("cuda", case.query, kv, idx, plan, topk_lens=lens))
  ref_out, ref_lse = reference_sparse_decode(case.query.astype(np.float32), kv, idx, case.plan("xla"),
                                             topk_lens=lens)
  assert_matches(*results[0], ref_out, ref_lse, case.dtype)
  out, lse = results[0]
  for out_o, lse_o in results[1:]:
    np.testing.assert_array_equal(np.asarray(out_o.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(lse_o), np.asarray(lse))
