// Programmatic dependent launch (sm_90 and later), twice in a call:
// * scheduler kernel -> decode kernel: the portable, lock-step and swap-AB
//   kernels when the scheduler kernel runs in their call (schedule
//   "kernel"; sparse decode's auto for the portable and lock-step kernels,
//   and for the swap-AB one above 32 requests) are launched with
//   programmatic stream serialisation; the scheduler calls
//   pdl_allow_dependents() first thing, so their CTAs are dispatched and do
//   their set-up while the schedule is computed, and each calls
//   pdl_wait_for_previous() before it reads the schedule. (The seesaw
//   kernel, after the scheduler kernel only when a plan forces that
//   schedule, is launched plainly: an earlier chain through it measured
//   slower, docs/perf.md. With schedule "step" no scheduler runs in the call
//   and every decode kernel is launched plainly: its set-up reads call
//   inputs, which the kernel ahead of it in the stream may still write.)
// * decode kernel -> combine kernel: the combine's CTAs may be dispatched
//   once every decode CTA has called pdl_allow_dependents() (the portable,
//   lock-step and swap-AB kernels at their start, the seesaw kernel when a
//   CTA starts its last item) or exited; its first statement,
//   pdl_wait_for_previous(), returns only when the decode grid has completed
//   and its writes are visible.
// So only launch latency, CTA dispatch and set-up overlap the kernel before,
// never data. A dependent reads nothing its primary writes before the wait;
// what kernels before the primary wrote is visible to it, since the primary
// itself started only after they completed. Whether the combine uses it is
// part of the kernel configuration (csrc/dispatch/select.cc).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "csrc/smxx/api.h"

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

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream
// serialisation when `programmatic` and the kernel's code was compiled for
// sm_90 or later. Invariant: a kernel whose code lacks griddepcontrol (a
// build without 90a/100a code runs PTX JIT-compiled for an older target,
// where pdl_wait_for_previous() is compiled out) is never launched with the
// attribute, which would let it race the kernel before it. (The Hopper
// kernels' sm_100a images have empty bodies and a PTX version >= 90; they
// are never launched: kernel selection keeps them to sm_90 devices.)
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  if (programmatic) programmatic = smxx::kernel_has_sm90_code(reinterpret_cast<const void*>(kernel));
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
