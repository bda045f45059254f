// Host entry points of the arch-neutral split-KV pieces every CUDA decode
// kernel shares: the on-device scheduler and the combine kernel.
//
// A call runs, on one stream: the scheduler (unless the decode kernel
// schedules itself), the decode kernel of the selected family (one CTA per
// partition x 64-row block; csrc/sm80, csrc/sm90) and the combine kernel,
// which merges the splits of each request by their LSE (FlashDecoding).
// All scratch comes from the caller (XLA), so the sequence can be captured
// into a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include "csrc/common/kernel_config.h"
#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"

namespace mla_jax {
namespace smxx {

// KV blocks the scheduler deals in (tokens); every kernel tile divides it.
constexpr int kSchedBlockTokens = 64;

// The scheduler kernel: writes every request's items, the partition bounds
// and the per-request metadata the combine reads.
cudaError_t run_scheduler(const PagedDecodeParams& params, const DecodeWorkspace& ws, const SplitSchedule& schedule,
                          cudaStream_t stream);

// The combine kernel on `grid` (not kAuto), launched with programmatic
// dependent launch when `programmatic` (pdl.cuh).
cudaError_t run_combine(const PagedDecodeParams& params, const DecodeWorkspace& ws, CombineGrid grid,
                        bool programmatic, cudaStream_t stream);

// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) once per
// kernel and device (the attribute belongs to the device's context).
cudaError_t set_max_dynamic_smem_once(const void* kernel, int bytes);

// Whether `kernel`'s code on the current device was compiled for sm_90 or
// later (so its griddepcontrol instructions exist); asked once per kernel
// and device.
bool kernel_has_sm90_code(const void* kernel);

}  // namespace smxx
}  // namespace mla_jax
