// Host side of the portable decode: validation and the three launches.
#include "csrc/sm80/api.h"
#include "csrc/sm80/schedule_inline.cuh"
#include "csrc/sm90/api.h"

namespace mla_jax {
namespace sm80 {

int rows_per_cta(int rows_per_request) {
  return rows_per_request <= 16 ? 16 : rows_per_request <= 32 ? 32 : 64;
}

const char* check_supported(const PagedDecodeParams& p) {
  if (p.kv_lora_rank != 512 || p.qk_rope_head_dim != 64)
    return "the CUDA kernels need kv_lora_rank 512 and qk_rope_head_dim 64";
  if (p.q_type == ElemType::kFP8E4M3) return "the query must be bf16 or fp16";
  if (p.page_size <= 0) return "page_size must be positive";
  return nullptr;
}

cudaError_t paged_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws, cudaStream_t stream) {
  if (params.batch == 0 || params.rows_per_request() == 0) return cudaSuccess;
  // Each decode launcher launches the scheduler itself, right before its
  // kernel and after its host-side work (tensor maps, attributes), so that
  // outside a CUDA graph no host work sits between the two kernels. (The
  // 4.5-5.8 us idle gap before the decode kernel seen in H200 traces of one
  // request stayed after this change: it is not that host work.)
  cudaError_t err = cudaSuccess;
  bool programmatic_combine = false;
  if (sm90::selected(params)) {  // Hopper: the wgmma kernel for 64-row blocks
    sm90::DecodeKernel launched = sm90::DecodeKernel::kLockstep;
    err = params.q_type == ElemType::kBF16 ? sm90::run_decode_bf16(params, ws, stream, &launched)
                                           : sm90::run_decode_fp16(params, ws, stream, &launched);
    // The seesaw kernel allows the combine's launch when each CTA starts
    // its last item. Above 32 requests its CTAs run several items, so the
    // combine's launch and CTA dispatch hide behind the decode's last
    // items: 128 requests at 128 heads traced 3.6-7.4 us faster per call.
    // With fewer requests a CTA usually runs one item and triggers at its
    // start: 8 x 42k and one 76.8k request at 12 heads traced 1.2-1.9 us
    // slower (benchmarks/NOTES.md v12). MLA_JAX_PDL overrides this.
    programmatic_combine = launched == sm90::DecodeKernel::kSeesaw && params.batch > kInlineScheduleMaxBatch;
  } else if (params.kv_format == KvFormat::kFp8DsMla) {
    err = run_decode_ds_mla(params, ws, stream);
  } else {
    switch (params.kv_type) {
      case ElemType::kBF16: err = run_decode_bf16(params, ws, stream); break;
      case ElemType::kF16: err = run_decode_fp16(params, ws, stream); break;
      case ElemType::kFP8E4M3: err = run_decode_fp8(params, ws, stream); break;
    }
  }
  if (err != cudaSuccess) return err;
  return run_combine(params, ws, stream, programmatic_combine);
}

cudaError_t sparse_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws, cudaStream_t stream) {
  // Every query token has its own index row: run B*Q requests of one token.
  PagedDecodeParams per_token = params;
  per_token.batch = params.batch * params.q_len;
  per_token.q_len = 1;
  per_token.causal = false;
  DecodeWorkspace w = ws;
  w.sparse_group = params.q_len;
  return paged_decode(per_token, w, stream);
}

}  // namespace sm80
}  // namespace mla_jax
