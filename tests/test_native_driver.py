"""The native tools over the CUDA decode path keep compiling.

tests/native/kernel_driver.cc runs the path without XLA for compute-sanitizer
(scripts/sanitize.sh builds and runs it on a GPU machine);
benchmarks/native/decode_timing.cc times it by CUDA-graph replay. CI has nvcc
but no GPU: this compiles their host code against the headers they share with
the extension, so that an interface change breaks here rather than on the GPU
machine. Skipped where nvcc is missing.
"""

import os
import pathlib
import subprocess

import pytest

from test_sm90_layout import _nvcc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "native" / "kernel_driver.cc", ROOT / "benchmarks" / "native" / "decode_timing.cc"]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_native_tool_compiles(tmp_path, source):
  nvcc = _nvcc()
  if nvcc is None or not source.exists():
    pytest.skip("needs nvcc and the source tree")
  # nvcc puts the toolkit's include folder on the path; CUDA 13 keeps CCCL
  # in include/cccl, which the host compiler needs named.
  cccl = [f"-I{home}/include/cccl" for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda",
                                                 str(pathlib.Path(nvcc).resolve().parent.parent))
          if home and os.path.isdir(f"{home}/include/cccl")][:1]
  build = subprocess.run(
      [nvcc, "-std=c++17", "-x", "c++", "-c", f"-I{ROOT}", *cccl,
       "-o", str(tmp_path / f"{source.stem}.o"), str(source)],
      capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stdout + build.stderr


PROBE_UNIT = r"""
#include "csrc/common/phase_registry.h"
#include "csrc/smxx/phase_probe.cuh"

__global__ void probed_NAME(int* out) {
  MLA_JAX_PHASE_BEGIN();
  out[0] = 1;
  if (out[1] == 0) MLA_JAX_PHASE(1); else MLA_JAX_PHASE(2);
}

int launch_NAME(int* out) { probed_NAME<<<1, 32>>>(out); return 0; }
"""

PROBE_MAIN = r"""
#include <cstdio>
#include "csrc/common/phase_registry.h"

int launch_a(int*);
int launch_b(int*);

int main() {
  // Compiled in, each probed unit registers itself, also from a static
  // library (both units are linked: main calls into each); without a GPU no
  // launch is recorded and nothing is printed.
  const std::vector<unsigned> before = mla_jax::phase::snapshot();
  std::printf("units %zu\n", mla_jax::phase::registry().size());
  mla_jax::phase::dump_since(before, 4);
  if (before.size() > 1000) { launch_a(nullptr); launch_b(nullptr); }  // never: links the units
  return 0;
}
"""


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "no_probe"])
def test_phase_probe_compiles_in_or_out(tmp_path, probe):
  """csrc/smxx/phase_probe.cuh: with MLA_JAX_PHASE_PROBE each unit of a static
  library registers its records (run here without a GPU: no launch, nothing
  printed); without, the marks compile to nothing and nothing registers."""
  nvcc = _nvcc()
  if nvcc is None:
    pytest.skip("needs nvcc")
  define = ["-DMLA_JAX_PHASE_PROBE"] if probe else []
  objects = []
  for name in ("a", "b"):
    src = tmp_path / f"unit_{name}.cu"
    src.write_text(PROBE_UNIT.replace("NAME", name))
    obj = tmp_path / f"unit_{name}.o"
    build = subprocess.run([nvcc, "-std=c++17", f"-I{ROOT}", *define, "-c", "-o", str(obj), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    objects.append(str(obj))
  lib = tmp_path / "libunits.a"
  subprocess.run(["ar", "qc", str(lib), *objects], check=True)
  main = tmp_path / "main.cu"
  main.write_text(PROBE_MAIN)
  exe = tmp_path / "probe"
  build = subprocess.run([nvcc, "-std=c++17", f"-I{ROOT}", *define, "-o", str(exe), str(main), str(lib)],
                         capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stdout + build.stderr
  run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.splitlines()[0] == f"units {2 if probe else 0}", run.stdout
  assert "PHASE" not in run.stdout, run.stdout  # no launch was recorded
