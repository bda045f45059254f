"""Sharded paged MLA decode with mla_jax: two runnable patterns.

1. Tensor parallel (TP): query heads split over a 'model' mesh axis (and the
   batch over 'data'), one cache replicated on every device. Plain jax.jit
   with NamedSharding inputs (or explicit sharding with jax.set_mesh): the
   op's sharding rule runs one kernel per device on its own heads/requests,
   with no communication. The plan holds the *global* head count.

2. Data parallel (DP) with a per-shard cache: every 'data' shard owns its own
   pages; block tables hold *local* page ids. Expressed with jax.shard_map,
   in which the op sees local shapes, so the plan holds the *local* head
   count. TP over 'model' works inside it too.

Runs anywhere: with fewer than two accelerators it uses 8 CPU devices.

    python examples/sharded_decode.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)   # before any backend starts; CPU only

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mla_jax  # noqa: E402
from mla_jax.testing import random_paged_inputs, reference_paged_decode  # noqa: E402

NUM_HEADS = 16       # global query heads (DeepSeek-V3 has 128; 16 per GPU at TP 8)
PAGE_SIZE = 64
SM_SCALE = 192 ** -0.5


def _devices():
  devs = jax.devices()
  return devs if len(devs) >= 2 else jax.devices("cpu")


def _mesh(axis_type=AxisType.Auto):
  devs = _devices()
  model = 2 if len(devs) % 2 == 0 else 1
  return jax.make_mesh((len(devs) // model, model), ("data", "model"),
                       axis_types=(axis_type,) * 2, devices=devs)


def _check(name, out, query, cache, block_table, seq_lens, plan):
  ref, _ = reference_paged_decode(np.asarray(query, np.float64)[:, None],
                                  np.asarray(cache, np.float64), block_table, seq_lens, plan)
  err = np.abs(np.asarray(out, np.float32) - ref[:, 0]).max()
  print(f"{name}: out {out.shape} sharded {out.sharding.spec}, max |err| vs float64 {err:.2e}")
  assert err < 3e-2, err


def _inputs(rng, lens):
  d = random_paged_inputs(rng, lens, num_heads=NUM_HEADS, page_size=PAGE_SIZE)
  return (jnp.asarray(d["query"][:, 0], jnp.bfloat16),       # [B, H, 576]
          jnp.asarray(d["kv_cache"], jnp.bfloat16),           # [num_pages, 64, 576]
          jnp.asarray(d["block_table"]), jnp.asarray(d["seq_lens"]))


# --- 1. TP: heads (and batch) sharded, one replicated cache --------------------
def tp_heads():
  mesh = _mesh()
  n_data = mesh.shape["data"]
  lens = np.random.default_rng(0).integers(1, 600, size=4 * n_data)
  query, cache, block_table, seq_lens = _inputs(np.random.default_rng(1), lens)
  plan = mla_jax.DecodePlan(num_heads=NUM_HEADS, page_size=PAGE_SIZE, sm_scale=SM_SCALE)

  @jax.jit
  def decode(query, cache, block_table, seq_lens):
    return mla_jax.paged_decode(query, cache, block_table, seq_lens, plan=plan)

  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  out = decode(put(query, "data", "model"),          # [B, H, 576]: B over data, H over model
               put(cache),                           # replicated
               put(block_table, "data"), put(seq_lens, "data"))
  _check("TP (auto axes)", out, query, cache, block_table, seq_lens, plan)

  # The same with explicit sharding: shardings live in the types.
  emesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(emesh):
    out = decode(jax.device_put(query, P("data", "model")), jax.device_put(cache, P()),
                 jax.device_put(block_table, P("data")), jax.device_put(seq_lens, P("data")))
    print("  explicit type:", jax.typeof(out))
  _check("TP (explicit axes)", out, query, cache, block_table, seq_lens, plan)


# --- 2. DP: every data shard owns its cache; TP inside --------------------------
def dp_per_shard_cache():
  mesh = _mesh()
  n_data, n_model = mesh.shape["data"], mesh.shape["model"]
  rng = np.random.default_rng(2)
  # Each shard's own requests, pages and local page ids (as its own page
  # allocator would produce them); padded to one shape and stacked.
  shards = [random_paged_inputs(rng, rng.integers(1, 400, size=4), num_heads=NUM_HEADS,
                                page_size=PAGE_SIZE) for _ in range(n_data)]
  pages = max(s["kv_cache"].shape[0] for s in shards)
  cols = max(s["block_table"].shape[1] for s in shards)
  for s in shards:
    s["kv_cache"] = np.pad(s["kv_cache"], ((0, pages - len(s["kv_cache"])), (0, 0), (0, 0)))
    s["block_table"] = np.pad(s["block_table"], ((0, 0), (0, cols - s["block_table"].shape[1])),
                              constant_values=-1)
  cat = lambda k: np.concatenate([s[k] for s in shards])
  query = jnp.asarray(cat("query")[:, 0], jnp.bfloat16)  # [n_data*4, H, 576]
  cache = jnp.asarray(cat("kv_cache"), jnp.bfloat16)     # [n_data*pages, 64, 576]: shard d's pages
  block_table, seq_lens = cat("block_table"), cat("seq_lens")   # local page ids

  # Inside shard_map the op sees local shapes: the plan has the local heads.
  local_plan = mla_jax.DecodePlan(num_heads=NUM_HEADS // n_model, page_size=PAGE_SIZE,
                                  sm_scale=SM_SCALE)

  @jax.jit
  @jax.shard_map(mesh=mesh,
                 in_specs=(P("data", "model"), P("data"), P("data"), P("data")),
                 out_specs=P("data", "model"))
  def decode(query, cache, block_table, seq_lens):
    # query [4, H/n_model, 576], cache [pages, 64, 576]: this shard's own.
    return mla_jax.paged_decode(query, cache, block_table, seq_lens, plan=local_plan)

  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  out = decode(put(query, "data", "model"), put(cache, "data"), put(block_table, "data"),
               put(seq_lens, "data"))
  # Reference: shard by shard, against that shard's own cache.
  plan = mla_jax.DecodePlan(num_heads=NUM_HEADS, page_size=PAGE_SIZE, sm_scale=SM_SCALE)
  out_np = np.asarray(out, np.float32)
  for d, s in enumerate(shards):
    rows = slice(4 * d, 4 * d + 4)
    ref, _ = reference_paged_decode(np.asarray(query[rows], np.float64)[:, None],
                                    np.asarray(cache[d * pages:(d + 1) * pages], np.float64),
                                    s["block_table"], s["seq_lens"], plan)
    assert np.abs(out_np[rows] - ref[:, 0]).max() < 3e-2
  print(f"DP per-shard cache + TP: out {out.shape} sharded {out.sharding.spec}, "
        f"{n_data} caches of {pages} pages, matches the per-shard reference")


if __name__ == "__main__":
  print(f"devices: {len(_devices())} x {_devices()[0].platform}, mla_jax {mla_jax.__version__}")
  tp_heads()
  dp_per_shard_cache()
