// Instantiation: fp16 query and fp16 cache.
#include "csrc/sm80/decode_kernel.cuh"

namespace mla_jax {
namespace sm80 {

cudaError_t run_decode_fp16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              const SplitSchedule& schedule, cudaStream_t stream) {
  return dispatch_decode<__half, KvNative>(params, ws, schedule, stream);
}

}  // namespace sm80
}  // namespace mla_jax
