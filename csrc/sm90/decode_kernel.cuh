// Kernel body of the Hopper (sm_90a) split-KV paged MLA decode, lock-step
// schedule: wgmma through CuTe with both operands in shared memory. Serves
// the caches TMA cannot load tile by tile (page sizes below 64, sparse
// indices); decode_seesaw.cuh serves the others (csrc/dispatch/select.cc
// chooses).
//
// Grid (row blocks of 64, num_parts) over the items of the on-device
// scheduler (csrc/smxx/scheduler.cu), like the portable kernel; per item
// the CTA loads its 64 query rows once, streams 64-token KV tiles through
// two stages (cp.async row gathers with page ids from the block table, so
// any page_size and scattered pages work; TMA boxes when kv_tma.h allows
// and a plan forced this schedule on such a cache), keeps the online
// softmax in registers and writes the final output or a normalised partial output + LSE for the
// combine kernel. Per tile t (see decode_traits.h for the split of work):
//   1. S(t) half (computed during the previous tile): mask, scale, row max;
//   2. exchange the row maxima through shared memory (one barrier);
//   3. P = exp2(S - max) to shared memory, rescale O, barrier;
//   4. issue O half += P(t) V(t) and S(t+1) = Q K(t+1)^T back to back
//      (wgmma, async); once PV(t) is done, tile t+2 starts loading into
//      tile t's stage while S(t+1) still runs.
#pragma once

#include "csrc/common/mla_params.h"
#include "csrc/smxx/pdl.cuh"
#include "csrc/smxx/api.h"
#include "csrc/smxx/kv_source.cuh"
#include "csrc/smxx/request.cuh"
#include "csrc/sm90/decode_common.cuh"
#include "csrc/sm90/decode_traits.h"
#include "csrc/sm90/kv_convert.cuh"
#include "csrc/sm90/kv_tma.h"

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

namespace mla_jax {
namespace sm90 {

using smxx::cp_async_16;
using smxx::kSchedBlockTokens;
using smxx::locate_token;
using smxx::pack2;
using smxx::TokenSource;
static_assert(kSchedBlockTokens == 64, "one KV tile per scheduler block");

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_kernel(const PagedDecodeParams p, const DecodeWorkspace ws, const __grid_constant__ KvTma tma) {
  // The combine kernel after this one may be dispatched now; it waits for
  // this grid to complete before reading anything (csrc/smxx/pdl.cuh).
  pdl_allow_dependents();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using T = typename Tr::QType;
  using Elem = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;

  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  char* sQ_bytes = smem + Tr::kSmemQ;
  char* sKv_bytes = smem + Tr::kSmemKv;
  // The small per-row / per-token arrays are addressed from smem_raw so the
  // compiler knows they are shared memory (LDS/STS, not generic accesses).
  const int smem_pad = static_cast<int>(smem - smem_raw);
  float* sRed = reinterpret_cast<float*>(smem_raw + smem_pad + Tr::kSmemRed);
  uint8_t* sValid = reinterpret_cast<uint8_t*>(smem_raw + smem_pad + Tr::kSmemValid);
  char* sP_shared = smem_raw + smem_pad + Tr::kSmemP;
  char* sKv_shared = smem_raw + smem_pad + Tr::kSmemKv;  // FP8 conversion: LDS/STS
  int* s_bad_page = reinterpret_cast<int*>(smem_raw + smem_pad + Tr::kSmemFlags);
  // TMA path: "stage full" barriers, one arrival per warpgroup plus the
  // bytes its copies bring (see issue_tile).
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem_raw + smem_pad + Tr::kSmemBarriers);
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  const bool use_tma = !Tr::kConvert && tma.enabled != 0;  // FP8 rows are gathered and converted

  const int tid = threadIdx.x;
  // Broadcast from lane 0, so that the compiler treats the warpgroup index
  // as warp-uniform (uniform registers for what derives from it).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), wg_tid = tid % 128;
  const int lane = tid % 32;
  const int copy_lane = tid % Tr::kThreadsPerRow;
  const int kv_copy_row = wg_tid / Tr::kThreadsPerRow;   // KV rows: per warpgroup

