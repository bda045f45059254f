"""Static configuration of a paged MLA decode call (the *plan*)."""

from __future__ import annotations

import dataclasses
import math

BACKENDS = ("auto", "cuda", "cpu", "xla")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """Static configuration of :func:`mla_jax.paged_decode`.

  Frozen and hashable: pass it as a static argument through ``jax.jit``.
  Equal plans share one compiled executable; the *values* of ``seq_lens`` and
  ``block_table`` never cause a recompilation.

  Attributes:
    num_heads: query heads H (1-128). All heads share the one latent KV head.
    page_size: tokens per cache page; a power of two from 1 to 256.
    sm_scale: softmax scale applied to q.k (e.g. 1/sqrt(192) for DeepSeek-V3).
    q_len: query tokens per request Q (1-8; >1 for MTP / speculative decode).
    causal: query token i of Q sees positions ``0 .. seq_len - Q + i``; when
      False every query token sees all ``seq_len`` positions.
    kv_lora_rank: width of the compressed latent ``ckv`` (512 for DeepSeek).
    qk_rope_head_dim: width of the rope part ``kpe`` (64 for DeepSeek).
    max_num_splits: upper bound on how many KV splits (FlashDecoding) one
      request may be cut into on the GPU; None lets the on-device scheduler
      choose (at most one split per SM partition).
    backend: "auto" (cuda on a GPU, cpu otherwise), "cuda", "cpu", or "xla"
      (the pure-JAX reference formulation).

  Raises:
    ValueError: on construction, if a field is out of range.
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

  def __post_init__(self):
    def _int(name, lo, hi):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"DecodePlan.{name} must be an int, got {type(v).__name__}")
      if not lo <= v <= hi:
        raise ValueError(f"DecodePlan.{name} must be in [{lo}, {hi}], got {v}")

    _int("num_heads", 1, 128)
    _int("page_size", 1, 256)
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"DecodePlan.page_size must be a power of two, got {self.page_size}")
    _int("q_len", 1, 8)
    _int("kv_lora_rank", 1, 1 << 16)
    _int("qk_rope_head_dim", 1, 1 << 16)
    if self.max_num_splits is not None:
      _int("max_num_splits", 1, 1 << 16)
    if not isinstance(self.sm_scale, (int, float)) or isinstance(self.sm_scale, bool):
      raise TypeError(f"DecodePlan.sm_scale must be a float, got {type(self.sm_scale).__name__}")
    if not (math.isfinite(self.sm_scale) and self.sm_scale > 0):
      raise ValueError(f"DecodePlan.sm_scale must be finite and > 0, got {self.sm_scale}")
    object.__setattr__(self, "sm_scale", float(self.sm_scale))
    if not isinstance(self.causal, bool):
      raise TypeError(f"DecodePlan.causal must be a bool, got {type(self.causal).__name__}")
    if self.backend not in BACKENDS:
      raise ValueError(f"DecodePlan.backend must be one of {BACKENDS}, got {self.backend!r}")

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

  def __post_init__(self):
    def _int(name, lo, hi):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"SparseDecodePlan.{name} must be an int, got {type(v).__name__}")
      if not lo <= v <= hi:
        raise ValueError(f"SparseDecodePlan.{name} must be in [{lo}, {hi}], got {v}")

    _int("num_heads", 1, 128)
    _int("page_size", 1, 256)
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"SparseDecodePlan.page_size must be a power of two, got {self.page_size}")
    _int("topk", 1, 65536)
    _int("q_len", 1, 8)
    if not isinstance(self.sm_scale, (int, float)) or isinstance(self.sm_scale, bool):
      raise TypeError(f"SparseDecodePlan.sm_scale must be a float, got {type(self.sm_scale).__name__}")
    if not (math.isfinite(self.sm_scale) and self.sm_scale > 0):
      raise ValueError(f"SparseDecodePlan.sm_scale must be finite and > 0, got {self.sm_scale}")
    object.__setattr__(self, "sm_scale", float(self.sm_scale))
    if self.kv_format not in KV_FORMATS:
      raise ValueError(f"SparseDecodePlan.kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"SparseDecodePlan.backend must be one of {BACKENDS}, got {self.backend!r}")

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
