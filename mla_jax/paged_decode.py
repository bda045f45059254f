"""mla_jax.paged_decode: the jittable, shardable paged MLA decode op."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from . import _ffi
from ._kernel_call import inference_only, kernel_out_types as _out_types, operand_layouts as _operand_layouts, varying_like_inputs as _varying_like_inputs
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
  cuda = functools.partial(_cuda_call if _ffi.has_cuda_kernels() else _xla_call, plan,
                           q_axis_added=q_axis_added)
  return jax.lax.platform_dependent(
      *args, cpu=functools.partial(_cpu_call, plan, q_axis_added=q_axis_added), cuda=cuda,
      default=functools.partial(_xla_call, plan))


# --- sharding: custom_partitioning with a Shardy rule -----------------------
# Batch (B) and heads (H) of the query may be sharded; every request's rows
# are independent, so each device runs the kernel on its own slice with no
# communication. The cache, page axis of the block table and feature dims
# stay whole (they are replicated when sharded). On a single device
# custom_partitioning lowers to the plain kernel call, which keeps the op
# exportable with jax.export.
_SHARDY_RULE = "b q h d, b q h r, p s c, p s k, b t, b, z -> b q h e, b q h"


def _query_axes(sharding):
  spec = tuple(sharding.spec) + (None,) * 4
  return spec[0], spec[2]


def _shardings(mesh, batch_axis, head_axis):
  ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  args = (ns(batch_axis, None, head_axis, None), ns(batch_axis, None, head_axis, None),
          ns(), ns(), ns(batch_axis, None), ns(batch_axis), ns())
  outs = (ns(batch_axis, None, head_axis, None), ns(batch_axis, None, head_axis))
  return args, outs


def _infer(plan, q_axis_added, mesh, arg_shapes, result_shape):
  del plan, q_axis_added, result_shape
  return _shardings(mesh, *_query_axes(arg_shapes[0].sharding))[1]


def _partition(plan, q_axis_added, mesh, arg_shapes, result_shape):
  del result_shape
  args, outs = _shardings(mesh, *_query_axes(arg_shapes[0].sharding))
  return mesh, functools.partial(_local_decode, plan, q_axis_added=q_axis_added), outs, args


@functools.partial(custom_partitioning, static_argnums=(7, 8))
def _partitioned_decode(q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale, plan,
                        q_axis_added):
  return _local_decode(plan, q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale,
                       q_axis_added=q_axis_added)


_partitioned_decode.def_partition(
    infer_sharding_from_operands=_infer, partition=_partition, sharding_rule=_SHARDY_RULE)


def _trace_mesh(x):
  """The abstract mesh in context, else the one in x's type (explicit mode)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", mesh)
  return mesh


def _sharded_decode(plan: DecodePlan, *args, q_axis_added: bool = False):
  """Calls the op in every JAX sharding mode.

  * Auto axes (jax.jit with NamedSharding inputs): Shardy propagates the
    rule and custom_partitioning runs one kernel per device.
  * Explicit axes: the shardings are in the types, so the kernel runs in a
    shard_map over the explicit axes with the rule's specs (an operand typed
    otherwise, e.g. a sharded cache, is resharded first). The result's type
    keeps the query's B/H sharding.
  * Inside shard_map the kernel is called directly on the local shapes (what
    custom_partitioning lowers to when every axis is manual). With only some
    axes manual, custom_partitioning would get no mesh (jax passes
    GSPMDShardings and, under a legacy `with mesh:`, XLA aborts), so there
    too the kernel is called directly and XLA runs it replicated over the
    remaining automatic axes (gathering the query over them). This is also
    the case for a mesh that mixes Explicit and Auto axes.
  """
  mesh = _trace_mesh(args[0])
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  explicit = {n for n, t in types.items() if t == jax.sharding.AxisType.Explicit}
  manual = {n for n, t in types.items() if t == jax.sharding.AxisType.Manual}
  if explicit:
    b, h = _query_axes(jax.typeof(args[0]).sharding)
    arg_specs, out_specs = (tuple(s.spec for s in ss) for ss in _shardings(mesh, b, h))
    # the explicit axes are manual there
    local = functools.partial(_sharded_decode, plan, q_axis_added=q_axis_added)
    with contextlib.ExitStack() as stack:
      if jax.sharding.get_abstract_mesh().empty:  # explicit types but no jax.set_mesh
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
      args = [jax.sharding.reshard(a, s) for a, s in zip(args, arg_specs)]
      return jax.shard_map(local, mesh=mesh, in_specs=arg_specs, out_specs=out_specs,
                           axis_names=explicit)(*args)
  if manual:
    return _local_decode(plan, *args, q_axis_added=q_axis_added)
  return _partitioned_decode(*args, plan, q_axis_added)


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

  @decode.def_vmap
  def _decode_vmap(axis_size, in_batched, *args):
    per_request = (0, 1, 4, 5)  # q_nope, q_pe, block_table, seq_lens
    if any(in_batched[i] for i in (2, 3, 6)):
      # A batched cache or scale cannot fold into B: loop instead.
      args = [a if bat else jnp.broadcast_to(a, (axis_size,) + a.shape)
              for a, bat in zip(args, in_batched)]
      out = jax.lax.map(lambda xs: decode(*xs), tuple(args))
      return out, (True, True)
    # Fold B-major, [V, B, ...] -> [B * V, ...]: a sharded B then keeps whole
    # blocks per device (a V-major fold would need an all-gather, and is
    # untypeable under explicit sharding). The transposes copy only the small
    # query, table and output.
    args = list(args)
    for i in per_request:
      a = args[i]
      a = (jnp.swapaxes(a, 0, 1) if in_batched[i] else
           jnp.broadcast_to(a[:, None], (a.shape[0], axis_size) + a.shape[1:]))
      args[i] = a.reshape((a.shape[0] * axis_size,) + a.shape[2:])
    unfold = lambda x: jnp.swapaxes(x.reshape((-1, axis_size) + x.shape[1:]), 0, 1)
    out, lse = decode(*args)
    return (unfold(out), unfold(lse)), (True, True)

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
  device from ``seq_lens``, never on the host.

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
  and lse -inf. Cache slots past ``seq_lens[b]`` and table entries past the
  live pages are never read. A negative ``seq_lens[b]``, one above
  ``max_pages_per_seq * page_size``, or a live page id outside
  ``[0, num_pages)`` never causes an out-of-bounds access: that request's
  out and lse are NaN (:func:`mla_jax.check_inputs` says which and why).

  Raises:
    TypeError: wrong dtypes, a plan that is not a DecodePlan, or
      differentiation (the op is inference-only).
    ValueError: wrong ranks or shapes, or a mismatch with the plan.
    RuntimeError: backend "cuda" requested but not compiled in.
  """
  inputs = normalize(query, kv_cache, block_table, seq_lens, plan, kv_scale)
  decode = _decode_fn(plan, not inputs.query_had_q_axis)
  out, lse = decode(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, inputs.block_table,
                    inputs.seq_lens, inputs.kv_scale)
  if not inputs.query_had_q_axis:  # reshapes lower to bitcasts: no copy
    out = out.reshape(out.shape[:1] + out.shape[2:])
    lse = lse.reshape(lse.shape[:1] + lse.shape[2:])
  return (out, lse) if return_lse else out
