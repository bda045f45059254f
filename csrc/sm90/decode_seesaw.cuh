// Kernel body of the Hopper (sm_90a) decode for TMA-loadable caches (dense,
// page_size a multiple of 64; csrc/sm90/kv_tma.h): the two warpgroups take
// turns instead of working in lock-step. Included by decode_launch.cuh.
//
// Tiles go in pairs (a, b) = (2k, 2k + 1). Warpgroup 0 computes S over the
// whole of tile a, warpgroup 1 over tile b (m64n64k16, 36 k-steps each);
// output columns stay split ([0, 256) in warpgroup 0, [256, 512) in 1), so
// each warpgroup multiplies both tiles' P by its half of V. The running
// max m passes from one to the other:
//   m_a = max(m, rowmax S_a)    (warpgroup 0; P_a = 2^(S_a - m_a))
//   m_b = max(m_a, rowmax S_b)  (warpgroup 1; P_b = 2^(S_b - m_b))
//   O_half = (O_half 2^(m - m_a) + P_a V_a,half) 2^(m_a - m_b) + P_b V_b,half
// so while one warpgroup does its softmax the tensor cores run the other's
// matrix products. P_x goes to the rope block of tile x's stage (only S_x
// reads the rope features, and S_x is done by then), which keeps shared
// memory at Q + two KV stages. The FlashMLA write-up calls this schedule
// "seesaw"; the code here is ours.
//
// Hand-offs (named barriers, warpgroup 0 arrives, warpgroup 1 waits, or the
// reverse):
//   A (0 -> 1): m_a and P_a are in shared memory;
//   B (1 -> 0): m_b and P_b are in shared memory;
//   C (0 -> 1): warpgroup 0's P_a V_a is done: stage a may be refilled;
//   D (0 -> 1): warpgroup 0's P_b V_b (previous pair) is done: stage b may be refilled.
// Each warpgroup refills the features it reads (decode_traits.h), so a
// stage is refilled in two halves, each as soon as its reader is done; the
// rope half (which holds P) waits for both.
#pragma once

#include "csrc/sm90/decode_kernel.cuh"

namespace mla_jax {
namespace sm90 {

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_seesaw_kernel(const PagedDecodeParams p, const DecodeWorkspace ws, const __grid_constant__ KvTma tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using T = typename Tr::QType;
  using Elem = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  constexpr int kRopeBlock = 8 * 8192;  // byte offset of a stage's rope block (P after S)
  // Named barrier ids (cutlass offsets them past its reserved ones).
  constexpr uint32_t kBarA = 0, kBarB = 1, kBarC = 2, kBarD = 3, kBarWg0 = 4, kBarWg1 = 5;
  using cutlass::arch::NamedBarrier;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  char* sQ_bytes = smem + Tr::kSmemQ;
  char* sKv_bytes = smem + Tr::kSmemKv;
  const int smem_pad = static_cast<int>(smem - smem_raw);
  char* sKv_shared = smem_raw + smem_pad + Tr::kSmemKv;  // same bytes; the compiler knows it is shared
  float* sRed = reinterpret_cast<float*>(smem_raw + smem_pad + Tr::kSmemRed);  // [2][64]: m_a, m_b; then sums
  int* s_bad_page = reinterpret_cast<int*>(smem_raw + smem_pad + Tr::kSmemFlags);
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem_raw + smem_pad + Tr::kSmemBarriers);

