// Launch of the Hopper decode: the seesaw kernel when the cache can be
// loaded with TMA (csrc/sm90/kv_tma.h), the lock-step kernel otherwise.
// Included by the per-dtype instantiation files decode_*.cu.
#pragma once

#include "csrc/common/env_flag.h"
#include "csrc/sm90/api.h"
#include "csrc/sm90/decode_kernel.cuh"
#include "csrc/sm90/decode_seesaw.cuh"

namespace mla_jax {
namespace sm90 {

template <typename Tr>
cudaError_t launch_decode(const PagedDecodeParams& p, const DecodeWorkspace& ws, cudaStream_t stream,
                          DecodeKernel* launched) {
  KvTma tma;
  make_kv_tma(p, &tma);
  // MLA_JAX_SM90_LOCKSTEP=1 keeps the lock-step kernel on TMA-loadable
  // caches too (A/B benchmarks, tests of that kernel's TMA path).
  const bool seesaw = tma.enabled && !env_flag("MLA_JAX_SM90_LOCKSTEP");
  *launched = seesaw ? DecodeKernel::kSeesaw : DecodeKernel::kLockstep;
  // The seesaw kernel schedules itself (no scheduler kernel, no launch gap):
  // batches of up to 32 requests with one warp's shuffles
  // (sm80/schedule_inline.cuh), larger ones with the block-level schedule
  // in every CTA (sm80/schedule_block.cuh, its own instantiation of the
  // kernel) where the items scratch has a region per row block.
  // MLA_JAX_SCHEDULER_KERNEL=1 keeps the scheduler kernel for every batch.
  const int rows = p.rows_per_request();
  dim3 grid((rows + Tr::kBlockM - 1) / Tr::kBlockM, ws.num_parts);
  DecodeWorkspace w = ws;
  const bool own_schedule = seesaw && !env_flag("MLA_JAX_SCHEDULER_KERNEL");
  w.inline_schedule = own_schedule && p.batch <= sm80::kInlineScheduleMaxBatch;
  w.schedule_in_decode = own_schedule && !w.inline_schedule && ws.item_regions >= static_cast<int>(grid.x);
  auto kernel = !seesaw ? decode_kernel<Tr>
                : w.schedule_in_decode ? decode_seesaw_kernel<Tr, true>
                                       : decode_seesaw_kernel<Tr, false>;
  // Per call, not cached: the attribute belongs to the current device.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemAlloc);
  if (err != cudaSuccess) return err;
  if (!w.inline_schedule && !w.schedule_in_decode) {
    err = sm80::run_scheduler(p, w, stream);  // after the host work: see sm80::paged_decode
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(p, w, tma);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace mla_jax
