"""Shared pieces of the FFI kernel calls of every op (paged and sparse)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def kernel_out_types(q_nope, dn):
  b, q, h = q_nope.shape[:3]
  return (jax.ShapeDtypeStruct((b, q, h, dn), q_nope.dtype),
          jax.ShapeDtypeStruct((b, q, h), jnp.float32))


def operand_layouts(q_axis_added: bool, num_operands: int):
  """input_layouts for the kernel call (major to minor; None: row-major).

  A query given without a Q axis ([B, H, D], plan.q_len 1) reaches the kernel
  through a reshape to [B, 1, H, D]. XLA (jax 0.10) lays that reshape out as
  {3,2,0,1}, a bitcast of the caller's buffer, and would copy it to reach the
  default row-major {3,2,1,0}. With a size-1 axis both are the same bytes, so
  the kernel is asked for the bitcast's layout (major to minor (1, 0, 2, 3))
  and gets the caller's buffer. A query that has its Q axis keeps row-major:
  that is its own parameter layout. Results need nothing: the kernel's
  row-major [B, 1, H, ...] outputs bitcast to [B, H, ...].
  """
  if not q_axis_added:
    return None
  q = (1, 0, 2, 3)
  return (q, q) + (None,) * (num_operands - 2)


def varying_axes(x) -> frozenset:
  """Manual mesh axes (inside shard_map) over which x's value varies."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax 0.10 and 0.11: aval.mat.varying; older: aval.vma
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_like_inputs(call):
  """ffi_call results carry no varying-manual-axes type; inside shard_map
  they must vary like the inputs (else lax.platform_dependent refuses to join
  them with the pure-JAX branch, and the types would claim replication)."""

  @functools.wraps(call)
  def wrapped(plan, *args, **kwargs):
    arrays = [a for a in args if hasattr(a, "shape")]  # skips static flags
    axes = frozenset().union(*map(varying_axes, arrays))
    outs = call(plan, *args, **kwargs)
    return tuple(jax.lax.pcast(o, tuple(sorted(axes - varying_axes(o), key=str)), to="varying")
                 for o in outs)

  return wrapped


def fold_into_batch(decode, per_request: tuple):
  """A custom_vmap rule for decode(*operands) -> (out, lse): the mapped axis
  folds into B when only the per-request operands (leading B axis) are
  batched; a batched shared operand (cache, scale, sink) loops instead."""

  def rule(axis_size, in_batched, *args):
    if any(bat for i, bat in enumerate(in_batched) if i not in per_request):
      # A batched shared operand cannot fold into B: loop instead.
      args = [a if bat else jnp.broadcast_to(a, (axis_size,) + a.shape)
              for a, bat in zip(args, in_batched)]
      out = jax.lax.map(lambda xs: decode(*xs), tuple(args))
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
    out, lse = decode(*args)
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
