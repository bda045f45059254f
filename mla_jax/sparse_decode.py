"""mla_jax.sparse_decode: sparse top-k MLA decode (DeepSeek V3.2 DSA)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _context, _ffi, _op, _sharding, kernels
from ._inputs import SparseInputs, normalize_sparse
from .plan import SparseDecodePlan
from .sparse_reference import sparse_decode_xla

# Operand order of every backend: (q_nope, q_pe, kv, indices, topk_lens,
# attn_sink, kv_scale); results (out [B, Q, H, 512], lse [B, Q, H]).


def _shardings(mesh, batch_axis, head_axis, page_axis=None):
  # Batch (B: query, indices, topk_lens) and heads (H: query, attn_sink) may
  # be sharded; every query token's rows are independent, so each device
  # runs the kernel on its own slice with no communication. The cache's
  # pages may be split over other axes (context parallelism:
  # mla_jax/_context.py). The top-k axis of the indices and feature dims
  # stay whole (replicated when sharded).
  ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  query = ns(batch_axis, None, head_axis, None)
  args = (query, query, ns(page_axis), ns(batch_axis, None, None), ns(batch_axis), ns(head_axis), ns())
  outs = (query, ns(batch_axis, None, head_axis))
  return args, outs


def _facts(call: _op.Call, args):
  plan = call.plan
  q_nope, _, kv = args[:3]
  b, q, h = q_nope.shape[:3]
  return kernels.facts(op="sparse", q_dtype=q_nope.dtype, kv_dtype=kv.dtype, kv_format=plan.kv_format,
                       kv_lora_rank=plan.kv_lora_rank, qk_rope_head_dim=plan.qk_rope_head_dim,
                       page_size=plan.page_size, q_len=q, num_heads=h, batch=b, num_pages=kv.shape[0],
                       topk=plan.topk, schedule_operand=True)


def _kernel_shape(call: _op.Call, q_nope):
  b, q, h = q_nope.shape[:3]
  return b * q, h  # every query token is one kernel request of H rows


def _schedule(call: _op.Call, args, sel: kernels.Selection):
  """The schedule operand (_op.schedule_operand) over topk_lens alone: it does
  not depend on the indices, so a step's layers share it. Every query token
  is a request of H rows."""
  q_nope, indices, topk_lens = args[0], args[3], args[4]
  b, q, h = q_nope.shape[:3]
  return _op.schedule_operand(sel, _ffi.SPARSE_SCHEDULE_CUDA_TARGET, b * q, h, (topk_lens,), q_len=int(q),
                              topk=int(indices.shape[-1]), num_heads=int(h))


def _xla(call: _op.Call, *args):
  return sparse_decode_xla(SparseInputs(*args, has_sink=call.has_sink, query_had_q_axis=True), call.plan)


SPEC = _op.OpSpec(
    name="sparse_decode",
    cpu_target=_ffi.SPARSE_CPU_TARGET,
    cuda_target=_ffi.SPARSE_CUDA_TARGET,
    per_request=(0, 1, 3, 4),  # q_nope, q_pe, indices, topk_lens
    sharding_rule="b q h d, b q h r, p s c, b q k, b, h, z -> b q h e, b q h",
    shardings=_shardings,
    attrs=lambda c: dict(sm_scale=np.float32(c.plan.sm_scale),
                         kv_format=kernels.KV_FORMAT_CODES[c.plan.kv_format], has_sink=bool(c.has_sink),
                         kv_lora_rank=int(c.plan.kv_lora_rank),
                         qk_rope_head_dim=int(c.plan.qk_rope_head_dim)),
    cuda_attrs=lambda c: {},
    facts=_facts,
    kernel_shape=_kernel_shape,
    xla=_xla,
    cuda_serves=lambda c: True,  # the sparse plan fixes the widths at 512 + 64
    dv=lambda c: c.plan.kv_lora_rank,
    cache_operands=(2,),  # kv
    context=_context.sparse_decode_local,
    cuda_extra=_schedule,
)


def explain_call(plan: SparseDecodePlan, query, kv_cache, indices, *, topk_lens=None, attn_sink=None,
                 device=None, return_lse: bool = False, context_axis=None):
  """mla_jax.explain for sparse_decode's arguments."""
  del return_lse  # the kernels always compute the LSE
  found = []

  def trace(query, kv_cache, indices, topk_lens, attn_sink):  # shapes only: nothing runs
    inputs = normalize_sparse(query, kv_cache, indices, topk_lens, attn_sink, plan)
    call = _op.Call(plan, not inputs.query_had_q_axis, inputs.has_sink)
    found.append(_op.explain(SPEC, call, inputs.operands, device))
    return 0

  jax.eval_shape(trace, query, kv_cache, indices, topk_lens, attn_sink)
  return _context.explain(found[0], context_axis, "sparse_decode")


