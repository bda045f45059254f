"""DeepSeek V3.2 "fp8_ds_mla" latent cache: quantisation and dequantisation.

One cached token is 656 bytes (the layout of FlashMLA / vLLM's
``fp8_ds_mla`` cache):

  bytes   0..511  512 float8_e4m3fn values: ckv[g*128 + j] / scale[g]
  bytes 512..527  4 little-endian float32 scales, one per group g of 128
                  ckv values: scale[g] = amax_g / 448 ("arbitrary"), or the
                  smallest power of two >= max(amax_g / 448, 1e-4) ("pow2",
                  DeepSeek's rule: byte for byte the rows FlashMLA's reference
                  quantiser writes)
  bytes 528..655  64 bfloat16 kpe (rope) values, unquantised

Dequantisation: ``ckv[i] = float(e4m3[i]) * scale[i // 128]``,
``kpe = float(bf16)``. Everything here is pure JAX (bitcasts via
``jax.lax.bitcast_convert_type``) and jittable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

KV_LORA_RANK = 512
ROPE_DIM = 64
GROUP = 128
NUM_GROUPS = KV_LORA_RANK // GROUP
SCALE_OFFSET = 512
ROPE_OFFSET = 528
ROW_BYTES = 656
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FORMATS = ("pow2", "arbitrary")
_MIN_NORMAL = 2.0**-126
# DeepSeek's pow2 rule floors amax / 448 at 1e-4 before rounding up, so no
# pow2 scale is below 2^-13 (the smallest power of two >= 1e-4).
_POW2_FLOOR = 2.0**-13


def _round_up_pow2(s):
  """Smallest power of two >= s for finite s > 0 (exact, via the bits)."""
  bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
  exp = bits & jnp.uint32(0x7F800000)
  mant = bits & jnp.uint32(0x007FFFFF)
  # A mantissa of 0 is already a power of two; otherwise bump the exponent
  # (a subnormal becomes 2^-126, the smallest normal power of two).
  up = jnp.where(mant == 0, exp, exp + jnp.uint32(0x00800000))
  return jax.lax.bitcast_convert_type(up, jnp.float32)


def _exact_pow2_scale(amax, approx, live):
  """Smallest power of two s with amax <= 448 * s (1 where not live).

  ``approx`` (amax / 448 from the platform's division, which on GPUs may be
  off by an ulp) gives a candidate; exact comparisons (448 * 2^e is exact)
  then fix it, so the result does not depend on the division's rounding.
  live groups have amax / 448 >= 2^-126, so the result is a normal number.
  """
  fp8_max = jnp.float32(FP8_MAX)
  c = _round_up_pow2(jnp.where(live, approx, jnp.float32(1.0)))
  half = c * jnp.float32(0.5)
  c = jnp.where(live & (c > jnp.float32(_MIN_NORMAL)) & (amax <= fp8_max * half), half, c)
  c = jnp.where(live & (amax > fp8_max * c), c * jnp.float32(2.0), c)
  return jnp.where(live, c, jnp.float32(1.0))


def _divide(a, b):
  """a / b elementwise, b given at a's full shape.

  XLA rewrites ``x / broadcast(y)`` into ``x * broadcast(1 / y)``, which is
  not correctly rounded; the optimisation barrier hides the broadcast so the
  quotient is the IEEE one (as in NumPy / PyTorch quantisers) wherever the
  platform's division is.
  """
  return a / jax.lax.optimization_barrier(b)


@functools.partial(jax.jit, static_argnames=("scale_format",))
def quantize_latent_fp8(kv, scale_format: str = "pow2"):
  """Quantises a packed latent cache to the 656-byte ``fp8_ds_mla`` layout.

  Args:
    kv: ``[..., 576]`` (typically ``[num_pages, page_size, 576]``) bfloat16,
      float16 or float32: ckv in the first 512 features, kpe in the last 64.
    scale_format: "pow2" (default; DeepSeek V3.2 / FlashMLA): each group's
      scale is the smallest power of two >= ``max(amax / 448, 1e-4)`` (so at
      least 2^-13; the same bytes as FlashMLA's reference quantiser), so
      quantising and dequantising are exact scalings and the bytes are
      identical on every platform; "arbitrary": the float32 quotient
      ``amax / 448`` itself, not rounded (IEEE division on CPU; XLA's GPU
      division may differ from it by an ulp, and then so may a few e4m3
      codes), and a group whose ``amax / 448`` is 0 or subnormal (amax below
      about 5e-36) gets scale 1 (its values quantise to 0).

  Returns:
    uint8 ``[..., 656]``: per token 512 e4m3 bytes, 4 little-endian float32
    scales, 64 little-endian bfloat16 kpe values (see the module docstring).
    kpe is rounded to bfloat16 (round to nearest even) when kv is not bf16.

  Raises:
    TypeError: kv is not bfloat16, float16 or float32.
    ValueError: kv's last dimension is not 576, or scale_format is unknown.
  """
  if scale_format not in SCALE_FORMATS:
    raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
  if not hasattr(kv, "shape") or not hasattr(kv, "dtype"):
    raise TypeError(f"kv: expected a jax or numpy array, got {type(kv).__name__}")
  allowed = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
  if jnp.dtype(kv.dtype) not in allowed:
    raise TypeError(f"kv: expected dtype one of (bfloat16, float16, float32), got {kv.dtype}")
  if kv.ndim < 1 or kv.shape[-1] != KV_LORA_RANK + ROPE_DIM:
    raise ValueError(f"kv: expected last dimension {KV_LORA_RANK + ROPE_DIM}, got shape {kv.shape}")
  lead = kv.shape[:-1]
  ckv = kv[..., :KV_LORA_RANK].astype(jnp.float32).reshape(lead + (NUM_GROUPS, GROUP))
  amax = jnp.max(jnp.abs(ckv), axis=-1)                                   # [..., 4]
  approx = _divide(amax, jnp.full(amax.shape, FP8_MAX, jnp.float32))
  # Groups whose amax / 448 is 0 or subnormal (all zero, or below ~5e-36)
  # get scale 1: scales stay normal numbers, the same where a GPU flushes
  # subnormals to zero.
  live = approx >= jnp.float32(_MIN_NORMAL)
  if scale_format == "pow2":
    floor = jnp.float32(_POW2_FLOOR)
    scale = jnp.where(live, jnp.maximum(_exact_pow2_scale(amax, approx, live), floor), floor)
    # x / 2^e == x * 2^-e exactly; the reciprocal comes from the bits, so no
    # platform division is involved and every platform gives the same bytes.
    inv = jax.lax.bitcast_convert_type(
        jnp.uint32(0x7F000000) - jax.lax.bitcast_convert_type(scale, jnp.uint32), jnp.float32)
    scaled = ckv * inv[..., None]
  else:
    scale = jnp.where(live, approx, jnp.float32(1.0))
    scaled = _divide(ckv, jnp.broadcast_to(scale[..., None], ckv.shape))
  q = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  q_bytes = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(lead + (KV_LORA_RANK,))
  s_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(lead + (4 * NUM_GROUPS,))
  kpe = kv[..., KV_LORA_RANK:].astype(jnp.bfloat16)
  r_bytes = jax.lax.bitcast_convert_type(kpe, jnp.uint8).reshape(lead + (2 * ROPE_DIM,))
  return jnp.concatenate([q_bytes, s_bytes, r_bytes], axis=-1)


def split_latent_fp8(kv_u8):
  """Views of a ``[..., 656]`` uint8 cache: (e4m3 [..., 512], scales f32 [..., 4], kpe bf16 [..., 64])."""
  lead = kv_u8.shape[:-1]
  q = jax.lax.bitcast_convert_type(kv_u8[..., :SCALE_OFFSET], jnp.float8_e4m3fn)
  s = jax.lax.bitcast_convert_type(
      kv_u8[..., SCALE_OFFSET:ROPE_OFFSET].reshape(lead + (NUM_GROUPS, 4)), jnp.float32)
  r = jax.lax.bitcast_convert_type(
      kv_u8[..., ROPE_OFFSET:].reshape(lead + (ROPE_DIM, 2)), jnp.bfloat16)
  return q, s, r


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_latent_fp8(kv_u8, dtype=jnp.float32):
  """Inverse of :func:`quantize_latent_fp8` (for tests and references).

  Args:
    kv_u8: uint8 ``[..., 656]`` fp8_ds_mla rows.
    dtype: result dtype (default float32). The products ``e4m3 * scale`` are
      computed in float32 and then cast.

  Returns:
    ``[..., 576]`` of ``dtype``: ckv (512) then kpe (64).

  Raises:
    TypeError: kv_u8 is not uint8. ValueError: last dimension is not 656.
  """
  if jnp.dtype(kv_u8.dtype) != jnp.dtype(jnp.uint8):
    raise TypeError(f"kv_u8: expected dtype uint8, got {kv_u8.dtype}")
  if kv_u8.ndim < 1 or kv_u8.shape[-1] != ROW_BYTES:
    raise ValueError(f"kv_u8: expected last dimension {ROW_BYTES}, got shape {kv_u8.shape}")
  q, s, r = split_latent_fp8(kv_u8)
  lead = kv_u8.shape[:-1]
  ckv = (q.astype(jnp.float32).reshape(lead + (NUM_GROUPS, GROUP)) * s[..., None])
  ckv = ckv.reshape(lead + (KV_LORA_RANK,))
  return jnp.concatenate([ckv.astype(dtype), r.astype(dtype)], axis=-1)
