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


def _fake_timer(tmp_path, body):
  exe = tmp_path / "timer"
  exe.write_text("#!/bin/sh\n" + body)
  exe.chmod(0o755)
  return str(exe)


def test_native_timing_rows_reach_their_records(bench, tmp_path):
  """The native timer gets the rows (a varlen row with the script's own lengths) and its JSON
  lines land on the rows of the same name, with the derived fields."""
  rows = [bench.Row(1, 1, 128, 4096), bench.Row(4, 1, 128, 4096, varlen=True)]
  exe = _fake_timer(tmp_path, """echo "$@" > "$(dirname "$0")/args"
spec=$2; lens=${spec#*@}; cat "$lens" > "$(dirname "$0")/lens"
echo '# device line'
echo '{"name": "b1q1h128s4096", "graph_us": 24.5, "check_ok": true, "sum_seq": 4096, "kernel_config": "k"}'
echo '{"name": "b4q1h128s4096v", "graph_us": 300.0, "check_ok": false}'
echo '{"name": "cut short'
""")
  nat = bench.run_native_timing(exe, rows, l2_mb=50.0)
  assert "error" not in nat and sorted(nat) == ["b1q1h128s4096", "b4q1h128s4096v"]
  args = (tmp_path / "args").read_text().split()
  assert args[0] == "--rows" and args[1].startswith("1,1,128,4096;4,1,128,4096,@")
  assert args[2:] == ["--reps", "10", "--l2-mb", "50.0"]
  assert [int(x) for x in (tmp_path / "lens").read_text().split()] == list(rows[1].seq_lens())
  rec = dict(mla_jax_us=28.0, flashmla_us=20.0, sum_seq=4096)
  bench.add_native(rec, nat["b1q1h128s4096"])
  assert rec["mla_jax_graph_us"] == 24.5
  assert rec["jax_over_graph_us"] == pytest.approx(3.5)
  assert rec["graph_over_flashmla"] == pytest.approx(24.5 / 20.0)
  # A row whose output failed the timer's check gives no time, nor one of other work.
  rec = dict(mla_jax_us=310.0)
  bench.add_native(rec, nat["b4q1h128s4096v"])
  assert rec["mla_jax_graph_us"] is None and "jax_over_graph_us" not in rec
  rec = dict(mla_jax_us=28.0, sum_seq=8192)
  bench.add_native(rec, nat["b1q1h128s4096"])
  assert rec["mla_jax_graph_us"] is None


def test_native_timing_failure_is_recorded(bench, tmp_path):
  exe = _fake_timer(tmp_path, "echo 'CUDA error' >&2\nexit 2\n")
  nat = bench.run_native_timing(exe, [bench.Row(1, 1, 16, 64)])
  assert "exit status 2" in nat["error"] and "CUDA error" in nat["error"]
  assert "error" in bench.run_native_timing(str(tmp_path / "missing"), [bench.Row(1, 1, 16, 64)])


def test_kernel_request_forces_a_schedule_too(bench):
  import mla_jax
  assert bench.kernel_request("sm90_lockstep") == "sm90_lockstep"
  assert bench.kernel_request("sm90_seesaw:block") == mla_jax.KernelChoice(kernel="sm90_seesaw", schedule="block")
  for bad in ("sm90_seesaw:weekly", "sm90_seesaw:"):
    with pytest.raises(ValueError, match="schedule"):
      bench.kernel_request(bad)
