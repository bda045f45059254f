// Kernel body of the portable split-KV paged MLA decode (sm_80+:
// cp.async, ldmatrix and mma.sync m16n8k16 through CuTe's instruction
// atoms). Included by the per-dtype instantiation files decode_*.cu.
//
// Grid (num_parts, row blocks). A CTA walks the items the scheduler gave
// its partition; an item is a range of 64-token blocks of one request. For
// each item it loads the request's query rows once, streams the KV tiles
// through a two-stage cp.async pipeline (page ids gathered from the block
// table one tile ahead), keeps the online-softmax state in registers and
// writes either the final output (request not split) or a normalised
// partial output and LSE for the combine kernel.
#pragma once

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"
#include "csrc/sm80/api.h"
#include "csrc/sm80/decode_traits.h"
#include "csrc/smxx/api.h"
#include "csrc/smxx/fp8_convert.cuh"
#include "csrc/smxx/kv_source.cuh"
#include "csrc/smxx/pdl.cuh"
#include "csrc/smxx/request.cuh"

namespace mla_jax {
namespace sm80 {

using smxx::cp_async_16;
using smxx::kSchedBlockTokens;
using smxx::locate_token;
using smxx::pack2;
using smxx::request_span;
using smxx::RequestSpan;
using smxx::TokenSource;

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0],
                                            d[1], d[2], d[3]);
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0],
                                          d[1], d[2], d[3]);
}

