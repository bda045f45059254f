// Instantiation: float8_e4m3fn cache with a bf16 or fp16 query.
#include "csrc/sm80/decode_kernel.cuh"

namespace mla_jax {
namespace sm80 {

cudaError_t run_decode_fp8(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              const SplitSchedule& schedule, cudaStream_t stream) {
  if (params.q_type == ElemType::kBF16) return dispatch_decode<__nv_bfloat16, KvFp8>(params, ws, schedule, stream);
  return dispatch_decode<__half, KvFp8>(params, ws, schedule, stream);
}

}  // namespace sm80
}  // namespace mla_jax
