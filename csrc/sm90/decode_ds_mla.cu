// Instantiation: DeepSeek V3.2 fp8_ds_mla cache (656-byte rows) with a bf16
// or fp16 query on sm_90a (sparse top-k decode); lock-step kernel, or the
// seesaw kernel for sparse decode with a bf16 query; rows dequantised on chip.
#include "csrc/sm90/decode_launch.cuh"

namespace mla_jax {
namespace sm90 {

cudaError_t run_decode_ds_mla(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              const SplitSchedule& schedule, bool seesaw, cudaStream_t stream) {
  if (params.q_type == ElemType::kBF16)
    return launch_decode<DecodeTraits<__nv_bfloat16, KvLoad::kDsMla>>(params, ws, schedule, seesaw, stream);
  return launch_decode<DecodeTraits<__half, KvLoad::kDsMla>>(params, ws, schedule, seesaw, stream);
}

}  // namespace sm90
}  // namespace mla_jax