  const int tid = threadIdx.x;
  const int wg = tid / 128, wg_tid = tid % 128;
  const int lane = tid % 32;
  const int copy_lane = tid % Tr::kThreadsPerRow;
  const int q_copy_row = tid / Tr::kThreadsPerRow;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(sQ_bytes)), typename Tr::LayoutQK{});
  auto mma_s = make_tiled_mma(typename Tr::MmaSTile{});
  auto mma_o = make_tiled_mma(typename Tr::MmaO{});
  auto thr_s = mma_s.get_thread_slice(wg_tid);
  auto thr_o = mma_o.get_thread_slice(wg_tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<Tr::kOCols>>{});
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<Tr::kOCols>>{}));
  // Accumulator rows of this thread: row_base + 8 * rr, rr = (i / 2) % 2
  // (csrc/sm90/layout_check.cu checks this for both MMA shapes).
  const int row_base = (wg_tid / 32) * 16 + lane / 4;
  auto half_of = [](int i) { return (i >> 1) & 1; };

  const int part = blockIdx.y;
  const int m0 = blockIdx.x * kBlockM;
  const int rows = p.rows_per_request();
  const float kv_scale = p.kv_scale ? *p.kv_scale : 1.0f;
  const float scale_log2 = p.sm_scale * kv_scale * kLog2e;
  const int item_begin = ws.part_begin[part], item_end = ws.part_begin[part + 1];
  const char* q_nope = static_cast<const char*>(p.q_nope);
  const char* q_pe = static_cast<const char*>(p.q_pe);

  // One barrier per 64-feature block of each stage (one arrival: the
  // issuing thread, plus the box's bytes), so S can start on the first
  // block of a tile while the others are still arriving: with every SM
  // streaming, a whole 72 KB tile takes microseconds to land.
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < Tr::kStages * Tr::kKvBlocks; ++i) FullBarrier::init(&kv_full[i], 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  uint32_t full_phase = 0;  // parity of each stage's next completion (bit = stage)
  auto wait_block = [&](int t, int blk) {
    const int st = t % Tr::kStages;
    FullBarrier::wait(&kv_full[st * Tr::kKvBlocks + blk], (full_phase >> st) & 1u);
  };
  auto tile_consumed = [&](int t) { full_phase ^= 1u << (t % Tr::kStages); };
  // (exp2 correction factor, max to subtract) for a running max moving from
  // m_old to m_new; a row with nothing visible yet keeps m = -inf.
  auto correction = [](float m_old, float m_new) { return m_new == -INFINITY ? 1.f : fast_exp2(m_old - m_new); };
  auto usable = [](float m) { return m == -INFINITY ? 0.f : m; };
  auto rescale_o = [&](const float (&c)[2]) {
    // Per warp: its accumulator rows are its own.
    if (__any_sync(0xffffffffu, c[0] != 1.f || c[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= c[half_of(i)];
    }
  };

  for (int item = item_begin; item < item_end; ++item) {
    const int b = ws.items[4 * item];
    const int block_begin = ws.items[4 * item + 1], block_end = ws.items[4 * item + 2];
    const int splits = ws.request_meta[2 * b + 1];
    const sm80::RequestSpan span = sm80::request_span(p, ws, b);
    const int64_t seq_len = span.len;
    const bool len_ok = span.valid;
    const int64_t tok_end = min(seq_len, int64_t{block_end} * kSchedBlockTokens);
    const int tile_begin = block_begin;
    const int num_tiles = len_ok ? static_cast<int>((tok_end + kBlockN - 1) / kBlockN) - tile_begin : 0;
    const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;

    cute::cp_async_wait<0>();
    __syncthreads();  // the previous item is done with every buffer
    if (tid == 0) *s_bad_page = 0;
    __syncthreads();

    // Block-table entry of tile `tile` (its first token's page), or of
    // entry 0 past the end (the row has one: the item has tokens).
    auto fetch_entry = [&](int tile) {
      const int tok = tile * kBlockN;
      int page, slot;
      sm80::div_page(p, tok, page, slot);
      return table[tok < tok_end ? page : 0];
    };
    // This warpgroup's boxes of tile `tile` into its stage (warpgroup 0:
    // ckv features [0, 256); warpgroup 1: [256, 512) and the rope block).
    auto issue_tile = [&](int tile, int entry) {
      if (wg_tid != 0) return;
      uint64_t* bar = &kv_full[(tile % Tr::kStages) * Tr::kKvBlocks];
      char* dst = sKv_bytes + (tile % Tr::kStages) * Tr::kTileBytes;
      const int tok = (tile_begin + tile) * kBlockN;
      const int first = wg * 4, count = wg == 0 ? 4 : 5;  // blocks of this warpgroup (8: kpe)
      if (entry < 0 || entry >= p.num_pages) {
        *s_bad_page = 1;  // the request's output becomes NaN
        for (int j = 0; j < count; ++j) FullBarrier::arrive(&bar[first + j]);
        return;
      }
      int page, slot;
      sm80::div_page(p, tok, page, slot);
      const int row = entry * p.page_size + slot;
      constexpr uint32_t kBox = 64 * 64 * 2;
      const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int blk = first + j;
        FullBarrier::arrive_and_expect_tx(&bar[blk], kBox);
        cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, &bar[blk], hint, dst + blk * 8192, blk * 64, row);
      }
      if (wg == 1) {
        FullBarrier::arrive_and_expect_tx(&bar[8], kBox);
        cute::SM90_TMA_LOAD_2D::copy(&tma.kpe, &bar[8], hint, dst + kRopeBlock, 0, row);
      }
    };
    // Tiles are refilled in order by each warpgroup; the entry of the next
    // one is read one refill ahead.
    int next_entry = 0;
    auto refill = [&](int tile) {  // tile < num_tiles
      issue_tile(tile, next_entry);
      if (wg_tid == 0 && tile + 1 < num_tiles) next_entry = fetch_entry(tile_begin + tile + 1);
    };

    // Query rows of this row block (zero past the request's rows).
    for (int r = q_copy_row; r < kBlockM; r += Tr::kRowsPerPass) {
      const bool live = m0 + r < rows;
      const int64_t grow = int64_t{b} * rows + (live ? m0 + r : 0);
      const char* qn = q_nope + grow * p.q_nope_row_stride * 2;
      const char* qp = q_pe + grow * p.q_pe_row_stride * 2;
#pragma unroll
      for (int j = 0; j < Tr::kChunksPerThread; ++j) {
        const int c = copy_lane + j * Tr::kThreadsPerRow;
        const char* src = c < Tr::kNopeChunks ? qn + c * 16 : qp + (c - Tr::kNopeChunks) * 16;
        cp_async_16(sQ_bytes + qk_chunk_offset(r, c), src, live);
      }
    }
    cute::cp_async_fence();

    int limit[2];  // visible length of this thread's two rows (<= tok_end)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = m0 + row_base + 8 * rr;
      const int qi = row < rows ? row / p.num_heads : 0;
      limit[rr] = row < rows ? static_cast<int>(min(visible_len(seq_len, p.q_len, qi, p.causal), tok_end)) : 0;
    }
    clear(tOrO);
    float m_run[2] = {-INFINITY, -INFINITY};  // running max (log2 domain), the same in both warpgroups
    float l_own[2] = {0.f, 0.f};  // sum of this warpgroup's P (its own tiles), relative to m_run

    auto stage_ptr = [&](int t) { return sKv_bytes + (t % Tr::kStages) * Tr::kTileBytes; };
    auto issue_s = [&](int t) {  // S = Q K(t)^T over the whole tile (async), block by block as it lands
      Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(stage_ptr(t))), typename Tr::LayoutQK{});
      Tensor tSrK = thr_s.partition_fragment_B(sK);
      warpgroup_fence_operand(tSrS);
      // The first k-step overwrites the accumulator (no clear: writing it
      // with ordinary instructions while other wgmmas are in flight makes
      // ptxas serialise them all).
      mma_s.accumulate_ = GMMA::ScaleOut::Zero;
      static_assert(decltype(size<2>(tSrQ))::value == 4 * Tr::kKvBlocks, "4 k-steps per 64-feature block");
