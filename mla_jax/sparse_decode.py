"""mla_jax.sparse_decode: sparse top-k MLA decode (DeepSeek V3.2 DSA)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _ffi, _sharding
from ._kernel_call import fold_into_batch, inference_only, kernel_out_types as _out_types, operand_layouts as _operand_layouts, varying_like_inputs as _varying_like_inputs
from ._scratch import split_kv_scratch
from ._inputs import SparseInputs, normalize_sparse
from .plan import SparseDecodePlan
from .sparse_reference import sparse_decode_xla

# Operand order of every backend: (q_nope, q_pe, kv, indices, topk_lens,
# attn_sink, kv_scale); results (out [B, Q, H, 512], lse [B, Q, H]).
_KV_FORMAT_CODES = {"bf16": 0, "fp8_ds_mla": 1}   # KvFormat in csrc/common/mla_params.h


def _attrs(plan: SparseDecodePlan, has_sink: bool):
  return dict(sm_scale=np.float32(plan.sm_scale), kv_format=_KV_FORMAT_CODES[plan.kv_format],
              has_sink=bool(has_sink), kv_lora_rank=int(plan.kv_lora_rank),
              qk_rope_head_dim=int(plan.qk_rope_head_dim))


@_varying_like_inputs
def _cpu_call(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool, *args):
  call = jax.ffi.ffi_call(_ffi.SPARSE_CPU_TARGET, _out_types(args[0], plan.kv_lora_rank),
                          input_layouts=_operand_layouts(q_axis_added, len(args)))
  return tuple(call(*args, **_attrs(plan, has_sink)))


@_varying_like_inputs
def _cuda_call(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool, *args):
  # Same operands and attributes as the CPU target, plus the split-KV
  # scratch: every query token is one kernel request of H rows.
  b, q, h = args[0].shape[:3]
  scratch = split_kv_scratch(b * q, h, plan.kv_lora_rank)
  call = jax.ffi.ffi_call(_ffi.SPARSE_CUDA_TARGET, _out_types(args[0], plan.kv_lora_rank) + scratch,
                          input_layouts=_operand_layouts(q_axis_added, len(args)))
  res = call(*args, **_attrs(plan, has_sink))
  return res[0], res[1]


def _xla_call(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool, *args):
  del q_axis_added  # XLA picks its own layouts
  return sparse_decode_xla(SparseInputs(*args, has_sink=has_sink, query_had_q_axis=True), plan)


def _has_cuda_sparse() -> bool:
  return _ffi.has_cuda_kernels() and _ffi.has_cuda_target(_ffi.SPARSE_CUDA_TARGET)


def _local_sparse(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool, *args):
  """One device's sparse decode on 4-D query / 3-D index operands.

  q_axis_added: the caller's query had no Q axis (see _operand_layouts).
  """
  static = (plan, has_sink, q_axis_added)
  backend = plan.backend
  if backend == "xla":
    return _xla_call(*static, *args)
  _ffi.require_extension()
  if backend == "cpu":
    return _cpu_call(*static, *args)
  if backend == "cuda":
    if not _has_cuda_sparse():
      raise RuntimeError("backend 'cuda': this mla_jax build has no CUDA sparse decode kernel "
                         "(no CUDA toolkit at build time, or MLA_JAX_CUDA=0)")
    return _cuda_call(*static, *args)
  # "auto": the lowering platform picks the branch; nothing else is lowered.
  cuda = _cuda_call if _has_cuda_sparse() else _xla_call
  return jax.lax.platform_dependent(
      *args, cpu=functools.partial(_cpu_call, *static),
      cuda=functools.partial(cuda, *static),
      default=functools.partial(_xla_call, *static))


# --- sharding (mla_jax/_sharding.py) ------------------------------------------
# Batch (B: query, indices, topk_lens) and heads (H: query, attn_sink) may be
# sharded; every query token's rows are independent, so each device runs the
# kernel on its own slice with no communication. The cache, the top-k axis of
# the indices and feature dims stay whole (they are replicated when sharded).
_SHARDY_RULE = "b q h d, b q h r, p s c, b q k, b, h, z -> b q h e, b q h"


def _shardings(mesh, batch_axis, head_axis):
  ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  query = ns(batch_axis, None, head_axis, None)
  args = (query, query, ns(), ns(batch_axis, None, None), ns(batch_axis), ns(head_axis), ns())
  outs = (query, ns(batch_axis, None, head_axis))
  return args, outs


def _bind(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool):
  return functools.partial(_local_sparse, plan, has_sink, q_axis_added)


# _partitioned_sparse(plan, has_sink, q_axis_added, q_nope, q_pe, kv, indices, topk_lens,
#                     attn_sink, kv_scale)
_partitioned_sparse = _sharding.partitioned_op(_bind, _shardings, _SHARDY_RULE, num_static=3)


def _sharded_sparse(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool, *args):
  """The op in every JAX sharding mode (see _sharding.dispatch)."""
  static = (plan, has_sink, q_axis_added)
  return _sharding.dispatch(args, local=_bind(*static),
                            partitioned=functools.partial(_partitioned_sparse, *static),
                            shardings=_shardings)


# --- vmap and autodiff --------------------------------------------------------
@functools.cache
def _sparse_fn(plan: SparseDecodePlan, has_sink: bool, q_axis_added: bool = False):
  """The op for one plan: vmap folds into the batch, autodiff is refused.

  q_axis_added: the caller's query had no Q axis (normalize added it).
  """

  @jax.custom_batching.custom_vmap
  def decode(q_nope, q_pe, kv, indices, topk_lens, attn_sink, kv_scale):
    return _sharded_sparse(plan, has_sink, q_axis_added, q_nope, q_pe, kv, indices, topk_lens,
                           attn_sink, kv_scale)

  # q_nope, q_pe, indices, topk_lens have a leading B axis
  decode.def_vmap(fold_into_batch(decode, per_request=(0, 1, 3, 4)))
  return inference_only(decode, "sparse_decode")


@functools.partial(jax.jit, static_argnames=("plan", "return_lse"))
def sparse_decode(query, kv_cache, indices, *, plan: SparseDecodePlan, topk_lens=None,
                  attn_sink=None, return_lse: bool = False):
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
  out, lse = _sparse_fn(plan, inputs.has_sink, not inputs.query_had_q_axis)(*inputs.operands)
  if not inputs.query_had_q_axis:  # reshapes lower to bitcasts: no copy
    out = out.reshape(out.shape[:1] + out.shape[2:])
    lse = lse.reshape(lse.shape[:1] + lse.shape[2:])
  return (out, lse) if return_lse else out