  // MMA operands. Q and P are A operands (K-major); K (rows = tokens of
  // this warpgroup's half) and V (this warpgroup's output columns) are B.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(sQ_bytes)), typename Tr::LayoutQK{});
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Tr::kSmemP)), typename Tr::LayoutP{});
  auto mma_s = make_tiled_mma(typename Tr::MmaS{});
  auto mma_o = make_tiled_mma(typename Tr::MmaO{});
  auto thr_s = mma_s.get_thread_slice(wg_tid);
  auto thr_o = mma_o.get_thread_slice(wg_tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tOrP = thr_o.partition_fragment_A(sP);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<Tr::kSCols>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<Tr::kOCols>>{});
  // (row, column) of every accumulator element this thread holds.
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<Tr::kSCols>>{}));
  // Accumulator rows of this thread: row_base + 8 * accumulator_row_half(i).
  const int row_base = accumulator_row_base(wg_tid);

  // Row blocks of one partition are adjacent in launch order: they stream
  // the same KV tiles at the same time and can share them through L2.
  const int part = blockIdx.y;
  const int m0 = blockIdx.x * kBlockM;
  const SoftmaxScale softmax = softmax_scale(p);
  const float kv_scale = softmax.kv_scale, scale_log2 = softmax.scale_log2;
  const char* ckv = static_cast<const char*>(p.ckv);
  const char* kpe = static_cast<const char*>(p.kpe);
  const bool sparse = p.indices != nullptr;
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < Tr::kStages; ++st) FullBarrier::init(&kv_full[st], Tr::kWarpgroups);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  // Launched as a programmatic dependent of the scheduler kernel, which
  // always runs before this kernel, this CTA may start before the schedule
  // is written: wait for it here, after the set-up that does not read it
  // (csrc/smxx/pdl.cuh).
  pdl_wait_for_previous();
  const int item_begin = ws.part_begin[part], item_end = ws.part_begin[part + 1];
  // Parity of the next completion of each stage's barrier (bit = stage);
  // every thread waits for every TMA tile once, in order.
  uint32_t full_phase = 0;
  auto wait_tile = [&](int t) {
    if (!use_tma) return;
    const int st = t % Tr::kStages;
    FullBarrier::wait(&kv_full[st], (full_phase >> st) & 1u);
    full_phase ^= 1u << st;
  };

  for (int item = item_begin; item < item_end; ++item) {
    const DecodeItem it = load_item<kBlockN>(p, ws, item);
    const int b = it.b;
    const int64_t tok_end = it.tok_end;
    const int tile_begin = it.tile_begin;
    const int num_tiles = it.num_tiles;
    const int32_t* table = sparse ? p.indices + static_cast<int64_t>(b) * p.topk
                                  : p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;

    // The previous item is done with every buffer (its last cp.async group,
    // the query's alone when it had no tiles, has landed too).
    cute::cp_async_wait<0>();
    __syncthreads();
    if (tid == 0) *s_bad_page = 0;
    __syncthreads();

    // Page and slot of each KV row this thread copies (see locate_token).
    // Block-table (dense) or index (sparse) entries of the KV rows this
    // thread copies, read one tile ahead of the copy that needs them. The
    // loads are unconditional and independent so their latencies overlap;
    // an entry past the request's end reads table[0] (the row has one: the
    // item has tokens) and is discarded by row_of(). Both warpgroups look
    // up the same rows (each copies its own features).
    auto kv_token = [&](int tile, int ps) { return tile * kBlockN + ps * Tr::kKvRowsPerPass + kv_copy_row; };
    auto fetch_pages = [&](int tile, int (&entry)[Tr::kKvPasses]) {
#pragma unroll
      for (int ps = 0; ps < Tr::kKvPasses; ++ps) {
        if (use_tma && ps > 0) break;  // one page per tile: thread 0's row says which
        const int tok = kv_token(tile, ps);
        int page, slot;
        smxx::div_page(p, tok, page, slot);
        const int at = tok < tok_end ? (sparse ? tok : page) : 0;
        entry[ps] = table[at];
      }
    };
    // Cache row (page * page_size + slot) of a KV row, or -1: nothing to
    // read (past the end, sparse padding, or a bad dense page id, which
    // also flags the request). The host selects this kernel only when
    // page_stride == page_size * token_stride (api.cu), so the row number
    // times the token stride addresses it.
    auto row_of = [&](int tile, int ps, int entry) -> int64_t {
      const int tok = kv_token(tile, ps);
      if (tok >= tok_end) return -1;
      if (sparse) return (entry >= 0 && int64_t{entry} < int64_t{p.num_pages} * p.page_size) ? entry : -1;
      if (entry < 0 || entry >= p.num_pages) {
        *s_bad_page = 1;
        return -1;
      }
      int page, slot;
      smxx::div_page(p, tok, page, slot);
      return int64_t{entry} * p.page_size + slot;
    };

    // This warpgroup's features of a KV tile into `stage` (see
    // decode_traits.h): four 16-byte chunks of its 256 V columns per row and
    // thread, and for warpgroup 1 a fifth one of the rope part. One code
    // path for both warpgroups: two copies of it would not fit the
    // registers left beside the accumulators.
    const int wg_first_chunk = wg * (Tr::kOCols / 8);
    auto issue_tile = [&](int tile, int stage, const int (&entry)[Tr::kKvPasses]) {
      char* dst_stage = sKv_bytes + stage * Tr::kTileBytes;
      if (use_tma) {
        // One thread per warpgroup: boxes of 64 rows x 64 features of this
        // warpgroup's feature blocks (four of ckv; warpgroup 1 also kpe).
        if (wg_tid == 0) {
          const int64_t first = row_of(tile, 0, entry[0]);  // wg_tid 0 copies the tile's first row
          uint64_t* bar = &kv_full[stage];
          if (first < 0) {
            FullBarrier::arrive(bar);  // bad page id: flagged by row_of, nothing to copy
          } else {
            constexpr uint32_t kBox = 64 * 64 * 2;
            const int row = static_cast<int>(first);
            const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
            FullBarrier::arrive_and_expect_tx(bar, (wg == 0 ? 4 : 5) * kBox);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int blk = wg * 4 + j;
              cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, bar, hint, dst_stage + blk * 8192, blk * 64, row);
            }
            if (wg == 1) cute::SM90_TMA_LOAD_2D::copy(&tma.kpe, bar, hint, dst_stage + 8 * 8192, 0, row);
          }
        }
        return;
      }
