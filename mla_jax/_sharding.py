"""Sharding of the decode ops (paged and sparse), shared by both.

Batch (B) and heads (H) of the query may be sharded; every request's rows
and every head are independent, so each device runs the kernel on its own
slice with no communication. A cache sharded on its page axis over mesh
axes that shard neither B nor H is decoded where it lives (context
parallelism, mla_jax/_context.py): each device attends its own pages and
the partial results are merged over those axes. Everything else (the page
axis of a block table, the top-k axis of an index array, feature dims, and
a cache sharded otherwise) stays whole: it is replicated when sharded. An
op supplies

  * ``bind(*static, context_axis=None)``: the one-device function of the
    operands for its static arguments (plan and flags), run on local
    (per-device) shapes; with context_axis, that device's share merged
    over the axis;
  * ``shardings(mesh, batch_axis, head_axis, page_axis=None)``: the
    NamedShardings of its operands and results for a query sharded as
    ``[batch_axis, _, head_axis, _]`` and a cache as ``[page_axis, ...]``;
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


def axis_names(entry) -> tuple:
  """The mesh axis names of one PartitionSpec entry (a name, a tuple of
  names, or None), as a tuple."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def context_axis(cache_sharding, num_pages, batch_axis, head_axis, allowed=None):
  """The mesh axes the cache's page axis is split over, when the op can
  decode it in place: axes that shard neither B nor H (and are in
  ``allowed`` when given), splitting ``num_pages`` evenly. None: the cache
  is replicated first."""
  spec = tuple(getattr(cache_sharding, "spec", None) or ())
  names = axis_names(spec[0]) if spec else ()
  if not names or set(names) & set(axis_names(batch_axis) + axis_names(head_axis)):
    return None
  if allowed is not None and not set(names) <= set(allowed):
    return None
  mesh_shape = dict(getattr(getattr(cache_sharding, "mesh", None), "shape", None) or {})
  size = 1
  for n in names:
    size *= mesh_shape.get(n, 0)
  # An uneven split pads the last shards, whose pages would then look real
  # (ids past the cache must stay NaN): replicate instead.
  if size == 0 or not isinstance(num_pages, int) or num_pages % size:
    return None
  return names[0] if len(names) == 1 else names


def partitioned_op(bind, shardings, sharding_rule: str, cache_operand: int):
  """``op(call, *operands)``: ``bind(call)(*operands)`` partitioned by
  ``custom_partitioning`` with a Shardy rule; the query is operand 0, the
  cache operand ``cache_operand``.

  Each device runs ``bind(call)`` on its shard, with the operand and result
  shardings ``shardings`` gives for the query's B/H axes, or, when the
  cache is split on its pages over other axes (:func:`context_axis`),
  ``bind(call, context_axis=...)`` on its share of the pages. On a single
  device custom_partitioning lowers to the plain call, which keeps the op
  exportable with jax.export.
  """

  def op(call, *args):
    return bind(call)(*args)

  op = custom_partitioning(op, static_argnums=(0,))

  def infer(call, mesh, arg_shapes, result_shape):
    return shardings(mesh, *query_axes(arg_shapes[0].sharding))[1]

  def partition(call, mesh, arg_shapes, result_shape):
    b, h = query_axes(arg_shapes[0].sharding)
    cache = arg_shapes[cache_operand]
    pages = context_axis(cache.sharding, cache.shape[0], b, h)
    arg_shardings, out_shardings = shardings(mesh, b, h, pages)
    return mesh, bind(call, context_axis=pages), out_shardings, arg_shardings

  op.def_partition(infer_sharding_from_operands=infer, partition=partition,
                   sharding_rule=sharding_rule)
  return op


def dispatch(args, *, local, partitioned, shardings, cache_operand: int):
  """Calls an op in every JAX sharding mode.

  local(context_axis=None): the kernel call on local shapes (see
  partitioned_op's bind); partitioned(*args): the op's custom_partitioning
  form (see partitioned_op); shardings: as there.

  * Auto axes (jax.jit with NamedSharding inputs): Shardy propagates the
    rule and custom_partitioning runs one kernel per device.
  * Explicit axes: the shardings are in the types, so the kernel runs in a
    shard_map over the explicit axes with the rule's specs (an operand typed
    otherwise, e.g. a cache sharded on an axis of B, is resharded first; a
    cache sharded on its pages over other explicit axes stays in place and
    is decoded there). The result's type keeps the query's B/H sharding.
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
    cache = jax.typeof(args[cache_operand])
    pages = context_axis(cache.sharding, cache.shape[0], b, h, allowed=explicit)
    arg_specs, out_specs = (tuple(s.spec for s in ss) for ss in shardings(mesh, b, h, pages))
    # the explicit axes are manual there
    inner = local(context_axis=pages) if pages is not None else None
    body = lambda *a: (inner(*a) if inner is not None else
                       dispatch(a, local=local, partitioned=partitioned, shardings=shardings,
                                cache_operand=cache_operand))
    with contextlib.ExitStack() as stack:
      if jax.sharding.get_abstract_mesh().empty:  # explicit types but no jax.set_mesh
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
      args = [jax.sharding.reshard(a, s) for a, s in zip(args, arg_specs)]
      return jax.shard_map(body, mesh=mesh, in_specs=arg_specs, out_specs=out_specs,
                           axis_names=explicit)(*args)
  if manual:
    return local()(*args)
  return partitioned(*args)


def require_manual(axis, op_name: str) -> None:
  """context_axis= names axes that must be manual here (inside shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  types = dict(zip(mesh.axis_names, mesh.axis_types)) if not mesh.empty else {}
  for name in axis_names(axis):
    if types.get(name) != jax.sharding.AxisType.Manual:
      raise ValueError(f"mla_jax.{op_name}: context_axis={axis!r}: axis {name!r} is not a manual axis here; "
                       "context_axis is for calls inside jax.shard_map over that axis (under jax.jit, "
                       "shard the cache on its page axis instead)")
