// Instantiation: fp16 query and fp16 cache on sm_90a.
#include "csrc/sm90/decode_launch.cuh"

namespace mla_jax {
namespace sm90 {

cudaError_t run_decode_fp16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            const SplitSchedule& schedule, bool seesaw, cudaStream_t stream) {
  return launch_decode<DecodeTraits<__half>>(params, ws, schedule, seesaw, stream);
}

}  // namespace sm90
}  // namespace mla_jax
