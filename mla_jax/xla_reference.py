"""Pure-JAX paged MLA decode (backend "xla"): the reference formulation.

It gathers every page of the block table and runs two einsums, which is what
a JAX user writes without a kernel; benchmarks use it as the baseline. Same
semantics as the kernels, including the edge cases (see
:func:`mla_jax.paged_decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._inputs import DecodeInputs
from .plan import DecodePlan


def live_pages(seq_lens, page_size: int):
  """int32 [B]: pages a request's length covers, ceil(seq_len / page_size)
  (<= 0 for a negative length), without int32 overflow near 2^31."""
  return seq_lens // page_size + (seq_lens % page_size > 0).astype(seq_lens.dtype)


def capacity(max_pages, page_size: int):
  """max_pages_per_seq * page_size, clamped to int32 (seq_lens are int32, so
  comparisons with it are unchanged); a symbolic size (jax.export) as is."""
  cap = max_pages * page_size
  return min(cap, 2**31 - 1) if isinstance(cap, int) else cap


def _known_zero(*dims) -> bool:
  """Whether any of these sizes is a concrete 0 (symbolic sizes are not)."""
  return any(isinstance(d, int) and d == 0 for d in dims)


def bad_live_pages(block_table, seq_lens, num_pages: int, page_size: int):
  """bool [B, T]: table entries a request's length covers whose page id is
  outside [0, num_pages)."""
  live = jnp.arange(block_table.shape[1])[None, :] < live_pages(seq_lens, page_size)[:, None]
  return live & ((block_table < 0) | (block_table >= num_pages))


def request_validity(block_table, seq_lens, num_pages: int, page_size: int):
  """bool [B]: length in range and every live page id inside the cache."""
  pages_ok = ~jnp.any(bad_live_pages(block_table, seq_lens, num_pages, page_size), axis=1)
  len_ok = (seq_lens >= 0) & (seq_lens <= capacity(block_table.shape[1], page_size))
  return len_ok & pages_ok


def attend(q_nope, q_pe, k_nope, k_pe, visible, sm_scale: float, kv_scale):
  """Softmax attention of a request's query tokens over keys they share.

  q_nope [B, Q, H, dn], q_pe [B, Q, H, dr]; k_nope [B, N, dn] (also the
  values), k_pe [B, N, dr], in the query dtype; visible bool [B, Q, N];
  kv_scale: a float32 scalar that both the scores and the output carry.
  Returns (out [B, Q, H, dn] float32, lse [B, Q, H] natural log): a row that
  sees no key gets out 0, lse -inf.
  """
  scores = (jnp.einsum("bqhd,bnd->bqhn", q_nope, k_nope, preferred_element_type=jnp.float32) +
            jnp.einsum("bqhd,bnd->bqhn", q_pe, k_pe, preferred_element_type=jnp.float32))
  scores = scores * (sm_scale * kv_scale)
  scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)                                   # -inf if empty
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  out = jnp.einsum("bqhn,bnd->bqhd", probs.astype(k_nope.dtype), k_nope,
                   preferred_element_type=jnp.float32) * kv_scale
  return out, lse


def paged_decode_xla(inputs: DecodeInputs, plan: DecodePlan):
  """Returns out [B, Q, H, kv_lora_rank] (query dtype) and lse [B, Q, H] f32."""
  dn = plan.kv_lora_rank
  q_nope, q_pe = inputs.q_nope, inputs.q_pe
  if inputs.q_packed(plan):
    q_nope, q_pe = q_nope[..., :dn], q_nope[..., dn:]
  ckv, kpe = inputs.ckv, inputs.kpe
  if inputs.kv_packed(plan):
    ckv, kpe = ckv[..., :dn], ckv[..., dn:]
  num_pages, page_size = ckv.shape[0], ckv.shape[1]
  block_table, seq_lens = inputs.block_table, inputs.seq_lens
  b, q_len, h = q_nope.shape[0], q_nope.shape[1], q_nope.shape[2]
  kv_scale = inputs.kv_scale[0]
  n_tok = block_table.shape[1] * page_size

  valid = request_validity(block_table, seq_lens, num_pages, page_size)[:, None, None]
  if _known_zero(b, n_tok, num_pages):
    # Nothing to gather (and nothing a gather could index): a valid request
    # then has no visible position (out 0, lse -inf), the others are NaN.
    out = jnp.where(valid[..., None], jnp.zeros((b, q_len, h, dn), q_nope.dtype), jnp.nan)
    lse = jnp.where(valid, jnp.full((b, q_len, h), -jnp.inf, jnp.float32), jnp.nan)
    return out.astype(q_nope.dtype), lse

  # Clipped ids, gathered with mode="clip": every index is in bounds, so the
  # gather needs no out-of-bounds mask (jnp.take's default "fill" adds one).
  ids = jnp.clip(block_table, 0, num_pages - 1)
  compute = q_nope.dtype
  k_nope = jnp.take(ckv, ids, axis=0, mode="clip").reshape(b, n_tok, dn).astype(compute)
  k_pe = jnp.take(kpe, ids, axis=0, mode="clip").reshape(b, n_tok, kpe.shape[-1]).astype(compute)

  pos = jnp.arange(n_tok)
  live = pos[None, :] < seq_lens[:, None]                                  # [B, N]
  # Slots past seq_len may hold anything (NaN included): zero them so that a
  # zero softmax weight cannot meet a NaN value.
  k_nope = jnp.where(live[..., None], k_nope, jnp.zeros((), compute))
  k_pe = jnp.where(live[..., None], k_pe, jnp.zeros((), compute))

  i = jnp.arange(q_len)
  if plan.causal:
    limit = seq_lens[:, None] - q_len + i[None, :] + 1                      # [B, Q]
  else:
    limit = jnp.broadcast_to(seq_lens[:, None], (b, q_len))
  visible = pos[None, None, :] < limit[:, :, None]                          # [B, Q, N]
  out, lse = attend(q_nope, q_pe, k_nope, k_pe, visible, plan.sm_scale, kv_scale)
  # The validity select below stays out of the PV matmul's fusion: XLA's GPU
  # compiler (jax 0.11) fused it into a Triton GEMM epilogue and rejected the
  # program it made of it when every dimension of the validity chain is 1
  # (one request, a one-column block table): "Expected instruction to have
  # shape equal to pred[], actual shape is pred[1]".
  out = jax.lax.optimization_barrier(out)

  out = jnp.where(valid[..., None], out, jnp.nan)
  lse = jnp.where(valid, lse, jnp.nan)
  return out.astype(q_nope.dtype), lse