#pragma unroll
      for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
        if (kb % 4 == 0) {
          wait_block(t, kb / 4);
          warpgroup_arrive();  // explicit, after the wait: one ptxas would insert there serialises
        }
        gemm(mma_s, tSrQ(_, _, kb), tSrK(_, _, kb), tSrS);
        mma_s.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      tile_consumed(t);
    };
    auto issue_pv = [&](int t) {  // O half += P(t) V(t) half (async)
      char* st = stage_ptr(t);
      Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(st + kRopeBlock)), typename Tr::LayoutP{});
      Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(st + wg * (Tr::kOCols / 64) * 8192)),
                              typename Tr::LayoutVHalf{});
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      gemm(mma_o, thr_o.partition_fragment_A(sP), thr_o.partition_fragment_B(sV), tOrO);
      warpgroup_commit_batch();
    };
    // Row maxima of this tile's scaled, masked S (quad-reduced). S is only
    // read: writing the accumulator while the other product is in flight
    // would make ptxas serialise the wgmmas (write_p scales it again).
    auto visible_all = [&](int t) { return (tile_begin + t) * kBlockN + kBlockN <= min(limit[0], limit[1]); };
    auto tile_rowmax = [&](int t, float (&tile_max)[2]) {
      warpgroup_fence_operand(tSrS);
      const int tok0 = (tile_begin + t) * kBlockN;
      tile_max[0] = tile_max[1] = -INFINITY;
      if (visible_all(t)) {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) tile_max[half_of(i)] = fmaxf(tile_max[half_of(i)], tSrS(i) * scale_log2);
      } else {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int rr = half_of(i);
          if (tok0 + get<1>(tScS(i)) < limit[rr]) tile_max[rr] = fmaxf(tile_max[rr], tSrS(i) * scale_log2);
        }
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 1));
        tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 2));
      }
    };
    // P(t) = 2^(S scale - m) (0 where masked) into tile t's rope block;
    // returns this thread's row sums.
    auto write_p = [&](int t, const float (&m)[2], float (&sum)[2]) {
      char* dst = sKv_shared + (t % Tr::kStages) * Tr::kTileBytes + kRopeBlock;
      const int tok0 = (tile_begin + t) * kBlockN;
      const bool all = visible_all(t);
      const float neg_m[2] = {-usable(m[0]), -usable(m[1])};
      sum[0] = sum[1] = 0.f;
#pragma unroll
      for (int i = 0; i < size(tSrS); i += 2) {
        const int row = get<0>(tScS(i)), col = get<1>(tScS(i));
        const int rr = half_of(i);
        float e0 = fast_exp2(fmaf(tSrS(i), scale_log2, neg_m[rr]));
        float e1 = fast_exp2(fmaf(tSrS(i + 1), scale_log2, neg_m[rr]));
        if (!all) {
          e0 = tok0 + col < limit[rr] ? e0 : 0.f;
          e1 = tok0 + col + 1 < limit[rr] ? e1 : 0.f;
        }
        sum[rr] += e0 + e1;
        *reinterpret_cast<uint32_t*>(dst + qk_chunk_offset(row, col >> 3) + (col & 7) * 2) = pack2<T>(e0, e1);
      }
      fence_smem_for_wgmma();  // P is read by wgmma (async proxy)
    };
    auto publish_max = [&](const float (&m)[2], int slot) {
      if (lane % 4 == 0) {
        sRed[slot * kBlockM + row_base] = m[0];
        sRed[slot * kBlockM + row_base + 8] = m[1];
      }
    };
    auto read_max = [&](float (&m)[2], int slot) {
      m[0] = sRed[slot * kBlockM + row_base];
      m[1] = sRed[slot * kBlockM + row_base + 8];
    };

    // Prologue: tiles 0 and 1 (each warpgroup its boxes), the query, S(0).
    if (num_tiles > 0) {
      if (wg_tid == 0) next_entry = fetch_entry(tile_begin);
      refill(0);
      if (num_tiles > 1) refill(1);
    }
    cute::cp_async_wait<0>();
    fence_smem_for_wgmma();
    __syncthreads();  // the query landed
    if (wg == 0 && num_tiles > 0) {
      issue_s(0);
      warpgroup_wait<0>();
    }

    // One pair of tiles. Every wgmma a pair issues is unconditional inside
    // its instantiation (kHasB: tile b exists; kNext: a next pair exists):
    // a wgmma issued on one path only makes ptxas serialise all of them.
    auto pair = [&](const int k, auto has_b_const, auto next_const) __attribute__((always_inline)) {
      constexpr bool kHasB = decltype(has_b_const)::value;
      constexpr bool kNext = decltype(next_const)::value;
      const int ta = 2 * k, tb = 2 * k + 1;
      const bool refill_b = kHasB && k > 0;  // stage b held tile tb - 2
      float m_a[2], m_b[2], tmax[2], sum[2], c[2];
      if (wg == 0) {
        if (refill_b) {
          warpgroup_wait<1>();  // P(tb - 2) V done (S(ta) may still run)
          warpgroup_fence_operand(tOrO);
          refill(tb);
          NamedBarrier::arrive(256, kBarD);
        }
        warpgroup_wait<0>();  // S(ta)
        tile_rowmax(ta, tmax);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          m_a[rr] = fmaxf(m_run[rr], tmax[rr]);
          c[rr] = correction(m_run[rr], m_a[rr]);
        }
        write_p(ta, m_a, sum);
        publish_max(m_a, 0);
        NamedBarrier::arrive(256, kBarA);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) l_own[rr] = l_own[rr] * c[rr] + sum[rr];
        warpgroup_fence_operand(tOrO);
        rescale_o(c);
        NamedBarrier::sync(128, kBarWg0);  // all of P(ta) written
        issue_pv(ta);
        if constexpr (kHasB) {
          NamedBarrier::sync(256, kBarB);
          read_max(m_b, 1);
        } else {
          m_b[0] = m_a[0];
          m_b[1] = m_a[1];
        }
        warpgroup_wait<0>();  // P(ta) V done: stage a's low features are free
        warpgroup_fence_operand(tOrO);
        if constexpr (kNext) {
          refill(ta + 2);
          NamedBarrier::arrive(256, kBarC);
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          c[rr] = correction(m_a[rr], m_b[rr]);
          l_own[rr] *= c[rr];
          m_run[rr] = m_b[rr];
        }
        if constexpr (kHasB) {
          rescale_o(c);
          issue_pv(tb);
        }
        if constexpr (kNext) {
          issue_s(ta + 2);
        }
      } else {
        warpgroup_wait<0>();  // P(tb - 2) V done
        warpgroup_fence_operand(tOrO);
        if (refill_b) {
          NamedBarrier::sync(256, kBarD);  // warpgroup 0's P(tb - 2) V done too
          refill(tb);
        }
        if constexpr (kHasB) {
          issue_s(tb);
        }
        NamedBarrier::sync(256, kBarA);
        read_max(m_a, 0);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) c[rr] = correction(m_run[rr], m_a[rr]);
        rescale_o(c);
        issue_pv(ta);
        if constexpr (kHasB) {
          warpgroup_wait<1>();  // S(tb)
          tile_rowmax(tb, tmax);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) m_b[rr] = fmaxf(m_a[rr], tmax[rr]);
          write_p(tb, m_b, sum);
          publish_max(m_b, 1);
          NamedBarrier::arrive(256, kBarB);
        } else {
          m_b[0] = m_a[0];
          m_b[1] = m_a[1];
          sum[0] = sum[1] = 0.f;
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          l_own[rr] = l_own[rr] * correction(m_run[rr], m_b[rr]) + sum[rr];
          c[rr] = correction(m_a[rr], m_b[rr]);
          m_run[rr] = m_b[rr];
        }
        warpgroup_wait<0>();  // P(ta) V done: stage a's high features are free
        warpgroup_fence_operand(tOrO);
        if constexpr (kNext) {
          NamedBarrier::sync(256, kBarC);  // and warpgroup 0's: P(ta) in the rope block is free
          refill(ta + 2);
        }
        if constexpr (kHasB) {
          rescale_o(c);
          NamedBarrier::sync(128, kBarWg1);  // all of P(tb) written
          issue_pv(tb);
        }
      }
    };
    const int num_pairs = (num_tiles + 1) / 2;
    for (int k = 0; k + 1 < num_pairs; ++k) pair(k, std::true_type{}, std::true_type{});
    if (num_pairs > 0) {
      if (num_tiles % 2 == 0) {
        pair(num_pairs - 1, std::true_type{}, std::false_type{});
      } else {
        pair(num_pairs - 1, std::false_type{}, std::false_type{});
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);

    // Epilogue: both warpgroups' sums are relative to the same m_run.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      l_own[rr] += __shfl_xor_sync(0xffffffffu, l_own[rr], 1);
      l_own[rr] += __shfl_xor_sync(0xffffffffu, l_own[rr], 2);
    }
    __syncthreads();  // the last reads of the maxima in sRed are done
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
      if (lane % 4 == 0) sRed[wg * kBlockM + row_base + 8 * rr] = l_own[rr];
    __syncthreads();
    const bool bad = !len_ok || *s_bad_page != 0;
    const bool split = splits > 1;
    float scale[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int lrow = row_base + 8 * rr;
      const int row = m0 + lrow;
      const float total = sRed[lrow] + sRed[kBlockM + lrow];
      float lse;
      if (bad) {
        lse = NAN;
        scale[rr] = NAN;
      } else if (total > 0.f) {
        lse = m_run[rr] * kLn2 + logf(total);
        scale[rr] = kv_scale / total;
        if (p.attn_sink != nullptr && !split && row < rows) {  // split rows get the sink in combine
          scale[rr] /= 1.f + __expf(p.attn_sink[row % p.num_heads] - lse);
        }
      } else {
        lse = -INFINITY;  // nothing visible: out 0
        scale[rr] = 0.f;
      }
      if (wg == 0 && lane % 4 == 0 && row < rows) {
        const int64_t out_row = split ? int64_t{item} * rows + row : int64_t{b} * rows + row;
        (split ? ws.lse_accum : p.lse)[out_row] = lse;
      }
    }
#pragma unroll
    for (int i = 0; i < size(tOrO); i += 2) {
      const int row = m0 + get<0>(tOcO(i));
      if (row >= rows) continue;
      const int col = wg * Tr::kOCols + get<1>(tOcO(i));
      const float sc = scale[half_of(i)];
      if (split) {
        float* dst = ws.out_accum + (int64_t{item} * rows + row) * Tr::kDimNope + col;
        *reinterpret_cast<float2*>(dst) = make_float2(tOrO(i) * sc, tOrO(i + 1) * sc);
      } else {
        T* dst = static_cast<T*>(p.out) + (int64_t{b} * rows + row) * Tr::kDimNope + col;
        *reinterpret_cast<uint32_t*>(dst) = pack2<T>(tOrO(i) * sc, tOrO(i + 1) * sc);
      }
    }
  }
#endif  // sm_90a
}

}  // namespace sm90
}  // namespace mla_jax
