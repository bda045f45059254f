"""Pure-JAX sparse top-k MLA decode (backend "xla"): the reference formulation.

It gathers the K indexed cache rows of every query token and runs the two
products as einsums, which is what a JAX user writes without a kernel (for
fp8_ds_mla one einsum per 128-feature scale group, the scales applied in
float32). Same semantics as the kernels, edge cases included (see
:func:`mla_jax.sparse_decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import fp8_cache
from ._inputs import SparseInputs
from .plan import SparseDecodePlan


def valid_index_mask(indices, topk_lens, num_slots: int):
  """bool [B, Q, K]: index in [0, num_slots) and position < min(topk_lens[b], K)."""
  k = indices.shape[-1]
  in_range = (indices >= 0) & (indices < num_slots)
  counted = jnp.arange(k)[None, None, :] < jnp.minimum(topk_lens, k)[:, None, None]
  return in_range & counted


def _gather_keys(kv, safe_idx, kv_format: str, compute):
  """Cache rows at safe_idx [B, Q, K] as (k_nope [B,Q,K,512], scales, k_pe [B,Q,K,64]).

  k_nope and k_pe are in ``compute``. For fp8_ds_mla, k_nope holds the e4m3
  values themselves (exact in bf16 and fp16) and ``scales`` their group
  scales, float32 [B, Q, K, 4], applied in float32 by the caller: with
  arbitrary (not power-of-two) scales e4m3 * scale is not exact in the
  query dtype, and rounding it there shifts every score of a long top-k
  the same way. For bf16 rows ``scales`` is None.
  """
  num_slots = kv.shape[0] * kv.shape[1]
  flat = kv.reshape(num_slots, kv.shape[-1])
  rows = jnp.take(flat, safe_idx, axis=0, mode="clip")                   # [B, Q, K, W]
  dn = fp8_cache.KV_LORA_RANK
  if kv_format == "fp8_ds_mla":
    q, s, r = fp8_cache.split_latent_fp8(rows)
    return q.astype(compute), s, r.astype(compute)
  return rows[..., :dn].astype(compute), None, rows[..., dn:].astype(compute)


def sparse_decode_xla(inputs: SparseInputs, plan: SparseDecodePlan):
  """Returns out [B, Q, H, 512] (query dtype) and lse [B, Q, H] float32."""
  dn = plan.kv_lora_rank
  q_nope, q_pe = inputs.q_nope, inputs.q_pe
  if q_nope.shape[-1] == q_pe.shape[-1]:  # packed query passed twice
    q_nope, q_pe = q_nope[..., :dn], q_nope[..., dn:]
  kv = inputs.kv
  compute = q_nope.dtype
  num_slots = kv.shape[0] * kv.shape[1]
  valid = valid_index_mask(inputs.indices, inputs.topk_lens, num_slots)   # [B, Q, K]
  safe = jnp.where(valid, inputs.indices, 0)
  k_nope, scales, k_pe = _gather_keys(kv, safe, plan.kv_format, compute)
  # Padding rows may hold anything (NaN included): zero them so that a zero
  # softmax weight cannot meet a NaN value.
  zero = jnp.zeros((), compute)
  k_nope = jnp.where(valid[..., None], k_nope, zero)
  k_pe = jnp.where(valid[..., None], k_pe, zero)

  kv_scale = inputs.kv_scale[0]
  f32 = jnp.float32
  if scales is None:
    nope_scores = jnp.einsum("bqhd,bqkd->bqhk", q_nope, k_nope, preferred_element_type=f32)
  else:
    # Per 128-feature group: the exact products summed in float32, times the
    # rows' scale of that group (as the swap-AB kernel does).
    scales = jnp.where(valid[..., None], scales, 0.0)                      # [B, Q, K, 4]
    g = fp8_cache.GROUP
    q_groups = [q_nope[..., j * g:(j + 1) * g] for j in range(fp8_cache.NUM_GROUPS)]
    k_groups = [k_nope[..., j * g:(j + 1) * g] for j in range(fp8_cache.NUM_GROUPS)]
    nope_scores = sum(
        jnp.einsum("bqhd,bqkd->bqhk", qg, kg, preferred_element_type=f32) * scales[:, :, None, :, j]
        for j, (qg, kg) in enumerate(zip(q_groups, k_groups)))
  scores = nope_scores + jnp.einsum("bqhd,bqkd->bqhk", q_pe, k_pe, preferred_element_type=f32)
  scores = scores * (plan.sm_scale * kv_scale)
  scores = jnp.where(valid[:, :, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)                                  # -inf if empty
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  if scales is None:
    out = jnp.einsum("bqhk,bqkd->bqhd", probs.astype(compute), k_nope, preferred_element_type=f32)
  else:
    # Each group's values times their scale: the weights p * scale of a
    # (token, head) over their largest magnitude, in [-1, 1] like P, rounded
    # to the query dtype as P is for bf16 rows (p * scale itself could leave
    # fp16's range, and a scale's share alone could underflow); the largest
    # weight multiplies the product in float32.
    def group_out(j, kg):
      w = probs * scales[:, :, None, :, j]                                 # [B, Q, H, K]
      top = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
      top = jnp.where(top > 0, top, 1.0)
      return jnp.einsum("bqhk,bqkd->bqhd", (w / top).astype(compute), kg, preferred_element_type=f32) * top
    out = jnp.concatenate([group_out(j, kg) for j, kg in enumerate(k_groups)], axis=-1)
  out = out * kv_scale
  if inputs.has_sink:
    # exp(lse) / (exp(lse) + exp(sink)) without overflow; 0 when lse = -inf.
    sink = inputs.attn_sink[None, None, :]
    factor = jnp.where(jnp.isneginf(lse), 0.0, jax.nn.sigmoid(lse - sink))
    out = out * factor[..., None]
  return out.astype(q_nope.dtype), lse
