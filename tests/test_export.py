"""jax.export: symbolic shapes, serialization round trip, custom-call checks.

The kernels are custom calls without JAX's compatibility guarantee, so an
export must allow them explicitly:

    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                     for t in mla_jax.EXPORT_TARGETS]

EXPORT_TARGETS holds the CPU and CUDA targets of both ops
(mla_jax_{paged,sparse}_decode_{cpu,cuda}) and their schedule calls
(mla_jax_{paged,sparse}_decode_schedule_cuda): a CPU target is in every export
that lowers for "cpu" (backends "cpu" and "auto"), a CUDA one in exports for
"cuda" (backends "cuda" and "auto", when mla_jax was built with CUDA kernels).
Backend "xla" needs none. Serialization
needs the flatbuffers package (in the test extra).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mla_jax
from mla_jax import _ffi
from mla_jax.testing import random_paged_inputs, reference_paged_decode

pytest.importorskip("flatbuffers")

CPU = jax.devices("cpu")
H = 4
PAGE = 16
ALLOW = [export.DisabledSafetyCheck.custom_call(t) for t in _ffi.EXPORT_TARGETS]


def _plan(backend, num_heads=H):
  return mla_jax.DecodePlan(num_heads=num_heads, page_size=PAGE, sm_scale=0.125, backend=backend)


def _fn(plan):
  return jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan,
                                                            return_lse=True))


def _symbolic_args(num_heads=H):
  b, p, t = export.symbolic_shape("b, num_pages, max_pages_per_seq")
  return (jax.ShapeDtypeStruct((b, num_heads, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((p, PAGE, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, t), jnp.int32),
          jax.ShapeDtypeStruct((b,), jnp.int32))


def _inputs(rng, lens, extra_pages=3, num_heads=H):
  d = random_paged_inputs(rng, lens, num_heads=num_heads, page_size=PAGE, extra_pages=extra_pages)
  q = np.asarray(jnp.asarray(d["query"][:, 0], jnp.bfloat16))
  kv = np.asarray(jnp.asarray(d["kv_cache"], jnp.bfloat16))
  return q, kv, d["block_table"], d["seq_lens"]


def _reference(q, kv, bt, sl, plan):
  out, lse = reference_paged_decode(np.asarray(q, np.float64)[:, None], np.asarray(kv, np.float64),
                                    bt, sl, plan)
  return out[:, 0], lse[:, 0]


def _targets(exp):
  return set(re.findall(r"custom_call @(\w+)", exp.mlir_module())) - {"shape_assertion"}


# Concrete sizes: (lengths, extra pages) -> different B, num_pages and max_pages_per_seq.
SIZES = [([5, 40], 3), ([1, 2, 3, 100, 17], 0), ([0, 16, 33], 7), ([250], 1)]


@pytest.mark.parametrize("backend,platforms", [("cpu", ("cpu",)), ("auto", ("cpu", "cuda")),
                                               ("xla", ("cpu",))])
def test_export_symbolic_roundtrip(backend, platforms):
  plan = _plan(backend)
  exp = export.export(_fn(plan), disabled_checks=ALLOW, platforms=platforms)(*_symbolic_args())
  blob = exp.serialize()
  exp = export.deserialize(blob)
  assert exp.platforms == platforms
  assert [str(a.shape) for a in exp.in_avals] == [
      "(b, 4, 576)", "(num_pages, 16, 576)", "(b, max_pages_per_seq)", "(b,)"]
  if backend == "xla":
    assert _targets(exp) == set()
  else:
    assert _ffi.CPU_TARGET in _targets(exp)
    assert _targets(exp) <= set(_ffi.EXPORT_TARGETS)
  rng = np.random.default_rng(0)
  for lens, extra in SIZES:
    q, kv, bt, sl = _inputs(rng, lens, extra)
    with jax.default_device(CPU[0]):
      out, lse = exp.call(q, kv, bt, sl)
    assert out.shape == (len(lens), H, 512) and lse.shape == (len(lens), H)
    ref_out, ref_lse = _reference(q, kv, bt, sl, plan)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.parametrize("backend,platforms", [("cpu", ("cpu",)), ("auto", ("cpu", "cuda"))])
def test_export_sparse_symbolic_batch_roundtrip(backend, platforms):
  """sparse_decode exports on one device with a symbolic B (its sharding rule
  lowers to the plain kernel call there)."""
  topk, pages = 16, 5
  plan = mla_jax.SparseDecodePlan(num_heads=H, page_size=PAGE, sm_scale=0.125, topk=topk,
                                  backend=backend)
  f = jax.jit(lambda q, kv, i, tl, s: mla_jax.sparse_decode(q, kv, i, plan=plan, topk_lens=tl,
                                                            attn_sink=s, return_lse=True))
  (b,) = export.symbolic_shape("b")
  args = (jax.ShapeDtypeStruct((b, H, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((pages, PAGE, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, topk), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
          jax.ShapeDtypeStruct((H,), jnp.float32))
  exp = export.deserialize(
      export.export(f, disabled_checks=ALLOW, platforms=platforms)(*args).serialize())
  assert [str(a.shape) for a in exp.in_avals][0] == "(b, 4, 576)"
  assert _ffi.SPARSE_CPU_TARGET in _targets(exp) and _targets(exp) <= set(_ffi.EXPORT_TARGETS)
  rng = np.random.default_rng(3)
  kv = np.asarray(jnp.asarray(rng.standard_normal((pages, PAGE, 576)), jnp.bfloat16))
  sink = np.linspace(-1, 1, H).astype(np.float32)
  for batch in (1, 3):
    q = np.asarray(jnp.asarray(rng.standard_normal((batch, H, 576)), jnp.bfloat16))
    idx = rng.integers(-1, pages * PAGE, (batch, topk)).astype(np.int32)
    lens = rng.integers(0, topk + 1, (batch,)).astype(np.int32)
    with jax.default_device(CPU[0]):
      out, lse = exp.call(q, kv, idx, lens, sink)
    ref_out, ref_lse = mla_jax.testing.reference_sparse_decode(
        np.asarray(q, np.float64)[:, None], np.asarray(kv, np.float64), idx[:, None], plan,
        topk_lens=lens, attn_sink=sink)
    assert out.shape == (batch, H, 512) and lse.shape == (batch, H)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out[:, 0], atol=2e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), ref_lse[:, 0], atol=1e-3, rtol=0)


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_export_without_allowing_the_targets_fails(backend):
  with pytest.raises(ValueError, match=r"custom calls whose targets have no compatibility "
                     r"guarantees(.|\n)*mla_jax_paged_decode_cpu"):
    export.export(_fn(_plan(backend)), platforms=("cpu",))(*_symbolic_args())


def test_export_xla_backend_needs_no_allowance():
  exp = export.export(_fn(_plan("xla")), platforms=("cpu", "cuda"))(*_symbolic_args())
  assert _targets(export.deserialize(exp.serialize())) == set()


def test_export_shard_map_multi_device():
  """A sharded program exports through shard_map (the kernel call on local
  shapes), with concrete shapes. Limits (jax 0.10): a jit with multi-device
  shardings around the op itself does not serialize (custom_partitioning is
  a host callback), and a symbolic dimension inside an exported shard_map
  fails when called (JAX's shape refinement; a plain x * 2 fails too)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=CPU[:8])
  local = _plan("cpu", num_heads=4)                 # 8 heads over 2 'model' shards
  specs = (P("data", "model"), P(), P("data"), P("data"))
  f = jax.jit(jax.shard_map(
      lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=local, return_lse=True),
      mesh=mesh, in_specs=specs, out_specs=(P("data", "model"), P("data", "model"))))
  q, kv, bt, sl = _inputs(np.random.default_rng(1), [3, 40, 17, 0, 1, 64, 20, 33], num_heads=8)
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, kv, bt, sl)]
  exp = export.export(f, disabled_checks=ALLOW, platforms=("cpu",))(*args)
  exp = export.deserialize(exp.serialize())
  assert exp.nr_devices == 8
  assert _targets(exp) == {_ffi.CPU_TARGET}
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, kv, bt, sl), specs)]
  out, lse = exp.call(*placed)
  ref_out, ref_lse = _reference(q, kv, bt, sl, _plan("cpu", num_heads=8))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_export_auto_runs_on_gpu():
  """One artifact for CPU and GPU hosts: backend "auto" exported for both
  platforms runs the CUDA kernel when called on a GPU."""
  plan = mla_jax.DecodePlan(num_heads=16, page_size=64, sm_scale=0.125)
  b, p, t = export.symbolic_shape("b, num_pages, max_pages_per_seq")
  args = (jax.ShapeDtypeStruct((b, 16, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((p, 64, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
  exp = export.export(_fn(plan), disabled_checks=ALLOW, platforms=("cpu", "cuda"))(*args)
  exp = export.deserialize(exp.serialize())
  if _ffi.has_cuda_kernels():
    assert _ffi.CUDA_TARGET in _targets(exp)
  gpu = jax.devices("cuda")[0]
  rng = np.random.default_rng(2)
  for lens in ([5, 400], [1, 2, 3, 1000, 17], [0, 64, 129]):
    d = random_paged_inputs(rng, lens, num_heads=16, page_size=64)
    q = np.asarray(jnp.asarray(d["query"][:, 0], jnp.bfloat16))
    kv = np.asarray(jnp.asarray(d["kv_cache"], jnp.bfloat16))
    out, lse = exp.call(*[jax.device_put(x, gpu) for x in (q, kv, d["block_table"],
                                                            d["seq_lens"])])
    ref_out, ref_lse = _reference(q, kv, d["block_table"], d["seq_lens"], plan)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-3, rtol=0)
