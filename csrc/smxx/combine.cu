// Combine kernel: merges the split partial results of each request,
// weighting each split's normalised output by exp(lse_i - lse)
// (FlashDecoding). Requests with one split were written by the decode
// kernel directly and are skipped.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>

#include "csrc/smxx/pdl.cuh"
#include "csrc/smxx/phase_probe.cuh"
#include "csrc/smxx/api.h"

namespace mla_jax {
namespace smxx {
namespace {

// Three grids (which one a call uses is part of the kernel configuration,
// csrc/dispatch/select.cc):
// * combine_kernel: few pairs with many splits each (one long request at
//   few heads). A CTA per row and 128-column slice whose eight warps split
//   the splits, so the reads spread over many SMs.
// * combine_rows_kernel, a warp per 128-column slice of a row: few pairs
//   with fewer splits each.
// * combine_rows_kernel, a warp per row over all of its columns: many pairs.
// The rows kernels have no block barriers; the split weights pass between
// lanes by shuffles and each lane keeps sixteen 8-byte loads in flight.
// Every grid gives the right answer for every shape; the two warp grids add
// the splits in the same order, so they agree bit for bit.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpColumns = 128;  // four columns per lane
constexpr int kRowWarps = 8;       // warps per CTA of combine_rows_kernel
constexpr int kRowGroups = 4;      // groups of four columns per lane of a 512-column row
constexpr int kWeightChunk = 256;  // splits whose weights are staged in shared memory at once

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

// Four consecutive partial values (8 bytes, stored in the output's dtype,
// csrc/common/workspace.h) as floats. Loaded raw and converted where they
// are added, so that loads in flight hold two registers each, not four.
template <typename T>
__device__ __forceinline__ float4 to_float4(uint2 raw);

template <>
__device__ __forceinline__ float4 to_float4<__nv_bfloat16>(uint2 raw) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <>
__device__ __forceinline__ float4 to_float4<__half>(uint2 raw) {
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <typename T>
__device__ __forceinline__ uint2 load_raw4(const T* src) {
  return *reinterpret_cast<const uint2*>(src);
}

// acc += w * v for one split's four partial columns. A split of weight 0
// (nothing visible, or exp underflow) adds exactly nothing, whatever its
// partials hold: 0 * inf or 0 * NaN must not reach the sum. The partials are
// loaded before the weight test (they lie inside the workspace), so loads of
// consecutive splits need not wait for it and can be in flight together.
__device__ __forceinline__ void add_weighted(float4& acc, float w, float4 v) {
  if (w == 0.f) v = make_float4(0.f, 0.f, 0.f, 0.f);
  acc.x = fmaf(w, v.x, acc.x); acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z); acc.w = fmaf(w, v.w, acc.w);
}

// grid: (batch, rows, dv / kWarpColumns).
template <typename OutT>
__global__ void __launch_bounds__(kThreads) combine_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  MLA_JAX_PHASE_BEGIN();  // diagnostic builds: mark 1 once the decode kernel is waited for
  pdl_wait_for_previous();  // may be dispatched before the decode kernel ends (csrc/smxx/pdl.cuh)
  MLA_JAX_PHASE(1);
  const int b = blockIdx.x;
  const int row = blockIdx.y;
  const int splits = ws.request_meta[2 * b + 1];
  if (splits <= 1) return;
  const int first = ws.request_meta[2 * b];
  const int rows = p.rows_per_request();
  const int dv = p.kv_lora_rank;
  const float* lse_split = ws.lse_accum + static_cast<int64_t>(first) * rows + row;  // stride rows

  float local_max = -INFINITY;
  bool local_nan = false;
  for (int i = threadIdx.x; i < splits; i += kThreads) {
    const float l = lse_split[static_cast<int64_t>(i) * rows];
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
      local_sum += __expf(lse_split[static_cast<int64_t>(i) * rows] - row_max);
  }
  __syncthreads();  // tmp reuse
  const float sum = Reduce(tmp).Sum(local_sum);
  if (threadIdx.x == 0) {
    s_lse = any_nan ? NAN : (row_max == -INFINITY ? -INFINITY : row_max + logf(sum));
  }
  __syncthreads();
  const float lse = s_lse;