__device__ __forceinline__ void ldsm_x4(const void* smem, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*static_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}
__device__ __forceinline__ void ldsm_x2(const void* smem, uint32_t (&r)[2]) {
  cute::SM75_U32x2_LDSM_N::copy(*static_cast<const cute::uint128_t*>(smem), r[0], r[1]);
}
__device__ __forceinline__ void ldsm_x4_trans(const void* smem, uint32_t (&r)[4]) {
  cute::SM75_U16x8_LDSM_T::copy(*static_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

// 16 e4m3 values -> 16 QType values times `scale` (two 16-byte stores).
template <typename T>
__device__ __forceinline__ void convert_fp8x16(const uint8_t* src, T* dst, float scale) {
  uint4 out[2];
  smxx::e4m3x16_to<T, false>(*reinterpret_cast<const uint4*>(src), scale, out);
  reinterpret_cast<uint4*>(dst)[0] = out[0];
  reinterpret_cast<uint4*>(dst)[1] = out[1];
}

// 8 bf16 values -> 8 QType values (one 16-byte store).
template <typename T>
__device__ __forceinline__ void convert_bf16x8(const uint8_t* src, T* dst) {
  *reinterpret_cast<uint4*>(dst) = smxx::bf16x8_to<T>(*reinterpret_cast<const uint4*>(src));
}

// Converts staged cache row chunk `c` into the MMA-ready row `dst`.
// KvFp8: 36 chunks of 16 e4m3 values. KvDsMla: chunks 0-31 are e4m3 ckv
// scaled by their group's float32 scale, then 8 chunks of 8 bf16 kpe values
// (the 16 scale bytes in between are not a chunk of their own).
template <typename Tr>
__device__ __forceinline__ void convert_chunk(const uint8_t* src_row, typename Tr::QType* dst_row, int c) {
  using T = typename Tr::QType;
  if constexpr (std::is_same_v<typename Tr::KvTag, KvDsMla>) {
    if (c < 32) {
      const float scale = reinterpret_cast<const float*>(src_row + kDsMlaScaleOffset)[c / 8];
      convert_fp8x16<T>(src_row + c * 16, dst_row + c * 16, scale);
    } else {
      convert_bf16x8<T>(src_row + kDsMlaRopeOffset + (c - 32) * 16, dst_row + 512 + (c - 32) * 8);
    }
  } else {
    convert_fp8x16<T>(src_row + c * 16, dst_row + c * 16, 1.0f);
  }
}

// Element offset of (row, col) in a Q/KV tile; col is a multiple of 8 for
// the 16-byte accesses. Swizzled tiles XOR the chunk index with row % 8, so
// the 8 rows of an ldmatrix phase (or of a cp.async wavefront) always hit 8
// distinct bank groups although the unpadded row stride is 1152 bytes.
template <typename Tr>
__device__ __forceinline__ int tile_offset(int row, int col) {
  if constexpr (Tr::kSwizzle) {
    return row * Tr::kRowStride + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
  } else {
    return row * Tr::kRowStride + col;
  }
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_kernel(const PagedDecodeParams p, const DecodeWorkspace ws) {
  // The combine kernel after this one may be dispatched now; it waits for
  // this grid to complete before reading anything (csrc/smxx/pdl.cuh).
  pdl_allow_dependents();
  using T = typename Tr::QType;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kMT = Tr::kMTiles;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

  extern __shared__ __align__(128) char smem[];
  T* sQ = reinterpret_cast<T*>(smem + Tr::kSmemQ);
  char* sKvStage = smem + Tr::kSmemKv;
  T* sP = reinterpret_cast<T*>(smem + Tr::kSmemP);
  float* sRed = reinterpret_cast<float*>(smem + Tr::kSmemRed);
  uint8_t* sValid = reinterpret_cast<uint8_t*>(smem + Tr::kSmemValid);
  __shared__ int s_bad_page;

  const int tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int wm = warp % Tr::kWarpsM, wn = warp / Tr::kWarpsM;
  const int g = lane / 4, tig = lane % 4;
  const int copy_row = tid / Tr::kThreadsPerRow, copy_lane = tid % Tr::kThreadsPerRow;
  // Row (within the CTA's block) of this thread's accumulator entries:
  // m-tile mt, half rr (the MMA C layout holds rows g and g + 8).
  auto my_row = [&](int mt, int rr) { return wm * Tr::kWarpRows + mt * 16 + g + rr * 8; };

  const int part = blockIdx.x;
  const int m0 = blockIdx.y * kBlockM;
  const int rows = p.rows_per_request();
  const float kv_scale = p.kv_scale ? *p.kv_scale : 1.0f;
  const float scale_log2 = p.sm_scale * kv_scale * kLog2e;
  // Launched as a programmatic dependent of the scheduler kernel, which
  // always runs before this kernel, this CTA may start before the schedule
  // is written: wait for it here, after the set-up that does not read it
  // (csrc/smxx/pdl.cuh).
  pdl_wait_for_previous();
  const int item_begin = ws.part_begin[part], item_end = ws.part_begin[part + 1];
  const T* kv_tile = reinterpret_cast<const T*>(Tr::kFp8Kv ? smem + Tr::kSmemConverted : sKvStage);
  const char* q_nope = static_cast<const char*>(p.q_nope);
  const char* q_pe = static_cast<const char*>(p.q_pe);
  const char* ckv = static_cast<const char*>(p.ckv);
  const char* kpe = static_cast<const char*>(p.kpe);
  constexpr int kKvElem = std::is_same_v<typename Tr::KvTag, KvNative> ? 2 : 1;
  constexpr int kConvertUnits = std::is_same_v<typename Tr::KvTag, KvDsMla> ? 40 : Tr::kKvChunks;
  const bool sparse = p.indices != nullptr;

  for (int item = item_begin; item < item_end; ++item) {
    const int b = ws.items[4 * item];
    const int block_begin = ws.items[4 * item + 1], block_end = ws.items[4 * item + 2];
    const int splits = ws.request_meta[2 * b + 1];
    const RequestSpan span = request_span(p, b);
    const int64_t seq_len = span.len;
    const bool len_ok = span.valid;
    const int64_t tok_end = min(seq_len, int64_t{block_end} * kSchedBlockTokens);
    const int tile_begin = block_begin * (kSchedBlockTokens / kBlockN);
    const int num_tiles =
        len_ok ? static_cast<int>((tok_end + kBlockN - 1) / kBlockN) - tile_begin : 0;
    const int32_t* table = sparse ? p.indices + static_cast<int64_t>(b) * p.topk
                                  : p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;

    // The previous item is done with every buffer (its last cp.async group,
    // the query's alone when it had no tiles, has landed too).
    cute::cp_async_wait<0>();
    __syncthreads();
    if (tid == 0) s_bad_page = 0;
    __syncthreads();

    // Page and slot of each KV row this thread copies (see locate_token).
    auto fetch_pages = [&](int tile, int (&page)[Tr::kKvPasses], int (&slot)[Tr::kKvPasses]) {
#pragma unroll
      for (int ps = 0; ps < Tr::kKvPasses; ++ps) {
        const int r = ps * Tr::kRowsPerPass + copy_row;
        const TokenSource src =
            r < kBlockN ? locate_token(p, table, int64_t{tile} * kBlockN + r, tok_end) : TokenSource{-1, 0};
        page[ps] = src.page;
        slot[ps] = src.slot;
      }
    };
    auto issue_tile = [&](int tile, int stage, const int (&page)[Tr::kKvPasses],
                          const int (&slot)[Tr::kKvPasses]) {
      char* dst_stage = sKvStage + stage * Tr::kStageBytes;
#pragma unroll
      for (int ps = 0; ps < Tr::kKvPasses; ++ps) {
        const int r = ps * Tr::kRowsPerPass + copy_row;
        if (r >= kBlockN) continue;
        const bool live = page[ps] >= 0;
        if (page[ps] == -2) s_bad_page = 1;
        if (copy_lane == 0) sValid[stage * kBlockN + r] = live;
        const int64_t sl = live ? slot[ps] : 0;
        const int64_t pg = live ? page[ps] : 0;
        const char* ckv_row = ckv + (pg * p.ckv_page_stride + sl * p.ckv_token_stride) * kKvElem;
        const char* kpe_row = kpe + (pg * p.kpe_page_stride + sl * p.kpe_token_stride) * kKvElem;
#pragma unroll
        for (int j = 0; j < Tr::kKvChunksPerThread; ++j) {
          const int c = copy_lane + j * Tr::kThreadsPerRow;
          if (c < Tr::kKvChunks) {
            const char* src = (Tr::KvTag::kContiguousRow || c < Tr::kNopeChunks)
                                  ? ckv_row + c * 16
                                  : kpe_row + (c - Tr::kNopeChunks) * 16;
            char* dst = Tr::kFp8Kv ? dst_stage + r * Tr::kKvRowBytes + c * 16
                                   : dst_stage + tile_offset<Tr>(r, c * 8) * 2;
            cp_async_16(dst, src, live);
          }
        }
      }
    };

    // Query rows of this row block (zero past the request's rows).
    for (int r = copy_row; r < kBlockM; r += Tr::kRowsPerPass) {
      const bool live = m0 + r < rows;
      const int64_t grow = int64_t{b} * rows + (live ? m0 + r : 0);
      const char* qn = q_nope + grow * p.q_nope_row_stride * 2;
      const char* qp = q_pe + grow * p.q_pe_row_stride * 2;
      for (int c = copy_lane; c < Tr::kDimQK / 8; c += Tr::kThreadsPerRow) {
        const char* src = c < Tr::kDimNope / 8 ? qn + c * 16 : qp + (c - Tr::kDimNope / 8) * 16;
        cp_async_16(sQ + tile_offset<Tr>(r, c * 8), src, live);
      }
    }

    // Visible length of the rows this thread owns in S and O (positions fit
    // in 32 bits: a request's length is an int32).
    int limit[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = m0 + my_row(mt, rr);
        const int qi = row < rows ? row / p.num_heads : 0;
        limit[mt][rr] = row < rows ? static_cast<int>(visible_len(seq_len, p.q_len, qi, p.causal)) : 0;
      }

    float acc_o[kMT][Tr::kOTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j)
        acc_o[mt][j][0] = acc_o[mt][j][1] = acc_o[mt][j][2] = acc_o[mt][j][3] = 0.f;
    float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        row_max[mt][rr] = -INFINITY;
        row_sum[mt][rr] = 0.f;
      }

    int pages[Tr::kKvPasses], slots[Tr::kKvPasses];
    if (num_tiles > 0) {
      fetch_pages(tile_begin, pages, slots);
      issue_tile(tile_begin, 0, pages, slots);
    }
    cute::cp_async_fence();
    if (num_tiles > 1) fetch_pages(tile_begin + 1, pages, slots);

    for (int t = 0; t < num_tiles; ++t) {
      cute::cp_async_wait<0>();
      __syncthreads();  // tile t (and the query) landed; tile t-1 is no longer read
      if (t + 1 < num_tiles) issue_tile(tile_begin + t + 1, (t + 1) % Tr::kStages, pages, slots);
      cute::cp_async_fence();
      if (t + 2 < num_tiles) fetch_pages(tile_begin + t + 2, pages, slots);

      if constexpr (Tr::kFp8Kv) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(sKvStage + (t % Tr::kStages) * Tr::kStageBytes);
        T* dst = const_cast<T*>(kv_tile);
        for (int c = tid; c < kBlockN * kConvertUnits; c += Tr::kThreads) {
          const int r = c / kConvertUnits, col = c % kConvertUnits;
          convert_chunk<Tr>(src + r * Tr::kKvRowBytes, dst + r * Tr::kRowStride, col);
        }
        __syncthreads();
      }
      const T* sK = Tr::kFp8Kv ? kv_tile
                               : reinterpret_cast<const T*>(sKvStage + (t % Tr::kStages) * Tr::kStageBytes);

      // S = Q K^T for this warp's kWarpRows rows x kSCols tokens. The 36
      // k-steps accumulate into kSplitK independent sets so that consecutive
      // MMAs do not wait on each other.
      constexpr int kSplitK = Tr::kSTiles * kMT >= 4 ? 1 : (Tr::kSTiles == 2 ? 2 : 4);
      float acc_k[kSplitK][kMT][Tr::kSTiles][4];
#pragma unroll
      for (int sk = 0; sk < kSplitK; ++sk)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int n = 0; n < Tr::kSTiles; ++n)
            acc_k[sk][mt][n][0] = acc_k[sk][mt][n][1] = acc_k[sk][mt][n][2] = acc_k[sk][mt][n][3] = 0.f;
      // ldmatrix rows: Q rows of each m-tile; K rows of the warp's tokens.
      const int q_row0 = wm * Tr::kWarpRows + lane % 16;
      const int q_col8 = lane / 16;                  // which 8 of the 16 k values
      const int k_row = Tr::kSTiles == 2 ? wn * 16 + lane % 8 + 8 * (lane / 16) : wn * 8 + lane % 8;
      const int k_col8 = (lane / 8) % 2;
#pragma unroll(kMT == 1 ? 2 : 1)
      for (int ks0 = 0; ks0 < Tr::kDimQK / 16; ks0 += kSplitK) {
#pragma unroll
        for (int sk = 0; sk < kSplitK; ++sk) {
          const int ks = ks0 + sk;
          uint32_t a[kMT][4];
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) ldsm_x4(sQ + tile_offset<Tr>(q_row0 + mt * 16, ks * 16 + 8 * q_col8), a[mt]);
          if constexpr (Tr::kSTiles == 2) {
            uint32_t bk[4];
            ldsm_x4(sK + tile_offset<Tr>(k_row, ks * 16 + 8 * k_col8), bk);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma16816<T>(acc_k[sk][mt][0], a[mt], bk[0], bk[1]);
              mma16816<T>(acc_k[sk][mt][1], a[mt], bk[2], bk[3]);
            }
          } else {
            uint32_t bk[2];
            ldsm_x2(sK + tile_offset<Tr>(k_row, ks * 16 + 8 * k_col8), bk);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) mma16816<T>(acc_k[sk][mt][0], a[mt], bk[0], bk[1]);
          }
        }
      }
      float acc_s[kMT][Tr::kSTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < Tr::kSTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float v = acc_k[0][mt][n][e];
#pragma unroll
            for (int sk = 1; sk < kSplitK; ++sk) v += acc_k[sk][mt][n][e];
            acc_s[mt][n][e] = v;
          }

      // Mask, scale (log2 domain) and the tile's row maxima across warps.
      const int tok0 = (tile_begin + t) * kBlockN + wn * Tr::kSCols + 2 * tig;
      const uint8_t* valid = sValid + (t % Tr::kStages) * kBlockN + wn * Tr::kSCols + 2 * tig;
      float tile_max[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        tile_max[mt][0] = tile_max[mt][1] = -INFINITY;
#pragma unroll
        for (int n = 0; n < Tr::kSTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rr = e / 2;
            const int tok = tok0 + n * 8 + (e % 2);
            const bool visible = tok < limit[mt][rr] && valid[n * 8 + (e % 2)];
            const float s = visible ? acc_s[mt][n][e] * scale_log2 : -INFINITY;
            acc_s[mt][n][e] = s;
            tile_max[mt][rr] = fmaxf(tile_max[mt][rr], s);
          }
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          tile_max[mt][rr] = fmaxf(tile_max[mt][rr], __shfl_xor_sync(0xffffffffu, tile_max[mt][rr], 1));
          tile_max[mt][rr] = fmaxf(tile_max[mt][rr], __shfl_xor_sync(0xffffffffu, tile_max[mt][rr], 2));
          if (tig == 0) sRed[wn * kBlockM + my_row(mt, rr)] = tile_max[mt][rr];
        }
      }
      __syncthreads();
      float correction[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          float m = row_max[mt][rr];
#pragma unroll
          for (int w = 0; w < Tr::kWarpsN; ++w) m = fmaxf(m, sRed[w * kBlockM + my_row(mt, rr)]);
          const float m_use = m == -INFINITY ? 0.f : m;  // fully masked so far: avoid inf - inf
          correction[mt][rr] = exp2f(row_max[mt][rr] - m_use);
          row_max[mt][rr] = m;
          row_sum[mt][rr] *= correction[mt][rr];
#pragma unroll
          for (int n = 0; n < Tr::kSTiles; ++n) {
            acc_s[mt][n][2 * rr] = exp2f(acc_s[mt][n][2 * rr] - m_use);
            acc_s[mt][n][2 * rr + 1] = exp2f(acc_s[mt][n][2 * rr + 1] - m_use);
            row_sum[mt][rr] += acc_s[mt][n][2 * rr] + acc_s[mt][n][2 * rr + 1];
          }
        }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < Tr::kSTiles; ++n) {
          const int col = wn * Tr::kSCols + n * 8 + 2 * tig;
          *reinterpret_cast<uint32_t*>(sP + my_row(mt, 0) * Tr::kPStride + col) =
              pack2<T>(acc_s[mt][n][0], acc_s[mt][n][1]);
          *reinterpret_cast<uint32_t*>(sP + my_row(mt, 1) * Tr::kPStride + col) =
              pack2<T>(acc_s[mt][n][2], acc_s[mt][n][3]);
        }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j) {
          acc_o[mt][j][0] *= correction[mt][0];
          acc_o[mt][j][1] *= correction[mt][0];
          acc_o[mt][j][2] *= correction[mt][1];
          acc_o[mt][j][3] *= correction[mt][1];
        }
      __syncthreads();  // P complete

      // O += P V for this warp's kWarpRows rows x kOCols outputs (V = ckv part).
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          ldsm_x4(sP + (q_row0 + mt * 16) * Tr::kPStride + kk * 16 + 8 * (lane / 16), a[mt]);
        const int v_row = kk * 16 + lane % 16;
