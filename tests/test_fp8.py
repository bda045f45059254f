"""FP8 latent caches.

* ``quantize_latent_fp8`` / ``dequantize_latent_fp8``: the 656-byte
  fp8_ds_mla layout byte for byte, both scale rules (power-of-two scales are
  rounded up, arbitrary ones are not rounded at all), zero groups, dtypes,
  jit, errors.
* Dense FP8 decode (``paged_decode`` with a float8_e4m3fn cache and
  ``kv_scale``): equal to the bf16 decode of the same dequantised cache, and
  to the float64 reference; the kv_scale / cache-dtype pairing errors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mla_jax
from mla_jax.testing import (dequantize_latent_fp8_np, random_paged_inputs,
                             reference_paged_decode)

DN, DR = 512, 64
D = DN + DR
SM_SCALE = 1.0 / np.sqrt(192.0)
GPU = pytest.mark.gpu
BACKENDS = ["cpu", "xla", pytest.param("cuda", marks=GPU)]


def device_for(backend: str):
  if backend == "cpu":
    return jax.devices("cpu")[0]
  if backend == "cuda":
    return jax.devices("cuda")[0]
  return jax.devices()[0]


def latent(seed, shape=(3, 8), dtype=np.float32):
  rng = np.random.default_rng(seed)
  kv = rng.standard_normal(shape + (D,)).astype(np.float32)
  kv[..., :DN] *= np.repeat(np.array([1e-3, 1.0, 37.0, 0.3], np.float32), 128)
  kv *= rng.uniform(0.1, 10.0, shape + (1,)).astype(np.float32)
  return kv.astype(dtype)


def expected_scales(kv, scale_format):
  """float32 [..., 4] scales computed in NumPy from the rule."""
  amax = np.abs(np.asarray(kv, np.float32)[..., :DN].reshape(kv.shape[:-1] + (4, 128))).max(-1)
  s = (amax / np.float32(448.0)).astype(np.float32)
  if scale_format == "pow2":   # floored at 1e-4, then rounded up to a power of two
    return np.exp2(np.ceil(np.log2(np.maximum(s.astype(np.float64), 1e-4)))).astype(np.float32)
  return np.where(s >= np.float32(2.0**-126), s, np.float32(1.0)).astype(np.float32)


# --- quantisation ------------------------------------------------------------------------------
def quantize_on(device, kv, scale_format):
  with jax.default_device(device):
    return np.asarray(mla_jax.quantize_latent_fp8(jax.device_put(kv, device),
                                                  scale_format=scale_format))


def exact_device(scale_format):
  """pow2 bytes are exact everywhere; arbitrary scales need IEEE division (CPU)."""
  return jax.devices()[0] if scale_format == "pow2" else jax.devices("cpu")[0]


@pytest.mark.parametrize("scale_format", ["pow2", "arbitrary"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, jnp.float16])
def test_layout_byte_for_byte(scale_format, dtype):
  kv = latent(1, dtype=dtype)
  q = quantize_on(exact_device(scale_format), kv, scale_format)
  assert q.dtype == np.uint8 and q.shape == kv.shape[:-1] + (656,)
  scales = np.ascontiguousarray(q[..., 512:528]).view("<f4")
  want = expected_scales(kv, scale_format)
  np.testing.assert_array_equal(scales, want)
  # Scales are little-endian float32 bytes.
  np.testing.assert_array_equal(q[..., 512:528], want.astype("<f4").view(np.uint8).reshape(q[..., 512:528].shape))
  # ckv bytes: round-to-nearest e4m3 of ckv / scale.
  ckv = np.asarray(kv, np.float32)[..., :DN].reshape(kv.shape[:-1] + (4, 128)) / want[..., None]
  e4m3 = np.clip(ckv, -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(kv.shape[:-1] + (DN,))
  np.testing.assert_array_equal(q[..., :512], e4m3.view(np.uint8))
  # kpe: bf16 bytes (little-endian), rounded from the input dtype.
  kpe = np.asarray(kv)[..., DN:].astype(np.float32).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(q[..., 528:], kpe.view(np.uint8).reshape(q[..., 528:].shape))
  assert not np.any((q[..., :512] & 0x7F) == 0x7F), "an e4m3 NaN byte"


def _reference_rows(kv_bf16):
  """656-byte rows by the rule of FlashMLA's reference quantiser, in float32
  as it computes: scale = 2^ceil(log2(max(amax / 448, 1e-4))), e4m3 of
  ckv / scale (round to nearest even), the bf16 rope bytes as they are."""
  x = np.asarray(kv_bf16).astype(np.float32)
  groups = x[..., :DN].reshape(x.shape[:-1] + (4, 128))
  inv = np.abs(groups).max(-1) / np.float32(448.0)
  scale = np.power(np.float32(2.0), np.ceil(np.log2(np.maximum(inv, np.float32(1e-4))))).astype(np.float32)
  e4m3 = (groups / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(x.shape[:-1] + (DN,))
  rope = np.asarray(kv_bf16)[..., DN:].astype(ml_dtypes.bfloat16)
  return np.concatenate([e4m3.view(np.uint8), scale.astype("<f4").view(np.uint8).reshape(x.shape[:-1] + (16,)),
                         rope.view(np.uint8).reshape(x.shape[:-1] + (128,))], axis=-1)


def test_pow2_rows_equal_the_reference_quantiser_bytes():
  """Interoperability: the pow2 rows are byte for byte what FlashMLA's
  reference quantiser writes for a bf16 cache, tiny and all-zero groups
  included, so caches in that layout are read and written as they are."""
  kv = latent(20, shape=(64, 16))
  kv[..., 128:256] *= 1e-4       # groups below the 1e-4 floor
  kv[3, 5, :DN] = 0.0            # an all-zero token
  kv = jnp.asarray(kv, jnp.bfloat16)
  ours = quantize_on(jax.devices()[0], kv, "pow2")
  want = _reference_rows(kv)
  assert ours.shape == want.shape == (64, 16, 656)
  np.testing.assert_array_equal(ours, want)


def test_scale_bytes_known_values():
  kv = np.zeros((1, 1, D), np.float32)
  kv[0, 0, 0] = 448.0          # group 0: amax 448 -> scale 1.0
  kv[0, 0, 128] = -3 * 448.0   # group 1: 3.0 (arbitrary) / 4.0 (pow2)
  kv[0, 0, 256] = 0.5 * 448.0  # group 2: 0.5 exactly (a power of two already)
  # group 3: all zero -> 1.0 (arbitrary), 2^-13 (pow2: the 1e-4 floor)
  for fmt, want in [("arbitrary", [1.0, 3.0, 0.5, 1.0]), ("pow2", [1.0, 4.0, 0.5, 2.0**-13])]:
    q = quantize_on(exact_device(fmt), kv, fmt)
    np.testing.assert_array_equal(q[0, 0, 512:528], np.array(want, "<f4").view(np.uint8))
  q = quantize_on(jax.devices("cpu")[0], kv, "arbitrary")
  assert q[0, 0, 0] == np.array([448.0], ml_dtypes.float8_e4m3fn).view(np.uint8)[0]
  assert q[0, 0, 128] == np.array([-448.0], ml_dtypes.float8_e4m3fn).view(np.uint8)[0]


def test_pow2_scale_boundaries():
  """amax exactly 448 * 2^k gives 2^k; one ulp more gives 2^(k+1) (on every device)."""
  kv = np.zeros((6, D), np.float32)
  for i, k in enumerate([-13, -3, 0, 1, 5, 40]):
    kv[i, 0] = np.float32(448.0 * 2.0**k)
    kv[i, 128] = np.nextafter(np.float32(448.0 * 2.0**k), np.float32(np.inf))
    kv[i, 256] = np.nextafter(np.float32(448.0 * 2.0**k), np.float32(0))
  q = quantize_on(jax.devices()[0], kv, "pow2")
  s = np.ascontiguousarray(q[..., 512:528]).view("<f4")
  for i, k in enumerate([-13, -3, 0, 1, 5, 40]):
    assert s[i].tolist() == [2.0**k, 2.0**(k + 1), 2.0**k, 2.0**-13], (k, s[i])
  d = dequantize_latent_fp8_np(q)
  np.testing.assert_array_equal(d[:, 0], kv[:, 0])   # 448 * 2^k is exact in e4m3 * 2^k


@GPU
@pytest.mark.parametrize("scale_format", ["pow2", "arbitrary"])
def test_gpu_quantize_matches_cpu(scale_format):
  kv = latent(8, shape=(64, 64))
  qc = quantize_on(jax.devices("cpu")[0], kv, scale_format)
  qg = quantize_on(jax.devices("cuda")[0], kv, scale_format)
  np.testing.assert_array_equal(qg[..., 528:], qc[..., 528:])
  if scale_format == "pow2":
    np.testing.assert_array_equal(qg, qc)
    return
  # GPU division may be an ulp off the IEEE quotient.
  sc = np.ascontiguousarray(qc[..., 512:528]).view(np.int32).astype(np.int64)
  sg = np.ascontiguousarray(qg[..., 512:528]).view(np.int32).astype(np.int64)
  assert np.abs(sg - sc).max() <= 1
  assert np.mean(qg[..., :512] != qc[..., :512]) <= 1e-3
  np.testing.assert_allclose(dequantize_latent_fp8_np(qg), dequantize_latent_fp8_np(qc),
                             rtol=2**-3, atol=0)


def test_pow2_scales_are_rounded_up_powers_of_two():
  kv = latent(2, shape=(16, 16))
  q = np.asarray(mla_jax.quantize_latent_fp8(jnp.asarray(kv), scale_format="pow2"))
  s = np.ascontiguousarray(q[..., 512:528]).view("<f4").astype(np.float64)
  mant, _ = np.frexp(s)
  assert np.all(mant == 0.5), "pow2 scales must be powers of two"
  exact = np.maximum(expected_scales(kv, "arbitrary").astype(np.float64), 1e-4)
  assert np.all(s >= exact) and np.all(s < 2 * exact)


def test_arbitrary_scales_are_not_rounded():
  kv = latent(3, shape=(16, 16))
  qa = np.asarray(mla_jax.quantize_latent_fp8(jnp.asarray(kv), scale_format="arbitrary"))
  qp = np.asarray(mla_jax.quantize_latent_fp8(jnp.asarray(kv), scale_format="pow2"))
  sa = np.ascontiguousarray(qa[..., 512:528]).view("<f4")
  mant, _ = np.frexp(sa.astype(np.float64))
  assert np.mean(mant != 0.5) > 0.9, "arbitrary scales look rounded to powers of two"
  # Bytes and dequantised values differ between the two rules ...
  assert np.mean(qa[..., :512] != qp[..., :512]) > 0.3
  da, dp = dequantize_latent_fp8_np(qa), dequantize_latent_fp8_np(qp)
  assert np.mean(da[..., :DN] != dp[..., :DN]) > 0.3
  # ... and both approximate the input to e4m3 precision.
  for deq, fmt in [(da, "arbitrary"), (dp, "pow2")]:
    scale = np.repeat(expected_scales(kv, fmt), 128, axis=-1)
    err = np.abs(deq[..., :DN] - kv[..., :DN])
    bound = np.maximum(np.abs(kv[..., :DN]) * 2.0**-4, scale * 2.0**-10) * 1.0001
    assert np.all(err <= bound), fmt


@pytest.mark.parametrize("scale_format", ["pow2", "arbitrary"])
def test_dequantize_matches_numpy(scale_format):
  kv = latent(4)
  q = mla_jax.quantize_latent_fp8(jnp.asarray(kv), scale_format=scale_format)
  ref = dequantize_latent_fp8_np(q)
  got = np.asarray(mla_jax.dequantize_latent_fp8(q), np.float64)
  assert got.shape == kv.shape
  np.testing.assert_allclose(got, ref, rtol=2**-23, atol=0)
  if scale_format == "pow2":  # exact scaling: float32 product is exact
    np.testing.assert_array_equal(got, ref)
  bf = mla_jax.dequantize_latent_fp8(q, jnp.bfloat16)
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(bf[..., DN:], np.float32),
                                np.asarray(kv[..., DN:]).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_zero_groups_and_tokens():
  kv = latent(5, shape=(2, 4))
  kv[0, 0] = 0.0                 # a whole token
  kv[1, 2, 128:256] = 0.0        # one group
  kv[1, 3, :DN] = 1e-42          # subnormal group (amax / 448 underflows)
  for fmt in ("pow2", "arbitrary"):
    q = mla_jax.quantize_latent_fp8(jnp.asarray(kv), scale_format=fmt)
    d = dequantize_latent_fp8_np(q)
    assert np.all(np.isfinite(d))
    assert np.all(d[0, 0] == 0) and np.all(d[1, 2, 128:256] == 0)
    s = np.ascontiguousarray(np.asarray(q)[..., 512:528]).view("<f4")
    empty = 1.0 if fmt == "arbitrary" else 2.0**-13
    assert s[0, 0].tolist() == [empty] * 4 and s[1, 2, 1] == empty
    assert s[1, 3].tolist() == [empty] * 4 and np.all(d[1, 3, :DN] == 0)
    assert np.all(s > 0) and np.all(np.isfinite(s))


def test_jit_and_shapes():
  kv = jnp.asarray(latent(6, shape=(2, 3, 4)), jnp.bfloat16)   # any leading shape
  f = jax.jit(lambda x: mla_jax.dequantize_latent_fp8(mla_jax.quantize_latent_fp8(x) , jnp.float32))
  out = f(kv)
  assert out.shape == kv.shape and out.dtype == jnp.float32
  assert mla_jax.quantize_latent_fp8(kv[0, 0, 0]).shape == (656,)


def test_errors():
  with pytest.raises(ValueError, match="576"):
    mla_jax.quantize_latent_fp8(jnp.zeros((2, 4, 512), jnp.bfloat16))
  with pytest.raises(TypeError, match="dtype"):
    mla_jax.quantize_latent_fp8(jnp.zeros((2, 4, 576), jnp.int32))
  with pytest.raises(ValueError, match="scale_format"):
    mla_jax.quantize_latent_fp8(jnp.zeros((2, 4, 576), jnp.bfloat16), scale_format="pow3")
  with pytest.raises(TypeError, match="uint8"):
    mla_jax.dequantize_latent_fp8(jnp.zeros((2, 4, 656), jnp.int8))
  with pytest.raises(ValueError, match="656"):
    mla_jax.dequantize_latent_fp8(jnp.zeros((2, 4, 576), jnp.uint8))


# --- dense FP8 decode (paged_decode with a float8_e4m3fn cache) ---------------------------------
def dense_case(seed, seq_lens, num_heads=16, page_size=16, q_len=1, dtype=jnp.bfloat16):
  d = random_paged_inputs(np.random.default_rng(seed), seq_lens, num_heads=num_heads,
                          page_size=page_size, q_len=q_len)
  return d["query"].astype(dtype), d["kv_cache"], d["block_table"], d["seq_lens"]


def run_paged(backend, query, kv_cache, block_table, seq_lens, plan, **kw):
  dev = device_for(backend)
  args, kw = jax.device_put(((query, kv_cache, block_table, seq_lens), kw), dev)
  with jax.default_device(dev):
    return jax.block_until_ready(mla_jax.paged_decode(*args, plan=plan, return_lse=True, **kw))


def rel_err(a, b):
  a = np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("q_len", [1, 2])
def test_dense_fp8_equals_bf16_of_dequantised(backend, dtype, q_len):
  """A power-of-two kv_scale makes the dequantised cache exact in bf16/fp16:
  both decodes see the same numbers and must agree (and match float64)."""
  query, kv, bt, sl = dense_case(11 + q_len, [0, 1, 17, 40, 64], q_len=q_len, dtype=dtype)
  kv_scale = np.float32(0.25)
  kv8 = (kv / kv_scale).astype(ml_dtypes.float8_e4m3fn)
  deq = kv8.astype(np.float32) * kv_scale
  kv16 = deq.astype(dtype)
  np.testing.assert_array_equal(kv16.astype(np.float32), deq)   # exact: same values
  plan = mla_jax.DecodePlan(num_heads=16, page_size=16, sm_scale=SM_SCALE, q_len=q_len,
                            backend=backend)
  out8, lse8 = run_paged(backend, query, kv8, bt, sl, plan, kv_scale=kv_scale)
  out16, lse16 = run_paged(backend, query, kv16, bt, sl, plan)
  assert out8.dtype == jnp.dtype(dtype) and lse8.dtype == jnp.float32
  ref_out, ref_lse = reference_paged_decode(query.astype(np.float32), deq, bt, sl, plan)
  live = sl > 0
  assert rel_err(out8[live], ref_out[live]) <= 1e-2
  assert rel_err(out8[live], np.asarray(out16[live].astype(jnp.float32))) <= 1e-2
  np.testing.assert_allclose(np.asarray(lse8[live]), ref_lse[live], atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(lse8[live]), np.asarray(lse16[live]), atol=2e-2, rtol=0)
  assert np.all(np.asarray(out8[~live].astype(jnp.float32)) == 0)
  assert np.all(np.isneginf(np.asarray(lse8[~live])))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_scale", [0.37, 3.0])
def test_dense_fp8_arbitrary_kv_scale(backend, kv_scale):
  query, kv, bt, sl = dense_case(21, [5, 33, 64], num_heads=16, page_size=16)
  kv_scale = np.float32(kv_scale)
  kv8 = (kv / kv_scale).astype(ml_dtypes.float8_e4m3fn)
  deq = kv8.astype(np.float64) * np.float64(kv_scale)
  plan = mla_jax.DecodePlan(num_heads=16, page_size=16, sm_scale=SM_SCALE, backend=backend)
  out, lse = run_paged(backend, query, kv8, bt, sl, plan, kv_scale=kv_scale)
  ref_out, ref_lse = reference_paged_decode(query.astype(np.float32), deq, bt, sl, plan)
  assert rel_err(out, ref_out) <= 1e-2
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-2, rtol=0)


@GPU
@pytest.mark.parametrize("kernel", ["sm90_lockstep", "sm90_seesaw"])
@pytest.mark.parametrize("num_heads,q_len,page_size,dtype", [
    (128, 1, 64, jnp.bfloat16),   # two 64-row blocks
    (64, 2, 16, jnp.float16),     # 128 rows, fp16 query (the e4m3 rope converted to fp16)
    (128, 2, 32, jnp.bfloat16),   # four blocks
    (96, 2, 16, jnp.bfloat16),    # three blocks
    (96, 1, 64, jnp.float16),     # two blocks, the second with 32 live rows
    (64, 2, 128, jnp.bfloat16),   # two blocks, pages of two tiles
    (48, 1, 64, jnp.bfloat16),    # one block with 48 live rows
])
def test_dense_fp8_lockstep_row_blocks(kernel, num_heads, q_len, page_size, dtype):
  """The lock-step and seesaw kernels over an e4m3 cache with more than 32
  query rows (up to several 64-row blocks a request, each converting every
  tile): ragged lengths, several tiles and splits, every request against
  float64. The seesaw kernel (auto for pages of a multiple of 64 tokens)
  takes only such pages."""
  if kernel == "sm90_seesaw" and page_size % 64 != 0:
    pytest.skip("sm90_seesaw serves pages of a multiple of 64 tokens")
  seq_lens = [0, 1, 63, 64, 65, 700, 2100]
  query, kv, bt, sl = dense_case(41 + num_heads + q_len, seq_lens, num_heads=num_heads,
                                 page_size=page_size, q_len=q_len, dtype=dtype)
  kv_scale = np.float32(0.37)
  kv8 = (kv / kv_scale).astype(ml_dtypes.float8_e4m3fn)
  deq = kv8.astype(np.float64) * np.float64(kv_scale)
  plan = mla_jax.DecodePlan(num_heads=num_heads, page_size=page_size, sm_scale=SM_SCALE,
                            q_len=q_len, backend="cuda")
  dev = jax.devices("cuda")[0]
  got = mla_jax.explain(plan, *jax.device_put((query, kv8, bt, sl), dev),
                        kv_scale=jnp.float32(kv_scale), device=dev)
  want = "sm90_seesaw" if page_size % 64 == 0 else "sm90_lockstep"
  assert got.kernel.kernel == want, str(got)
  plan = dataclasses.replace(plan, kernel=kernel)
  out, lse = run_paged("cuda", query, kv8, bt, sl, plan, kv_scale=kv_scale)
  ref_out, ref_lse = reference_paged_decode(query.astype(np.float32), deq, bt, sl, plan)
  live = sl > 0
  assert np.all(np.isfinite(np.asarray(out[live].astype(jnp.float32))))
  assert rel_err(out[live], ref_out[live]) <= 1e-2
  for b in np.flatnonzero(live):   # every request on its own: a wrong half shows in one
    assert rel_err(out[b], ref_out[b]) <= 1e-2, b
  np.testing.assert_allclose(np.asarray(lse[live]), ref_lse[live], atol=2e-2, rtol=0)
  assert np.all(np.asarray(out[~live].astype(jnp.float32)) == 0)
  assert np.all(np.isneginf(np.asarray(lse[~live])))


def test_dense_kv_scale_dtype_pairing():
  query, kv, bt, sl = dense_case(31, [4, 9])
  plan = mla_jax.DecodePlan(num_heads=16, page_size=16, sm_scale=SM_SCALE, backend="xla")
  with pytest.raises(TypeError, match="kv_scale"):
    mla_jax.paged_decode(query, kv.astype(jnp.bfloat16), bt, sl, plan=plan,
                         kv_scale=jnp.float32(0.5))
  with pytest.raises(TypeError, match="kv_scale"):
    mla_jax.paged_decode(query, kv.astype(ml_dtypes.float8_e4m3fn), bt, sl, plan=plan)
