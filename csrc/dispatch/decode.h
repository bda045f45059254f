// The CUDA side of a decode call: the only code that knows every
// architecture's kernels. ffi/cuda_handlers.cc calls it with the kernel
// configuration select_kernel() resolved (csrc/dispatch/select.h).
#pragma once

#include <cuda_runtime.h>

#include "csrc/common/kernel_config.h"
#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"

namespace mla_jax {

// Facts of a CUDA device, asked of the runtime until it answers, then kept.
struct DeviceInfo {
  int arch = 0;      // 10 * major + minor
  int sm_count = 0;
  cudaError_t status = cudaSuccess;
};
DeviceInfo device_info(int device_ordinal);

// Whether this build carries sm_90a code (the Hopper kernels).
bool build_has_sm90a();

// Scheduler (unless the decode schedules itself) + decode + combine (unless
// the decode kernel combines itself: config.fused_combine) on `stream`.
// config is fully resolved; num_parts from num_partitions().
cudaError_t run_paged_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws, const KernelConfig& config,
                             int num_parts, int max_num_splits, cudaStream_t stream);

// The schedule alone (the scheduler kernel), for a later run_paged_decode
// with ScheduleMode::kStep over the same lengths, num_parts and
// max_num_splits: writes ws.items (region 0), ws.part_begin and
// ws.request_meta. params needs batch, seq_lens, page_size and
// max_pages_per_seq only.
cudaError_t run_decode_schedule(const PagedDecodeParams& params, const DecodeWorkspace& ws, int num_parts,
                                int max_num_splits, cudaStream_t stream);

// The same for a sparse call's params as the sparse op fills them (B
// requests of Q tokens): the schedule of run_sparse_decode's B * Q
// one-token requests, which reads topk_lens, topk and the shapes only.
cudaError_t run_sparse_decode_schedule(const PagedDecodeParams& params, const DecodeWorkspace& ws, int num_parts,
                                       cudaStream_t stream);

// Sparse decode: params as the sparse op fills them (batch B, q_len Q); runs
// as B * Q requests of one query token each.
cudaError_t run_sparse_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws, const KernelConfig& config,
                              int num_parts, cudaStream_t stream);

}  // namespace mla_jax
