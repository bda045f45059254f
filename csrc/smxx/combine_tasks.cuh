// The combine's work, one task at a time: merging the split partial
// results of one request's row (or a 128-column slice of it), weighting
// each split's normalised output by exp(lse_i - lse) (FlashDecoding).
// Called by the combine kernels (csrc/smxx/combine.cu), one task a CTA or a
// warp, and by the seesaw decode kernel when it combines itself after a
// grid-wide barrier (SplitSchedule::fused_combine), looping over tasks.
// The two callers of one task function add the splits in the same order,
// so a fused combine and the combine kernel of the same grid agree bit for
// bit.
#pragma once

#include <cub/block/block_reduce.cuh>

#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"
#include "csrc/smxx/kv_source.cuh"

namespace mla_jax {
namespace smxx {

constexpr int kCombineThreads = 256;                      // threads of a block task
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineSliceColumns = 128;                 // four columns per lane
constexpr int kCombineSlices = 4;                         // 128-column slices of a 512-column row
constexpr int kCombineWeightChunk = 256;                  // splits whose weights are staged at once

// Four output values (8 bytes) in OutT.
template <typename OutT>
__device__ __forceinline__ void combine_store4(OutT* dst, float4 v) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<OutT>(v.x, v.y), pack2<OutT>(v.z, v.w));
}

// Four consecutive partial values (8 bytes, stored in the output's dtype,
// csrc/common/workspace.h) as floats. Loaded raw and converted where they
// are added, so that loads in flight hold two registers each, not four.
template <typename T>
__device__ __forceinline__ float4 to_float4(uint2 raw) {
  const float2 lo = unpack2<T>(raw.x), hi = unpack2<T>(raw.y);
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

// Shared memory of a block task (static in the combine kernel, in the
// decode kernel's free KV stages when fused).
struct CombineBlockSmem {
  typename cub::BlockReduce<float, kCombineThreads>::TempStorage reduce;
  float row_max, lse;
  float w[kCombineWeightChunk];
  float4 acc[kCombineWarps][32];
};

// Block task: request b, row `row`, columns [slice_columns z, slice_columns
// (z + 1)) of the 512-column row (slice_columns a multiple of 128), by the
// kCombineThreads threads of a CTA, whose warps split the splits. For few
// pairs with many splits each (one long request at few heads), so that the
// reads spread over many SMs. Every thread of the CTA calls it with the same
// arguments (it holds block barriers); s is free when it is called.
template <typename OutT>
__device__ __forceinline__ void combine_block_task(const PagedDecodeParams& p, const DecodeWorkspace& ws, int b,
                                                   int row, int z, int slice_columns, CombineBlockSmem& s) {
  const int splits = ws.request_meta[2 * b + 1];
  if (splits <= 1) return;
  const int first = ws.request_meta[2 * b];
  const int rows = p.rows_per_request();
  const int dv = p.kv_lora_rank;
  const float* lse_split = ws.lse_accum + static_cast<int64_t>(first) * rows + row;  // stride rows
  const int tid = threadIdx.x;

  float local_max = -INFINITY;
  bool local_nan = false;
  for (int i = tid; i < splits; i += kCombineThreads) {
    const float l = lse_split[static_cast<int64_t>(i) * rows];
    local_nan |= isnan(l);
    local_max = fmaxf(local_max, l);
  }
  using Reduce = cub::BlockReduce<float, kCombineThreads>;
  const bool any_nan = __syncthreads_or(local_nan);
  const float m = Reduce(s.reduce).Reduce(local_max, [](float a, float c) { return fmaxf(a, c); });
  if (tid == 0) s.row_max = m;
  __syncthreads();
  const float row_max = s.row_max;

  float local_sum = 0.f;
  if (row_max != -INFINITY) {
    for (int i = tid; i < splits; i += kCombineThreads)
      local_sum += __expf(lse_split[static_cast<int64_t>(i) * rows] - row_max);
  }
  __syncthreads();  // reduce storage reuse
  const float sum = Reduce(s.reduce).Sum(local_sum);
  if (tid == 0) s.lse = any_nan ? NAN : (row_max == -INFINITY ? -INFINITY : row_max + logf(sum));
  __syncthreads();
  const float lse = s.lse;

  // The weights exp(lse_i - lse) go through shared memory a chunk of splits
  // at a time, so the loop over splits has no global load feeding a branch
  // and its partial-output loads can overlap. The chunk loop's bounds are
  // the same for every thread (it holds barriers).
  const int column_groups = slice_columns / kCombineSliceColumns;
  const int split_groups = kCombineWarps / column_groups;
  const int warp = tid / 32, lane = tid % 32;
  const int column_group = warp % column_groups, split_group = warp / column_groups;
  const int d = z * slice_columns + column_group * kCombineSliceColumns + lane * 4;
  const int64_t split_stride = static_cast<int64_t>(rows) * dv;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool accumulate = !any_nan && lse != -INFINITY;
  for (int c0 = 0; accumulate && c0 < splits; c0 += kCombineWeightChunk) {
    const int n = min(kCombineWeightChunk, splits - c0);
    __syncthreads();  // the previous chunk's weights are read
    for (int i = tid; i < n; i += kCombineThreads)
      s.w[i] = __expf(lse_split[static_cast<int64_t>(c0 + i) * rows] - lse);
    __syncthreads();
    const OutT* src = ws.partials<OutT>() + (static_cast<int64_t>(first + c0) * rows + row) * dv + d;
#pragma unroll 4
    for (int i = split_group; i < n; i += split_groups)
      add_weighted(acc, s.w[i], to_float4<OutT>(load_raw4(src + i * split_stride)));
  }
  if (split_groups > 1) {  // sum the split groups' partial sums into group 0
    s.acc[warp][lane] = acc;
    __syncthreads();
    if (split_group != 0) return;
    for (int g = 1; g < split_groups; ++g) {
      const float4 o = s.acc[warp + g * column_groups][lane];
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
  combine_store4(static_cast<OutT*>(p.out) + out_row * dv + d, acc);
  if (z == 0 && tid == 0) p.lse[out_row] = lse;
}

// Warp task: request b, row `row`, columns [128 kGroups z, 128 kGroups (z +
// 1)) of the 512-column row, by one warp (no block barriers; the split
// weights pass between lanes by shuffles and each lane keeps sixteen 8-byte
// loads in flight). kGroups (groups of four columns a lane) = 4: the whole
// row; 1: a 128-column slice. Both add the splits in the same order, so
// they agree bit for bit.
template <typename OutT, int kGroups>
__device__ __forceinline__ void combine_warp_task(const PagedDecodeParams& p, const DecodeWorkspace& ws, int b,
                                                  int row, int z) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kDv = kCombineSliceColumns * kCombineSlices;
  // Splits loaded at once: sixteen 8-byte loads (four 16-bit partials each)
  // of a lane in flight.
  constexpr int kUnroll = 16 / kGroups;
  const int splits = ws.request_meta[2 * b + 1];
  if (splits <= 1) return;
  const int rows = p.rows_per_request();
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

  const int col0 = z * kCombineSliceColumns * kGroups + lane * 4;
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
            for (int k = 0; k < kGroups; ++k) v[u][k] = load_raw4(s + k * kCombineSliceColumns);
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
    combine_store4(dst + k * kCombineSliceColumns,
                   make_float4(acc[k].x * scale, acc[k].y * scale, acc[k].z * scale, acc[k].w * scale));
  if (lane == 0 && z == 0) p.lse[out_row] = lse;
}

}  // namespace smxx
}  // namespace mla_jax
