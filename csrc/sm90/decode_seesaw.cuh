// Kernel body of the Hopper (sm_90a) decode for TMA-loadable caches (dense,
// page_size a multiple of 64; csrc/sm90/kv_tma.h) and for the fp8_ds_mla
// rows of sparse decode (gathered by index): the two warpgroups take turns
// instead of working in lock-step. Included by decode_launch.cuh.
//
// Tiles go in pairs (a, b) = (2k, 2k + 1); tile a always lives in stage 0,
// tile b in stage 1. Warpgroup 0 computes S over the whole of tile a,
// warpgroup 1 over tile b (m64n64k16, 36 k-steps each); output columns
// stay split ([0, 256) in warpgroup 0, [256, 512) in 1), so each
// warpgroup multiplies both tiles' P by its half of V: its own tile's P
// straight from registers, the other's from shared memory. With m the
// running max before the pair (log2 domain):
//   m_a = max(m, rowmax S_a),  P_a = 2^(S_a - m_a)           (warpgroup 0)
//   m_b = max(m_a, rowmax S_b), P_b = 2^(S_b - m_b)          (warpgroup 1)
//   O_L = (O_L 2^(m - m_a) + P_a V_aL) 2^(m_a - m_b) + P_b V_bL
//   O_R = O_R 2^(m - m_b) + P_b V_bR + (P_a 2^(m_a - m_b)) V_aR
// Warpgroup 0 rescales its P_a once m_b is known and hands that to
// warpgroup 1, which therefore never rescales O between its two products.
// While one warpgroup does its softmax the tensor cores run the other's
// products. The FlashMLA write-up calls this schedule "seesaw"; the code
// and the buffer plan here are ours.
//
// Shared memory: Q, two KV stages, one P buffer (P_b). P_a goes to stage
// 0's rope block, which only S_a reads. Each 64-feature block of a stage
// is refilled by the warpgroup that reads it last, right after that read:
//   stage 0 blocks 0-3 (V_aL): warpgroup 0, after P_a V_aL;
//   stage 0 blocks 4-8 (V_aR, rope = P_a): warpgroup 1, after P_a V_aR;
//   stage 1 blocks 4-8 (V_bR, rope):       warpgroup 1, after P_b V_bR;
//   stage 1 blocks 0-3 (V_bL):             warpgroup 0, after P_b V_bL;
// and S of the next tile reads its blocks in the order they were freed
// (tile a: 0-8; tile b: 4-8, then 0-3), each as soon as its TMA lands.
// Every whole pair runs one copy of the pair's code (short items stall
// much on instruction fetch of code run once per item: docs/perf.md), so
// it issues that S even where the next tile does not exist: the refilling
// warpgroup then completes the blocks' barriers without a load
// (complete_boxes; gathers zero-fill the tile), and the S is discarded.
//
// Hand-offs (named barriers; one warpgroup arrives, the other waits):
//   MaxA (0 -> 1): m_a is in shared memory;   MaxB (1 -> 0): m_b;
//   Pa (0 -> 1): P_a (rescaled) is in stage 0's rope block;
//   Pb (1 -> 0): P_b is in the P buffer.
// Every wgmma a warpgroup issues in a pair is waited for inside the pair.
//
// Dense e4m3 rows (Tr::kConvert): a refill lands a half's raw bytes (ckv
// [0, 256) for blocks 0-3; ckv [256, 512) and kpe for blocks 4-8) on the
// half's first block barrier, and the warpgroup that computes S over the
// stage converts the half in place right before its k-steps
// (kv_convert.cuh, convert_seesaw_half). The other warpgroup reads the
// stage's V only after a hand-off that follows that S, so it finds the
// converted tile.
//
// fp8_ds_mla rows (kGather, sparse decode with a bf16 query): the same
// halves, owners and barriers, but a refill is a cp.async gather by the
// whole refilling warpgroup (every lane looked up the tile's rows at the
// start of the pair), each thread arriving on the half's barrier once its
// copies land (kv_convert.cuh, gather_seesaw_half_ds); the converting
// warpgroup applies each row's group scales (convert_seesaw_half_ds).
// Padding, out-of-range entries and positions past the end are zero-filled
// and masked out of the softmax by the rows looked up (tile_mask).
#pragma once

#include <cooperative_groups.h>

#include "csrc/smxx/combine_tasks.cuh"
#include "csrc/smxx/phase_probe.cuh"
#include "csrc/smxx/schedule_block.cuh"
#include "csrc/sm90/decode_kernel.cuh"
#include "csrc/sm90/kv_convert.cuh"

