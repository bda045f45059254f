"""The benchmark's record of which code ran (benchmarks/bench_paged_decode.py)."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_paged_decode.py"


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location("bench_paged_decode_for_test", BENCH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _tree(root):
  (root / "mla_jax").mkdir()
  (root / "csrc" / "sm90").mkdir(parents=True)
  (root / "ffi").mkdir()
  (root / "mla_jax" / "__init__.py").write_text("x = 1\n")
  (root / "csrc" / "sm90" / "decode.cu").write_text("// kernel\n")
  (root / "ffi" / "handlers.cc").write_text("// handler\n")
  (root / "CMakeLists.txt").write_text("project(x)\n")


def test_source_digest_follows_sources_not_build_outputs(bench, tmp_path):
  _tree(tmp_path)
  base = bench.source_digest(tmp_path)
  assert re.fullmatch(r"[0-9a-f]{64}", base)
  assert bench.source_digest(tmp_path) == base
  # Build outputs and caches do not count.
  (tmp_path / "mla_jax" / "_mla_jax.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
  (tmp_path / "mla_jax" / "__pycache__").mkdir()
  (tmp_path / "mla_jax" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"pyc")
  assert bench.source_digest(tmp_path) == base
  # A kernel edit does.
  (tmp_path / "csrc" / "sm90" / "decode.cu").write_text("// kernel, edited\n")
  edited = bench.source_digest(tmp_path)
  assert edited != base
  # So does moving a file with the same contents.
  (tmp_path / "csrc" / "sm90" / "decode.cu").rename(tmp_path / "csrc" / "decode.cu")
  assert bench.source_digest(tmp_path) not in (base, edited)


def test_source_digest_of_this_tree(bench):
  assert re.fullmatch(r"[0-9a-f]{64}", bench.source_digest())


def test_env_records_only_set_mla_jax_switches(bench):
  environ = {"MLA_JAX_PDL": "1", "MLA_JAX_COMBINE_GRID": "", "XLA_FLAGS": "--x", "MLA_JAX_BACKEND": "cuda"}
  assert bench.mla_jax_env(environ) == {"MLA_JAX_BACKEND": "cuda", "MLA_JAX_PDL": "1"}
  assert list(bench.mla_jax_env(environ)) == ["MLA_JAX_BACKEND", "MLA_JAX_PDL"]
  assert bench.mla_jax_env({}) == {}
