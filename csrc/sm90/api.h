// Host entry points of the Hopper (sm_90a) decode kernels: wgmma through
// CuTe, 64 query rows per CTA (fewer rows are zero-filled to one block).
// Two schedules (decode_launch.cuh): seesaw for caches TMA loads tile by
// tile and for sparse fp8_ds_mla rows with a bf16 query, lock-step
// otherwise (and the swap-AB kernel for FP8 caches with few query rows). When they serve a call is decided by
// csrc/dispatch/select.cc. The scheduler, the scratch layout and the
// combine kernel are the shared ones (csrc/smxx).
#pragma once

#include <cuda_runtime.h>

#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"

namespace mla_jax {
namespace sm90 {

// seesaw: the seesaw kernel (needs TMA loads: returns
// cudaErrorNotSupported when the cache's tensor maps cannot be encoded);
// otherwise the lock-step kernel, with TMA loads where the cache allows
// them and cp.async row gathers elsewhere. The schedule's inline_schedule
// and schedule_in_decode flags apply to the seesaw kernel only.
cudaError_t run_decode_bf16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            const SplitSchedule& schedule, bool seesaw, cudaStream_t stream);
cudaError_t run_decode_fp16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            const SplitSchedule& schedule, bool seesaw, cudaStream_t stream);
// FP8 caches, converted to the query dtype in shared memory; bf16 or fp16
// query. float8_e4m3fn with one kv_scale: the lock-step kernel (rows
// gathered with cp.async), or with `seesaw` the seesaw kernel (TMA loads of
// the raw bytes; cudaErrorNotSupported unless page_size is a multiple of
// 64 and the rows are 16-byte aligned).
cudaError_t run_decode_fp8(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                           const SplitSchedule& schedule, bool seesaw, cudaStream_t stream);
// Swap-AB kernel (decode_swapab.cuh): float8_e4m3fn cache with one
// kv_scale, paged with page_size a multiple of 64 (TMA), at most 32 query
// rows per request; cudaErrorNotSupported otherwise.
cudaError_t run_decode_fp8_swapab(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                                  const SplitSchedule& schedule, cudaStream_t stream);
// DeepSeek V3.2 fp8_ds_mla rows: the lock-step kernel, or with `seesaw`
// the seesaw kernel, gathering the rows by index (sparse decode with a bf16
// query only; cudaErrorNotSupported otherwise).
cudaError_t run_decode_ds_mla(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              const SplitSchedule& schedule, bool seesaw, cudaStream_t stream);

}  // namespace sm90
}  // namespace mla_jax
