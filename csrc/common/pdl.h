// Programmatic dependent launch (sm_90 and later) from the decode kernel to
// the combine kernel that always follows it. The combine is launched with
// programmatic stream serialisation, so its CTAs may be dispatched once
// every decode CTA has called pdl_allow_dependents() (the portable and
// lock-step kernels at their start, the seesaw kernel when a CTA starts its
// last item) or exited; its first statement, pdl_wait_for_previous(),
// returns only when the decode grid has completed and its writes are
// visible. So only the launch latency and the CTA dispatch overlap the
// decode, never data. When it is on by default, and why: sm80::paged_decode
// (csrc/sm80/api.cu). MLA_JAX_PDL=1 or 0 forces it on or off.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "csrc/common/env_flag.h"

namespace mla_jax {

// Both are no-ops in a kernel launched without the attribute, and below sm_90.
__device__ __forceinline__ void pdl_wait_for_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the next launch may overlap the kernel before it: MLA_JAX_PDL=1
// (on), MLA_JAX_PDL=0 (off), unset or empty: `by_default`; and a device of
// compute capability 9.0 or later. Host queries only (no stream work), so it
// is safe while XLA captures the call into a command buffer, where the
// overlap becomes a programmatic graph edge.
inline bool pdl_enabled(bool by_default) {
  if (!env_flag_or("MLA_JAX_PDL", by_default)) return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream
// serialisation when `programmatic` and the kernel's code was compiled for
// sm_90 or later: a build without 90a/100a code runs PTX JIT-compiled for an
// older target, where pdl_wait_for_previous() is compiled out, so the
// attribute would let the kernel race the one before it.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  if (programmatic) {
    cudaFuncAttributes attrs;
    programmatic = cudaFuncGetAttributes(&attrs, kernel) == cudaSuccess && attrs.ptxVersion >= 90;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  // Read (and clear) the last error here, as after a <<<>>> launch, so a
  // failure is reported by this call and not by a later one.
  const cudaError_t last = cudaGetLastError();
  return err != cudaSuccess ? err : last;
}

}  // namespace mla_jax