#pragma unroll
      for (int ps = 0; ps < Tr::kKvPasses; ++ps) {
        const int r = ps * Tr::kKvRowsPerPass + kv_copy_row;
        const int64_t cache_row = row_of(tile, ps, entry[ps]);
        const bool live = cache_row >= 0;
        if (wg == 0 && copy_lane == 0) sValid[stage * kBlockN + r] = live;
        const int64_t row = live ? cache_row : 0;
        if constexpr (Tr::kConvert) {
          // Raw bytes at the offsets of decode_traits.h, each warpgroup inside
          // its own region (so, as for native rows, it refills right after its
          // own P V): warpgroup 0 ckv bytes [0, 256) and the ds_mla scales,
          // warpgroup 1 ckv bytes [256, 512) and the kpe part.
          const char* ckv_src = ckv + row * p.ckv_token_stride + wg * 256;  // bytes
          char* dst = dst_stage + (wg == 0 ? Tr::kRawNopeLo : Tr::kRawNopeHi) + r * 256;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int c = copy_lane + j * Tr::kThreadsPerRow;
            cp_async_16(dst + c * 16, ckv_src + c * 16, live);
          }
          if (wg == 0) {
            if (Tr::kLoad == KvLoad::kDsMla && copy_lane == 0)
              cp_async_16(dst_stage + Tr::kRawScales + r * 16, ckv_src + kDsMlaScaleOffset, live);
          } else {
            const char* kpe_src = kpe + row * p.kpe_token_stride + copy_lane * 16;
            if constexpr (Tr::kRopeDirect) {
              cp_async_16(dst_stage + qk_chunk_offset(r, Tr::kNopeChunks + copy_lane), kpe_src, live);
            } else if (copy_lane * 16 < Tr::kRawRopeBytes) {
              cp_async_16(dst_stage + Tr::kRawRope + r * Tr::kRawRopeBytes + copy_lane * 16, kpe_src, live);
            }
          }
        } else {
          const char* ckv_src = ckv + (row * p.ckv_token_stride + (wg_first_chunk + copy_lane) * 8) * 2;
#pragma unroll
          for (int j = 0; j < Tr::kKvChunksWg0; ++j) {
            const int c = wg_first_chunk + copy_lane + j * Tr::kThreadsPerRow;
            cp_async_16(dst_stage + qk_chunk_offset(r, c), ckv_src + j * Tr::kThreadsPerRow * 16, live);
          }
          if (wg == 1) {
            const char* kpe_src = kpe + (row * p.kpe_token_stride + copy_lane * 8) * 2;
            cp_async_16(dst_stage + qk_chunk_offset(r, Tr::kNopeChunks + copy_lane), kpe_src, live);
          }
        }
      }
    };
    static_assert(Tr::kKvChunksWg1 == Tr::kKvChunksWg0 + 1, "warpgroup 1 copies one rope chunk more");

    load_query_rows<Tr>(p, sQ_bytes, b, m0, tid);  // committed with the first tile's copies

    int limit[2];  // visible length of this thread's two accumulator rows
    row_limits(p, it, m0, row_base, limit);

    clear(tOrO);
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};  // this warpgroup's share (its 32 tokens of each tile)

    // Operands of tile t: K half and V half of stage t % 2.
    auto k_operand = [&](int t) {
      Elem* kv = reinterpret_cast<Elem*>(sKv_bytes + (t % Tr::kStages) * Tr::kTileBytes);
      Tensor sK = make_tensor(make_smem_ptr(kv), typename Tr::LayoutQK{});
      return thr_s.partition_fragment_B(
          local_tile(sK, Shape<Int<Tr::kSCols>, Int<Tr::kDimQK>>{}, make_coord(wg, 0)));
    };
    auto v_operand = [&](int t) {
      Elem* kv = reinterpret_cast<Elem*>(sKv_bytes + (t % Tr::kStages) * Tr::kTileBytes);
      // Warpgroup 1's output columns start at feature 256: 4 column blocks of 8 KB.
      return thr_o.partition_fragment_B(
          make_tensor(make_smem_ptr(kv + wg * (Tr::kOCols / 64) * 4096), typename Tr::LayoutVHalf{}));
    };
    auto issue_s = [&](int t) {  // S = Q K^T over this warpgroup's 32 tokens of tile t (async)
      // tSrS was zeroed before the pipeline stage began (see step()).
      warpgroup_fence_operand(tSrS);
      warpgroup_arrive();
      gemm(mma_s, tSrQ, k_operand(t), tSrS);
    };

    // Prologue: query + tile 0, then tile 1, in flight; S of tile 0.
    int entries[Tr::kKvPasses];
    if (num_tiles > 0) {
      fetch_pages(tile_begin, entries);
      issue_tile(tile_begin, 0, entries);
    }
    cute::cp_async_fence();
    if (num_tiles > 1) {
      fetch_pages(tile_begin + 1, entries);
      issue_tile(tile_begin + 1, 1, entries);
    }
    cute::cp_async_fence();
    if (num_tiles > 2) fetch_pages(tile_begin + 2, entries);
    cute::cp_async_wait<1>();
    fence_smem_for_wgmma();
    __syncthreads();  // query and tile 0 landed
    // FP8: tile t is converted in step t - 1, before S(t) is issued; tile 0 here.
    auto convert_tile = [&](int stage) __attribute__((always_inline)) {
      RawTile<Tr> raw;
      load_raw<Tr>(sKv_shared + stage * Tr::kTileBytes, tid, raw);
      __syncthreads();  // every raw byte of the stage is read
      store_converted<Tr>(sKv_shared + stage * Tr::kTileBytes, tid, raw);
    };
    if constexpr (Tr::kConvert) {
      if (num_tiles > 0) {
        convert_tile(0);
        fence_smem_for_wgmma();
        __syncthreads();
      }
    }
    if (num_tiles > 0) {
      wait_tile(0);
      clear(tSrS);
      issue_s(0);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
    }

    // Per tile t (S(t) is done on entry): softmax(t) -> P(t); then PV(t) and
    // S(t+1) go to the tensor cores back to back, and tile t+2 is loaded
    // into tile t's stage as soon as PV(t) has finished reading it.
    // The last tile is peeled off (kHasNext false): a conditional S(t+1)
    // would make the compiler copy the in-flight accumulators at the merge
    // point, which serialises the wgmmas.
    auto step = [&](const int t, auto has_next) {
      constexpr bool kHasNext = decltype(has_next)::value;
      const int stage = t % Tr::kStages;

      // Mask, scale into the log2 domain, row maxima of this half.
      const int tok0 = (tile_begin + t) * kBlockN + wg * Tr::kSCols;
      const uint8_t* valid = sValid + stage * kBlockN + wg * Tr::kSCols;
      float tile_max[2] = {-INFINITY, -INFINITY};
      // Dense caches only lose tokens at the request's end (split ends are
      // tile boundaries) and past a row's causal limit; a bad page id
      // turns the whole output to NaN anyway. So a tile inside all of
      // these needs no per-token mask.
      const bool unmasked = !sparse && tok0 + Tr::kSCols <= min(limit[0], limit[1]);
      if (unmasked) {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const float s = tSrS(i) * scale_log2;
          tSrS(i) = s;
          tile_max[accumulator_row_half(i)] = fmaxf(tile_max[accumulator_row_half(i)], s);
        }
      } else {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int col = get<1>(tScS(i));
          const int rr = accumulator_row_half(i);
          // Dense: the limit says it all (sValid is not written on the TMA path).
          const bool visible = tok0 + col < limit[rr] && (!sparse || valid[col]);
          const float s = visible ? tSrS(i) * scale_log2 : -INFINITY;
          tSrS(i) = s;
          tile_max[rr] = fmaxf(tile_max[rr], s);
        }
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 1));
        tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 2));
        if (lane % 4 == 0) sRed[wg * kBlockM + row_base + 8 * rr] = tile_max[rr];
      }
      // FP8: tile t+1's raw bytes (the only group in flight) are read by
      // every thread after the barrier below.
      if constexpr (Tr::kConvert && kHasNext) cute::cp_async_wait<0>();
      __syncthreads();  // both halves' maxima are in sRed
      [[maybe_unused]] RawTile<Tr> raw;
      if constexpr (Tr::kConvert && kHasNext) load_raw<Tr>(sKv_shared + (stage ^ 1) * Tr::kTileBytes, tid, raw);

      // New running max, P, and the rescaled O (PV(t-1) has completed).
      float m_use[2], correction[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = row_base + 8 * rr;
        const float m = fmaxf(row_max[rr], fmaxf(sRed[row], sRed[kBlockM + row]));
        m_use[rr] = m == -INFINITY ? 0.f : m;  // fully masked so far: avoid inf - inf
        correction[rr] = fast_exp2(row_max[rr] - m_use[rr]);
        row_max[rr] = m;
        row_sum[rr] *= correction[rr];
      }
      // Elements 2k, 2k + 1 are adjacent columns: one 4-byte store per pair
      // (the swizzle moves 16-byte chunks, so a pair stays together).