#pragma unroll
        for (int j2 = 0; j2 < Tr::kOTiles / 2; ++j2) {
          uint32_t bv[4];
          ldsm_x4_trans(sK + tile_offset<Tr>(v_row, wn * Tr::kOCols + j2 * 16 + 8 * (lane / 16)), bv);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma16816<T>(acc_o[mt][2 * j2], a[mt], bv[0], bv[1]);
            mma16816<T>(acc_o[mt][2 * j2 + 1], a[mt], bv[2], bv[3]);
          }
        }
      }
    }

    // Epilogue: row sums across the quad and the kWarpsN column warps.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        row_sum[mt][rr] += __shfl_xor_sync(0xffffffffu, row_sum[mt][rr], 1);
        row_sum[mt][rr] += __shfl_xor_sync(0xffffffffu, row_sum[mt][rr], 2);
      }
    __syncthreads();  // sRed's last readers are done
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        if (tig == 0) sRed[wn * kBlockM + my_row(mt, rr)] = row_sum[mt][rr];
    __syncthreads();
    const bool bad = !len_ok || s_bad_page != 0;
    const bool split = splits > 1;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = m0 + my_row(mt, rr);
        if (row >= rows) continue;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < Tr::kWarpsN; ++w) total += sRed[w * kBlockM + my_row(mt, rr)];
        float lse, scale;
        if (bad) {
          lse = NAN;
          scale = NAN;
        } else if (total > 0.f) {
          lse = row_max[mt][rr] * kLn2 + logf(total);
          scale = kv_scale / total;
          if (p.attn_sink != nullptr && !split) {  // split rows get the sink in combine
            scale /= 1.f + __expf(p.attn_sink[row % p.num_heads] - lse);
          }
        } else {
          lse = -INFINITY;  // nothing visible: out 0
          scale = 0.f;
        }
        const int64_t out_row = split ? int64_t{item} * rows + row : int64_t{b} * rows + row;
        // Split requests' partials are stored in T like the output (workspace.h).
        T* dst = (split ? ws.partials<T>() : static_cast<T*>(p.out)) + out_row * Tr::kDimNope + wn * Tr::kOCols +
                 2 * tig;
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j)
          *reinterpret_cast<uint32_t*>(dst + j * 8) =
              pack2<T>(acc_o[mt][j][2 * rr] * scale, acc_o[mt][j][2 * rr + 1] * scale);
        if (wn == 0 && tig == 0) (split ? ws.lse_accum : p.lse)[out_row] = lse;
      }
  }
}

