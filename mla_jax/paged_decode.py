"""mla_jax.paged_decode: the jittable, shardable paged MLA decode op."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _context, _ffi, _op, _ragged, _sharding, kernels
from ._inputs import DecodeInputs, _as_array, _check_dtype, normalize, normalize_query
from .plan import DecodePlan
from .xla_reference import paged_decode_xla

# Operand order of every backend: (q_nope, q_pe, ckv, kpe, block_table,
# seq_lens, kv_scale); results (out, lse).


def _shardings(mesh, batch_axis, head_axis, page_axis=None):
  # Batch (B) and heads (H) of the query may be sharded; every request's
  # rows are independent, so each device runs the kernel on its own slice
  # with no communication. The cache's pages may be split over other axes
  # (context parallelism: mla_jax/_context.py). The page axis of the block
  # table and the feature dims stay whole (replicated when sharded).
  ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  args = (ns(batch_axis, None, head_axis, None), ns(batch_axis, None, head_axis, None),
          ns(page_axis), ns(page_axis), ns(batch_axis, None), ns(batch_axis), ns())
  outs = (ns(batch_axis, None, head_axis, None), ns(batch_axis, None, head_axis))
  return args, outs


def _facts(call: _op.Call, args):
  plan = call.plan
  q_nope, _, ckv = args[:3]
  b, q, h = q_nope.shape[:3]
  return kernels.facts(op="paged", q_dtype=q_nope.dtype, kv_dtype=ckv.dtype, kv_format="bf16",
                       kv_lora_rank=plan.kv_lora_rank, qk_rope_head_dim=plan.qk_rope_head_dim,
                       page_size=plan.page_size, q_len=q, num_heads=h, batch=b, num_pages=ckv.shape[0],
                       schedule_operand=True)


def _kernel_shape(call: _op.Call, q_nope):
  b, q, h = q_nope.shape[:3]
  return b, q * h


def _schedule(call: _op.Call, args, sel: kernels.Selection):
  """The schedule operand (_op.schedule_operand) over block_table and seq_lens."""
  q_nope, block_table, seq_lens = args[0], args[4], args[5]
  b, q, h = q_nope.shape[:3]
  return _op.schedule_operand(sel, _ffi.SCHEDULE_CUDA_TARGET, b, q * h, (block_table, seq_lens), q_len=int(q),
                              num_heads=int(h), page_size=int(call.plan.page_size),
                              max_num_splits=int(call.plan.max_num_splits or 0))


def _xla(call: _op.Call, *args):
  return paged_decode_xla(DecodeInputs(*args, query_had_q_axis=True), call.plan)


SPEC = _op.OpSpec(
    name="paged_decode",
    cpu_target=_ffi.CPU_TARGET,
    cuda_target=_ffi.CUDA_TARGET,
    per_request=(0, 1, 4, 5),  # q_nope, q_pe, block_table, seq_lens
    sharding_rule="b q h d, b q h r, p s c, p s k, b t, b, z -> b q h e, b q h",
    shardings=_shardings,
    attrs=lambda c: dict(sm_scale=np.float32(c.plan.sm_scale), causal=bool(c.plan.causal),
                         kv_lora_rank=int(c.plan.kv_lora_rank),
                         qk_rope_head_dim=int(c.plan.qk_rope_head_dim)),
    cuda_attrs=lambda c: dict(max_num_splits=int(c.plan.max_num_splits or 0)),
    facts=_facts,
    kernel_shape=_kernel_shape,
    xla=_xla,
    cuda_serves=lambda c: (c.plan.kv_lora_rank, c.plan.qk_rope_head_dim) == (512, 64),
    dv=lambda c: c.plan.kv_lora_rank,
    cache_operands=(2, 3),  # ckv, kpe
    context=_context.paged_decode_local,
    cuda_extra=_schedule,
)


def explain_call(plan: DecodePlan, query, kv_cache, block_table, seq_lens, *, kv_scale=None, device=None,
                 return_lse: bool = False, cu_seqlens_q=None, context_axis=None):
  """mla_jax.explain for paged_decode's arguments."""
  del return_lse  # the kernels always compute the LSE
  found = []

  def trace(query, kv_cache, block_table, seq_lens, kv_scale, cu_seqlens_q):  # shapes only: nothing runs
    if cu_seqlens_q is None:
      inputs = normalize(query, kv_cache, block_table, seq_lens, plan, kv_scale)
      found.append(_op.explain(SPEC, _op.Call(plan, not inputs.query_had_q_axis), _operands(inputs), device))
      return 0
    inputs, _, tokens = ragged_inputs(query, kv_cache, block_table, seq_lens, cu_seqlens_q, plan, kv_scale)
    b, t = inputs.block_table.shape
    if _ragged.layout(plan) == "per_token":
      p, rows, how = dataclasses.replace(plan, q_len=1), tokens, (
          f"ragged query: each of its {tokens} rows is a q_len-1 request ({plan.num_heads} heads >= "
          f"{_ragged.PER_TOKEN_MIN_HEADS}: a token fills its own row tiles)")
    else:
      p, rows, how = plan, b, (
          f"ragged query: left-padded to [{b}, q_len {plan.q_len}] requests "
          + ("(the xla backend gathers per request)" if plan.backend == "xla" else
             f"({plan.num_heads} heads < {_ragged.PER_TOKEN_MIN_HEADS}: tokens share a request's row tiles)"))
    q_len = p.q_len
    mapped = DecodeInputs(
        jax.ShapeDtypeStruct((rows, q_len) + inputs.q_nope.shape[1:], inputs.q_nope.dtype),
        jax.ShapeDtypeStruct((rows, q_len) + inputs.q_pe.shape[1:], inputs.q_pe.dtype),
        inputs.ckv, inputs.kpe, jax.ShapeDtypeStruct((rows, t), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32), inputs.kv_scale, True)
    e = _op.explain(SPEC, _op.Call(p, False), _operands(mapped), device)
    found.append(dataclasses.replace(e, reasons=(how,) + e.reasons))
    return 0

  jax.eval_shape(trace, query, kv_cache, block_table, seq_lens, kv_scale, cu_seqlens_q)
  return _context.explain(found[0], context_axis, "paged_decode")


