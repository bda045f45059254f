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
