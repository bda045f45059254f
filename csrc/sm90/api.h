// Host entry points of the Hopper (sm_90a) decode kernel.
//
// It replaces the portable kernel for bf16/fp16 caches on sm_90 devices:
// for 64-row blocks (q_len x heads > 32: H = 64, 96, 128 and MTP) with two
// schedules (decode_launch.cuh), seesaw for TMA-loadable caches, lock-step
// otherwise; for fewer rows only where the pages allow TMA (api.cu).
// The scheduler, the scratch layout and the combine kernel are the
// portable path's (csrc/sm80): only the per-partition decode differs.
#pragma once

#include <cuda_runtime.h>

#include "csrc/common/mla_params.h"
#include "csrc/sm80/api.h"

namespace mla_jax {
namespace sm90 {

// True when this build carries sm_90a code, the current device is sm_90,
// the call is one the kernel serves, and MLA_JAX_PORTABLE_KERNEL is unset
// (that variable forces the portable kernel, e.g. for A/B benchmarks).
bool selected(const PagedDecodeParams& params);

// Which kernel a run_decode_* call launched; the combine after it picks
// its launch from this (sm80::paged_decode).
enum class DecodeKernel { kSeesaw, kLockstep };

cudaError_t run_decode_bf16(const PagedDecodeParams& params, const sm80::DecodeWorkspace& ws,
                            cudaStream_t stream, DecodeKernel* launched);
cudaError_t run_decode_fp16(const PagedDecodeParams& params, const sm80::DecodeWorkspace& ws,
                            cudaStream_t stream, DecodeKernel* launched);

}  // namespace sm90
}  // namespace mla_jax