def _operands(inputs: DecodeInputs):
  return (inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, inputs.block_table, inputs.seq_lens,
          inputs.kv_scale)


def _ragged_query(query, plan: DecodePlan):
  """(q_nope, q_pe) [T, H, *] of a packed ragged query (the same array twice
  when packed), checked like a q_len-1 query."""
  for name, x in (zip(("q_nope", "q_pe"), query) if isinstance(query, (tuple, list)) else (("query", query),)):
    if len(np.shape(x)) != 3:
      raise ValueError(f"{name}: with cu_seqlens_q, expected a packed [T, H, D] query, got shape {np.shape(x)}")
  q_nope, q_pe, _ = normalize_query(query, dataclasses.replace(plan, q_len=1))
  qn = q_nope[:, 0]
  return (qn, qn) if q_pe is q_nope else (qn, q_pe[:, 0])


def _check_cu_seqlens(cu_seqlens_q, block_table):
  cu = _as_array("cu_seqlens_q", cu_seqlens_q)
  _check_dtype("cu_seqlens_q", cu, (jnp.dtype(jnp.int32),))
  b = np.shape(block_table)[0] if len(np.shape(block_table)) == 2 else None
  if len(np.shape(cu)) != 1 or (b is not None and np.shape(cu)[0] != b + 1):
    raise ValueError(f"cu_seqlens_q: expected shape ({b} + 1,) (block_table's batch + 1), got {np.shape(cu)}")
  return cu


def ragged_inputs(query, kv_cache, block_table, seq_lens, cu_seqlens_q, plan, kv_scale):
  """Checks a call with cu_seqlens_q; returns (DecodeInputs of the cache,
  table and lengths with the [T, H, *] query, cu_seqlens_q, T)."""
  q_nope, q_pe = _ragged_query(query, plan)
  cu = _check_cu_seqlens(cu_seqlens_q, block_table)
  # The cache, table and lengths checked as for a uniform call of the
  # table's batch (a shape-only stand-in for the query).
  b = np.shape(block_table)[0] if len(np.shape(block_table)) else 0
  stand_in = jax.ShapeDtypeStruct((b, 1) + tuple(q_nope.shape[1:]), q_nope.dtype)
  if q_pe is not q_nope:
    stand_in = (stand_in, jax.ShapeDtypeStruct((b, 1) + tuple(q_pe.shape[1:]), q_pe.dtype))
  inputs = normalize(stand_in, kv_cache, block_table, seq_lens, dataclasses.replace(plan, q_len=1), kv_scale)
  return dataclasses.replace(inputs, q_nope=q_nope, q_pe=q_pe), cu, q_nope.shape[0]


def _ragged_call(query, kv_cache, block_table, seq_lens, cu_seqlens_q, plan, kv_scale, context_axis):
  """(out [T, H, dv], lse [T, H]) of a call with cu_seqlens_q."""
  inputs, cu, _ = ragged_inputs(query, kv_cache, block_table, seq_lens, cu_seqlens_q, plan, kv_scale)

  def run_uniform(p, q, bt, sl):
    ins = normalize(q, kv_cache, bt, sl, p, kv_scale)
    call = _op.Call(p, not ins.query_had_q_axis, context_axis=context_axis)
    return _op.run(SPEC, call, _operands(ins), ins.query_had_q_axis, return_lse=True)

  return _ragged.ragged_paged_decode(run_uniform, plan, inputs.q_nope, inputs.q_pe, inputs.block_table,
                                     inputs.seq_lens, cu, inputs.ckv.shape[0])


