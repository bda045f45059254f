"""Shared pytest setup: 8 CPU devices for the sharding tests, GPU detection."""

import jax
import pytest

# Must happen before any backend is initialised; gives the sharding tests a
# mesh of 8 fake devices on the CPU backend (the default device stays cpu:0).
jax.config.update("jax_num_cpu_devices", 8)


def _has_gpu() -> bool:
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords and not HAS_GPU:
      item.add_marker(skip)


def pytest_addoption(parser):
  group = parser.getgroup("mla_jax")
  group.addoption("--differential-cases", type=int, default=None,
                  help="cases per backend in test_differential.py (default: per backend, see there)")
  group.addoption("--differential-seed", type=int, default=None,
                  help="seed of the first case in test_differential.py")
