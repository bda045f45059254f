// Instantiation: DeepSeek V3.2 fp8_ds_mla cache (656-byte rows) with a bf16
// or fp16 query (sparse top-k decode).
#include "csrc/sm80/decode_kernel.cuh"

namespace mla_jax {
namespace sm80 {

cudaError_t run_decode_ds_mla(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              const SplitSchedule& schedule, cudaStream_t stream) {
  if (params.q_type == ElemType::kBF16) return dispatch_decode<__nv_bfloat16, KvDsMla>(params, ws, schedule, stream);
  return dispatch_decode<__half, KvDsMla>(params, ws, schedule, stream);
}

}  // namespace sm80
}  // namespace mla_jax