  // The weights exp(lse_i - lse) go through shared memory a chunk of splits
  // at a time, so the loop over splits has no global load feeding a branch
  // and its partial-output loads can overlap. The chunk loop's bounds are
  // the same for every thread (it holds barriers).
  __shared__ float s_w[kWeightChunk];
  __shared__ float4 s_acc[kWarps][32];
  const int cta_columns = dv / gridDim.z;  // kWarpColumns as launched (dv is 512 on this path)
  const int column_groups = cta_columns / kWarpColumns;
  const int split_groups = kWarps / column_groups;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int column_group = warp % column_groups, split_group = warp / column_groups;
  const int d = blockIdx.z * cta_columns + column_group * kWarpColumns + lane * 4;
  const int64_t split_stride = static_cast<int64_t>(rows) * dv;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool accumulate = !any_nan && lse != -INFINITY;
  for (int c0 = 0; accumulate && c0 < splits; c0 += kWeightChunk) {
    const int n = min(kWeightChunk, splits - c0);
    __syncthreads();  // the previous chunk's weights are read
    for (int i = threadIdx.x; i < n; i += kThreads)
      s_w[i] = __expf(lse_split[static_cast<int64_t>(c0 + i) * rows] - lse);
    __syncthreads();
    const OutT* src = ws.partials<OutT>() + (static_cast<int64_t>(first + c0) * rows + row) * dv + d;
#pragma unroll 4
    for (int i = split_group; i < n; i += split_groups)
      add_weighted(acc, s_w[i], to_float4<OutT>(load_raw4(src + i * split_stride)));
  }
  if (split_groups > 1) {  // sum the split groups' partial sums into group 0
    s_acc[warp][lane] = acc;
    __syncthreads();
    if (split_group != 0) return;
    for (int g = 1; g < split_groups; ++g) {
      const float4 o = s_acc[warp + g * column_groups][lane];
      acc.x += o.x; acc.y += o.y; acc.z += o.z; acc.w += o.w;
    }
  }
  if (any_nan) acc = make_float4(NAN, NAN, NAN, NAN);
  // Attention sink (FlashMLA semantics): scale by exp(lse) / (exp(lse) + exp(sink)).
  if (p.attn_sink != nullptr && lse != -INFINITY) {
    const float sink_scale = 1.f / (1.f + __expf(p.attn_sink[row % p.num_heads] - lse));
    acc.x *= sink_scale; acc.y *= sink_scale; acc.z *= sink_scale; acc.w *= sink_scale;
  }
  const int64_t out_row = static_cast<int64_t>(b) * rows + row;
  store4(static_cast<OutT*>(p.out) + out_row * dv + d, acc);
  if (blockIdx.z == 0 && threadIdx.x == 0) p.lse[out_row] = lse;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// grid: (batch, ceil(rows / kRowWarps), 4 / kGroups); warp w of CTA
// (b, y, z) merges columns [128 kGroups z, 128 kGroups (z + 1)) of row
// y * kRowWarps + w of request b. dv must be 32 * 4 * kRowGroups (512).
// kGroups (groups of four columns a lane) = 4: a warp per row; 1: a warp
// per 128-column slice of a row, four times the warps for the same bytes,
// for grids too small to keep every SM's loads in flight otherwise.
template <typename OutT, int kGroups>
__global__ void __launch_bounds__(kRowWarps * 32) combine_rows_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  MLA_JAX_PHASE_BEGIN();  // diagnostic builds: mark 1 once the decode kernel is waited for
  pdl_wait_for_previous();  // may be dispatched before the decode kernel ends (csrc/smxx/pdl.cuh)
  MLA_JAX_PHASE(1);
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kDv = 32 * 4 * kRowGroups;
  // Splits loaded at once: sixteen 8-byte loads (four 16-bit partials each)
  // of a lane in flight.
  constexpr int kUnroll = 16 / kGroups;
  const int b = blockIdx.x;
  const int splits = ws.request_meta[2 * b + 1];
  if (splits <= 1) return;
  const int rows = p.rows_per_request();
  const int row = blockIdx.y * kRowWarps + static_cast<int>(threadIdx.x) / 32;
  if (row >= rows) return;  // warp-uniform; no block barriers follow
  const int lane = threadIdx.x % 32;
  const int first = ws.request_meta[2 * b];
  const float* lse_split = ws.lse_accum + static_cast<int64_t>(first) * rows + row;  // stride rows