@functools.partial(jax.jit, static_argnames=("plan", "return_lse", "context_axis"))
def paged_decode(query, kv_cache, block_table, seq_lens, *, plan: DecodePlan,
                 return_lse: bool = False, kv_scale=None, context_axis=None, cu_seqlens_q=None):
  """Paged Multi-head Latent Attention decode (absorbed weights).

  Math (DeepSeek-V2, "Multi-head Latent Attention", arXiv:2405.04434, with the
  up-projections absorbed into the query and output): for request b, query
  token i, head h and visible positions p,

    score[p] = sm_scale * (q_nope . ckv[p] + q_pe . kpe[p])
    out      = softmax(score) . ckv
    lse      = ln(sum_p exp(score[p]))      (natural log, float32)

  Long requests are split across the GPU's SMs and merged with their LSEs
  (FlashDecoding, Dao et al. 2023); the split schedule is computed on the
  device from ``seq_lens``, never on the host. Where whole requests spread
  evenly enough over the SMs (within 5 % of an equal share), none is split.

  Args:
    query: ``[B, H, 576]`` (plan.q_len 1) or ``[B, Q, H, 576]`` packed
      (q_nope in the first 512 features, q_pe in the last 64), or a pair
      ``(q_nope [B, (Q,) H, 512], q_pe [B, (Q,) H, 64])``. bfloat16 or float16.
    kv_cache: packed ``[num_pages, page_size, 576]`` (ckv then kpe) or a pair
      ``(ckv [num_pages, page_size, 512], kpe [num_pages, page_size, 64])``.
      Same dtype as the query (float8_e4m3fn together with ``kv_scale``).
    block_table: int32 ``[B, max_pages_per_seq]``; token p of request b is at
      page ``block_table[b, p // page_size]``, slot ``p % page_size``.
    seq_lens: int32 ``[B]``: cached tokens of each request, *including* its Q
      new tokens (FlashMLA's ``cache_seqlens``).
    plan: the static :class:`DecodePlan`.
    return_lse: also return the log-sum-exp.
    kv_scale: float32 scalar dequantisation scale of an FP8 cache; scores use
      ``sm_scale * kv_scale`` and the output is multiplied by ``kv_scale``.
    cu_seqlens_q: optional int32 ``[B + 1]`` (FlashInfer's ``qo_indptr``,
      vLLM's ``query_start_loc``) for per-request query lengths: the query is
      then packed ``[T, H, 576]`` (or a pair of ``[T, H, *]``), request b's
      tokens are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``,
      ``plan.q_len`` is the largest count, and token i of a request of n
      sees positions ``0 .. seq_len - n + i`` (causal). Returns
      ``out [T, H, 512]`` (and ``lse [T, H]``); rows no request holds give
      out 0, lse -inf. A request whose range is malformed (outside
      ``[0, T]``, decreasing, overlapping an earlier one) or longer than
      ``plan.q_len`` gives NaN rows (see mla_jax/_ragged.py), never an
      out-of-bounds access.
    context_axis: only inside ``jax.shard_map``: a mesh axis name (or tuple)
      over which the cache's pages are split, device r of it holding global
      pages ``[r * num_pages, (r + 1) * num_pages)`` (num_pages: the local
      cache's). ``block_table`` then holds global page ids, each device
      attends its own pages, and the result, merged over the axis, is the
      same on every device of it. Under ``jax.jit`` a cache sharded on its
      page axis (evenly, over axes that shard neither B nor H; otherwise it
      is gathered first) is decoded this way without this argument.

  Returns:
    ``out [B, (Q,) H, 512]`` in the query dtype, and with ``return_lse`` also
    ``lse [B, (Q,) H]`` float32 (natural log). The Q axis is present exactly
    when the query had one.

  Edge cases: a request or query token with no visible position gives out 0
  and lse -inf. Table entries past the live pages are never read; cache
  slots past ``seq_lens[b]`` never affect the result (may hold anything, NaN
  included). A negative ``seq_lens[b]``, one above
  ``max_pages_per_seq * page_size``, or a live page id outside
  ``[0, num_pages)`` never causes an out-of-bounds access: that request's
  out and lse are NaN (:func:`mla_jax.check_inputs` says which and why).

  Raises:
    TypeError: wrong dtypes, a plan that is not a DecodePlan, or
      differentiation (the op is inference-only).
    ValueError: wrong ranks or shapes, or a mismatch with the plan.
    RuntimeError: backend "cuda" requested but not compiled in.
    jax.errors.JaxRuntimeError: backend "cuda" compiled for a device that
      is not a CUDA GPU (raised by XLA when the program runs: no FFI handler
      registered for that platform).
  """
  if context_axis is not None:
    _sharding.require_manual(context_axis, "paged_decode")
  if cu_seqlens_q is not None:
    out, lse = _ragged_call(query, kv_cache, block_table, seq_lens, cu_seqlens_q, plan, kv_scale, context_axis)
    return (out, lse) if return_lse else out
  inputs = normalize(query, kv_cache, block_table, seq_lens, plan, kv_scale)
  call = _op.Call(plan, not inputs.query_had_q_axis, context_axis=context_axis)
  return _op.run(SPEC, call, _operands(inputs), inputs.query_had_q_axis, return_lse)
