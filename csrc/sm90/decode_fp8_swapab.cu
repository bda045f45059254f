// Instantiation: the swap-AB kernel (decode_swapab.cuh) for a float8_e4m3fn
// cache with one kv_scale, bf16 or fp16 query, 16 query rows per CTA (up to
// 16 rows per request) or 32 (17 to 32 rows; the warpgroups split S^T by
// query rows and O^T by features); and for sparse decode over fp8_ds_mla
// rows gathered by index (bf16 query, 16 or 32 rows per CTA as above,
// swapab_traits.h kSparse).
#include "csrc/sm90/api.h"
#include "csrc/sm90/decode_swapab.cuh"
#include "csrc/smxx/api.h"

namespace mla_jax {
namespace sm90 {
namespace {

template <typename Tr>
cudaError_t launch_swapab(const PagedDecodeParams& p, const DecodeWorkspace& ws, const SplitSchedule& schedule,
                          cudaStream_t stream) {
  KvTma tma;  // unused by the sparse instantiation (cp.async gathers)
  if constexpr (!Tr::kSparse) {
    make_kv_tma_fp8(p, &tma);
    if (!tma.enabled) return cudaErrorNotSupported;
  }
  // Up to kInlineScheduleMaxBatch requests one warp of every CTA schedules
  // (csrc/smxx/schedule_inline.cuh); above, the scheduler kernel runs first
  // and the decode is its programmatic dependent (csrc/smxx/pdl.cuh).
  // select_kernel never plans an inline schedule above that bound; a plan
  // that does is refused here rather than silently run another way.
  if (schedule.inline_schedule && p.batch > smxx::kInlineScheduleMaxBatch) return cudaErrorNotSupported;
  SplitSchedule s = schedule;
  s.schedule_in_decode = false;
  auto* kernel = s.inline_schedule ? decode_swapab_kernel<Tr, true> : decode_swapab_kernel<Tr, false>;
  cudaError_t err = smxx::set_max_dynamic_smem_once(reinterpret_cast<const void*>(kernel), Tr::kSmemAlloc);
  if (err != cudaSuccess) return err;
  if (!s.inline_schedule && !s.schedule_given) {
    err = smxx::run_scheduler(p, ws, s, stream);
    if (err != cudaSuccess) return err;
  }
  return launch_kernel(kernel, dim3(1, s.num_parts), Tr::kThreads, Tr::kSmemAlloc, stream,
                       /*programmatic=*/!s.inline_schedule && !s.schedule_given, p, ws, s, tma);
}

}  // namespace

cudaError_t run_decode_fp8_swapab(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                                  const SplitSchedule& schedule, cudaStream_t stream) {
  // select_kernel routes only such calls here; the kernel addresses cache
  // row page * page_size + slot with the token stride alone.
  const int rows = params.rows_per_request();
  if (params.indices != nullptr) {
    // Sparse fp8_ds_mla: rows addressed as index * token stride, copied in
    // 16-byte chunks.
    if (rows > 32 || params.kv_format != KvFormat::kFp8DsMla || params.q_type != ElemType::kBF16 ||
        params.ckv_page_stride != int64_t{params.page_size} * params.ckv_token_stride ||
        params.kpe_page_stride != int64_t{params.page_size} * params.kpe_token_stride ||
        reinterpret_cast<uintptr_t>(params.ckv) % 16 != 0 || reinterpret_cast<uintptr_t>(params.kpe) % 16 != 0 ||
        params.ckv_token_stride % 16 != 0 || params.kpe_token_stride % 16 != 0)
      return cudaErrorNotSupported;
    if (rows <= 16)
      return launch_swapab<SwapAbTraits<__nv_bfloat16, 16, kSwapAbWarpgroups, kSwapAbStages, true>>(params, ws, schedule,
                                                                                                    stream);
    return launch_swapab<SwapAbTraits<__nv_bfloat16, 32, kSwapAbWarpgroups, kSwapAbStages, true>>(params, ws, schedule,
                                                                                                  stream);
  }
  if (rows > 32 || params.kv_type != ElemType::kFP8E4M3 ||
      params.kv_format != KvFormat::kPlain ||
      params.ckv_page_stride != int64_t{params.page_size} * params.ckv_token_stride ||
      params.kpe_page_stride != int64_t{params.page_size} * params.kpe_token_stride)
    return cudaErrorNotSupported;
  const bool bf16 = params.q_type == ElemType::kBF16;
  if (rows <= 16)
    return bf16 ? launch_swapab<SwapAbTraits<__nv_bfloat16, 16>>(params, ws, schedule, stream)
                : launch_swapab<SwapAbTraits<__half, 16>>(params, ws, schedule, stream);
  return bf16 ? launch_swapab<SwapAbTraits<__nv_bfloat16, 32>>(params, ws, schedule, stream)
              : launch_swapab<SwapAbTraits<__half, 32>>(params, ws, schedule, stream);
}

}  // namespace sm90
}  // namespace mla_jax
