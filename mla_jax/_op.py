"""One skeleton for every decode op (paged and sparse).

An op describes itself with an :class:`OpSpec` (FFI targets, attributes,
kernel-selection facts, the pure-JAX formulation, which operands are per
request, its sharding rule); :func:`build` turns a spec and the static part of
a call into the op: backend routing ("auto" by lowering platform), the CUDA
call with its trace-time kernel selection and workspace, the CPU call,
sharding in every JAX mode (mla_jax/_sharding.py), vmap folded into the
batch, and the refusal to differentiate.

Operand order is the op's (seven arrays, the query pair first); results are
``out [B, Q, H, dv]`` (query dtype) and ``lse [B, Q, H]`` float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import _context, _ffi, _sharding, kernels


@dataclasses.dataclass(frozen=True)
class Call:
  """The static part of one call (hashable): the plan and operand flags."""
  plan: Any
  q_axis_added: bool     # the caller's query had no Q axis (see operand_layouts)
  has_sink: bool = False  # sparse decode: attn_sink was given
  # Mesh axis (name or tuple of names) over which the cache's page axis is
  # split, device r holding global pages [r*P, (r+1)*P) (mla_jax/_context.py);
  # None: the cache is whole on every device.
  context_axis: Any = None


@dataclasses.dataclass(frozen=True)
class OpSpec:
  name: str                 # "paged_decode": in error messages as mla_jax.<name>
  cpu_target: str
  cuda_target: str
  per_request: tuple        # operand indices with a leading B axis (vmap folds into B)
  sharding_rule: str        # Shardy rule over the operands -> (out, lse)
  shardings: Callable       # (mesh, batch_axis, head_axis) -> (operand shardings, result shardings)
  attrs: Callable           # Call -> attributes of both kernels
  cuda_attrs: Callable      # Call -> attributes of the CUDA kernel only
  facts: Callable           # (Call, operands) -> kernels.facts(...) of the call
  kernel_shape: Callable    # (Call, q_nope) -> (kernel requests, rows per request)
  xla: Callable             # (Call, *operands) -> (out, lse): the pure-JAX formulation
  cuda_serves: Callable     # Call -> whether the CUDA kernels can serve it (else "auto" uses xla)
  dv: Callable              # Call -> output width
  cache_operands: tuple     # operand indices with a leading page axis (context parallelism)
  context: Callable         # (op_local, Call, *operands) -> (out, lse): one device's share, merged
  # (Call, operands, Selection) -> extra operands of the CUDA call after the
  # op's own (paged decode: its schedule); None: none.
  cuda_extra: Callable | None = None


def _out_types(q_nope, dv):
  b, q, h = q_nope.shape[:3]
  return (jax.ShapeDtypeStruct((b, q, h, dv), q_nope.dtype),
          jax.ShapeDtypeStruct((b, q, h), jnp.float32))


def operand_layouts(q_axis_added: bool, num_operands: int):
  """input_layouts for the kernel call (major to minor; None: row-major).

  A query given without a Q axis ([B, H, D], plan.q_len 1) reaches the kernel
  through a reshape to [B, 1, H, D]. XLA lays that reshape out as {3,2,0,1},
  a bitcast of the caller's buffer, and would copy it to reach the default
  row-major {3,2,1,0}. With a size-1 axis both are the same bytes, so the
  kernel is asked for the bitcast's layout (major to minor (1, 0, 2, 3)) and
  gets the caller's buffer. A query that has its Q axis keeps row-major:
  that is its own parameter layout. Results need nothing: the kernel's
  row-major [B, 1, H, ...] outputs bitcast to [B, H, ...].
  """
  if not q_axis_added:
    return None
  q = (1, 0, 2, 3)
  return (q, q) + (None,) * (num_operands - 2)


def _varying_axes(x) -> frozenset:
  """Manual mesh axes (inside shard_map) over which x's value varies."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax 0.10 and 0.11: aval.mat.varying; older: aval.vma
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_like_inputs(outs, args):
  """ffi_call results carry no varying-manual-axes type; inside shard_map
  they must vary like the inputs (else lax.platform_dependent refuses to join
  them with the pure-JAX branch, and the types would claim replication)."""
  axes = frozenset().union(*map(_varying_axes, args))
  return tuple(jax.lax.pcast(o, tuple(sorted(axes - _varying_axes(o), key=str)), to="varying")
               for o in outs)


