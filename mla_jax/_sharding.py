"""Sharding of the decode ops (paged and sparse), shared by both.

Batch (B) and heads (H) of the query may be sharded; every request's rows
and every head are independent, so each device runs the kernel on its own
slice with no communication. Everything else (the cache, the page axis of a
block table, the top-k axis of an index array, feature dims) stays whole:
it is replicated when sharded. An op supplies

  * ``bind(*static)``: the one-device function of the operands for its
    static arguments (plan and flags), run on local (per-device) shapes;
  * ``shardings(mesh, batch_axis, head_axis)``: the NamedShardings of its
    operands and results for a query sharded as ``[batch_axis, _, head_axis, _]``;
  * a Shardy sharding rule (einsum-like string) over the same operands.

:func:`partitioned_op` turns these into a ``custom_partitioning`` op and
:func:`dispatch` calls the op right for the sharding mode in effect.
"""

from __future__ import annotations

import contextlib

import jax
from jax.experimental.custom_partitioning import custom_partitioning


def query_axes(sharding):
  """The (batch, head) mesh axes of a [B, Q, H, D] query's sharding."""
  spec = tuple(sharding.spec) + (None,) * 4
  return spec[0], spec[2]


def trace_mesh(x):
  """The abstract mesh in context, else the one in x's type (explicit mode)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", mesh)
  return mesh


def partitioned_op(bind, shardings, sharding_rule: str, num_static: int):
  """``op(*static, *operands)``: ``bind(*static)(*operands)`` partitioned by
  ``custom_partitioning`` with a Shardy rule; the query is operand 0.

  Each device runs ``bind(*static)`` on its shard, with the operand and
  result shardings ``shardings`` gives for the query's B/H axes. On a single
  device custom_partitioning lowers to the plain call, which keeps the op
  exportable with jax.export.
  """

  def op(*args):
    return bind(*args[:num_static])(*args[num_static:])

  op = custom_partitioning(op, static_argnums=tuple(range(num_static)))

  def infer(*args):  # (*static, mesh, arg_shapes, result_shape)
    mesh, arg_shapes = args[num_static:num_static + 2]
    return shardings(mesh, *query_axes(arg_shapes[0].sharding))[1]

  def partition(*args):
    static, (mesh, arg_shapes, _) = args[:num_static], args[num_static:]
    arg_shardings, out_shardings = shardings(mesh, *query_axes(arg_shapes[0].sharding))
    return mesh, bind(*static), out_shardings, arg_shardings

  op.def_partition(infer_sharding_from_operands=infer, partition=partition,
                   sharding_rule=sharding_rule)
  return op


def dispatch(args, *, local, partitioned, shardings):
  """Calls an op in every JAX sharding mode.

  local(*args): the kernel call on local shapes; partitioned(*args): the
  op's custom_partitioning form (see partitioned_op); shardings: as there.

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
  mesh = trace_mesh(args[0])
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  explicit = {n for n, t in types.items() if t == jax.sharding.AxisType.Explicit}
  manual = {n for n, t in types.items() if t == jax.sharding.AxisType.Manual}
  if explicit:
    b, h = query_axes(jax.typeof(args[0]).sharding)
    arg_specs, out_specs = (tuple(s.spec for s in ss) for ss in shardings(mesh, b, h))
    # the explicit axes are manual there
    body = lambda *a: dispatch(a, local=local, partitioned=partitioned, shardings=shardings)
    with contextlib.ExitStack() as stack:
      if jax.sharding.get_abstract_mesh().empty:  # explicit types but no jax.set_mesh
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
      args = [jax.sharding.reshard(a, s) for a, s in zip(args, arg_specs)]
      return jax.shard_map(body, mesh=mesh, in_specs=arg_specs, out_specs=out_specs,
                           axis_names=explicit)(*args)
  if manual:
    return local(*args)
  return partitioned(*args)