template <typename Tr>
cudaError_t launch_decode(const PagedDecodeParams& p, const DecodeWorkspace& ws, const SplitSchedule& schedule,
                          cudaStream_t stream) {
  auto kernel = decode_kernel<Tr>;
  cudaError_t err = smxx::set_max_dynamic_smem_once(reinterpret_cast<const void*>(kernel), Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  // The scheduler right before the kernel, after the host work, so that
  // outside a CUDA graph no host work sits between the two launches.
  if (!schedule.schedule_given) {
    err = smxx::run_scheduler(p, ws, schedule, stream);
    if (err != cudaSuccess) return err;
  }
  const int rows = p.rows_per_request();
  dim3 grid(schedule.num_parts, (rows + Tr::kBlockM - 1) / Tr::kBlockM);
  // The decode is the scheduler's programmatic dependent (csrc/smxx/pdl.cuh);
  // after a given schedule it is launched plainly.
  return launch_kernel(kernel, grid, Tr::kThreads, Tr::kSmemBytes, stream,
                       /*programmatic=*/!schedule.schedule_given, p, ws);
}

// Picks the row-block size from q_len x heads: 16, 32 or 64 rows (the
// dispatch layer's portable_rows_per_cta gives the same sizes).
template <typename QType, typename KvTag>
cudaError_t dispatch_decode(const PagedDecodeParams& p, const DecodeWorkspace& ws, const SplitSchedule& schedule,
                            cudaStream_t stream) {
  const int rows = p.rows_per_request();
  if (rows <= 16) return launch_decode<DecodeTraits<QType, KvTag, 16, 64>>(p, ws, schedule, stream);
  if (rows <= 32) return launch_decode<DecodeTraits<QType, KvTag, 32, 64>>(p, ws, schedule, stream);
  if constexpr (std::is_same_v<KvTag, KvNative>) {
    // 64 rows as 2 x 4 warps of 32 rows x 16 tokens, 64-token tiles in
    // swizzled (unpadded) smem: half the K/V shared-memory reads per token
    // of the 4 x 2 layout, which is shared-memory bound.
    return launch_decode<DecodeTraits<QType, KvTag, 64, 64, 2, true>>(p, ws, schedule, stream);
  } else {  // a converted FP8 tile does not fit beside 64-token stages
    return launch_decode<DecodeTraits<QType, KvTag, 64, 32>>(p, ws, schedule, stream);
  }
}

}  // namespace sm80
}  // namespace mla_jax
