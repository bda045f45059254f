// CPU sparse top-k MLA decode (DeepSeek V3.2): same semantics as the CUDA
// kernel, used by CI, laptops and the demo when no GPU is present.
#pragma once

#include "../common/mla_params.h"
#include "paged_decode_cpu.h"  // ParallelFor

namespace mla_jax {

// Computes out and lse for every query row of a sparse call (params.indices
// set; see mla_params.h). Padding indices (-1, or outside
// [0, num_pages * page_size), or past min(topk_lens[b], topk)) are never
// read; a query token with no valid index gets out 0 and lse -inf.
// kv_format kPlain reads kv_type (bf16/fp16/e4m3 with kv_scale) rows;
// kFp8DsMla dequantises each 656-byte row (e4m3 * group scale, bf16 rope).
void sparse_decode_cpu(const PagedDecodeParams& params, const ParallelFor& parallel_for);

}  // namespace mla_jax