@functools.partial(jax.jit, static_argnames=("plan", "return_lse", "context_axis"))
def sparse_decode(query, kv_cache, indices, *, plan: SparseDecodePlan, topk_lens=None,
                  attn_sink=None, return_lse: bool = False, context_axis=None):
  """Sparse top-k Multi-head Latent Attention decode (DeepSeek V3.2 DSA).

  Math (DeepSeek-V2 MLA with absorbed weights, arXiv:2405.04434, attending
  only to the top-k positions chosen by DeepSeek-V3.2-Exp's lightning
  indexer, "DeepSeek Sparse Attention"): for query token (b, i), head h and
  the set T of valid indices t of that token,

    score[t] = sm_scale * (q_nope . ckv[t] + q_pe . kpe[t])
    out      = softmax(score) . ckv
    lse      = ln(sum_t exp(score[t]))        (natural log, float32)

  with ckv/kpe the dequantised cache rows (fp8_ds_mla: ``e4m3 * group
  scale``, bf16 rope). There is no causal masking: the indices decide.
  With ``attn_sink`` (FlashMLA semantics) out is further multiplied by
  ``exp(lse) / (exp(lse) + exp(attn_sink[h]))``; lse is unchanged.

  Args:
    query: ``[B, H, 576]`` (plan.q_len 1) or ``[B, Q, H, 576]`` packed
      (q_nope in the first 512 features, q_pe in the last 64), or a pair
      ``(q_nope [B, (Q,) H, 512], q_pe [B, (Q,) H, 64])``. bfloat16 or float16.
    kv_cache: plan.kv_format "bf16": packed ``[num_pages, page_size, 576]``
      in the query dtype. "fp8_ds_mla": uint8 ``[num_pages, page_size, 656]``
      from :func:`mla_jax.quantize_latent_fp8`.
    indices: int32 ``[B, K]`` (query without a Q axis) or ``[B, Q, K]``,
      ``K == plan.topk``: global cache slots ``page * page_size + offset``.
      -1, and any other value outside ``[0, num_pages * page_size)``, is
      padding (masked out, never read); padding may appear anywhere in a row.
    plan: the static :class:`SparseDecodePlan`.
    topk_lens: optional int32 ``[B]``: only the first
      ``min(topk_lens[b], K)`` indices of each of request b's rows count;
      the entries after them may hold anything. None: all K.
    attn_sink: optional float32 ``[H]`` per-head sink logit (natural-log
      units, same scale as lse).
    return_lse: also return the log-sum-exp.
    context_axis: only inside ``jax.shard_map``: a mesh axis name (or tuple)
      over which the cache's pages are split, device r of it holding global
      slots ``[r * S, (r + 1) * S)`` (S: the local cache's slots);
      ``indices`` hold global slots and the result, merged over the axis, is
      the same on every device of it. Under ``jax.jit`` a cache sharded on
      its page axis (evenly, over axes that shard neither B nor H; otherwise
      it is gathered first) is decoded this way without this argument.

  Returns:
    ``out [B, (Q,) H, 512]`` in the query dtype, and with ``return_lse`` also
    ``lse [B, (Q,) H]`` float32 (natural log, sink not included). The Q axis
    is present exactly when the query had one. A query token with no valid
    index gets out 0 and lse -inf (never NaN).

  Raises:
    TypeError: wrong dtypes, a plan that is not a SparseDecodePlan, a
      (ckv, kpe) cache pair, or differentiation (the op is inference-only).
    ValueError: wrong ranks or shapes, or a mismatch with the plan.
    RuntimeError: backend "cuda" requested but not compiled in.
    jax.errors.JaxRuntimeError: backend "cuda" compiled for a device that
      is not a CUDA GPU (raised by XLA when the program runs: no FFI handler
      registered for that platform).
  """
  inputs = normalize_sparse(query, kv_cache, indices, topk_lens, attn_sink, plan)
  if context_axis is not None:
    _sharding.require_manual(context_axis, "sparse_decode")
  call = _op.Call(plan, not inputs.query_had_q_axis, inputs.has_sink, context_axis=context_axis)
  return _op.run(SPEC, call, inputs.operands, inputs.query_had_q_axis, return_lse)
