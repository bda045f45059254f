// Host entry points of the portable (sm_80+) decode kernel: mma.sync tensor
// cores, cp.async row gathers, any page size, every cache format (FP8 ones
// dequantised in shared memory). One per (query dtype, cache format); each
// launches the scheduler kernel, then its decode kernel (the combine is the
// dispatch layer's, csrc/dispatch/decode.cu).
#pragma once

#include <cuda_runtime.h>

#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"

namespace mla_jax {
namespace sm80 {

cudaError_t run_decode_bf16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            const SplitSchedule& schedule, cudaStream_t stream);
cudaError_t run_decode_fp16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            const SplitSchedule& schedule, cudaStream_t stream);
// float8_e4m3fn cache with one kv_scale, bf16 or fp16 query.
cudaError_t run_decode_fp8(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                           const SplitSchedule& schedule, cudaStream_t stream);
// DeepSeek V3.2 fp8_ds_mla cache (656-byte rows), bf16 or fp16 query.
cudaError_t run_decode_ds_mla(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              const SplitSchedule& schedule, cudaStream_t stream);

}  // namespace sm80
}  // namespace mla_jax