namespace mla_jax {
namespace sm90 {

// kBlockSchedule: the CTA computes the block-level schedule itself
// (SplitSchedule::schedule_in_decode). A separate instantiation, so the
// kernel of the other modes carries none of that code (inlined behind a
// run-time flag, it slowed every shape's kernel). kFusedCombine
// (SplitSchedule::fused_combine, with the inline schedule): launched
// cooperatively, the kernel waits for its whole grid after its items and
// merges the split requests itself, as the combine kernel of the call's
// grid would (csrc/smxx/combine_tasks.cuh); also its own instantiation.
template <typename Tr, bool kBlockSchedule, bool kFusedCombine = false>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_seesaw_kernel(const PagedDecodeParams p, const DecodeWorkspace ws, const SplitSchedule schedule,
                         const __grid_constant__ KvTma tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Marks (diagnostic builds, csrc/smxx/phase_probe.cuh): 1 inline schedule
  // published (or barriers set up), 7 block schedule done, 3 the first
  // item's query landed, 5 its tiles done, 6 its output written.
  MLA_JAX_PHASE_BEGIN();
  using namespace cute;
  using T = typename Tr::QType;
  using Elem = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr int kRopeBlock = 8 * 8192;  // byte offset of a stage's rope block (P_a in stage 0)
  // Named barrier ids (cutlass offsets them past its reserved ones); the
  // last two are warpgroup-local (128 threads).
  constexpr uint32_t kBarMaxA = 0, kBarMaxB = 1, kBarPa = 2, kBarPb = 3, kBarTail0 = 4, kBarTail1 = 5;
  constexpr uint32_t kBarConv0 = 6, kBarConv1 = 7;  // warpgroup-local, FP8 conversion (kConvert)
  static_assert(kBarConv1 < 8, "16 hardware barriers, the first 8 reserved by cutlass");
  // fp8_ds_mla rows (sparse decode, bf16 query): gathered by index with
  // cp.async instead of TMA boxes (see the header).
  constexpr bool kGather = Tr::kLoad == KvLoad::kDsMla;
  static_assert(!Tr::kConvert || Tr::kLoad == KvLoad::kFp8 || (kGather && Tr::kRopeDirect),
                "the seesaw kernel converts dense e4m3 rows and fp8_ds_mla rows with a bf16 query only");
  using cutlass::arch::NamedBarrier;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  char* sQ_bytes = smem + Tr::kSmemQ;
  char* sKv_bytes = smem + Tr::kSmemKv;
  const int smem_pad = static_cast<int>(smem - smem_raw);
  // The same bytes addressed from smem_raw: the compiler knows they are shared.
  char* sKv_shared = smem_raw + smem_pad + Tr::kSmemKv;
  char* sPb_shared = smem_raw + smem_pad + Tr::kSmemP;
  float* sRed = reinterpret_cast<float*>(smem_raw + smem_pad + Tr::kSmemRed);  // [2][64]: m_a, m_b; then sums
  int* s_bad_page = reinterpret_cast<int*>(smem_raw + smem_pad + Tr::kSmemFlags);
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem_raw + smem_pad + Tr::kSmemBarriers);

