// Instantiation: bf16 query and bf16 cache on sm_90a.
#include "csrc/sm90/decode_launch.cuh"

namespace mla_jax {
namespace sm90 {

cudaError_t run_decode_bf16(const PagedDecodeParams& params, const sm80::DecodeWorkspace& ws,
                            cudaStream_t stream, DecodeKernel* launched) {
  return launch_decode<DecodeTraits<__nv_bfloat16>>(params, ws, stream, launched);
}

}  // namespace sm90
}  // namespace mla_jax
