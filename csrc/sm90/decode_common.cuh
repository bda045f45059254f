// Per-item pieces the two Hopper decode schedules share (decode_kernel.cuh,
// the lock-step one, and decode_seesaw.cuh): reading a scheduler item, the
// query copy, the visible length of a thread's accumulator rows, and the
// epilogue that normalises O and writes the output or the split partials.
// Both schedules keep the same accumulator layout (64 rows x 256 output
// columns per warpgroup, two rows per thread; layout_check.cu), so these
// take the row base and the CuTe fragments as they are.
#pragma once

#include "csrc/common/mla_params.h"
#include "csrc/smxx/api.h"
#include "csrc/smxx/kv_source.cuh"
#include "csrc/smxx/request.cuh"
#include "csrc/smxx/schedule_inline.cuh"

#include <cute/tensor.hpp>

namespace mla_jax {
namespace sm90 {

// Makes this thread's generic-proxy shared-memory writes (cp.async data
// once waited for, and st.shared) visible to wgmma, which reads through
// the async proxy. Must precede the barrier that publishes the data.
__device__ __forceinline__ void fence_smem_for_wgmma() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// 2^x in one MUFU.EX2 (flush-to-zero; 2^-inf = 0). exp2f adds range
// fix-ups around it that cost three more instructions per element.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// wgmma's accumulator layout (m64nNk16, f32): a thread of a warpgroup holds
// rows accumulator_row_base + 8 * rr, and its element i sits in row half
// rr = accumulator_row_half(i) = (i / 2) % 2 and column accumulator_col(i),
// with elements 2k and 2k + 1 in adjacent columns. A static rr keeps the
// per-row softmax state in registers; csrc/sm90/layout_check.cu checks these
// functions against CuTe's layouts on the host.
__host__ __device__ __forceinline__ int accumulator_row_base(int wg_tid) {
  return (wg_tid / 32) * 16 + (wg_tid % 32) / 4;
}
__host__ __device__ __forceinline__ int accumulator_row_half(int i) { return (i >> 1) & 1; }
__host__ __device__ __forceinline__ int accumulator_col(int wg_tid, int i) {
  return 2 * (wg_tid % 4) + (i & 1) + 8 * (i >> 2);
}

// The FP8 KV dequantisation scale (1 for bf16/fp16 caches) and the softmax
// scale in log2 units with it folded in, so S feeds exp2 directly.
struct SoftmaxScale {
  float kv_scale;
  float scale_log2;
};
__device__ __forceinline__ SoftmaxScale softmax_scale(const PagedDecodeParams& p) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float kv_scale = p.kv_scale ? *p.kv_scale : 1.0f;
  return {kv_scale, p.sm_scale * kv_scale * kLog2e};
}

// Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` in a
// LayoutQK tile: 8-row x 128-byte atoms, row atoms first, then 64-column
// blocks of 8 KB; inside an atom the chunk index is XORed with row % 8
// (the hardware's 128-byte swizzle). Equal to &tile(row, 8 * chunk).
__host__ __device__ __forceinline__ int qk_chunk_offset(int row, int chunk) {
  return (row & 7) * 128 + (row >> 3) * 1024 + (chunk >> 3) * 8192 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Sparse: the top-k entry at position pos of a request (index row
// `table`), as stored, or -1 past the item's end; sparse_checked turns an
// entry into its cache row, or -1 for padding and out-of-range entries
// (never read, masked out); sparse_row does both.
__device__ __forceinline__ int sparse_entry(const int32_t* table, int pos, int64_t tok_end) {
  return pos < tok_end ? table[pos] : -1;
}
__device__ __forceinline__ int sparse_checked(const PagedDecodeParams& p, int idx) {
  return (idx >= 0 && int64_t{idx} < int64_t{p.num_pages} * p.page_size) ? idx : -1;
}
__device__ __forceinline__ int sparse_row(const PagedDecodeParams& p, const int32_t* table, int pos,
                                          int64_t tok_end) {
  return sparse_checked(p, sparse_entry(table, pos, tok_end));
}

// One scheduler item: request b's 64-token blocks [block_begin, block_end),
// as KV tiles [tile_begin, tile_begin + num_tiles) clipped to its length.
struct DecodeItem {
  int b;
  int splits;        // pieces request b was cut into (1: write the output directly)
  int64_t seq_len;
  bool len_ok;       // false: the request's output is NaN
  int64_t tok_end;   // first token past this item
  int tile_begin;
  int num_tiles;     // 0 for an invalid request
};

template <int kBlockN>
__device__ __forceinline__ DecodeItem make_item(const PagedDecodeParams& p, const DecodeWorkspace& ws, int b,
                                                int block_begin, int block_end, int splits) {
  static_assert(kBlockN == smxx::kSchedBlockTokens, "one KV tile per scheduler block");
  DecodeItem it;
  it.b = b;
  it.splits = splits;
  const smxx::RequestSpan span = smxx::request_span(p, it.b);
  it.seq_len = span.len;
  it.len_ok = span.valid;
  it.tok_end = min(it.seq_len, int64_t{block_end} * smxx::kSchedBlockTokens);
  it.tile_begin = block_begin;
  it.num_tiles = it.len_ok ? static_cast<int>((it.tok_end + kBlockN - 1) / kBlockN) - it.tile_begin : 0;
  return it;
}

// Item `item` as the scheduler kernel wrote it.
template <int kBlockN>
__device__ __forceinline__ DecodeItem load_item(const PagedDecodeParams& p, const DecodeWorkspace& ws,
                                                int item) {
  const int b = ws.items[4 * item];
  return make_item<kBlockN>(p, ws, b, ws.items[4 * item + 1], ws.items[4 * item + 2], ws.request_meta[2 * b + 1]);
}

// Issues (cp.async, uncommitted) this thread's share of the 64 query rows
// [m0, m0 + 64) of request b into sQ (LayoutQK); rows past the request's
// are zero-filled.
template <typename Tr>
__device__ __forceinline__ void load_query_rows(const PagedDecodeParams& p, char* sQ_bytes, int b, int m0,
                                                int tid) {
  const int rows = p.rows_per_request();
  const int copy_lane = tid % Tr::kThreadsPerRow;
  const char* q_nope = static_cast<const char*>(p.q_nope);
  const char* q_pe = static_cast<const char*>(p.q_pe);
  for (int r = tid / Tr::kThreadsPerRow; r < Tr::kBlockM; r += Tr::kRowsPerPass) {
    const bool live = m0 + r < rows;
    const int64_t grow = int64_t{b} * rows + (live ? m0 + r : 0);
    const char* qn = q_nope + grow * p.q_nope_row_stride * 2;
    const char* qp = q_pe + grow * p.q_pe_row_stride * 2;
#pragma unroll
    for (int j = 0; j < Tr::kChunksPerThread; ++j) {
      const int c = copy_lane + j * Tr::kThreadsPerRow;
      const char* src = c < Tr::kNopeChunks ? qn + c * 16 : qp + (c - Tr::kNopeChunks) * 16;
      smxx::cp_async_16(sQ_bytes + qk_chunk_offset(r, c), src, live);
    }
  }
}

// Visible length (<= tok_end; tokens past it belong to the next split or do
// not exist) of this thread's two accumulator rows row_base + 8 rr.
__device__ __forceinline__ void row_limits(const PagedDecodeParams& p, const DecodeItem& it, int m0, int row_base,
                                           int (&limit)[2]) {
  const int rows = p.rows_per_request();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = m0 + row_base + 8 * rr;
    const int qi = row < rows ? row / p.num_heads : 0;
    limit[rr] = row < rows ? static_cast<int>(min(visible_len(it.seq_len, p.q_len, qi, p.causal), it.tok_end)) : 0;
  }
}

// Epilogue of one item. row_sum: this thread's partial softmax sums of its
// two rows (its columns of its warpgroup's share), relative to row_max (log2
// domain, the same in both warpgroups); sRed: 2 x 64 floats of shared memory
// no thread still reads. Writes LSE and O / sum (times kv_scale, and the
// attention sink's factor when the request is not split) to the output, or
// to the item's partials (in T, as the output) when the request is split. NaN rows for invalid
// requests or bad page ids (s_bad_page: shared flag set by the copies).
// staging: the KV stages (kStages x kTileBytes of shared memory), which no
// load writes and no wgmma reads at an item's end.
template <typename Tr, typename T, typename FragO>
__device__ __forceinline__ void write_item_output(const PagedDecodeParams& p, const DecodeWorkspace& ws,
                                                  const DecodeItem& it, int item, int m0, float (&row_sum)[2],
                                                  const float (&row_max)[2], float kv_scale,
                                                  const int* s_bad_page, float* sRed, char* staging,
                                                  FragO& tOrO) {
  constexpr float kLn2 = 0.6931471805599453f;
  const int tid = threadIdx.x;
  const int wg = tid / 128, wg_tid = tid % 128, lane = tid % 32;
  const int row_base = accumulator_row_base(wg_tid);
  const int rows = p.rows_per_request();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    row_sum[rr] += __shfl_xor_sync(0xffffffffu, row_sum[rr], 1);
    row_sum[rr] += __shfl_xor_sync(0xffffffffu, row_sum[rr], 2);
  }
  __syncthreads();  // sRed's last readers are done
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
    if (lane % 4 == 0) sRed[wg * Tr::kBlockM + row_base + 8 * rr] = row_sum[rr];
  __syncthreads();
  const bool bad = !it.len_ok || *s_bad_page != 0;  // read after the barriers: any thread may have set it
  const bool split = it.splits > 1;
  float scale[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int lrow = row_base + 8 * rr;
    const int row = m0 + lrow;
    const float total = sRed[lrow] + sRed[Tr::kBlockM + lrow];
    float lse;
    if (bad) {
      lse = NAN;
      scale[rr] = NAN;
    } else if (total > 0.f) {
      lse = row_max[rr] * kLn2 + logf(total);
      scale[rr] = kv_scale / total;
      if (p.attn_sink != nullptr && !split && row < rows) {  // split rows get the sink in combine
        scale[rr] /= 1.f + __expf(p.attn_sink[row % p.num_heads] - lse);
      }
    } else {
      lse = -INFINITY;  // nothing visible: out 0
      scale[rr] = 0.f;
    }
    if (wg == 0 && lane % 4 == 0 && row < rows) {
      const int64_t out_row = split ? int64_t{item} * rows + row : int64_t{it.b} * rows + row;
      (split ? ws.lse_accum : p.lse)[out_row] = lse;
    }
  }
  // The block's output goes through shared memory: each thread writes its
  // accumulator pairs into `staging` (row stride padded by 16 bytes, so the
  // eight rows of one store instruction fall in different banks), then the
  // CTA copies whole rows out with 16-byte loads and stores, consecutive
  // threads on consecutive bytes. Stored from the accumulator layout
  // directly, every warp store would touch eight rows (eight 16-byte
  // pieces). Element i
  // of tOrO is row row_base + 8 accumulator_row_half(i), column
  // wg * kOCols + accumulator_col(wg_tid, i) of the block.
  const int valid_rows = min(Tr::kBlockM, rows - m0);
  const int64_t block_row = (split ? int64_t{item} : int64_t{it.b}) * rows + m0;  // output row of block row 0
  auto stage_and_store = [&](T* out) {
    constexpr int kRowBytes = Tr::kDimNope * static_cast<int>(sizeof(T));
    constexpr int kStride = kRowBytes + 16;
    static_assert(Tr::kBlockM * kStride <= Tr::kStages * Tr::kTileBytes, "the block fits the KV stages");
    char* mine = staging + row_base * kStride + (wg * Tr::kOCols + accumulator_col(wg_tid, 0)) * sizeof(T);
#pragma unroll
    for (int i = 0; i < cute::size(tOrO); i += 2) {
      const int rr = accumulator_row_half(i);
      const float a = tOrO(i) * scale[rr], b = tOrO(i + 1) * scale[rr];
      char* at = mine + rr * 8 * kStride + (accumulator_col(wg_tid, i) - accumulator_col(wg_tid, 0)) * sizeof(T);
      *reinterpret_cast<uint32_t*>(at) = smxx::pack2<T>(a, b);
    }
    __syncthreads();
    constexpr int kChunks = kRowBytes / 16;
    char* dst = reinterpret_cast<char*>(out + block_row * Tr::kDimNope);
    for (int idx = tid; idx < valid_rows * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      *reinterpret_cast<uint4*>(dst + r * kRowBytes + c * 16) =
          *reinterpret_cast<const uint4*>(staging + r * kStride + c * 16);
    }
    // The next item's TMA loads (async proxy) overwrite these bytes after
    // the barrier that starts it: order this thread's reads before them.
    fence_smem_for_wgmma();
  };
  stage_and_store(split ? ws.partials<T>() : static_cast<T*>(p.out));
}

}  // namespace sm90
}  // namespace mla_jax
