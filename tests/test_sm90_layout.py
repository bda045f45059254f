"""Host-side check of the Hopper kernel's shared-memory and accumulator layouts.

`csrc/sm90/layout_check.cu` compares the addresses the kernel's cp.async copies
write (and the V view it hands to wgmma) with CuTe's layouts, and the wgmma
accumulator ownership the softmax relies on; the seesaw kernel's in-place
e4m3 conversion against the TMA swizzles, with its coverage and barrier order;
and its fp8_ds_mla gathers and conversion, byte by byte. It needs nvcc and the CUTLASS
headers but no GPU, so CI runs it; it is skipped where either is missing.
"""

import importlib.util
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "csrc" / "sm90" / "layout_check.cu"


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


def _cutlass_include():
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = pathlib.Path(spec.submodule_search_locations[0]) / "source" / "include"
    return include if (include / "cute" / "tensor.hpp").exists() else None


def test_sm90_layouts_agree_with_cute(tmp_path):
    nvcc, include = _nvcc(), _cutlass_include()
    if nvcc is None or include is None or not SOURCE.exists():
        pytest.skip("needs nvcc, the nvidia-cutlass headers and the source tree")
    exe = tmp_path / "layout_check"
    build = subprocess.run(
        [nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT}", f"-I{include}",
         "-o", str(exe), str(SOURCE)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("bf16", "fp16", "swapab16", "swapab32", "swapab16 fp16", "swapab32 fp16", "swapab16 sparse",
               "seesaw e4m3", "seesaw e4m3 fp16", "seesaw fp8_ds_mla"):
        assert f"{name}: ok" in run.stdout, run.stdout