  // LSE of the row over its splits (lane i holds splits i, i + 32, ...).
  float row_max = -INFINITY;
  bool nan = false;
  for (int i = lane; i < splits; i += 32) {
    const float l = lse_split[static_cast<int64_t>(i) * rows];
    nan |= isnan(l);
    row_max = fmaxf(row_max, l);
  }
  nan = __any_sync(kAll, nan);
  row_max = warp_max(row_max);
  float sum = 0.f;
  if (row_max != -INFINITY) {
    for (int i = lane; i < splits; i += 32) sum += __expf(lse_split[static_cast<int64_t>(i) * rows] - row_max);
  }
  sum = warp_sum(sum);
  const float lse = nan ? NAN : (row_max == -INFINITY ? -INFINITY : row_max + logf(sum));

  const int col0 = blockIdx.z * 128 * kGroups + lane * 4;
  float4 acc[kGroups];
#pragma unroll
  for (int k = 0; k < kGroups; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (!nan && lse != -INFINITY) {
    const int64_t split_stride = static_cast<int64_t>(rows) * kDv;
    const OutT* src = ws.partials<OutT>() + (static_cast<int64_t>(first) * rows + row) * kDv + col0;
    for (int c0 = 0; c0 < splits; c0 += 32) {
      const int n = min(32, splits - c0);
      const float w_lane = lane < n ? __expf(lse_split[static_cast<int64_t>(c0 + lane) * rows] - lse) : 0.f;
      // kUnroll splits' loads are issued before any of them is added (the
      // guards are warp-uniform, so the shuffles stay convergent).
      for (int j0 = 0; j0 < n; j0 += kUnroll) {
        uint2 v[kUnroll][kGroups];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (j0 + u < n) {
            const OutT* s = src + (c0 + j0 + u) * split_stride;
#pragma unroll
            for (int k = 0; k < kGroups; ++k) v[u][k] = load_raw4(s + k * 128);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (j0 + u < n) {
            const float w = __shfl_sync(kAll, w_lane, j0 + u);
#pragma unroll
            for (int k = 0; k < kGroups; ++k) add_weighted(acc[k], w, to_float4<OutT>(v[u][k]));
          }
        }
      }
    }
  }
  float scale = 1.f;
  // Attention sink (FlashMLA semantics): scale by exp(lse) / (exp(lse) + exp(sink)).
  if (p.attn_sink != nullptr && lse != -INFINITY) scale = 1.f / (1.f + __expf(p.attn_sink[row % p.num_heads] - lse));
  if (nan) scale = NAN;
  const int64_t out_row = static_cast<int64_t>(b) * rows + row;
  OutT* dst = static_cast<OutT*>(p.out) + out_row * kDv + col0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    store4(dst + k * 128, make_float4(acc[k].x * scale, acc[k].y * scale, acc[k].z * scale, acc[k].w * scale));
  if (lane == 0 && blockIdx.z == 0) p.lse[out_row] = lse;
}

}  // namespace

cudaError_t run_combine(const PagedDecodeParams& params, const DecodeWorkspace& ws, CombineGrid grid,
                        bool programmatic, cudaStream_t stream) {
  const int rows = params.rows_per_request();
  if (params.batch == 0 || rows == 0) return cudaSuccess;
  // dv is 512 here (checked by the caller): four kWarpColumns slices, the
  // row width combine_rows_kernel assumes. The decode kernel is the
  // previous launch.
  const bool bf16 = params.q_type == ElemType::kBF16;
  const int row_ctas = (rows + kRowWarps - 1) / kRowWarps;
  switch (grid) {
    case CombineGrid::kBlock: {
      auto kernel = bf16 ? combine_kernel<__nv_bfloat16> : combine_kernel<__half>;
      return launch_kernel(kernel, dim3(params.batch, rows, params.kv_lora_rank / kWarpColumns), dim3(kThreads), 0,
                           stream, programmatic, params, ws);
    }
    case CombineGrid::kSlices: {
      auto kernel = bf16 ? combine_rows_kernel<__nv_bfloat16, 1> : combine_rows_kernel<__half, 1>;
      return launch_kernel(kernel, dim3(params.batch, row_ctas, kRowGroups), dim3(kRowWarps * 32), 0, stream,
                           programmatic, params, ws);
    }
    case CombineGrid::kRows:
    default: {
      auto kernel = bf16 ? combine_rows_kernel<__nv_bfloat16, kRowGroups> : combine_rows_kernel<__half, kRowGroups>;
      return launch_kernel(kernel, dim3(params.batch, row_ctas, 1), dim3(kRowWarps * 32), 0, stream, programmatic,
                           params, ws);
    }
  }
}

}  // namespace smxx
}  // namespace mla_jax
