// Launch of the Hopper decode kernels. Included by the per-dtype
// instantiation files decode_*.cu.
#pragma once

#include "csrc/sm90/api.h"
#include "csrc/sm90/decode_kernel.cuh"
#include "csrc/sm90/decode_seesaw.cuh"
#include "csrc/smxx/api.h"

namespace mla_jax {
namespace sm90 {

template <typename Tr>
cudaError_t launch_decode(const PagedDecodeParams& p, const DecodeWorkspace& ws, const SplitSchedule& schedule,
                          bool seesaw, cudaStream_t stream) {
  KvTma tma;
  tma.enabled = 0;
  // Which kernels a cache's rows can reach: dense e4m3 rows either (the
  // seesaw kernel loads their raw bytes with TMA); fp8_ds_mla rows the
  // lock-step kernel, and with a bf16 query in sparse decode the seesaw
  // kernel, both gathering them with cp.async.
  constexpr bool kSeesaw = Tr::kLoad != KvLoad::kDsMla || Tr::kRopeDirect;
  if constexpr (Tr::kLoad == KvLoad::kFp8) {
    if (seesaw) {
      make_kv_tma_fp8(p, &tma);
      if (!tma.enabled) return cudaErrorNotSupported;
    }
  } else if constexpr (Tr::kLoad == KvLoad::kDsMla) {
    // The gathers read a row's kpe at byte kDsMlaRopeOffset of its ckv row
    // (where ffi/decode_args.cc points p.kpe).
    const bool kpe_in_row = static_cast<const char*>(p.kpe) == static_cast<const char*>(p.ckv) + kDsMlaRopeOffset &&
                            p.kpe_token_stride == p.ckv_token_stride;
    if (seesaw && (!kSeesaw || p.indices == nullptr || !kpe_in_row)) return cudaErrorNotSupported;
  } else {
    make_kv_tma(p, &tma);
    if (seesaw && !tma.enabled) return cudaErrorNotSupported;
  }
  const int rows = p.rows_per_request();
  dim3 grid((rows + Tr::kBlockM - 1) / Tr::kBlockM, schedule.num_parts);
  // Only the seesaw kernel schedules itself.
  SplitSchedule s = schedule;
  s.inline_schedule = seesaw && schedule.inline_schedule;
  s.schedule_in_decode = seesaw && schedule.schedule_in_decode;
  // The block schedule keeps each row block's items in its own region.
  if (s.schedule_in_decode && ws.item_regions < static_cast<int>(grid.x)) return cudaErrorInvalidValue;
  // The block schedule is its own instantiation of the seesaw kernel, so the
  // other modes run a kernel without its code.
  const void* kernel = reinterpret_cast<const void*>(decode_kernel<Tr>);
  if constexpr (kSeesaw) {
    if (seesaw)
      kernel = s.schedule_in_decode ? reinterpret_cast<const void*>(decode_seesaw_kernel<Tr, true>)
               : s.fused_combine    ? reinterpret_cast<const void*>(decode_seesaw_kernel<Tr, false, true>)
                                    : reinterpret_cast<const void*>(decode_seesaw_kernel<Tr, false>);
  }
  cudaError_t err = smxx::set_max_dynamic_smem_once(kernel, Tr::kSmemAlloc);
  if (err != cudaSuccess) return err;
  if (!s.inline_schedule && !s.schedule_in_decode && !s.schedule_given) {
    err = smxx::run_scheduler(p, ws, s, stream);  // after the host work: no gap between the launches
    if (err != cudaSuccess) return err;
  }
  if (!seesaw) {
    // The lock-step kernel follows the scheduler kernel as its programmatic
    // dependent (csrc/smxx/pdl.cuh); after a given schedule, plainly.
    return launch_kernel(decode_kernel<Tr>, grid, Tr::kThreads, Tr::kSmemAlloc, stream,
                         /*programmatic=*/!s.schedule_given, p, ws,
                         tma);
  }
  // The seesaw kernel is launched plainly, also after the scheduler kernel
  // (a forced schedule): an earlier chain through it measured slower
  // (docs/perf.md, What was tried).
  if constexpr (kSeesaw) {
    if (s.fused_combine) {
      // Cooperative: every CTA resident at once, for the grid barrier before
      // the combine. The inline schedule's grid has at most one CTA per SM;
      // a device with fewer SMs at hand refuses the launch
      // (cudaErrorCooperativeLaunchTooLarge, nothing run), and the caller
      // falls back on the combine kernel.
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = 1;
      cudaLaunchConfig_t config = {};
      config.gridDim = grid;
      config.blockDim = dim3(Tr::kThreads);
      config.dynamicSmemBytes = Tr::kSmemAlloc;
      config.stream = stream;
      config.attrs = attr;
      config.numAttrs = 1;
      const cudaError_t launch = cudaLaunchKernelEx(&config, decode_seesaw_kernel<Tr, false, true>, p, ws, s, tma);
      const cudaError_t last = cudaGetLastError();
      return launch != cudaSuccess ? launch : last;
    }
    if (s.schedule_in_decode) {
      decode_seesaw_kernel<Tr, true><<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(p, ws, s, tma);
    } else {
      decode_seesaw_kernel<Tr, false><<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(p, ws, s, tma);
    }
  }
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace mla_jax
