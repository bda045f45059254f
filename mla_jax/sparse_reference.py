"""Pure-JAX sparse top-k MLA decode (backend "xla"): the reference formulation.

It gathers the K indexed cache rows of every query token, dequantises them
(fp8_ds_mla) and runs two einsums, which is what a JAX user writes without a
kernel. Same semantics as the kernels, edge cases included (see
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
  """Cache rows at safe_idx [B, Q, K] as (k_nope [B,Q,K,512], k_pe [B,Q,K,64]) in compute."""
  num_slots = kv.shape[0] * kv.shape[1]
  flat = kv.reshape(num_slots, kv.shape[-1])
  rows = jnp.take(flat, safe_idx, axis=0, mode="clip")                   # [B, Q, K, W]
  dn = fp8_cache.KV_LORA_RANK
  if kv_format == "fp8_ds_mla":
    q, s, r = fp8_cache.split_latent_fp8(rows)
    lead = rows.shape[:-1]
    k_nope = (q.astype(jnp.float32).reshape(lead + (fp8_cache.NUM_GROUPS, fp8_cache.GROUP)) *
              s[..., None]).reshape(lead + (dn,))
    return k_nope.astype(compute), r.astype(compute)
  return rows[..., :dn].astype(compute), rows[..., dn:].astype(compute)


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
  k_nope, k_pe = _gather_keys(kv, safe, plan.kv_format, compute)
  # Padding rows may hold anything (NaN included): zero them so that a zero
  # softmax weight cannot meet a NaN value.
  zero = jnp.zeros((), compute)
  k_nope = jnp.where(valid[..., None], k_nope, zero)
  k_pe = jnp.where(valid[..., None], k_pe, zero)

  kv_scale = inputs.kv_scale[0]
  scores = (jnp.einsum("bqhd,bqkd->bqhk", q_nope, k_nope, preferred_element_type=jnp.float32) +
            jnp.einsum("bqhd,bqkd->bqhk", q_pe, k_pe, preferred_element_type=jnp.float32))
  scores = scores * (plan.sm_scale * kv_scale)
  scores = jnp.where(valid[:, :, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)                                  # -inf if empty
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  out = jnp.einsum("bqhk,bqkd->bqhd", probs.astype(compute), k_nope,
                   preferred_element_type=jnp.float32) * kv_scale
  if inputs.has_sink:
    # exp(lse) / (exp(lse) + exp(sink)) without overflow; 0 when lse = -inf.
    sink = inputs.attn_sink[None, None, :]
    factor = jnp.where(jnp.isneginf(lse), 0.0, jax.nn.sigmoid(lse - sink))
    out = out * factor[..., None]
  return out.astype(q_nope.dtype), lse