#pragma unroll
      for (int i = 0; i < size(tSrS); i += 2) {
        const int row = get<0>(tScS(i)), col = get<1>(tScS(i));
        const int rr = accumulator_row_half(i);
        const float e0 = fast_exp2(tSrS(i) - m_use[rr]);
        const float e1 = fast_exp2(tSrS(i + 1) - m_use[rr]);
        row_sum[rr] += e0 + e1;
        // &sP(row, c) (LayoutP is LayoutQK's first 64 columns; layout_check.cu),
        // addressed from smem_raw so the store is an STS.
        const int c = wg * Tr::kSCols + col;
        *reinterpret_cast<uint32_t*>(sP_shared + qk_chunk_offset(row, c >> 3) + (c & 7) * 2) = pack2<T>(e0, e1);
      }
      // Once the running maxima settle, most tiles change none of a warp's
      // rows: skip the 128 multiplies then (the accumulator rows are the
      // warp's own, so the vote is per warp).
      if (__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= correction[accumulator_row_half(i)];
      }
      if constexpr (kHasNext) clear(tSrS);  // S(t+1) accumulates from zero
      // TMA loads whole 64-row tiles: rows at or past tok_end (the request's
      // last tile) hold whatever the cache has there, and 0 x NaN is NaN in
      // P V. Both S(t) halves are done (the barrier above), so each
      // warpgroup zeroes those rows of the V half it multiplies; the fence
      // and barrier below publish it. (cp.async zero-fills them itself.)
      if (use_tma) {
        const int valid = static_cast<int>(tok_end - int64_t{tile_begin + t} * kBlockN);
        char* dst = sKv_bytes + stage * Tr::kTileBytes;
        constexpr int kHalfChunks = Tr::kOCols / 8;
        for (int idx = wg_tid; idx < (kBlockN - max(valid, 0)) * kHalfChunks; idx += 128) {
          const int row = valid + idx / kHalfChunks, chunk = wg * kHalfChunks + idx % kHalfChunks;
          *reinterpret_cast<uint4*>(dst + qk_chunk_offset(row, chunk)) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      if constexpr (Tr::kConvert && kHasNext) {
        // FP8: P V(t) starts as soon as P(t) is complete, and tile t+1 is
        // converted into the other stage while it runs. That stage's last
        // readers (S(t-1), P V(t-1)) are done, and after this barrier so are
        // all reads of its raw bytes; S(t+1) follows the next barrier.
        fence_smem_for_wgmma();
        __syncthreads();  // P(t) complete, raw bytes of tile t+1 read; sRed free again
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
        gemm(mma_o, tOrP, v_operand(t), tOrO);
        warpgroup_commit_batch();
        store_converted<Tr>(sKv_shared + (stage ^ 1) * Tr::kTileBytes, tid, raw);
        fence_smem_for_wgmma();
        __syncthreads();  // tile t+1 converted
        issue_s(t + 1);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // this warpgroup's PV(t) done
      } else {
        cute::cp_async_wait<0>();  // tile t+1 (the only group in flight)
        fence_smem_for_wgmma();
        if constexpr (kHasNext) wait_tile(t + 1);
        __syncthreads();  // P(t) complete, tile t+1 visible; sRed free again

        // O += P V over this warpgroup's 256 output columns, then S(t+1).
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
        gemm(mma_o, tOrP, v_operand(t), tOrO);
        warpgroup_commit_batch();
        if constexpr (kHasNext) {
          issue_s(t + 1);
          warpgroup_commit_batch();
          warpgroup_wait<1>();  // this warpgroup's PV(t) done
        } else {
          warpgroup_wait<0>();
        }
      }
      warpgroup_fence_operand(tOrO);
      if constexpr (kHasNext) {
        // The features of tile t's stage that this warpgroup refills were
        // read only by its own PV(t) (done) and by S(t) of both warpgroups
        // (done before softmax(t)); P(t) is not rewritten before the next
        // step's first barrier. So no barrier here: the copies start while
        // the tensor cores still run S(t+1) and the other warpgroup's PV(t).
        if (t + 2 < num_tiles) issue_tile(tile_begin + t + 2, stage, entries);
        cute::cp_async_fence();
        if (t + 3 < num_tiles) fetch_pages(tile_begin + t + 3, entries);
        warpgroup_wait<0>();  // S(t+1) done
        warpgroup_fence_operand(tSrS);
      }
    };
    for (int t = 0; t + 1 < num_tiles; ++t) step(t, std::true_type{});
    if (num_tiles > 0) step(num_tiles - 1, std::false_type{});

    write_item_output<Tr, T>(p, ws, it, item, m0, row_sum, row_max, kv_scale, s_bad_page, sRed, smem_raw + smem_pad + Tr::kSmemKv, tOrO);
  }
#endif  // sm_90a
}

}  // namespace sm90
}  // namespace mla_jax
