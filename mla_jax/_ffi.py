"""Loads the compiled extension and registers its FFI targets with JAX."""

from __future__ import annotations

import functools
import os

import jax

try:
  from . import _mla_jax_ext as _ext
except ImportError as e:  # pragma: no cover - only when the build is broken
  _ext = None
  _IMPORT_ERROR = e
else:
  _IMPORT_ERROR = None

# The CUDA targets carry a version: their operands and attributes changed
# (one workspace result, the kernel-choice attributes; the schedule
# operand), so an export made with the earlier ones fails to find
# its target instead of misreading it.
CPU_TARGET = "mla_jax_paged_decode_cpu"
CUDA_TARGET = "mla_jax_paged_decode_cuda_v3"
SCHEDULE_CUDA_TARGET = "mla_jax_paged_decode_schedule_cuda_v1"
SPARSE_CPU_TARGET = "mla_jax_sparse_decode_cpu"
SPARSE_CUDA_TARGET = "mla_jax_sparse_decode_cuda_v3"
SPARSE_SCHEDULE_CUDA_TARGET = "mla_jax_sparse_decode_schedule_cuda_v1"
# Custom-call targets a jax.export user must allow (mla_jax.EXPORT_TARGETS):
#   jax.export.DisabledSafetyCheck.custom_call(name) for each.
EXPORT_TARGETS = (CPU_TARGET, CUDA_TARGET, SCHEDULE_CUDA_TARGET, SPARSE_CPU_TARGET, SPARSE_CUDA_TARGET,
                  SPARSE_SCHEDULE_CUDA_TARGET)


def has_extension() -> bool:
  return _ext is not None


def has_cuda_kernels() -> bool:
  return _ext is not None and bool(_ext.has_cuda())


def cuda_archs() -> str:
  return _ext.cuda_archs() if _ext is not None else ""


@functools.cache
def has_cuda_target(name: str) -> bool:
  """Whether the extension provides the CUDA handler ``name``."""
  return _ext is not None and name in _ext.cuda_registrations()


def require_extension():
  if _ext is None:
    raise RuntimeError(
        f"mla_jax's compiled extension is missing: mla_jax was imported from "
        f"{os.path.dirname(__file__)}. If that is a source checkout without the built "
        "extension, run from another directory or install with pip install -e . "
        f"(the import error was: {_IMPORT_ERROR})")


def ext():
  """The compiled extension (RuntimeError when it is missing)."""
  require_extension()
  return _ext


@functools.cache
def register() -> None:
  """Registers the handlers for platforms "cpu" and "CUDA" (idempotent)."""
  if _ext is None:
    return
  for name, capsule in _ext.cpu_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  for name, capsule in _ext.cuda_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
