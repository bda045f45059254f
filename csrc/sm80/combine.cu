// Combine kernel: merges the split partial results of each request,
// weighting each split's normalised output by exp(lse_i - lse)
// (FlashDecoding). Requests with one split were written by the decode
// kernel directly and are skipped.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>

#include "csrc/sm80/api.h"

namespace mla_jax {
namespace sm80 {
namespace {

constexpr int kThreads = 128;  // one float4 of the 512-wide row per thread

template <typename OutT>
__device__ __forceinline__ void store4(OutT* dst, float4 v);

template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* dst, float4 v) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 packed = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  *reinterpret_cast<uint2*>(dst) = packed;
}

template <>
__device__ __forceinline__ void store4<__half>(__half* dst, float4 v) {
  __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
  uint2 packed = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  *reinterpret_cast<uint2*>(dst) = packed;
}

// grid: (batch, rows); one CTA per output row.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) combine_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  const int b = blockIdx.x;
  const int row = blockIdx.y;
  const int splits = ws.request_meta[2 * b + 1];
  if (splits <= 1) return;
  const int first = ws.request_meta[2 * b];
  const int rows = p.rows_per_request();
  const int dv = p.kv_lora_rank;

  float local_max = -INFINITY;
  bool local_nan = false;
  for (int i = threadIdx.x; i < splits; i += kThreads) {
    const float l = ws.lse_accum[static_cast<int64_t>(first + i) * rows + row];
    local_nan |= isnan(l);
    local_max = fmaxf(local_max, l);
  }
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float s_max, s_lse;
  const bool any_nan = __syncthreads_or(local_nan);
  const float m = Reduce(tmp).Reduce(local_max, [](float a, float c) { return fmaxf(a, c); });
  if (threadIdx.x == 0) s_max = m;
  __syncthreads();
  const float row_max = s_max;

  float local_sum = 0.f;
  if (row_max != -INFINITY) {
    for (int i = threadIdx.x; i < splits; i += kThreads)
      local_sum += __expf(ws.lse_accum[static_cast<int64_t>(first + i) * rows + row] - row_max);
  }
  __syncthreads();  // tmp reuse
  const float sum = Reduce(tmp).Sum(local_sum);
  if (threadIdx.x == 0) {
    s_lse = any_nan ? NAN : (row_max == -INFINITY ? -INFINITY : row_max + logf(sum));
  }
  __syncthreads();
  const float lse = s_lse;

  const int64_t out_row = static_cast<int64_t>(b) * rows + row;
  // Attention sink (FlashMLA semantics): scale by exp(lse) / (exp(lse) + exp(sink)).
  const float sink_scale = (p.attn_sink != nullptr && lse != -INFINITY)
                               ? 1.f / (1.f + __expf(p.attn_sink[row % p.num_heads] - lse))
                               : 1.f;
  for (int d = threadIdx.x * 4; d < dv; d += kThreads * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (any_nan) {
      acc = make_float4(NAN, NAN, NAN, NAN);
    } else if (lse != -INFINITY) {
      for (int i = 0; i < splits; ++i) {
        const int64_t item = first + i;
        const float w = __expf(ws.lse_accum[item * rows + row] - lse);
        if (w == 0.f) continue;  // an empty split holds zeros; skip the read
        const float4 v = *reinterpret_cast<const float4*>(ws.out_accum + (item * rows + row) * dv + d);
        acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
      }
    }
    acc.x *= sink_scale; acc.y *= sink_scale; acc.z *= sink_scale; acc.w *= sink_scale;
    store4(static_cast<OutT*>(p.out) + out_row * dv + d, acc);
  }
  if (threadIdx.x == 0) p.lse[out_row] = lse;
}

}  // namespace

cudaError_t run_combine(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                        cudaStream_t stream) {
  const int rows = params.rows_per_request();
  if (params.batch == 0 || rows == 0) return cudaSuccess;
  dim3 grid(params.batch, rows);
  if (params.q_type == ElemType::kBF16) {
    combine_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(params, ws);
  } else {
    combine_kernel<__half><<<grid, kThreads, 0, stream>>>(params, ws);
  }
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace mla_jax
