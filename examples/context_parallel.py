"""Long contexts over several devices: a cache sharded on its pages, decoded in place.

One request of many tokens is bound by one GPU's memory bandwidth. Here the
paged cache is split on its page axis over a 'cp' mesh axis (device r holds
global pages [r * P, (r + 1) * P)), and a long request's pages are spread
over the devices by an interleaving allocator, so every device holds a share
of every long request. Under jax.jit, mla_jax.paged_decode then lets each
device attend only the tokens on its own pages and merges the partial
results by their LSEs: no cache bytes move, only [B, H, 512] partials.

Runs anywhere: with fewer than two accelerators it uses 8 CPU devices.

    python examples/context_parallel.py
"""

import re

import jax

jax.config.update("jax_num_cpu_devices", 8)   # before any backend starts; CPU only

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mla_jax  # noqa: E402
from mla_jax.testing import reference_paged_decode  # noqa: E402

NUM_HEADS = 16
PAGE_SIZE = 64
SM_SCALE = 192 ** -0.5


def interleaved_block_table(seq_lens, *, page_size: int, num_shards: int, pages_per_shard: int):
  """A block table whose requests take their pages round-robin over the shards.

  Page j of every request comes from shard ``j % num_shards`` (global page
  ids: shard s owns ``[s * pages_per_shard, (s + 1) * pages_per_shard)``),
  so a long request's tokens are split evenly over the devices. Unused
  entries are -1. A host-side sketch of what a serving allocator keeps per
  shard: a free list of its pages.

  Raises:
    ValueError: a shard runs out of pages.
  """
  seq_lens = np.asarray(seq_lens, np.int64)
  pages = [max(0, -(-int(n) // page_size)) for n in seq_lens]
  table = np.full((len(pages), max([1] + pages)), -1, np.int32)
  free = [list(range(s * pages_per_shard, (s + 1) * pages_per_shard)) for s in range(num_shards)]
  for b, n in enumerate(pages):
    for j in range(n):
      shard = (b + j) % num_shards      # offset by request: short requests spread over the shards too
      if not free[shard]:
        raise ValueError(f"shard {shard} has no free page left (pages_per_shard={pages_per_shard})")
      table[b, j] = free[shard].pop(0)
  return table


def _devices():
  devs = jax.devices()
  return devs if len(devs) >= 2 else jax.devices("cpu")


def main():
  devs = _devices()
  n = len(devs)
  mesh = jax.make_mesh((n,), ("cp",), devices=devs)
  lens = np.array([60_000, 4_000, 17, 0], np.int32)         # one long request, a few short ones
  pages_per_shard = -(-int(lens.sum()) // (PAGE_SIZE * n)) + len(lens)
  table = interleaved_block_table(lens, page_size=PAGE_SIZE, num_shards=n, pages_per_shard=pages_per_shard)
  rng = np.random.default_rng(0)
  query = jnp.asarray(rng.standard_normal((len(lens), NUM_HEADS, 576)), jnp.bfloat16)
  cache = jnp.asarray(rng.standard_normal((n * pages_per_shard, PAGE_SIZE, 576)), jnp.bfloat16)

  plan = mla_jax.DecodePlan(num_heads=NUM_HEADS, page_size=PAGE_SIZE, sm_scale=SM_SCALE)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  args = (put(query), put(cache, "cp"), put(table), put(lens))   # the cache split on its pages
  f = jax.jit(lambda q, kv, bt, sl: mla_jax.paged_decode(q, kv, bt, sl, plan=plan))
  out = f(*args)

  moved = sorted({m.group(1) for m in re.finditer(r"(all-gather|all-reduce|all-to-all)", f.lower(*args).compile()
                                                   .as_text())})
  print(f"{n} devices, cache {cache.shape} split on pages ({pages_per_shard} per device); "
        f"collectives in the program: {moved}")
  ref, _ = reference_paged_decode(np.asarray(query, np.float64)[:, None], np.asarray(cache, np.float64),
                                  table, lens, plan)
  err = np.abs(np.asarray(out, np.float32) - ref[:, 0]).max()
  print(f"out {out.shape}, max |err| vs float64 {err:.2e}")
  assert err < 3e-2, err


if __name__ == "__main__":
  main()
