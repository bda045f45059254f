// Instantiation: float8_e4m3fn cache (one kv_scale) with a bf16 or fp16
// query on sm_90a; lock-step or seesaw kernel, rows converted on chip.
#include "csrc/sm90/decode_launch.cuh"

namespace mla_jax {
namespace sm90 {

cudaError_t run_decode_fp8(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                           const SplitSchedule& schedule, bool seesaw, cudaStream_t stream) {
  if (params.q_type == ElemType::kBF16)
    return launch_decode<DecodeTraits<__nv_bfloat16, KvLoad::kFp8>>(params, ws, schedule, seesaw, stream);
  return launch_decode<DecodeTraits<__half, KvLoad::kFp8>>(params, ws, schedule, seesaw, stream);
}

}  // namespace sm90
}  // namespace mla_jax
