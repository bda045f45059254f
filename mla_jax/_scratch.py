"""Scratch buffers of the CUDA split-KV kernels, declared as FFI results.

XLA allocates them (the handlers allocate nothing, which keeps the calls
safe inside command buffers). Sizes follow from static shapes only, so they
stay valid for symbolic batch sizes under jax.export.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

_DEFAULT_SM_COUNT = 132  # H100/H200 SXM; used when no CUDA device is visible


@functools.cache
def cuda_sm_count() -> int:
  try:
    return int(jax.devices("cuda")[0].core_count)
  except Exception:  # no CUDA backend here (e.g. exporting on a CPU host)
    return _DEFAULT_SM_COUNT


def cuda_num_parts(rows_per_request: int) -> int:
  """Persistent KV partitions the scheduler may use: one per group of SMs
  that together cover all 64-row blocks of a request's (q_len x heads) rows."""
  return max(1, cuda_sm_count() // math.ceil(rows_per_request / 64))


def split_kv_scratch(requests, rows: int, dv: int):
  """Result types of the scheduler metadata and the per-split partials.

  requests: kernel requests (B for paged decode, B*Q for sparse decode; may
  be symbolic); rows: query rows per request; dv: output width (512).
  The scheduler never makes more than requests + num_parts splits.
  """
  parts = cuda_num_parts(rows)
  row_blocks = math.ceil(rows / 64)
  i32, f32 = jnp.int32, jnp.float32
  return (
      jax.ShapeDtypeStruct((requests, 2), i32),             # per request: first split, splits
      jax.ShapeDtypeStruct((parts + 1,), i32),              # per partition: first split
      # per split: request, blocks, partition; one region per 64-row block
      # (the Hopper kernel's CTAs keep their own partition's splits there)
      jax.ShapeDtypeStruct(((requests + parts) * row_blocks, 4), i32),
      jax.ShapeDtypeStruct((requests + parts, rows, dv), f32),  # partial outputs (normalised)
      jax.ShapeDtypeStruct((requests + parts, rows), f32),  # partial LSEs
  )
