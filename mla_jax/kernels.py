"""Which CUDA kernels a decode call runs, decided at trace time.

The decision itself is C++ (``csrc/dispatch/select.cc``), bound through the
extension so that tracing and the CUDA handler share one implementation:
Python calls it with the call's static facts (dtypes, layout, page size,
q_len x heads, batch size when it is concrete, and the CUDA device when one
is visible), and passes the result to the custom call as FFI attributes, so
the choice is visible in the HLO and fixed in an export. What only the device
knows (its architecture and SM count, when the trace ran without a CUDA
device) is settled by the same function in the handler. The capability table
is in docs/design.md; :func:`explain` says what a given call will run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi

KERNELS = ("auto", "portable", "sm90_lockstep", "sm90_seesaw", "sm90_swapab")
SCHEDULES = ("auto", "kernel", "inline", "block", "step")
COMBINE_GRIDS = ("auto", "block", "rows", "slices")

# ElemType and KvFormat of csrc/common/mla_params.h.
_ELEM_TYPES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1, jnp.dtype(jnp.float8_e4m3fn): 2,
               jnp.dtype(jnp.uint8): 2}
KV_FORMAT_CODES = {"bf16": 0, "fp8_ds_mla": 1}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """The CUDA kernel configuration a plan asks for (``plan.kernel``).

  Every field defaults to "auto": the library chooses from the call's static
  facts (docs/design.md has the table). Forcing a field is for tests and A/B
  measurements; a forced choice that cannot serve a call raises
  ``ValueError`` at trace time (or, for a device unknown then, fails the call
  on the device with a message naming it). Used by backend "cuda" (and
  "auto" on a GPU) only.

  Attributes:
    kernel: "auto", "portable" (``mma.sync``, any CUDA GPU, every cache
      format), "sm90_lockstep" (Hopper ``wgmma``, any page size; rows in
      blocks of 64), "sm90_seesaw" (Hopper ``wgmma`` with TMA
      loads; paged decode with ``page_size`` a multiple of 64, a cache in the
      query's dtype or ``float8_e4m3fn``; and, rows gathered by index, sparse
      decode over ``fp8_ds_mla`` with a bf16 query, auto-selected above 32
      heads from top-k 1024) or
      "sm90_swapab" (Hopper ``wgmma`` with the tokens as M: a
      ``float8_e4m3fn`` cache, ``page_size`` a multiple of 64, at most 32
      query rows per request; sparse decode over ``fp8_ds_mla`` with a bf16
      query and at most 32 heads).
    schedule: who computes the split-KV schedule: "auto", "step" (a call of
      its own before the decode, which XLA runs once for all the decode
      calls of an unrolled program over the same ``block_table`` and
      ``seq_lens``, or sparse decode's ``topk_lens``, as FlashMLA's metadata
      is computed once per step; auto above 32 requests),
      "kernel" (the scheduler kernel, before each decode), "inline" (one
      warp of every seesaw or swap-AB CTA, up to 32 requests) or "block"
      (every seesaw CTA).
    combine_grid: the combine kernel's grid: "auto", "block", "rows" or
      "slices".
    programmatic_combine: launch the combine with programmatic dependent
      launch (sm_90+): None (auto), True or False.
    fused_combine: the "sm90_seesaw" kernel with schedule "inline" merges
      the splits itself after a grid-wide barrier (a cooperative launch)
      instead of a combine kernel after it, adding them in the order of
      ``combine_grid``'s kernel (the same bits): None (auto: on in the
      block grid's order where every CTA takes at most one (request, row,
      128-column slice) task, docs/design.md), True or False.
  """

  kernel: str = "auto"
  schedule: str = "auto"
  combine_grid: str = "auto"
  programmatic_combine: bool | None = None
  fused_combine: bool | None = None

  def __post_init__(self):
    for name, allowed in (("kernel", KERNELS), ("schedule", SCHEDULES), ("combine_grid", COMBINE_GRIDS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"KernelChoice.{name} must be one of {allowed}, got {getattr(self, name)!r}")
    for name in ("programmatic_combine", "fused_combine"):
      if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
        raise TypeError(f"KernelChoice.{name} must be None, True or False, got {getattr(self, name)!r}")

  def attr(self) -> str:
    """The attribute text (``format_config`` in csrc/dispatch/select.cc)."""
    switch = {None: "auto", True: "on", False: "off"}
    return (f"{self.kernel},{self.schedule},{self.combine_grid},{switch[self.programmatic_combine]},"
            f"{switch[self.fused_combine]}")

  @classmethod
  def from_attr(cls, text: str) -> "KernelChoice":
    kernel, schedule, grid, pdl, fused = text.split(",")
    switch = {"auto": None, "on": True, "off": False}
    return cls(kernel, schedule, grid, switch[pdl], switch[fused])


def as_kernel_choice(value, owner: str) -> KernelChoice:
  """A plan's ``kernel`` field as a KernelChoice (a str names the kernel)."""
  if isinstance(value, KernelChoice):
    return value
  if isinstance(value, str):
    if value not in KERNELS:
      raise ValueError(f"{owner}.kernel must be one of {KERNELS} or a mla_jax.KernelChoice, got {value!r}")
    return KernelChoice(kernel=value)
  raise TypeError(f"{owner}.kernel must be a str or a mla_jax.KernelChoice, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class CudaDevice:
  """A CUDA device as kernel selection sees it; pass one to :func:`explain`
  to ask what a call would run on a GPU that is not here."""
  arch: int       # 10 * major + minor compute capability: 90 for H100/H200, 100 for B200
  sm_count: int   # 132 on an H100 SXM / H200


def cuda_device(d) -> CudaDevice:
  """The selection facts of a CUDA jax.Device."""
  major, _, minor = str(getattr(d, "compute_capability", "0.0")).partition(".")
  return CudaDevice(10 * int(major or 0) + int(minor or 0), int(d.core_count))


@functools.cache
def visible_cuda_device() -> CudaDevice | None:
  """The first CUDA device JAX sees, or None (a host without one)."""
  try:
    return cuda_device(jax.devices("cuda")[0])
  except RuntimeError:
    return None


def _static(x) -> int | None:
  """A concrete dimension as int, None for a symbolic one (jax.export)."""
  return int(x) if isinstance(x, (int, np.integer)) else None


def workspace_parts(rows: int, device: CudaDevice | None) -> int:
  """Partitions the workspace is sized for: the visible device's SM count
  over the 64-row blocks of a request, or the largest supported SM count
  when no CUDA device is visible (so an export from a CPU host runs at full
  width on any part)."""
  sms = device.sm_count if device is not None else _ffi.ext().max_supported_sm_count()
  return max(1, sms // -(-rows // 64))


@dataclasses.dataclass(frozen=True)
class Selection:
  """A trace-time kernel selection: the FFI attributes and the workspace."""
  config: KernelChoice         # "auto" where only the device can decide
  explanation: tuple[str, ...]
  attrs: dict[str, Any]
  workspace: jax.ShapeDtypeStruct


def facts(*, op: str, q_dtype, kv_dtype, kv_format: str, kv_lora_rank: int, qk_rope_head_dim: int,
          page_size: int, q_len: int, num_heads: int, batch, num_pages, topk: int = 0,
          schedule_operand: bool = False) -> dict:
  """The static facts select_kernel takes (DecodeFacts in csrc/dispatch/select.h).

  topk: sparse decode's top-k entries per query token: required (>= 1) for
    op="sparse", whose kernel choice depends on it; 0 for paged decode.
  schedule_operand: the CUDA call takes a schedule computed by a call of its
    own (both ops' CUDA calls), which makes schedule "step" possible.
  """
  if op == "sparse" and int(topk) < 1:
    raise ValueError(f"facts: sparse decode needs topk >= 1 (its kernel choice depends on it), got {topk}")
  return dict(op=op, q_type=_ELEM_TYPES[jnp.dtype(q_dtype)], kv_type=_ELEM_TYPES[jnp.dtype(kv_dtype)],
              kv_format=KV_FORMAT_CODES[kv_format], kv_lora_rank=int(kv_lora_rank),
              qk_rope_head_dim=int(qk_rope_head_dim), page_size=int(page_size), q_len=int(q_len),
              num_heads=int(num_heads), batch=_static(batch), num_pages=_static(num_pages),
              topk=int(topk), schedule_operand=bool(schedule_operand))


VISIBLE = "visible"  # select()'s default device: the CUDA device JAX sees, if any


def select(call_facts: dict, request: KernelChoice, *, requests, rows: int, dv: int,
           device: CudaDevice | None | str = VISIBLE, owner: str = "plan") -> Selection:
  """Runs the C++ selection on ``call_facts`` (see :func:`facts`).

  requests: kernel requests (may be symbolic); rows: query rows per request;
  dv: output width. device: the CUDA device to select for; VISIBLE (the
  default) for the one JAX sees, None for none known (the device-dependent
  fields are then left to the handler). Raises ValueError when ``request``
  cannot serve the call.
  """
  device = visible_cuda_device() if device == VISIBLE else device
  ext = _ffi.ext()
  parts = workspace_parts(rows, device)
  f = {k: v for k, v in call_facts.items() if v is not None}
  f.update(build_sm90a=bool(ext.has_sm90a()), workspace_parts=parts)
  if device is not None:
    f.update(arch=device.arch, sm_count=device.sm_count)
  config, error, explanation = ext.select_kernel(f, request.attr())
  lines = tuple(line for line in explanation.splitlines() if line)
  if error:
    raise ValueError(f"{owner}.kernel = {request}: {error}")
  per_request, fixed = ext.workspace_size(rows, dv, parts)
  attrs = dict(kernel_config=config, kernel_request=request.attr(),
               selected_for_arch=device.arch if device is not None else 0,
               selected_for_sm_count=device.sm_count if device is not None else 0,
               workspace_parts=parts)
  workspace = jax.ShapeDtypeStruct((per_request * requests + fixed,), jnp.uint8)
  return Selection(KernelChoice.from_attr(config), lines, attrs, workspace)


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What :func:`explain` returns: the backend and kernels a call runs, and why."""
  backend: str                  # "cuda", "cpu" or "xla"
  kernel: KernelChoice | None   # the CUDA configuration (None off the cuda backend)
  reasons: tuple[str, ...]

  def __str__(self) -> str:
    head = f"backend: {self.backend}"
    return "\n".join((head,) + self.reasons)


def explain(plan, query, kv_cache, *args, device=None, **kwargs) -> Explanation:
  """Says which backend and kernels a call will run, and why.

  Takes the arguments of :func:`mla_jax.paged_decode` (with a
  :class:`mla_jax.DecodePlan`) or :func:`mla_jax.sparse_decode` (with a
  :class:`mla_jax.SparseDecodePlan`); arrays or ``jax.ShapeDtypeStruct``
  values (only shapes and dtypes are read; nothing runs). With
  ``context_axis=`` (inside ``jax.shard_map``) the first line says how the
  pages are split and merged, and the rest explain one device's call on the
  local shapes given.

  Args:
    device: the ``jax.Device`` the call would run on (default: JAX's first
      device), or a :class:`CudaDevice` such as ``CudaDevice(arch=90,
      sm_count=132)`` (an H200) for a GPU that is not attached.

  Returns:
    An :class:`Explanation`; ``str()`` of it prints one line per decision.

  Raises:
    TypeError, ValueError: as the op would for these arguments (a forced
      ``plan.kernel`` that cannot serve them included).
  """
  # pylint: disable=g-import-not-at-top  (the op modules import this one)
  from .paged_decode import explain_call as explain_paged
  from .plan import DecodePlan, SparseDecodePlan
  from .sparse_decode import explain_call as explain_sparse
  if isinstance(plan, DecodePlan):
    return explain_paged(plan, query, kv_cache, *args, device=device, **kwargs)
  if isinstance(plan, SparseDecodePlan):
    return explain_sparse(plan, query, kv_cache, *args, device=device, **kwargs)
  raise TypeError(f"plan: expected mla_jax.DecodePlan or mla_jax.SparseDecodePlan, got {type(plan).__name__}")