def schedule_operand(sel: kernels.Selection, target: str, requests, rows: int, metadata, **attrs):
  """The CUDA call's schedule operand (a 1-tuple): with schedule "step", the
  uint8 result of the op's schedule call `target` over `metadata` (the only
  arrays it reads; pure, so XLA runs one for every decode call of an unrolled
  program with the same metadata and attributes; inside a lax.scan it stays
  in the loop body, since XLA:GPU runs no loop-invariant code motion), sized
  for `requests` kernel requests (possibly symbolic) of `rows` query rows as
  the handler lays it out (schedule_size); otherwise an empty buffer (the
  decode schedules itself)."""
  if sel.config.schedule != "step":
    return (jnp.zeros((0,), jnp.uint8),)
  parts = int(sel.attrs["workspace_parts"])
  per_request, fixed = _ffi.ext().schedule_size(rows, parts)
  sched = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((per_request * requests + fixed,), jnp.uint8))(
      *metadata, workspace_parts=parts, **attrs)
  return varying_like_inputs((sched,), metadata)


def select_cuda(spec: OpSpec, call: Call, args, device=kernels.VISIBLE) -> kernels.Selection:
  """The trace-time kernel selection of a CUDA call."""
  requests, rows = spec.kernel_shape(call, args[0])
  return kernels.select(spec.facts(call, args), call.plan.kernel, requests=requests, rows=rows,
                        dv=spec.dv(call), device=device, owner=type(call.plan).__name__)


def _cuda_call(spec: OpSpec, call: Call, *args):
  sel = select_cuda(spec, call, args)
  extra = tuple(spec.cuda_extra(call, args, sel)) if spec.cuda_extra is not None else ()
  res = jax.ffi.ffi_call(spec.cuda_target, _out_types(args[0], spec.dv(call)) + (sel.workspace,),
                         input_layouts=operand_layouts(call.q_axis_added, len(args) + len(extra)))(
      *args, *extra, **spec.attrs(call), **spec.cuda_attrs(call), **sel.attrs)
  return varying_like_inputs(res[:2], args)


def _cpu_call(spec: OpSpec, call: Call, *args):
  res = jax.ffi.ffi_call(spec.cpu_target, _out_types(args[0], spec.dv(call)),
                         input_layouts=operand_layouts(call.q_axis_added, len(args)))(
      *args, **spec.attrs(call))
  return varying_like_inputs(tuple(res), args)


def _local(spec: OpSpec, call: Call, *args):
  """One device's call on local (possibly sharded) operands."""
  if call.context_axis is not None:
    return spec.context(functools.partial(_local, spec), call, *args)
  backend = call.plan.backend
  if backend == "xla":
    return spec.xla(call, *args)
  _ffi.require_extension()
  if backend == "cpu":
    return _cpu_call(spec, call, *args)
  cuda_built = _ffi.has_cuda_target(spec.cuda_target)
  if backend == "cuda":
    if not cuda_built:
      raise RuntimeError(f"mla_jax.{spec.name}: backend 'cuda', but this build has no CUDA kernels "
                         "(no CUDA toolkit at build time, or MLA_JAX_CUDA=0)")
    if not spec.cuda_serves(call):
      raise ValueError(f"mla_jax.{spec.name}: backend 'cuda' needs kv_lora_rank 512 and qk_rope_head_dim 64; "
                       "use backend 'cpu' or 'xla'")
    return _cuda_call(spec, call, *args)
  # "auto": the lowering platform picks the branch; nothing else is lowered.
  # Every branch is traced, so a GPU branch the kernels cannot serve (other
  # latent widths, or no CUDA kernels built) falls back to XLA.
  cuda = _cuda_call if cuda_built and spec.cuda_serves(call) else (lambda _s, c, *a: spec.xla(c, *a))
  return jax.lax.platform_dependent(
      *args, cpu=functools.partial(_cpu_call, spec, call), cuda=functools.partial(cuda, spec, call),
      default=lambda *a: spec.xla(call, *a))


@functools.cache
def build(spec: OpSpec, call: Call):
  """The op for one spec and static call: fn(*operands) -> (out, lse)."""
  bind = lambda c, context_axis=None: functools.partial(
      _local, spec, c if context_axis is None else
      dataclasses.replace(c, context_axis=_context.join_axes(c.context_axis, context_axis)))
  shardings = spec.shardings
  cache = spec.cache_operands[0]
  partitioned = _sharding.partitioned_op(bind, shardings, spec.sharding_rule, cache_operand=cache)

  @jax.custom_batching.custom_vmap
  def op(*args):
    return _sharding.dispatch(args, local=functools.partial(bind, call),
                              partitioned=functools.partial(partitioned, call), shardings=shardings,
                              cache_operand=cache)

  op.def_vmap(fold_into_batch(op, spec.per_request))
  return inference_only(op, spec.name)


