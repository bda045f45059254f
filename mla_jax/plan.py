"""Static configuration of a paged MLA decode call (the *plan*)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .kernels import KernelChoice, as_kernel_choice

BACKENDS = ("auto", "cuda", "cpu", "xla")

_F32 = np.finfo(np.float32)


def _check_int(plan, name: str, lo: int, hi: int) -> None:
  """Field `name` of `plan` is an int (Python or NumPy) in [lo, hi]; stored as a Python int."""
  kind = type(plan).__name__
  v = getattr(plan, name)
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{kind}.{name} must be an int, got {type(v).__name__}")
  if not lo <= int(v) <= hi:
    raise ValueError(f"{kind}.{name} must be in [{lo}, {hi}], got {v}")
  object.__setattr__(plan, name, int(v))


def _check_sm_scale(plan) -> None:
  """sm_scale is a real number whose float32 value (what the kernels use) is
  finite and normal (> 0); stored as a Python float."""
  kind = type(plan).__name__
  v = plan.sm_scale
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
    raise TypeError(f"{kind}.sm_scale must be a float, got {type(v).__name__}")
  v = float(v)
  if not (math.isfinite(v) and float(_F32.tiny) <= v <= float(_F32.max)):
    raise ValueError(f"{kind}.sm_scale must be finite and > 0 in float32 "
                     f"([{float(_F32.tiny):.3g}, {float(_F32.max):.3g}]), got {plan.sm_scale}")
  object.__setattr__(plan, "sm_scale", v)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """Static configuration of :func:`mla_jax.paged_decode`.

  Frozen and hashable: pass it as a static argument through ``jax.jit``.
  Equal plans share one compiled executable; the *values* of ``seq_lens`` and
  ``block_table`` never cause a recompilation.

  Attributes:
    num_heads: query heads H (1-128). All heads share the one latent KV head.
    page_size: tokens per cache page; a power of two from 1 to 256.
    sm_scale: softmax scale applied to q.k (e.g. 1/sqrt(192) for DeepSeek-V3);
      finite and positive as a float32, which is what the kernels use.
    q_len: query tokens per request Q (1-8; >1 for MTP / speculative decode).
    causal: query token i of Q sees positions ``0 .. seq_len - Q + i``; when
      False every query token sees all ``seq_len`` positions.
    kv_lora_rank: width of the compressed latent ``ckv`` (512 for DeepSeek).
    qk_rope_head_dim: width of the rope part ``kpe`` (64 for DeepSeek).
    max_num_splits: upper bound on how many KV splits (FlashDecoding) one
      request may be cut into on the GPU; None lets the on-device scheduler
      choose (at most one split per SM partition, and none when whole
      requests spread within 5 % of an equal share).
    backend: "auto" (cuda on a GPU, cpu otherwise), "cuda", "cpu", or "xla"
      (the pure-JAX reference formulation).
    kernel: which CUDA kernels serve the call: "auto" (chosen from the
      call's static facts, see :func:`mla_jax.explain`), a kernel name
      ("portable", "sm90_lockstep", "sm90_seesaw", "sm90_swapab"), or a
      :class:`mla_jax.KernelChoice`; stored as a KernelChoice.

  Integer and float fields accept NumPy scalars and store Python numbers.

  Raises:
    TypeError, ValueError: on construction, if a field has the wrong type or
      is out of range.
  """

  num_heads: int
  page_size: int
  sm_scale: float
  q_len: int = 1
  causal: bool = True
  kv_lora_rank: int = 512
  qk_rope_head_dim: int = 64
  max_num_splits: int | None = None
  backend: str = "auto"
  kernel: KernelChoice | str = "auto"

  def __post_init__(self):
    _int = lambda name, lo, hi: _check_int(self, name, lo, hi)
    _int("num_heads", 1, 128)
    _int("page_size", 1, 256)
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"DecodePlan.page_size must be a power of two, got {self.page_size}")
    _int("q_len", 1, 8)
    _int("kv_lora_rank", 1, 1 << 16)
    _int("qk_rope_head_dim", 1, 1 << 16)
    if self.max_num_splits is not None:
      _int("max_num_splits", 1, 1 << 16)
    _check_sm_scale(self)
    if not isinstance(self.causal, bool):
      raise TypeError(f"DecodePlan.causal must be a bool, got {type(self.causal).__name__}")
    if self.backend not in BACKENDS:
      raise ValueError(f"DecodePlan.backend must be one of {BACKENDS}, got {self.backend!r}")
    object.__setattr__(self, "kernel", as_kernel_choice(self.kernel, "DecodePlan"))

  @property
  def head_dim_qk(self) -> int:
    """Query/key width: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)."""
    return self.kv_lora_rank + self.qk_rope_head_dim


KV_FORMATS = ("bf16", "fp8_ds_mla")


@dataclasses.dataclass(frozen=True)
class SparseDecodePlan:
  """Static configuration of :func:`mla_jax.sparse_decode` (DeepSeek V3.2 DSA).

  Frozen and hashable: pass it as a static argument through ``jax.jit``.
  The *values* of ``indices``, ``topk_lens`` and ``attn_sink`` never cause a
  recompilation.

  Attributes:
    num_heads: query heads H (1-128). All heads share the one latent KV head.
    page_size: tokens per cache page; a power of two from 1 to 256. An index
      is a global slot ``page * page_size + offset``.
    sm_scale: softmax scale applied to q.k (e.g. 1/sqrt(192) for DeepSeek).
    topk: K, the number of indices per query token (1-65536); the last axis
      of ``indices`` must have exactly this size.
    q_len: query tokens per request Q (1-8). Each query token has its own
      index row; there is no causal masking (the indices decide).
    kv_format: "bf16": packed ``[P, S, 576]`` cache in the query dtype
      (bfloat16 or float16, despite the name); "fp8_ds_mla": uint8
      ``[P, S, 656]`` rows from :func:`mla_jax.quantize_latent_fp8`.
    backend: "auto" (cuda on a GPU, cpu otherwise), "cuda", "cpu", or "xla"
      (the pure-JAX reference formulation).
    kernel: which CUDA kernels serve the call, as for
      :class:`DecodePlan`. On sm_90 "auto" picks, for fp8_ds_mla rows with
      a bf16 query, "sm90_swapab" up to 32 heads and above that
      "sm90_seesaw" from top-k 1024, else "sm90_lockstep"; with an fp16
      query "sm90_lockstep" above 16 heads; a "bf16" cache in the query
      dtype "sm90_lockstep" at every head count; "portable" otherwise
      (:func:`mla_jax.explain` says which and why).

  The latent widths are fixed by the fp8_ds_mla layout: ``kv_lora_rank`` is
  512 and ``qk_rope_head_dim`` 64 (read-only properties).

  Raises:
    TypeError, ValueError: on construction, if a field has the wrong type or
      is out of range.
  """

  num_heads: int
  page_size: int
  sm_scale: float
  topk: int
  q_len: int = 1
  kv_format: str = "bf16"
  backend: str = "auto"
  kernel: KernelChoice | str = "auto"

  def __post_init__(self):
    _int = lambda name, lo, hi: _check_int(self, name, lo, hi)
    _int("num_heads", 1, 128)
    _int("page_size", 1, 256)
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"SparseDecodePlan.page_size must be a power of two, got {self.page_size}")
    _int("topk", 1, 65536)
    _int("q_len", 1, 8)
    _check_sm_scale(self)
    if self.kv_format not in KV_FORMATS:
      raise ValueError(f"SparseDecodePlan.kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"SparseDecodePlan.backend must be one of {BACKENDS}, got {self.backend!r}")
    object.__setattr__(self, "kernel", as_kernel_choice(self.kernel, "SparseDecodePlan"))

  @property
  def kv_lora_rank(self) -> int:
    """Width of the compressed latent ckv and of the output: 512."""
    return 512

  @property
  def qk_rope_head_dim(self) -> int:
    """Width of the rope part kpe: 64."""
    return 64

  @property
  def head_dim_qk(self) -> int:
    """Query/key width: kv_lora_rank + qk_rope_head_dim = 576."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def kv_row_width(self) -> int:
    """Last dimension of the cache: 576 ("bf16") or 656 bytes ("fp8_ds_mla")."""
    return 656 if self.kv_format == "fp8_ds_mla" else 576
