"""The standalone kernel driver (tests/native/kernel_driver.cc) keeps compiling.

The driver runs the CUDA decode path without XLA for compute-sanitizer
(scripts/sanitize.sh builds and runs it on a GPU machine). CI has nvcc but no
GPU: this compiles the driver's host code against the headers it shares with
the extension, so that an interface change breaks here rather than on the
GPU machine. Skipped where nvcc is missing.
"""

import os
import pathlib
import subprocess

import pytest

from test_sm90_layout import _nvcc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "native" / "kernel_driver.cc"


def test_kernel_driver_compiles(tmp_path):
  nvcc = _nvcc()
  if nvcc is None or not SOURCE.exists():
    pytest.skip("needs nvcc and the source tree")
  # nvcc puts the toolkit's include folder on the path; CUDA 13 keeps CCCL
  # in include/cccl, which the host compiler needs named.
  cccl = [f"-I{home}/include/cccl" for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda",
                                                 str(pathlib.Path(nvcc).resolve().parent.parent))
          if home and os.path.isdir(f"{home}/include/cccl")][:1]
  build = subprocess.run(
      [nvcc, "-std=c++17", "-x", "c++", "-c", f"-I{ROOT}", *cccl,
       "-o", str(tmp_path / "kernel_driver.o"), str(SOURCE)],
      capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stdout + build.stderr