def fold_into_batch(op, per_request: tuple):
  """A custom_vmap rule for op(*operands) -> (out, lse): the mapped axis
  folds into B when only the per-request operands (leading B axis) are
  batched; a batched shared operand (cache, scale, sink) loops instead."""

  def rule(axis_size, in_batched, *args):
    if any(bat for i, bat in enumerate(in_batched) if i not in per_request):
      # A batched shared operand cannot fold into B: loop instead.
      args = [a if bat else jnp.broadcast_to(a, (axis_size,) + a.shape)
              for a, bat in zip(args, in_batched)]
      out = jax.lax.map(lambda xs: op(*xs), tuple(args))
      return out, (True, True)
    # Fold B-major, [V, B, ...] -> [B * V, ...]: a sharded B then keeps whole
    # blocks per device (a V-major fold would need an all-gather, and is
    # untypeable under explicit sharding). The transposes copy only the small
    # per-request operands and the output.
    args = list(args)
    batch = 0
    for i in per_request:
      a = args[i]
      a = (jnp.swapaxes(a, 0, 1) if in_batched[i] else
           jnp.broadcast_to(a[:, None], (a.shape[0], axis_size) + a.shape[1:]))
      batch = a.shape[0]
      args[i] = a.reshape((a.shape[0] * axis_size,) + a.shape[2:])
    # Explicit sizes: a mapped axis of size 0 leaves nothing to infer a -1 from.
    unfold = lambda x: jnp.swapaxes(x.reshape((batch, axis_size) + x.shape[1:]), 0, 1)
    out, lse = op(*args)
    return (unfold(out), unfold(lse)), (True, True)

  return rule


def inference_only(fn, op_name: str):
  """fn wrapped in a custom_jvp that refuses differentiation with a clear
  TypeError (decode never backpropagates); vmap and jit pass through."""

  @jax.custom_jvp
  def nodiff(*args):
    return fn(*args)

  @nodiff.defjvp
  def _no_jvp(primals, tangents):
    raise TypeError(
        f"mla_jax.{op_name} is inference-only: it has no derivative (decode never "
        "backpropagates). Wrap its inputs in jax.lax.stop_gradient if it sits inside a "
        "differentiated function.")

  return nodiff


def run(spec: OpSpec, call: Call, operands, query_had_q_axis: bool, return_lse: bool):
  """Calls the op and drops the Q axis again where normalisation added it."""
  out, lse = build(spec, call)(*operands)
  if not query_had_q_axis:  # reshapes lower to bitcasts: no copy
    out = out.reshape(out.shape[:1] + out.shape[2:])
    lse = lse.reshape(lse.shape[:1] + lse.shape[2:])
  return (out, lse) if return_lse else out


def explain(spec: OpSpec, call: Call, operands, device=None) -> kernels.Explanation:
  """What a call with these (normalised) operands runs on ``device``."""
  device = jax.devices()[0] if device is None else device
  backend = call.plan.backend
  if isinstance(device, kernels.CudaDevice):
    platform, cuda_device, kind = "cuda", device, f"sm_{device.arch} with {device.sm_count} SMs"
  else:
    platform = "cuda" if device.platform in ("gpu", "cuda") else device.platform
    cuda_device = kernels.cuda_device(device) if platform == "cuda" else None
    kind = device.platform
  if backend == "auto":
    backend = {"cpu": "cpu", "cuda": "cuda"}.get(platform, "xla")
    if backend == "cuda" and not (_ffi.has_cuda_target(spec.cuda_target) and spec.cuda_serves(call)):
      return kernels.Explanation("xla", None, (
          "backend auto on a CUDA device runs the pure-JAX formulation here: "
          + ("this build has no CUDA kernels" if not _ffi.has_cuda_target(spec.cuda_target)
             else "the CUDA kernels need kv_lora_rank 512 and qk_rope_head_dim 64"),))
    reason = {"cpu": "backend auto on a CPU device: the C++ CPU kernel",
              "cuda": "backend auto on a CUDA device: the CUDA kernels",
              "xla": f"backend auto on a {kind} device: the pure-JAX formulation"}[backend]
  else:
    reason = f"backend {backend} (requested by the plan)"
  if backend != "cuda":
    return kernels.Explanation(backend, None, (reason,))
  _ffi.require_extension()
  sel = select_cuda(spec, call, operands, device=cuda_device)
  return kernels.Explanation("cuda", sel.config, (reason,) + sel.explanation)
