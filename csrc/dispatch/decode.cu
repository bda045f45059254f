// Host-side dispatch of a decode call to the kernels of the selected
// configuration.
#include "csrc/dispatch/decode.h"

#include <atomic>
#include <mutex>

#include "csrc/sm80/api.h"
#include "csrc/sm90/api.h"
#include "csrc/smxx/api.h"

namespace mla_jax {

DeviceInfo device_info(int device_ordinal) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo infos[kMaxDevices];
  static std::atomic<bool> known[kMaxDevices];
  static std::mutex mu;
  if (device_ordinal < 0 || device_ordinal >= kMaxDevices) return DeviceInfo{0, 0, cudaErrorInvalidDevice};
  // infos[i] is written once, before known[i] is set.
  if (known[device_ordinal].load(std::memory_order_acquire)) return infos[device_ordinal];
  std::lock_guard<std::mutex> lock(mu);
  if (known[device_ordinal].load(std::memory_order_relaxed)) return infos[device_ordinal];
  DeviceInfo d;
  int major = 0, minor = 0;
  d.status = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_ordinal);
  if (d.status == cudaSuccess) d.status = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_ordinal);
  if (d.status == cudaSuccess)
    d.status = cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device_ordinal);
  d.arch = 10 * major + minor;
  // Kept once the runtime answered; a failed query (a transient error, a
  // device not yet visible) is asked again at the next call.
  if (d.status == cudaSuccess) {
    infos[device_ordinal] = d;
    known[device_ordinal].store(true, std::memory_order_release);
  }
  return d;
}

bool build_has_sm90a() {
#if defined(MLA_JAX_SM90A)
  return true;
#else
  return false;
#endif
}

cudaError_t run_paged_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws, const KernelConfig& config,
                             int num_parts, int max_num_splits, cudaStream_t stream) {
  if (params.batch == 0 || params.rows_per_request() == 0) return cudaSuccess;
  SplitSchedule schedule;
  schedule.num_parts = num_parts;
  schedule.max_num_splits = max_num_splits;
  schedule.inline_schedule = config.schedule == ScheduleMode::kInline;
  schedule.schedule_in_decode = config.schedule == ScheduleMode::kBlock;
  schedule.schedule_given = config.schedule == ScheduleMode::kStep;
  schedule.fused_combine = config.fused_combine == Switch::kOn;
  schedule.combine_block_order = config.combine_grid == CombineGrid::kBlock;
  // Only the seesaw kernel with the inline schedule combines itself (select_kernel refuses the rest).
  if (schedule.fused_combine && !(config.kernel == KernelFamily::kSm90Seesaw && schedule.inline_schedule))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  switch (config.kernel) {
    case KernelFamily::kSm90Seesaw:
    case KernelFamily::kSm90Lockstep:
    case KernelFamily::kSm90SwapAB: {
#if defined(MLA_JAX_SM90A)
      const bool seesaw = config.kernel == KernelFamily::kSm90Seesaw;
      if (config.kernel == KernelFamily::kSm90SwapAB) {
        err = sm90::run_decode_fp8_swapab(params, ws, schedule, stream);
      } else if (params.kv_format == KvFormat::kFp8DsMla) {
        err = sm90::run_decode_ds_mla(params, ws, schedule, seesaw, stream);
      } else if (params.kv_type == ElemType::kFP8E4M3) {
        err = sm90::run_decode_fp8(params, ws, schedule, seesaw, stream);
      } else {
        err = params.q_type == ElemType::kBF16 ? sm90::run_decode_bf16(params, ws, schedule, seesaw, stream)
                                               : sm90::run_decode_fp16(params, ws, schedule, seesaw, stream);
      }
#else
      err = cudaErrorNoKernelImageForDevice;  // select_kernel never picks it in such a build
#endif
      break;
    }
    case KernelFamily::kPortable:
      if (params.kv_format == KvFormat::kFp8DsMla) {
        err = sm80::run_decode_ds_mla(params, ws, schedule, stream);
      } else {
        switch (params.kv_type) {
          case ElemType::kBF16: err = sm80::run_decode_bf16(params, ws, schedule, stream); break;
          case ElemType::kF16: err = sm80::run_decode_fp16(params, ws, schedule, stream); break;
          case ElemType::kFP8E4M3: err = sm80::run_decode_fp8(params, ws, schedule, stream); break;
        }
      }
      break;
    default:
      err = cudaErrorInvalidValue;  // an unresolved configuration
  }
  if (err == cudaErrorCooperativeLaunchTooLarge && schedule.fused_combine) {
    // The fused combine's grid-wide barrier needs every CTA resident at once;
    // where fewer SMs are at hand than the device reports (the launch said
    // so and ran nothing), decode again and combine with the combine kernel
    // in the same order: the same bits.
    KernelConfig unfused = config;
    unfused.fused_combine = Switch::kOff;
    return run_paged_decode(params, ws, unfused, num_parts, max_num_splits, stream);
  }
  if (err != cudaSuccess || schedule.fused_combine) return err;
  return smxx::run_combine(params, ws, config.combine_grid, config.programmatic_combine == Switch::kOn, stream);
}

cudaError_t run_decode_schedule(const PagedDecodeParams& params, const DecodeWorkspace& ws, int num_parts,
                                int max_num_splits, cudaStream_t stream) {
  if (params.batch == 0) return cudaSuccess;
  SplitSchedule schedule;
  schedule.num_parts = num_parts;
  schedule.max_num_splits = max_num_splits;
  return smxx::run_scheduler(params, ws, schedule, stream);
}

namespace {
// Every query token of a sparse call has its own index row: B*Q requests of one token.
PagedDecodeParams per_token_requests(const PagedDecodeParams& params) {
  PagedDecodeParams per_token = params;
  per_token.batch = params.batch * params.q_len;
  per_token.q_len = 1;
  per_token.causal = false;
  per_token.sparse_group = params.q_len;
  return per_token;
}
}  // namespace

cudaError_t run_sparse_decode_schedule(const PagedDecodeParams& params, const DecodeWorkspace& ws, int num_parts,
                                       cudaStream_t stream) {
  return run_decode_schedule(per_token_requests(params), ws, num_parts, /*max_num_splits=*/0, stream);
}

cudaError_t run_sparse_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws, const KernelConfig& config,
                              int num_parts, cudaStream_t stream) {
  return run_paged_decode(per_token_requests(params), ws, config, num_parts, /*max_num_splits=*/0, stream);
}

}  // namespace mla_jax
