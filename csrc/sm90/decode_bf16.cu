// Instantiation: bf16 query and bf16 cache on sm_90a.
#include "csrc/sm90/decode_launch.cuh"

namespace mla_jax {
namespace sm90 {

cudaError_t run_decode_bf16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            const SplitSchedule& schedule, bool seesaw, cudaStream_t stream) {
  return launch_decode<DecodeTraits<__nv_bfloat16>>(params, ws, schedule, seesaw, stream);
}

}  // namespace sm90
}  // namespace mla_jax