  const int tid = threadIdx.x;
  // Broadcast from lane 0, so that the compiler treats the warpgroup index
  // as warp-uniform (uniform registers for what derives from it).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), wg_tid = tid % 128;
  const int lane = tid % 32;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(sQ_bytes)), typename Tr::LayoutQK{});
  Tensor sPb = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Tr::kSmemP)), typename Tr::LayoutP{});
  Tensor sPa = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(sKv_bytes + kRopeBlock)), typename Tr::LayoutP{});
  auto mma_s = make_tiled_mma(typename Tr::MmaSTile{});
  auto mma_o = make_tiled_mma(typename Tr::MmaO{});
  auto mma_o_regs = make_tiled_mma(typename Tr::MmaORegs{});
  auto thr_s = mma_s.get_thread_slice(wg_tid);
  auto thr_o = mma_o.get_thread_slice(wg_tid);
  auto thr_o_regs = mma_o_regs.get_thread_slice(wg_tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});  // S, then P in place
  Tensor tOrP = thr_o_regs.partition_fragment_A(sPb);  // this warpgroup's P as the A operand (registers)
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<Tr::kOCols>>{});
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value, "P fragment = S accumulator");
  // V half of this warpgroup in each stage, and the A operands from shared memory.
  auto v_half = [&](int stage) {
    return make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(sKv_bytes + stage * Tr::kTileBytes +
                                                              wg * (Tr::kOCols / 64) * 8192)),
                       typename Tr::LayoutVHalf{});
  };
  // Accumulator rows of this thread: row_base + 8 * accumulator_row_half(i).
  const int row_base = accumulator_row_base(wg_tid);

  const int part = blockIdx.y;
  const int m0 = blockIdx.x * kBlockM;
  const SoftmaxScale softmax = softmax_scale(p);
  const float kv_scale = softmax.kv_scale, scale_log2 = softmax.scale_log2;
  // This partition's items: from the scheduler kernel, or (small batches)
  // scheduled here by warp 0, CTA (0, 0) also writing the combine's metadata.
  smxx::PartItem* s_items = reinterpret_cast<smxx::PartItem*>(smem_raw + smem_pad + Tr::kSmemItems);
  int* s_num_items = reinterpret_cast<int*>(s_items + smxx::kInlineScheduleMaxBatch);
  if (!kBlockSchedule && schedule.inline_schedule && tid < 32) {
    const int num = smxx::schedule_partition_inline(p, ws, schedule, part, blockIdx.x == 0 && part == 0, s_items);
    if (tid == 0) *s_num_items = num;
  }

  // One barrier per 64-feature block of each stage (one arrival: the
  // issuing thread, plus the box's bytes), so S can start on the first
  // block of a tile while the others are still arriving.
  // Gathers (kGather): the two half barriers of a stage (blocks 0 and 4)
  // take one arrival from each of the refilling warpgroup's 128 threads.
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < Tr::kStages * Tr::kKvBlocks; ++i) {
      const int blk = i % Tr::kKvBlocks;
      FullBarrier::init(&kv_full[i], kGather && (blk == 0 || blk == 4) ? 128 : 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // also publishes the inline schedule
  MLA_JAX_PHASE(1);
  // Larger batches without the scheduler kernel: every CTA computes the
  // whole schedule in a KV stage no load has touched yet and keeps its
  // partition's items in its row block's region of ws.items.
  int32_t* own_items = ws.items + int64_t{blockIdx.x} * ws.max_items * 4;
  int item_begin, item_end;
  if constexpr (kBlockSchedule) {
    static_assert(sizeof(smxx::BlockScheduleSmem) <= Tr::kTileBytes, "schedule fits a KV stage");
    static_assert(Tr::kThreads == smxx::kScheduleThreads, "one schedule thread per kernel thread");
    auto& sched = *reinterpret_cast<smxx::BlockScheduleSmem*>(sKv_shared);
    smxx::schedule_block(p, ws, schedule, sched, part, own_items, blockIdx.x == 0 && part == 0);
    // The stage's first TMA boxes overwrite these bytes through the async
    // proxy: order the generic writes before them.
    fence_smem_for_wgmma();
    __syncthreads();  // the item range is complete
    item_begin = sched.part_num_items > 0 ? sched.part_first_item : 0;
    item_end = item_begin + sched.part_num_items;
    __syncthreads();  // read before the stage is reused for tiles
    MLA_JAX_PHASE(7);
  } else {
    item_begin = schedule.inline_schedule ? 0 : ws.part_begin[part];
    item_end = schedule.inline_schedule ? *s_num_items : ws.part_begin[part + 1];
  }
  // Warpgroup w computes S only over stage w's tiles, so it alone waits on
  // stage w's barriers: one phase bit per warpgroup.
  uint32_t full_phase = 0;
  // (exp2 correction factor, max to subtract) for a running max moving from
  // m_old to m_new; a row with nothing visible yet keeps m = -inf.
  auto correction = [](float m_old, float m_new) { return m_new == -INFINITY ? 1.f : fast_exp2(m_old - m_new); };
  auto usable = [](float m) { return m == -INFINITY ? 0.f : m; };
  auto rescale_o = [&](const float (&c)[2]) {
    // Per warp: its accumulator rows are its own.
    if (__any_sync(0xffffffffu, c[0] != 1.f || c[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= c[accumulator_row_half(i)];
    }
  };

  for (int i = item_begin; i < item_end; ++i) {
    // The combine kernel after this one may be dispatched once every CTA
    // has started its last item (or exited), so its waiting CTAs do not sit
    // beside this grid for the whole call (a trigger at the kernel's start
    // gained much less; docs/perf.md). It waits for this grid to complete
    // before reading anything (csrc/smxx/pdl.cuh); a CTA without items
    // triggers by exiting.
    if (i == item_end - 1) pdl_allow_dependents();
    int item = i;
    DecodeItem it;
    if (!kBlockSchedule && schedule.inline_schedule) {
      const smxx::PartItem own = s_items[i];
      item = own.item;
      it = make_item<kBlockN>(p, ws, own.b, own.block_begin, own.block_end, own.splits);
    } else if constexpr (kBlockSchedule) {
      const int4 own = reinterpret_cast<const int4*>(own_items)[i];
      it = make_item<kBlockN>(p, ws, own.x, own.y, own.z, own.w);
    } else {
      it = load_item<kBlockN>(p, ws, i);
    }
    const int64_t tok_end = it.tok_end;
    const int tile_begin = it.tile_begin;
    const int num_tiles = it.num_tiles;
    // Dense: the request's block-table row; gathers: its top-k index row.
    const int32_t* table = kGather ? p.indices + static_cast<int64_t>(it.b) * p.topk
                                   : p.block_table + static_cast<int64_t>(it.b) * p.max_pages_per_seq;

    cute::cp_async_wait<0>();
    __syncthreads();  // the previous item is done with every buffer
    if (tid == 0) *s_bad_page = 0;
    __syncthreads();

    // Block-table entry of tile `t` of this item (its first token's page),
    // or of entry 0 past the end (the row has one: the item has tokens).
    auto fetch_entry = [&](int t) {
      const int tok = (tile_begin + t) * kBlockN;
      int page, slot;
      smxx::div_page(p, tok, page, slot);
      return table[tok < tok_end ? page : 0];
    };
    // Boxes [first, first + count) of tile t into its stage (box 8: kpe),
    // issued by one thread of this warpgroup.
    auto issue_boxes = [&](int t, int entry, int first, int count) {
      if (wg_tid != 0) return;
      uint64_t* bar = &kv_full[(t % Tr::kStages) * Tr::kKvBlocks];
      char* dst = sKv_bytes + (t % Tr::kStages) * Tr::kTileBytes;
      if (entry < 0 || entry >= p.num_pages) {
        *s_bad_page = 1;  // the request's output becomes NaN
        if constexpr (Tr::kConvert) {
          FullBarrier::arrive(&bar[first]);
        } else {
          for (int j = 0; j < count; ++j) FullBarrier::arrive(&bar[first + j]);
        }
        return;
      }
      int page, slot;
      smxx::div_page(p, (tile_begin + t) * kBlockN, page, slot);
      const int row = entry * p.page_size + slot;
      const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
      if constexpr (Tr::kConvert) {
        // e4m3 rows: a half's raw bytes (decode_traits.h, kSeeRaw*) on the
        // half's first block barrier; converted before S reads it.
        if (first == 0) {
          FullBarrier::arrive_and_expect_tx(&bar[0], Tr::kSeeRawLoBytes);
          cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, &bar[0], hint, dst + Tr::kSeeRawLo, 0, row);
          cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, &bar[0], hint, dst + Tr::kSeeRawLo + 8192, 128, row);
        } else {
          FullBarrier::arrive_and_expect_tx(&bar[4], Tr::kSeeRawHiBytes);
          cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, &bar[4], hint, dst + Tr::kSeeRawHi, 256, row);
          cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, &bar[4], hint, dst + Tr::kSeeRawHi + 8192, 384, row);
          cute::SM90_TMA_LOAD_2D::copy(&tma.kpe, &bar[4], hint, dst + Tr::kSeeRawRope, 0, row);
        }
        return;
      }
      constexpr uint32_t kBox = 64 * 64 * 2;
      // EVICT_FIRST: the other row block's CTA still finds the tile in L2,
      // and the tile is dead after that (docs/perf.md has the comparison
      // with EVICT_NORMAL and with an L2 prefetch).
      for (int j = 0; j < count; ++j) {
        const int blk = first + j;
        FullBarrier::arrive_and_expect_tx(&bar[blk], kBox);
        if (blk < 8) {
          cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, &bar[blk], hint, dst + blk * 8192, blk * 64, row);
        } else {
          cute::SM90_TMA_LOAD_2D::copy(&tma.kpe, &bar[blk], hint, dst + kRopeBlock, 0, row);
        }
      }
    };
    // This warpgroup's part of a whole tile (prologue): 0-3 or 4-8.
    auto issue_own_part = [&](int t, int entry) { issue_boxes(t, entry, wg == 0 ? 0 : 4, wg == 0 ? 4 : 5); };
    // Completes the phase of blocks [first, first + count) of `stage` with no
    // load (a pair with no next tile still issues the next S, over whatever
    // the stage holds, and discards it).
    auto complete_boxes = [&](int stage, int first, int count) {
      if (wg_tid != 0) return;
      if constexpr (Tr::kConvert) {
        FullBarrier::arrive(&kv_full[stage * Tr::kKvBlocks + first]);  // a half lands on its first block's barrier
      } else {
        for (int j = 0; j < count; ++j) FullBarrier::arrive(&kv_full[stage * Tr::kKvBlocks + first + j]);
      }
    };
    // Gathers (kGather): rows[0], rows[1] of lane l are the cache rows (or
    // -1: padding, out of range, past the item's end) of tokens l and l + 32
    // of a tile, looked up by every lane of both warpgroups: each
    // warpgroup's gathers cover all 64 rows of its half, and its own tile's
    // rows are its softmax mask (tile_mask).
    auto fetch_rows = [&](int t, int (&rows)[2]) {
      const int pos = (tile_begin + t) * kBlockN + lane;
      rows[0] = sparse_row(p, table, pos, tok_end);
      rows[1] = sparse_row(p, table, pos + 32, tok_end);
    };
    // One half of tile t into its stage, gathered by this whole warpgroup
    // (high: blocks 4-8, else 0-3; kv_convert.cuh, gather_seesaw_half_ds).
    auto gather_half = [&](int t, const int (&rows)[2], bool high) {
      if constexpr (kGather) {
        int mine[4];  // the rows of tokens wg_tid / 8 + 16 k
#pragma unroll
        for (int k = 0; k < 4; ++k) mine[k] = __shfl_sync(0xffffffffu, rows[k >> 1], SeesawDsMap::row_lane(wg_tid, k));
        uint64_t* bar = &kv_full[(t % Tr::kStages) * Tr::kKvBlocks];
        char* dst = sKv_shared + (t % Tr::kStages) * Tr::kTileBytes;
        if (high) {
          gather_seesaw_half_ds<Tr, true>(p, dst, &bar[4], wg_tid, mine);
        } else {
          gather_seesaw_half_ds<Tr, false>(p, dst, &bar[0], wg_tid, mine);
        }
      }
    };
    auto gather_own_part = [&](int t, const int (&rows)[2]) { gather_half(t, rows, wg == 1); };
    // Gathers: which tokens of this warpgroup's current tile are cache rows,
    // shifted to this thread's S columns (SeesawDsMap::mask_*; the ballots
    // are warp-uniform, the shift per thread).
    constexpr uint32_t kKeep = SeesawDsMap::kMaskKeep;
    uint32_t tile_mask = kKeep | (kKeep << 2);
    auto set_tile_mask = [&](const int (&rows)[2]) {
      const int shift = SeesawDsMap::mask_shift(wg_tid);
      tile_mask = ((__ballot_sync(0xffffffffu, rows[0] >= 0) >> shift) & kKeep) |
                  (((__ballot_sync(0xffffffffu, rows[1] >= 0) >> shift) & kKeep) << 2);
    };
    // Whether accumulator element i's token is a cache row (i static).
    auto element_in_mask = [&](int i) { return ((tile_mask >> SeesawDsMap::mask_bit(i)) & 1u) != 0; };
    // All of this thread's 16 tokens are cache rows (per thread: a warp
    // with some masked tokens takes the masked path in some threads).
    auto mask_full = [&] { return tile_mask == (kKeep | (kKeep << 2)); };
    // TMA copies whole 64-row tiles, so in the request's last tile (length
    // not a multiple of 64) the rows at or past tok_end hold whatever the
    // cache has in those slots. Their P is 0, but 0 x NaN or 0 x Inf is NaN
    // in P V. So the warpgroup that computed S of tile t (done: nothing
    // else reads the tile's K part) zeroes those rows' V part (blocks 0-7)
    // in `stage`, fences for wgmma and syncs its own 128 threads before its
    // P V; the other warpgroup reads the tile's V only after the hand-off
    // that follows (Pa for tile a, Pb for tile b). tok_end and tile_begin
    // are the same in every thread, so the barrier is taken or skipped by
    // the whole warpgroup.
    auto clear_v_tail = [&](int t, int stage) {
      if constexpr (kGather) return;  // cp.async zero-fills the rows past the end
      const int valid = static_cast<int>(tok_end - int64_t{tile_begin + t} * kBlockN);
      if (valid >= kBlockN) return;
      char* dst = sKv_shared + stage * Tr::kTileBytes;
      for (int idx = wg_tid; idx < (kBlockN - valid) * Tr::kNopeChunks; idx += 128) {
        const int row = valid + idx / Tr::kNopeChunks, chunk = idx % Tr::kNopeChunks;
        *reinterpret_cast<uint4*>(dst + qk_chunk_offset(row, chunk)) = make_uint4(0u, 0u, 0u, 0u);
      }
      fence_smem_for_wgmma();
      NamedBarrier::sync(128, wg == 0 ? kBarTail0 : kBarTail1);
    };

    load_query_rows<Tr>(p, sQ_bytes, it.b, m0, tid);
    cute::cp_async_fence();
    int limit[2];  // visible length of this thread's two rows (<= tok_end)
    row_limits(p, it, m0, row_base, limit);
    // Rows past q_len x heads (zero query, never written; no row reads
    // another) need no mask, so that interior tiles take the unmasked path
    // with fewer than 64 rows.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
      if (m0 + row_base + 8 * rr >= p.rows_per_request()) limit[rr] = static_cast<int>(tok_end);
    clear(tOrO);
    float m_run[2] = {-INFINITY, -INFINITY};  // running max (log2 domain), the same in both warpgroups
    float l_own[2] = {0.f, 0.f};  // sum of this warpgroup's P (its own tiles), relative to m_run

    // S += Q K^T over blocks [kLo, kHi) of this warpgroup's stage (async;
    // the caller commits), each block's k-steps issued once its TMA lands.
    // kFirst: the first k-step overwrites the accumulator (no clear():
    // ordinary writes while other wgmmas run make ptxas serialise them).
    auto issue_s_blocks = [&](auto lo_const, auto hi_const, auto first_const) __attribute__((always_inline)) {
      constexpr int kLo = decltype(lo_const)::value, kHi = decltype(hi_const)::value;
      Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(sKv_bytes + wg * Tr::kTileBytes)),
                              typename Tr::LayoutQK{});
      Tensor tSrK = thr_s.partition_fragment_B(sK);
      static_assert(decltype(size<2>(tSrQ))::value == 4 * Tr::kKvBlocks, "4 k-steps per 64-feature block");
      warpgroup_fence_operand(tSrS);
      mma_s.accumulate_ = decltype(first_const)::value ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
      for (int blk = kLo; blk < kHi; ++blk) {
        if constexpr (Tr::kConvert) {
          // e4m3 rows: the half starting here lands as raw bytes on its
          // first block's barrier; this warpgroup (the only one that reads
          // S of this stage) converts it in place before its k-steps.
          static_assert((kLo == 0 || kLo == 4) && (kHi == 4 || kHi == 9), "whole halves");
          if (blk == 0 || blk == 4) {
            FullBarrier::wait(&kv_full[wg * Tr::kKvBlocks + blk], full_phase);
            char* stage = sKv_shared + wg * Tr::kTileBytes;
            auto sync = [&] { NamedBarrier::sync(128, wg == 0 ? kBarConv0 : kBarConv1); };
            if constexpr (kGather) {
              // The stage was written by cp.async (generic proxy), the kpe
              // block in place: the fence below also covers it.
              if (blk == 0) {
                convert_seesaw_half_ds<Tr, false>(stage, wg_tid, sync);
              } else {
                convert_seesaw_half_ds<Tr, true>(stage, wg_tid, sync);
              }
            } else if (blk == 0) {
              convert_seesaw_half<Tr, false>(stage, wg_tid, sync);
            } else {
              convert_seesaw_half<Tr, true>(stage, wg_tid, sync);
            }
            fence_smem_for_wgmma();
            sync();
            warpgroup_arrive();
          }
        } else {
          FullBarrier::wait(&kv_full[wg * Tr::kKvBlocks + blk], full_phase);
          warpgroup_arrive();  // explicit, after the wait: one ptxas would insert there serialises
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          gemm(mma_s, tSrQ(_, _, 4 * blk + j), tSrK(_, _, 4 * blk + j), tSrS);
          mma_s.accumulate_ = GMMA::ScaleOut::One;
        }
      }
    };
    using Zero = Int<0>;
    using Four = Int<4>;
    using Nine = Int<9>;
    // O half += P V half with P from registers (this warpgroup's tile) or
    // from shared memory (the other's); async, committed.
    auto issue_pv_regs = [&](int stage) __attribute__((always_inline)) {
      warpgroup_fence_operand(tOrP);
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      gemm(mma_o_regs, tOrP, thr_o_regs.partition_fragment_B(v_half(stage)), tOrO);
      warpgroup_commit_batch();
    };
    auto issue_pv_smem = [&](auto& sP, int stage) __attribute__((always_inline)) {
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      gemm(mma_o, thr_o.partition_fragment_A(sP), thr_o.partition_fragment_B(v_half(stage)), tOrO);
      warpgroup_commit_batch();
    };
    // Whether every element of tile t is visible to this thread's two rows.
    auto visible_all = [&](int t) {
      return (tile_begin + t) * kBlockN + kBlockN <= min(limit[0], limit[1]) &&
             (!kGather || mask_full());
    };
    // Row maxima of tile t's S (quad-reduced), after scaling S in place (log2
    // domain) and setting its masked elements to -inf, so that the maxima and
    // the softmax have one copy of their code, not a masked one beside it
    // (2^-inf = 0).
    auto tile_rowmax = [&](int t, float (&tile_max)[2]) {
      const int tok0 = (tile_begin + t) * kBlockN;
      tile_max[0] = tile_max[1] = -INFINITY;
      if (visible_all(t)) {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) tSrS(i) *= scale_log2;
      } else {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int col = get<1>(tScS(i));
          const bool keep = tok0 + col < limit[accumulator_row_half(i)] && (!kGather || element_in_mask(i));
          tSrS(i) = keep ? tSrS(i) * scale_log2 : -INFINITY;
        }
      }
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) tile_max[accumulator_row_half(i)] = fmaxf(tile_max[accumulator_row_half(i)], tSrS(i));
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 1));
        tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 2));
      }
    };
    // P = 2^(S - m) (S scaled and masked by tile_rowmax: 0 where masked), in
    // place in the S accumulator (no wgmma of this warpgroup is in flight
    // here) and as the bf16/fp16 A operand; returns this thread's row sums.
    // After tile_rowmax.
    auto softmax_in_place = [&](const float (&m)[2], float (&sum)[2]) {
      const float neg_m[2] = {-usable(m[0]), -usable(m[1])};
      sum[0] = sum[1] = 0.f;
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) {
        const int rr = accumulator_row_half(i);
        const float e = fast_exp2(tSrS(i) + neg_m[rr]);
        sum[rr] += e;
        tSrS(i) = e;
        tOrP(i) = static_cast<Elem>(e);
      }
    };
    // P (times c per row) into a LayoutP buffer for the other warpgroup.
    auto store_p = [&](char* dst, const float (&c)[2]) {
#pragma unroll
      for (int i = 0; i < size(tSrS); i += 2) {
        const int row = get<0>(tScS(i)), col = get<1>(tScS(i));
        const float f = c[accumulator_row_half(i)];
        *reinterpret_cast<uint32_t*>(dst + qk_chunk_offset(row, col >> 3) + (col & 7) * 2) =
            pack2<T>(tSrS(i) * f, tSrS(i + 1) * f);
      }
      fence_smem_for_wgmma();  // read by wgmma (async proxy) after the hand-off barrier
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

    // Prologue: tiles 0 and 1 (each warpgroup its boxes), the query, then
    // S(0) in warpgroup 0 and S(1) in warpgroup 1, each waited for.
    // Gathers: the rows of the tiles a and b of the next pair (every lane).
    int rows_a[2] = {-1, -1}, rows_b[2] = {-1, -1};
    if constexpr (kGather) {
      if (num_tiles > 0) fetch_rows(0, rows_a);
      if (num_tiles > 1) fetch_rows(1, rows_b);
      if (num_tiles > 0) gather_own_part(0, rows_a);
      if (num_tiles > 1) gather_own_part(1, rows_b);
      // The query's group only: the gathers were not committed to a group
      // (they arrive on their barriers).
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    } else {
      if (num_tiles > 0) issue_own_part(0, wg_tid == 0 ? fetch_entry(0) : 0);
      if (num_tiles > 1) issue_own_part(1, wg_tid == 0 ? fetch_entry(1) : 0);
      cute::cp_async_wait<0>();
    }
    fence_smem_for_wgmma();
    __syncthreads();  // the query landed
    if (i == item_begin) MLA_JAX_PHASE(3);
    if (wg < num_tiles) {  // warpgroup w's first tile is tile w
      issue_s_blocks(Zero{}, Nine{}, std::true_type{});
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      full_phase ^= 1u;
    }

    // Refills half `high` (blocks 4-8, else 0-3) of tile t's stage: gathers
    // its rows, loads `entry`'s page, or, where tile t does not exist
    // (!next), completes the blocks' barriers with no load.
    auto refill_half = [&](int t, const int (&rows)[2], int entry, bool next, bool high) __attribute__((always_inline)) {
      if constexpr (kGather) {
        gather_half(t, rows, high);
      } else if (next) {
        issue_boxes(t, entry, high ? 4 : 0, high ? 5 : 4);
      } else {
        complete_boxes(t % Tr::kStages, high ? 4 : 0, high ? 5 : 4);
      }
    };
    // One pair of tiles. Every wgmma a pair issues is unconditional inside
    // its instantiation (kHasB: tile b exists, a whole pair, which also
    // issues S of tiles a + 2 and b + 2): a wgmma issued on one path only
    // makes ptxas serialise all of them. next_a / next_b: tiles a + 2 / b + 2
    // exist (the loads decide; S is issued either way). S(a) (warpgroup 0)
    // and S(b) (warpgroup 1) are complete on entry.
    auto pair = [&](const int k, auto has_b_const, const bool next_a, const bool next_b) __attribute__((always_inline)) {
      constexpr bool kHasB = decltype(has_b_const)::value;
      const int ta = 2 * k, tb = 2 * k + 1;
      // Entries of the next pair's tiles, read now to be ready mid-pair.
      int entry_a = 0, entry_b = 0;
      if constexpr (kGather) {
        // This pair's own tile's rows (loaded a pair ago) become its mask.
        if (wg == 0) {
          set_tile_mask(rows_a);
        } else {
          set_tile_mask(rows_b);
        }
        if (kHasB) {  // past the item's end the rows come back -1 (zero-filled, masked)
          fetch_rows(ta + 2, rows_a);
          fetch_rows(tb + 2, rows_b);
        }
      } else if (wg_tid == 0) {
        if (kHasB && next_a) entry_a = fetch_entry(ta + 2);
        if (kHasB && next_b) entry_b = fetch_entry(tb + 2);
      }
      float m_a[2], m_b[2], tmax[2], sum[2], c[2];
      if (wg == 0) {
        clear_v_tail(ta, 0);  // S(a) is done
        tile_rowmax(ta, tmax);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          m_a[rr] = fmaxf(m_run[rr], tmax[rr]);
          c[rr] = correction(m_run[rr], m_a[rr]);
        }
        publish_max(m_a, 0);
        NamedBarrier::arrive(256, kBarMaxA);
        softmax_in_place(m_a, sum);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) l_own[rr] = l_own[rr] * c[rr] + sum[rr];
        warpgroup_fence_operand(tOrO);
        rescale_o(c);
        issue_pv_regs(0);  // O_L += P_a V_aL
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        if constexpr (kHasB) refill_half(ta + 2, rows_a, entry_a, next_a, false);  // V_aL is free
        if constexpr (kHasB) {
          NamedBarrier::sync(256, kBarMaxB);
          read_max(m_b, 1);
        } else {
          m_b[0] = m_a[0];
          m_b[1] = m_a[1];
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) c[rr] = correction(m_a[rr], m_b[rr]);
        store_p(sKv_shared + kRopeBlock, c);  // P_a relative to m_b, for warpgroup 1
        NamedBarrier::arrive(256, kBarPa);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          l_own[rr] *= c[rr];
          m_run[rr] = m_b[rr];
        }
        if constexpr (kHasB) {
          rescale_o(c);
          NamedBarrier::sync(256, kBarPb);
          issue_pv_smem(sPb, 1);  // O_L += P_b V_bL
          issue_s_blocks(Zero{}, Four{}, std::true_type{});  // S(a + 2): the blocks freed first
          warpgroup_commit_batch();
          warpgroup_wait<1>();  // P_b V_bL done: V_bL is free
          refill_half(tb + 2, rows_b, entry_b, next_b, false);
          issue_s_blocks(Four{}, Nine{}, std::false_type{});
          warpgroup_commit_batch();
          full_phase ^= 1u;
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tSrS);
      } else {
        if constexpr (kHasB) clear_v_tail(tb, 1);  // S(b) is done
        NamedBarrier::sync(256, kBarMaxA);
        read_max(m_a, 0);
        if constexpr (kHasB) {
          tile_rowmax(tb, tmax);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) m_b[rr] = fmaxf(m_a[rr], tmax[rr]);
          publish_max(m_b, 1);
          NamedBarrier::arrive(256, kBarMaxB);
          softmax_in_place(m_b, sum);
        } else {
          m_b[0] = m_a[0];
          m_b[1] = m_a[1];
          sum[0] = sum[1] = 0.f;
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          c[rr] = correction(m_run[rr], m_b[rr]);
          l_own[rr] = l_own[rr] * c[rr] + sum[rr];
          m_run[rr] = m_b[rr];
        }
        warpgroup_fence_operand(tOrO);
        rescale_o(c);
        if constexpr (kHasB) {
          const float one[2] = {1.f, 1.f};
          store_p(sPb_shared, one);  // P_b for warpgroup 0
          NamedBarrier::arrive(256, kBarPb);
          issue_pv_regs(1);  // O_R += P_b V_bR
        }
        NamedBarrier::sync(256, kBarPa);
        issue_pv_smem(sPa, 0);  // O_R += P_a V_aR
        if constexpr (kHasB) {
          warpgroup_wait<1>();  // P_b V_bR done: V_bR and tile b's rope are free
          refill_half(tb + 2, rows_b, entry_b, next_b, true);
        }
        warpgroup_wait<0>();  // P_a V_aR done: V_aR and P_a are free
        warpgroup_fence_operand(tOrO);
        if constexpr (kHasB) {
          refill_half(ta + 2, rows_a, entry_a, next_a, true);
          issue_s_blocks(Four{}, Nine{}, std::true_type{});  // S(b + 2): the blocks freed first
          issue_s_blocks(Zero{}, Four{}, std::false_type{});
          warpgroup_commit_batch();
          full_phase ^= 1u;
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
        }
      }
    };
    // Every whole pair runs the same code; an odd last tile has its own.
    for (int k = 0; 2 * k + 1 < num_tiles; ++k) pair(k, std::true_type{}, 2 * k + 2 < num_tiles, 2 * k + 3 < num_tiles);
    if (num_tiles > 0 && num_tiles % 2 != 0) pair(num_tiles / 2, std::false_type{}, false, false);
    warpgroup_fence_operand(tOrO);

    // Both warpgroups' sums are relative to the same m_run.
    if (i == item_begin) MLA_JAX_PHASE(5);
    write_item_output<Tr, T>(p, ws, it, item, m0, l_own, m_run, kv_scale, s_bad_page, sRed, sKv_shared, tOrO);
    if (i == item_begin) MLA_JAX_PHASE(6);
  }

  if constexpr (kFusedCombine) {
    static_assert(!kBlockSchedule && Tr::kThreads == smxx::kCombineThreads, "a block task takes the whole CTA");
    static_assert(sizeof(smxx::CombineBlockSmem) <= Tr::kTileBytes, "a block task's shared memory fits a KV stage");
    // Every CTA's partials, their LSEs and CTA (0, 0)'s request_meta are
    // written: the grid barrier orders them before the reads below (it
    // fences at device scope). No load is in flight into the KV stages at
    // an item's end (the output staging needs them), so they are free.
    cooperative_groups::this_grid().sync();
    const int rows = p.rows_per_request();
    const int cta = blockIdx.y * gridDim.x + blockIdx.x, ctas = gridDim.x * gridDim.y;
    const int tasks = p.batch * rows * smxx::kCombineSlices;  // (request, row, 128-column slice)
    if (schedule.combine_block_order) {
      auto& scratch = *reinterpret_cast<smxx::CombineBlockSmem*>(sKv_shared);
      for (int t = cta; t < tasks; t += ctas) {
        __syncthreads();  // the previous task is done with the scratch
        const int z = t % smxx::kCombineSlices, rq = t / smxx::kCombineSlices;
        smxx::combine_block_task<T>(p, ws, rq / rows, rq % rows, z, smxx::kCombineSliceColumns, scratch);
      }
    } else {
      constexpr int kWarps = Tr::kThreads / 32;
      for (int t = cta * kWarps + tid / 32; t < tasks; t += ctas * kWarps) {
        const int z = t % smxx::kCombineSlices, rq = t / smxx::kCombineSlices;
        smxx::combine_warp_task<T, 1>(p, ws, rq / rows, rq % rows, z);
      }
    }
  }
#endif  // sm_90a
}

}  // namespace sm90
}  // namespace mla_jax
