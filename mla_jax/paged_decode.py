"""mla_jax.paged_decode: the jittable, shardable paged MLA decode op."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _ffi, _sharding
from ._kernel_call import fold_into_batch, inference_only, kernel_out_types as _out_types, operand_layouts as _operand_layouts, varying_like_inputs as _varying_like_inputs
from ._scratch import split_kv_scratch
from ._inputs import DecodeInputs, normalize
from .plan import DecodePlan
from .xla_reference import paged_decode_xla

# Operand order of every backend: (q_nope, q_pe, ckv, kpe, block_table,
# seq_lens, kv_scale); results (out, lse).


def _attrs(plan: DecodePlan):
  return dict(sm_scale=np.float32(plan.sm_scale), causal=bool(plan.causal),
              kv_lora_rank=int(plan.kv_lora_rank),
              qk_rope_head_dim=int(plan.qk_rope_head_dim))


@_varying_like_inputs
def _cpu_call(plan: DecodePlan, *args, q_axis_added: bool = False):
  call = jax.ffi.ffi_call(_ffi.CPU_TARGET, _out_types(args[0], plan.kv_lora_rank),
                          input_layouts=_operand_layouts(q_axis_added, len(args)))
  return tuple(call(*args, **_attrs(plan)))


@_varying_like_inputs
def _cuda_call(plan: DecodePlan, *args, q_axis_added: bool = False):
  if plan.kv_lora_rank != 512 or plan.qk_rope_head_dim != 64:
    raise ValueError("backend 'cuda' needs kv_lora_rank=512 and qk_rope_head_dim=64, got "
                     f"{plan.kv_lora_rank} and {plan.qk_rope_head_dim}; use backend 'cpu' or 'xla'")
  q_nope = args[0]
  b, q, h = q_nope.shape[:3]
  scratch = split_kv_scratch(b, q * h, plan.kv_lora_rank)
  res = jax.ffi.ffi_call(_ffi.CUDA_TARGET, _out_types(q_nope, plan.kv_lora_rank) + scratch,
                         input_layouts=_operand_layouts(q_axis_added, len(args)))(
      *args, max_num_splits=int(plan.max_num_splits or 0), **_attrs(plan))
  return res[0], res[1]


def _xla_call(plan: DecodePlan, *args, q_axis_added: bool = False):
  del q_axis_added  # XLA picks its own layouts
  return paged_decode_xla(DecodeInputs(*args, query_had_q_axis=True), plan)


def _local_decode(plan: DecodePlan, *args, q_axis_added: bool = False):
  """One device's decode on local (possibly sharded) operands.

  q_axis_added: the caller's query had no Q axis (see _operand_layouts).
  """
  backend = plan.backend
  if backend == "xla":
    return _xla_call(plan, *args)
  _ffi.require_extension()
  if backend == "cpu":
    return _cpu_call(plan, *args, q_axis_added=q_axis_added)
  if backend == "cuda":
    if not _ffi.has_cuda_kernels():
      raise RuntimeError("backend 'cuda': mla_jax was built without CUDA kernels "
                         "(no CUDA toolkit at build time, or MLA_JAX_CUDA=0)")
    return _cuda_call(plan, *args, q_axis_added=q_axis_added)
  # "auto": the lowering platform picks the branch; nothing else is lowered.
  # Every branch is traced, so a GPU branch the kernels cannot serve (widths
  # other than 512/64, or no CUDA kernels built) falls back to XLA.
  kernel_ok = _ffi.has_cuda_kernels() and (plan.kv_lora_rank, plan.qk_rope_head_dim) == (512, 64)
  cuda = (functools.partial(_cuda_call, plan, q_axis_added=q_axis_added) if kernel_ok
          else functools.partial(_xla_call, plan))
  return jax.lax.platform_dependent(
      *args, cpu=functools.partial(_cpu_call, plan, q_axis_added=q_axis_added), cuda=cuda,
      default=functools.partial(_xla_call, plan))


# --- sharding (mla_jax/_sharding.py) ------------------------------------------
# Batch (B) and heads (H) of the query may be sharded; every request's rows
# are independent, so each device runs the kernel on its own slice with no
# communication. The cache, page axis of the block table and feature dims
# stay whole (they are replicated when sharded).
_SHARDY_RULE = "b q h d, b q h r, p s c, p s k, b t, b, z -> b q h e, b q h"


def _shardings(mesh, batch_axis, head_axis):
  ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  args = (ns(batch_axis, None, head_axis, None), ns(batch_axis, None, head_axis, None),
          ns(), ns(), ns(batch_axis, None), ns(batch_axis), ns())
  outs = (ns(batch_axis, None, head_axis, None), ns(batch_axis, None, head_axis))
  return args, outs


def _bind(plan: DecodePlan, q_axis_added: bool):
  return functools.partial(_local_decode, plan, q_axis_added=q_axis_added)


# _partitioned_decode(plan, q_axis_added, q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale)
_partitioned_decode = _sharding.partitioned_op(_bind, _shardings, _SHARDY_RULE, num_static=2)


def _sharded_decode(plan: DecodePlan, *args, q_axis_added: bool = False):
  """The op in every JAX sharding mode (see _sharding.dispatch)."""
  return _sharding.dispatch(args, local=_bind(plan, q_axis_added),
                            partitioned=functools.partial(_partitioned_decode, plan, q_axis_added),
                            shardings=_shardings)


# --- vmap and autodiff --------------------------------------------------------
@functools.cache
def _decode_fn(plan: DecodePlan, q_axis_added: bool = False):
  """The op for one plan: vmap folds into the batch, autodiff is refused.

  q_axis_added: the caller's query had no Q axis (normalize added it); the
  kernel then takes the query in the reshape's layout (_operand_layouts).
  """

  @jax.custom_batching.custom_vmap
  def decode(q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale):
    return _sharded_decode(plan, q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale,
                           q_axis_added=q_axis_added)

  # q_nope, q_pe, block_table, seq_lens have a leading B axis
  decode.def_vmap(fold_into_batch(decode, per_request=(0, 1, 4, 5)))
  return inference_only(decode, "paged_decode")


@functools.partial(jax.jit, static_argnames=("plan", "return_lse"))
def paged_decode(query, kv_cache, block_table, seq_lens, *, plan: DecodePlan,
                 return_lse: bool = False, kv_scale=None):
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
  inputs = normalize(query, kv_cache, block_table, seq_lens, plan, kv_scale)
  decode = _decode_fn(plan, not inputs.query_had_q_axis)
  out, lse = decode(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, inputs.block_table,
                    inputs.seq_lens, inputs.kv_scale)
  if not inputs.query_had_q_axis:  # reshapes lower to bitcasts: no copy
    out = out.reshape(out.shape[:1] + out.shape[2:])
    lse = lse.reshape(lse.shape[:1] + lse.shape[2:])
  return (out, lse) if return_lse else out
