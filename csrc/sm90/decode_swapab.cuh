// Kernel body of the Hopper (sm_90a) swap-AB decode: dense e4m3 caches
// (one kv_scale) whose pages TMA can load tile by tile, 32 query rows per
// request or fewer. The tile configuration, the operands' layouts (the
// O^T one permuted) and the shared-memory plan are in swapab_traits.h.
//
// Per item (a request, or a piece of one, from the scheduler kernel or,
// up to 32 requests, from one warp of the CTA itself): the
// CTA splits each query row into e4m3 parts (two for bf16, three for fp16,
// after scaling the row by a power of two), then warpgroup w of W takes the
// item's tiles w, w + W, ... from the stage ring (with kN = 32 both take
// every tile, steps 1-3 cover the warpgroup's 16 query rows, step 4 its 256
// features of all 32 rows):
//   1. S^T = K Q^T: FP8 wgmmas straight from the raw stage (18 k-steps, in
//      groups summed in float registers);
//   2. column (query row) maxima over the tile's 64 tokens: lanes, then the
//      warpgroup's four warps through shared memory (one barrier);
//   3. P^T = 2^(S^T scale - max) as fp16 into shared memory, O^T rescaled
//      (second barrier; with kN = 32 one of both warpgroups, after which
//      each rescales its O^T by the factors of all 32 rows);
//   4. O^T += V^T P^T: four 16-token k-steps of one wgmma per 64-feature
//      m-block each (eight; four at kN = 32), issued by pairs of m-blocks,
//      each pair's V^T converted as soon as its previous product is done;
//   5. the stage is refilled with tile t + kStages (kN = 16, and sparse at
//      kN = 32: each warp refills its own share as soon as it has read it,
//      inside step 4; dense kN = 32: the last warp to finish the tile).
// At the item's end, with kN = 16, the warpgroups merge (m, l, O^T) through
// shared memory and warpgroup 0 writes the output; with kN = 32 each row's
// (m, l) goes from the warpgroup that owns it to both, and each warpgroup
// writes its features.
#pragma once

#include <cuda_fp8.h>

#include "csrc/common/mla_params.h"
#include "csrc/smxx/api.h"
#include "csrc/smxx/kv_source.cuh"
#include "csrc/smxx/pdl.cuh"
#include "csrc/smxx/phase_probe.cuh"
#include "csrc/smxx/request.cuh"
#include "csrc/sm90/decode_common.cuh"
#include "csrc/sm90/kv_tma.h"
#include "csrc/sm90/swapab_traits.h"

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

namespace mla_jax {
namespace sm90 {

// Element e of S^T from an accumulator of the query's kQTerms e4m3 parts
// (part j of element e at e + j kSVals, weight 16^-j).
template <int kQTerms, int kSVals, typename Acc>
__device__ __forceinline__ float query_parts_sum(const Acc& acc, int e) {
  float v = acc(e);
#pragma unroll
  for (int j = 1; j < kQTerms; ++j) v += acc(e + j * kSVals) * (j == 1 ? 0.0625f : 0.00390625f);
  return v;
}

// Four e4m3 values -> two fp16x2, exactly: bytes 0-1 into lo, 2-3 into hi
// (the lower byte of each pair in the lower half). The 16-bit halves of
// `w` feed the conversions directly (no shift to extract the upper pair).
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

__device__ __forceinline__ uint4 lds128(const char* p) { return *reinterpret_cast<const uint4*>(p); }

// 4 bytes global -> shared, zero-filled when !pred (the source is not read).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>::copy(*static_cast<const uint32_t*>(gmem),
                                                         *static_cast<uint32_t*>(smem), pred);
}

// Sparse: warp `warp`'s share of a tile into `stage` (rows[i] of lane l:
// the cache row of token l + 32 i, or -1): its ckv box, its group's scale,
// and kpe chunks 2 warp and 2 warp + 1, zero where the row is < 0; then one
// arrival per lane on `bar` once its copies have landed. The lanes of one
// copy instruction cover whole 128- or 32-byte pieces of few rows (8 lanes a
// token's ckv piece, 2 lanes its kpe piece), so that each instruction
// touches 4 or 16 rows rather than 32, each row index taken from the lane
// that looked it up. Only this warp reads those ckv bytes and that scale
// after the S^T step (so it may refill them once its O^T step is done), and
// everyone's S^T reads of kpe and the scales are over at the barrier of step 2.
// (kN = 16; kN = 32: sparse_gather_split below.)
template <typename Tr>
__device__ __forceinline__ void sparse_gather(const PagedDecodeParams& p, char* stage, uint64_t* bar, int warp, int lane,
                                              const int (&rows)[2]) {
  const char* ckv = static_cast<const char*>(p.ckv);
  const char* kpe = static_cast<const char*>(p.kpe);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int tok = 4 * j + (lane >> 3), c = lane & 7;
    const int row = __shfl_sync(0xffffffffu, rows[j >> 3], tok & 31);
    const bool live = row >= 0;
    smxx::cp_async_16(stage + warp * Tr::kCkvBoxBytes + tok * 128 + ((c ^ (tok & 7)) << 4),
                      ckv + int64_t{live ? row : 0} * p.ckv_token_stride + 128 * warp + 16 * c, live);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = 16 * j + (lane >> 1), c = 2 * warp + (lane & 1);
    const int row = __shfl_sync(0xffffffffu, rows[j >> 1], tok & 31);
    const bool live = row >= 0;
    smxx::cp_async_16(stage + Tr::kRopeOffset + tok * 128 + ((c ^ (tok & 7)) << 4),
                      kpe + int64_t{live ? row : 0} * p.kpe_token_stride + 16 * c, live);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int tok = lane + 32 * i;
    const bool live = rows[i] >= 0;
    const int64_t r = live ? rows[i] : 0;
    cp_async_4(stage + Tr::kScaleOffset + tok * 16 + 4 * warp,
               static_cast<const char*>(p.ckv) + r * p.ckv_token_stride + kDsMlaScaleOffset + 4 * warp, live);
  }
  cutlass::arch::cpasync_barrier_arrive_noinc(bar);
}

// Sparse: the fp16 pairs scale / r_run (group `grp`) of tokens (a, a + 1)
// and (a + 8, a + 9) of the tile in `stage`, the V^T factors of one O^T
// k-step (sv[0], sv[1]).
template <typename Tr>
__device__ __forceinline__ void sparse_v_factors_of(const char* stage, int a, int grp, float inv_r, uint32_t (&sv)[2]) {
  const float* scl = reinterpret_cast<const float*>(stage + Tr::kScaleOffset);
  const __half2 lo = __floats2half2_rn(scl[4 * a + grp] * inv_r, scl[4 * (a + 1) + grp] * inv_r);
  const __half2 hi = __floats2half2_rn(scl[4 * (a + 8) + grp] * inv_r, scl[4 * (a + 9) + grp] * inv_r);
  sv[0] = *reinterpret_cast<const uint32_t*>(&lo);
  sv[1] = *reinterpret_cast<const uint32_t*>(&hi);
}

// Sparse, kN = 32 (both warpgroups on every tile): warp `warp` of
// warpgroup `wg`'s share of a tile, so that each of the 256 lanes arrives
// once on `bar` (rows[i] as above). In O^T each 16-byte ckv chunk of a
// tile is read by one warp (swapab_traits.h: warp w of warpgroup v reads box
// 2 v + w / 2, logical chunks 4 (w & 1) .. 4 (w & 1) + 3 of all 64 tokens):
// that warp refills it once its last read is done. kpe and the scales are
// read before the tile's barrier of both warpgroups only (S^T, the maxima of
// the scales, and each warp's V^T factors, taken then): warp 4 wg + warp
// refills tokens [8 (4 wg + warp), + 8) of both.
template <typename Tr>
__device__ __forceinline__ void sparse_gather_split(const PagedDecodeParams& p, char* stage, uint64_t* bar, int wg,
                                                    int warp, int lane, const int (&rows)[2]) {
  const char* ckv = static_cast<const char*>(p.ckv);
  const char* kpe = static_cast<const char*>(p.kpe);
  const int box = 2 * wg + (warp >> 1), w8 = 4 * wg + warp;
  // The kpe and scale tokens 8 w8 .. 8 w8 + 7 are all below 32 (wg 0) or
  // all above (wg 1): their rows come from one register (a select, not an
  // indexed array).
  const int rows_kpe = wg ? rows[1] : rows[0];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int tok = 8 * j + (lane >> 2), c = 4 * (warp & 1) + (lane & 3);
    const int row = __shfl_sync(0xffffffffu, rows[j >> 2], tok & 31);
    const bool live = row >= 0;
    smxx::cp_async_16(stage + box * Tr::kCkvBoxBytes + tok * 128 + ((c ^ (tok & 7)) << 4),
                      ckv + int64_t{live ? row : 0} * p.ckv_token_stride + 128 * box + 16 * c, live);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int tok = 8 * w8 + 4 * j + (lane >> 3), c = lane & 7;
    const int row = __shfl_sync(0xffffffffu, rows_kpe, tok & 31);
    const bool live = row >= 0;
    smxx::cp_async_16(stage + Tr::kRopeOffset + tok * 128 + ((c ^ (tok & 7)) << 4),
                      kpe + int64_t{live ? row : 0} * p.kpe_token_stride + 16 * c, live);
  }
  {
    // A token's four scales are 16 contiguous bytes of its row.
    const int tok = 8 * w8 + (lane & 7);
    const int row = __shfl_sync(0xffffffffu, rows_kpe, tok & 31);
    if (lane < 8) {
      const bool live = row >= 0;
      smxx::cp_async_16(stage + Tr::kScaleOffset + tok * 16,
                        ckv + int64_t{live ? row : 0} * p.ckv_token_stride + kDsMlaScaleOffset, live);
    }
  }
  cutlass::arch::cpasync_barrier_arrive_noinc(bar);
}

// kInlineSchedule: one warp of the CTA schedules a small batch itself
// (csrc/smxx/schedule_inline.cuh) instead of reading the scheduler kernel's
// items; a separate instantiation, so that the other keeps its tile loop's
// registers (a run-time flag there raised them).
template <typename Tr, bool kInlineSchedule>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_swapab_kernel(const PagedDecodeParams p, const DecodeWorkspace ws, const SplitSchedule schedule,
                         const __grid_constant__ KvTma tma) {
  // The combine kernel after this one may be dispatched now; it waits for
  // this grid to complete before reading anything (csrc/smxx/pdl.cuh).
  pdl_allow_dependents();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Marks (diagnostic builds, csrc/smxx/phase_probe.cuh): 1 inline schedule
  // published (or barriers set up), 7 the scheduler kernel waited for, 2
  // the first item's first tiles issued (dense), 3 its query in shared
  // memory, 4 its first tile landed, 5 its tiles done, 6 its output written
  // (4 and 5 as warpgroup 0 sees them).
  MLA_JAX_PHASE_BEGIN();
  using namespace cute;
  using T = typename Tr::QType;
  using Elem = typename Tr::Elem;
  using ElemS = typename Tr::ElemS;
  constexpr int kN = Tr::kN, kBlockN = Tr::kBlockN, kCols = Tr::kColsPerThread;
  constexpr int kOVals = kN / 2;  // O^T accumulator values per thread and m-block
  constexpr bool kSplit = Tr::kSplitO;
  constexpr bool kSparse = Tr::kSparse;
  constexpr int kColsS = Tr::kColsPerThreadS, kSVals = Tr::kNq / 2;  // the same for S^T (one query part)
  constexpr int kOFeat = Tr::kOFeatures, kMBlocks = kOFeat / 64;
  constexpr float kLn2 = 0.6931471805599453f;
  using cutlass::arch::NamedBarrier;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int smem_pad = static_cast<int>(smem - smem_raw);
  // Generic accesses go through smem_raw-based pointers (LDS/STS).
  char* const shared = smem_raw + smem_pad;
  float* sRed = reinterpret_cast<float*>(shared + Tr::kSmemRed);    // [wg][warp][kN]
  float* sMax = reinterpret_cast<float*>(shared + Tr::kSmemMax);    // [wg][kN]
  float* sColScale = reinterpret_cast<float*>(shared + Tr::kSmemColScale);  // [kN]
  float* sRescale = reinterpret_cast<float*>(shared + Tr::kSmemRescale);    // [tile parity][kN] (kSplit)
  int* s_bad_page = reinterpret_cast<int*>(shared + Tr::kSmemFlags);
  int* s_release = reinterpret_cast<int*>(shared + Tr::kSmemRelease);  // [stage] warp count (kSplitO)
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(shared + Tr::kSmemBarriers);

  const int tid = threadIdx.x;
  // The warpgroup and warp indices through a broadcast from lane 0, which
  // the compiler treats as warp-uniform: the addresses and wgmma
  // descriptors derived from them can then live in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), wg_tid = tid % 128;
  const int warp = __shfl_sync(0xffffffffu, wg_tid / 32, 0), lane = tid % 32;
  const int g = lane / 4, quad = lane % 4;  // accumulator row group, column pair
  const int rows = p.rows_per_request();
  // The first query row of this warpgroup's S^T and softmax (kN = 32: it
  // owns rows [16 wg, 16 wg + 16)).
  const int row0 = kSplit ? Tr::kNq * wg : 0;

  char* const q_slab = smem + Tr::kSmemQ + (kSplit ? wg : 0) * Tr::kQSlabBytes;
  Tensor sQn = make_tensor(make_smem_ptr(reinterpret_cast<ElemS*>(q_slab)), typename Tr::LayoutQn{});
  using ElemR = typename Tr::ElemR;
  Tensor sQr = make_tensor(make_smem_ptr(reinterpret_cast<ElemR*>(q_slab + Tr::kQRopeOffset)), typename Tr::LayoutQr{});
  auto mma = make_tiled_mma(typename Tr::MmaO{});
  auto thr = mma.get_thread_slice(wg_tid);
  auto mma_s = make_tiled_mma(typename Tr::MmaS{});
  auto thr_s = mma_s.get_thread_slice(wg_tid);
  // P^T buffer `buf` as the O^T B operand: (MMA, 1, 4) descriptors.
  auto p_operand = [&](int buf) {
    return thr.partition_fragment_B(
        make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Tr::kSmemP + buf * Tr::kPBytes)), typename Tr::LayoutP{}));
  };
  // The kpe part's S^T: MmaS (dense) or a bf16 m64n16k16 (sparse).
  auto mma_r = make_tiled_mma(typename Tr::MmaSr{});
  auto thr_r = mma_r.get_thread_slice(wg_tid);
  // (MMA, 1, 16) and (MMA, 1, kRopeSteps) descriptors.
  Tensor tSrQn = thr_s.partition_fragment_B(sQn);
  Tensor tSrQr = thr_r.partition_fragment_B(sQr);
  // S^T of the query's e4m3 parts: element e + j kSVals (e < kSVals) is
  // column (slab row) col(e)'s part j.
  Tensor tSacc = partition_fragment_C(mma_s, Shape<_64, Int<Tr::kNS>>{});
  Tensor tSacc2 = partition_fragment_C(mma_s, Shape<_64, Int<Tr::kNS>>{});
  Tensor tSrS = make_tensor<float>(Int<kSVals>{});  // S^T, this thread's part, the parts summed
  Tensor tOrO = partition_fragment_C(mma, Shape<Int<kOFeat>, Int<kN>>{});  // O^T: (MMA, m-blocks, 1)
  // The register A operand of O^T (only the view's shape matters).
  auto shape_v = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem)), make_layout(Shape<Int<kOFeat>, _16>{}));
  Tensor tVa = thr.partition_fragment_A(shape_v);  // (MMA, m-blocks, 1): one 16-token k-step
  static_assert(decltype(size(tOrO))::value == kMBlocks * kOVals);
  static_assert(decltype(size(tSacc))::value == Tr::kQTerms * kSVals && Tr::kQTerms <= 3);

  // Accumulator element e: token (S^T) or output-row half (O^T) 8 * ((e / 2) % 2),
  // query row col(e % 2 + 2 (e / 4)) (S^T: of the warpgroup's slab).
  auto col_index = [](int e) { return (e & 1) + 2 * (e >> 2); };
  auto col_of = [&](int ci) { return 2 * quad + (ci & 1) + 8 * (ci >> 1); };

  const int part = blockIdx.y;
  const SoftmaxScale softmax = softmax_scale(p);

  constexpr int kW = Tr::kWarpgroups, kS = Tr::kStages;
  // Arrivals per stage phase: with kN = 16 each of the owner's four warps
  // refills the ckv box it alone reads (warp 0 also the kpe box); with
  // kN = 32 one warp refills the whole stage; sparse: every lane of the
  // owner's four warps (kN = 32: of all eight) arrives once its cp.async
  // copies have landed.
  constexpr int kArrivals = kSparse ? 128 * (kSplit ? 2 : 1) : kSplit ? 1 : 4;
  // This partition's items: small batches (schedule.inline_schedule) are
  // scheduled here by warp 0, the CTA of partition 0 also writing the
  // combine's metadata; else the scheduler kernel wrote them.
  smxx::PartItem* s_items = reinterpret_cast<smxx::PartItem*>(shared + Tr::kSmemItems);
  int* s_num_items = reinterpret_cast<int*>(s_items + smxx::kInlineScheduleMaxBatch);
  if (kInlineSchedule && tid < 32) {
    const int num = smxx::schedule_partition_inline(p, ws, schedule, part, part == 0, s_items);
    if (tid == 0) *s_num_items = num;
  }
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      FullBarrier::init(&kv_full[i], kArrivals);
      s_release[i] = 0;
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // also publishes the inline schedule
  MLA_JAX_PHASE(1);
  // Bit s: parity of the phases stage s's barrier has completed before the
  // current item (the same in every thread).
  uint32_t stage_parity = 0;

  int item_begin = 0, item_end;
  if constexpr (kInlineSchedule) {
    item_end = *s_num_items;
  } else {
    // Launched as a programmatic dependent of the scheduler kernel, this
    // CTA may start before the schedule is written: wait for it here, after
    // the set-up that does not read it (csrc/smxx/pdl.cuh).
    pdl_wait_for_previous();
    MLA_JAX_PHASE(7);
    item_begin = ws.part_begin[part];
    item_end = ws.part_begin[part + 1];
  }
  for (int pos = item_begin; pos < item_end; ++pos) {
    // `item`: the global item number (the partial-output slot when split).
    int item = pos;
    const bool first_item = pos == item_begin;  // the one the phase marks follow
    DecodeItem it;
    if constexpr (kInlineSchedule) {
      const smxx::PartItem own = s_items[pos];
      item = own.item;
      it = make_item<kBlockN>(p, ws, own.b, own.block_begin, own.block_end, own.splits);
    } else {
      it = load_item<kBlockN>(p, ws, pos);
    }
    const int64_t tok_end = it.tok_end;
    const int tile_begin = it.tile_begin, num_tiles = it.num_tiles;
    // Dense: the request's block-table row; sparse: its index row.
    const int32_t* table = kSparse ? p.indices + static_cast<int64_t>(it.b) * p.topk
                                   : p.block_table + static_cast<int64_t>(it.b) * p.max_pages_per_seq;

    __syncthreads();  // the previous item is done with every buffer
    if (tid == 0) *s_bad_page = 0;
    __syncthreads();

    auto fetch_entry = [&](int t) {
      const int tok = (tile_begin + t) * kBlockN;
      int page, slot;
      smxx::div_page(p, tok, page, slot);
      return table[page];
    };
    // ckv boxes [box0, box0 + nbox) of tile t, and its kpe box if with_kpe,
    // into stage t % kS: one arrival on the stage's barrier.
    auto issue_boxes = [&](int t, int entry, int box0, int nbox, bool with_kpe) {
      uint64_t* bar = &kv_full[t % kS];
      char* dst = smem + Tr::kSmemKv + (t % kS) * Tr::kStageBytes;
      if (entry < 0 || entry >= p.num_pages) {
        *s_bad_page = 1;  // the request's output becomes NaN
        FullBarrier::arrive(bar);
        return;
      }
      int page, slot;
      smxx::div_page(p, (tile_begin + t) * kBlockN, page, slot);
      const int row = entry * p.page_size + slot;
      const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
      FullBarrier::arrive_and_expect_tx(bar, nbox * Tr::kCkvBoxBytes + (with_kpe ? Tr::kStageBytes - Tr::kRopeOffset : 0));
      for (int box = box0; box < box0 + nbox; ++box)
        cute::SM90_TMA_LOAD_2D::copy(&tma.ckv, bar, hint, dst + box * Tr::kCkvBoxBytes, box * 128, row);
      if (with_kpe) cute::SM90_TMA_LOAD_2D::copy(&tma.kpe, bar, hint, dst + Tr::kRopeOffset, 0, row);
    };
    // Sparse: the cache row (checked) or top-k entry (unchecked) of token
    // tok of tile t, and this warp's share of tile t into its stage (macros rather than lambdas: a closure over
    // the kernel's locals, even unused, changes the dense kernels' code).
#define MLA_SPARSE_ROW(t, tok) sparse_row(p, table, (tile_begin + (t)) * kBlockN + (tok), tok_end)
#define MLA_SPARSE_ENTRY(t, tok) sparse_entry(table, (tile_begin + (t)) * kBlockN + (tok), tok_end)
#define MLA_SPARSE_GATHER(t, rows_of)                                                                            \
  do {                                                                                                           \
    if constexpr (kSplit) {                                                                                      \
      sparse_gather_split<Tr>(p, shared + Tr::kSmemKv + ((t) % kS) * Tr::kStageBytes, &kv_full[(t) % kS], wg,   \
                              warp, lane, rows_of);                                                              \
    } else {                                                                                                     \
      sparse_gather<Tr>(p, shared + Tr::kSmemKv + ((t) % kS) * Tr::kStageBytes, &kv_full[(t) % kS], warp, lane, \
                        rows_of);                                                                                \
    }                                                                                                            \
  } while (0)
    // The query's loads go out before the first tiles' (below: 8 threads
    // a row, 9 chunks of 8 features each), so that they do not queue
    // behind the tiles of every CTA in the memory system; they are
    // consumed after the tiles are issued.
    const bool q_thread = tid < kN * 8;
    const int q_row = tid / 8, q_lane8 = tid % 8;
    const bool q_live = q_thread && q_row < rows;
    uint4 q_raw[9];
    {
      const int64_t grow = int64_t{it.b} * rows + (q_live ? q_row : 0);
      const char* qn = static_cast<const char*>(p.q_nope) + grow * p.q_nope_row_stride * 2;
      const char* qp = static_cast<const char*>(p.q_pe) + grow * p.q_pe_row_stride * 2;
#pragma unroll
      for (int n = 0; n < 9; ++n) {
        const int ch = q_lane8 + 8 * n;
        q_raw[n] = q_live ? *reinterpret_cast<const uint4*>(ch < 64 ? qn + ch * 16 : qp + (ch - 64) * 16)
                          : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if constexpr (kSparse) {
      // Each warpgroup fills the stages of its own first tiles (kN = 32:
      // every warp its share of every stage).
      for (int t = kSplit ? 0 : wg; t < kS && t < num_tiles; t += kSplit ? 1 : kW) {
        const int rows_of[2] = {MLA_SPARSE_ROW(t, lane), MLA_SPARSE_ROW(t, lane + 32)};
        MLA_SPARSE_GATHER(t, rows_of);
      }
    } else if (tid < 32) {
      // Lane t reads tile t's block-table entry (the reads in flight
      // together, not one after another); lane 0 issues the tiles.
      static_assert(kS <= 32, "one lane of warp 0 per stage");
      const int own_entry = lane < kS && lane < num_tiles ? fetch_entry(lane) : 0;
      int entries[kS];
#pragma unroll
      for (int t = 0; t < kS; ++t) entries[t] = __shfl_sync(0xffffffffu, own_entry, t);
      if (lane == 0) {
        for (int t = 0; t < kS && t < num_tiles; ++t) {
          if constexpr (kSplit) {
            issue_boxes(t, entries[t], 0, 4, true);
          } else {
#pragma unroll
            for (int w = 0; w < 4; ++w) issue_boxes(t, entries[t], w, 1, w == 0);
          }
        }
      }
      if (first_item) MLA_JAX_PHASE(2);
    }

    // The query rows as kQTerms e4m3 parts each (part j of row r: row
    // j kNq + r % kNq of slab r / kNq, the S^T B operand of warpgroup
    // r / kNq at kN = 32), after scaling the row by 2^shift so that its
    // largest value is below 2^8: x 2^shift = sum_j part_j / 16^j, exactly
    // for every value above 2^-13 (bf16) or 2^-14 (fp16) of the row's
    // largest (a bf16 value's 8 significant bits in two parts of 4, an fp16
    // value's 11 in three; the remainder after part j, times 16, stays below
    // 2^8).
    // sColScale[row]: the softmax scale (log2 domain, kv_scale folded in)
    // times 2^-shift, NaN for a row holding an infinity (its output is NaN,
    // as e4m3 has no infinity). 8 threads per row, 9 chunks of 8 features.
    if (q_thread) {
      const int r = q_row, lane8 = q_lane8;
      const uint4 (&raw)[9] = q_raw;
      float amax = 0.f;
#pragma unroll
      for (int n = 0; n < 9; ++n) {
        const uint32_t w4[4] = {raw[n].x, raw[n].y, raw[n].z, raw[n].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = smxx::unpack2<T>(w4[k]);
          amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      const bool finite = amax <= 3.402823466e38f;
      int e2 = 8;  // amax < 2^e2 (a zero row keeps scale 1)
      if (amax > 0.f && finite) frexpf(amax, &e2);
      // The cap keeps scale_log2 * 2^-shift a normal float; a row whose
      // largest value is below 2^-88 keeps fewer exact bits (its scores are
      // about 0 anyway).
      const int shift = min(8 - e2, 96);
      // Two values to e4m3 (x in the lower byte), and back.
      auto to_e4m3 = [](float x, float y) {
        return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3));
      };
      auto from_e4m3 = [](uint32_t v) {
        return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3)));
      };
      // Row r is row r % kNq of slab r / kNq.
      char* const slab = shared + Tr::kSmemQ + (r / Tr::kNq) * Tr::kQSlabBytes;
      const int slab_row = r % Tr::kNq;
#pragma unroll
      for (int n = 0; n < 9; ++n) {
        const int ch = lane8 + 8 * n;
        const uint32_t w4[4] = {raw[n].x, raw[n].y, raw[n].z, raw[n].w};
        if constexpr (kSparse) {
          if (n == 8) {
            // The kpe part (chunks 64..71) in bf16, times 2^shift (exact).
            uint32_t h[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float2 f = smxx::unpack2<T>(w4[k]);
              h[k] = smxx::pack2<__nv_bfloat16>(ldexpf(f.x, shift), ldexpf(f.y, shift));
            }
            *reinterpret_cast<uint4*>(slab + Tr::kQRopeOffset + kmajor_offset<Tr::kNq>(slab_row, 8 * (ch - 64))) =
                make_uint4(h[0], h[1], h[2], h[3]);
            continue;
          }
        }
        uint32_t part[Tr::kQTerms][2] = {};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = smxx::unpack2<T>(w4[k]);
          float x = ldexpf(f.x, shift), y = ldexpf(f.y, shift);
#pragma unroll
          for (int j = 0; j < Tr::kQTerms; ++j) {
            const uint32_t h = to_e4m3(x, y);
            part[j][k / 2] |= h << (16 * (k % 2));
            const float2 hf = from_e4m3(h);
            x = (x - hf.x) * 16.f;
            y = (y - hf.y) * 16.f;
          }
        }
#pragma unroll
        for (int j = 0; j < Tr::kQTerms; ++j)
          *reinterpret_cast<uint2*>(slab + query_fp8_offset<Tr::kNS>(j * Tr::kNq + slab_row, 8 * ch)) =
              make_uint2(part[j][0], part[j][1]);
      }
      if (lane8 == 0) sColScale[r] = finite ? ldexpf(softmax.scale_log2, -shift) : NAN;
    }
    fence_smem_for_wgmma();
    __syncthreads();  // the query and its rows' scales are in shared memory
    if (first_item) MLA_JAX_PHASE(3);

    // Per S^T accumulator column: softmax scale (log2 domain, kv_scale and
    // the query's power of two folded in) and visible length (worked out
    // only for the tiles that need it: registers are short).
    float col_scale[kColsS];
#pragma unroll
    for (int ci = 0; ci < kColsS; ++ci) col_scale[ci] = sColScale[row0 + col_of(ci)];
    auto limit_of = [&](int ci) {
      const int col = row0 + col_of(ci);
      return col < rows ? static_cast<int>(min(visible_len(it.seq_len, p.q_len, col / p.num_heads, p.causal), tok_end))
                        : 0;
    };
    // Every live row sees at least this many tokens (query token 0's).
    const int min_limit = static_cast<int>(min(visible_len(it.seq_len, p.q_len, 0, p.causal), tok_end));

    float m_run[kColsS], l_part[kColsS];
#pragma unroll
    for (int ci = 0; ci < kColsS; ++ci) {
      m_run[ci] = -INFINITY;
      l_part[ci] = 0.f;
    }
    clear(tOrO);
    float r_run = 0.f;  // sparse: see step 2

    const int tok_row0 = 16 * warp + g;  // this thread's S^T token rows: tok_row0, tok_row0 + 8
    // Sparse: the scale group of this warp's O^T features.
    const int grp = kSplit ? 2 * wg + (warp >> 1) : warp;
    // Every consumer of a stage has waited on each of its earlier phases
    // (kN = 16: the stage's owner; kN = 32: everyone), so a parity wait
    // names tile t's phase alone.
    for (int t = kSplit ? 0 : wg; t < num_tiles; t += kSplit ? 1 : kW) {
      const int j = t % kS;
      const char* stage = shared + Tr::kSmemKv + j * Tr::kStageBytes;
      // The refill's page, looked up early by whoever may issue it.
      int next_entry = 0;
      // Sparse: the top-k entries of the refill's tokens (this lane's two)
      // and of this thread's S^T rows (tokens tok_row0, tok_row0 + 8),
      // loaded here and checked where they are used (the refill, the
      // masking), so that the loads' latency passes during the wait.
      int next_rows[2] = {-1, -1};
      int tok_entry[2] = {0, 0};
      if constexpr (kSparse) {
        if (t + kS < num_tiles) {
          next_rows[0] = MLA_SPARSE_ENTRY(t + kS, lane);
          next_rows[1] = MLA_SPARSE_ENTRY(t + kS, lane + 32);
        }
        tok_entry[0] = MLA_SPARSE_ENTRY(t, tok_row0);
        tok_entry[1] = MLA_SPARSE_ENTRY(t, tok_row0 + 8);
      } else {
        if (lane == 0 && t + kS < num_tiles) next_entry = fetch_entry(t + kS);
      }
      FullBarrier::wait(&kv_full[j], ((stage_parity >> j) ^ static_cast<uint32_t>(t / kS)) & 1u);
      if (first_item && t == 0) MLA_JAX_PHASE(4);
      // Sparse: the stage was written by cp.async (generic proxy) and the
      // S^T wgmmas read it through the async proxy.
      if constexpr (kSparse) fence_smem_for_wgmma();

      // 1. S^T = K Q^T over the 18 k-steps (16 of ckv, then 2 of kpe) for
      // the warpgroup's rows, straight from the stage. The FP8 products
      // accumulate at less than float precision inside the tensor core,
      // with an error that grows with the running sum, so the sum runs in
      // groups of kSGroupSteps k-steps, each from zero, added up in float
      // registers (the query's parts together), in two accumulators so
      // that a group's wgmmas run while the previous group is added.
      if constexpr (kSparse) {
        // Sparse: the kpe part (bf16, four k-steps) first, then the ckv
        // part in eight chains of two k-steps, chain c in scale group c / 2;
        // each chain's sum (the query's parts together) times the token's
        // scale of its group is added in float registers.
        Tensor sKn = make_tensor(make_smem_ptr(reinterpret_cast<const ElemS*>(stage)), typename Tr::LayoutKn{});
        Tensor sKr = make_tensor(make_smem_ptr(reinterpret_cast<const ElemR*>(stage + Tr::kRopeOffset)),
                                 typename Tr::LayoutKr{});
        Tensor tSrKn = thr_s.partition_fragment_A(sKn);  // (MMA, 1, 16) descriptors
        Tensor tSrKr = thr_r.partition_fragment_A(sKr);  // (MMA, 1, 4)
        Tensor tRacc = partition_fragment_C(mma_r, Shape<_64, Int<Tr::kNq>>{});
        static_assert(decltype(size(tRacc))::value == kSVals);
        warpgroup_fence_operand(tRacc);
        warpgroup_arrive();
#pragma unroll
        for (int k = 0; k < Tr::kRopeSteps; ++k) {
          mma_r.accumulate_ = k == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
          gemm(mma_r, tSrKr(_, _, k), tSrQr(_, _, k), tRacc);
        }
        warpgroup_commit_batch();
        auto issue = [&](int c, auto& acc) __attribute__((always_inline)) {
          warpgroup_fence_operand(acc);
          warpgroup_arrive();
#pragma unroll
          for (int k = 2 * c; k < 2 * c + 2; ++k) {
            mma_s.accumulate_ = k == 2 * c ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
            gemm(mma_s, tSrKn(_, _, k), tSrQn(_, _, k), acc);
          }
          warpgroup_commit_batch();
        };
        // The scales [group] of this thread's two tokens.
        const float4 sc[2] = {*reinterpret_cast<const float4*>(stage + Tr::kScaleOffset + tok_row0 * 16),
                              *reinterpret_cast<const float4*>(stage + Tr::kScaleOffset + (tok_row0 + 8) * 16)};
        auto scale_of = [&](int half, int grp) {
          const float4 v = sc[half];
          return grp == 0 ? v.x : grp == 1 ? v.y : grp == 2 ? v.z : v.w;
        };
        auto add = [&](int c, auto& acc) __attribute__((always_inline)) {
          warpgroup_fence_operand(acc);
#pragma unroll
          for (int e = 0; e < kSVals; ++e)
            tSrS(e) += query_parts_sum<Tr::kQTerms, kSVals>(acc, e) * scale_of((e >> 1) & 1, c / 2);
        };
        issue(0, tSacc);
#pragma unroll
        for (int c = 1; c < 8; ++c) {
          if (c % 2) issue(c, tSacc2); else issue(c, tSacc);
          warpgroup_wait<1>();
          if (c == 1) {
            warpgroup_fence_operand(tRacc);
#pragma unroll
            for (int e = 0; e < kSVals; ++e) tSrS(e) = tRacc(e);
          }
          if (c % 2) add(c - 1, tSacc); else add(c - 1, tSacc2);
        }
        warpgroup_wait<0>();
        add(7, tSacc2);
      } else {
        constexpr int kG = Tr::kSGroupSteps, kGroups = (Tr::kSSteps + kG - 1) / kG;
        Tensor sKn = make_tensor(make_smem_ptr(reinterpret_cast<const ElemS*>(stage)), typename Tr::LayoutKn{});
        Tensor sKr = make_tensor(make_smem_ptr(reinterpret_cast<const ElemS*>(stage + Tr::kRopeOffset)),
                                 typename Tr::LayoutKr{});
        Tensor tSrKn = thr_s.partition_fragment_A(sKn);  // (MMA, 1, 16) descriptors
        Tensor tSrKr = thr_s.partition_fragment_A(sKr);  // (MMA, 1, 2)
        auto issue = [&](int grp, auto& acc) __attribute__((always_inline)) {
          warpgroup_fence_operand(acc);
          warpgroup_arrive();
#pragma unroll
          for (int k = kG * grp; k < kG * grp + kG && k < Tr::kSSteps; ++k) {
            mma_s.accumulate_ = k == kG * grp ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
            if (k < 16) {
              gemm(mma_s, tSrKn(_, _, k), tSrQn(_, _, k), acc);
            } else {
              gemm(mma_s, tSrKr(_, _, k - 16), tSrQr(_, _, k - 16), acc);
            }
          }
          warpgroup_commit_batch();
        };
        auto add = [&](int grp, auto& acc) __attribute__((always_inline)) {
          warpgroup_fence_operand(acc);
#pragma unroll
          for (int e = 0; e < kSVals; ++e)
            tSrS(e) = (grp == 0 ? 0.f : tSrS(e)) + query_parts_sum<Tr::kQTerms, kSVals>(acc, e);
        };
        issue(0, tSacc);
#pragma unroll
        for (int grp = 1; grp < kGroups; ++grp) {
          if (grp % 2) issue(grp, tSacc2); else issue(grp, tSacc);
          warpgroup_wait<1>();
          if (grp % 2) add(grp - 1, tSacc); else add(grp - 1, tSacc2);
        }
        warpgroup_wait<0>();
        if ((kGroups - 1) % 2) add(kGroups - 1, tSacc2); else add(kGroups - 1, tSacc);
      }
      // Sparse: the largest |scale| of this warp's group (warp) over the
      // tile, and the running one (r_run): V^T is converted times
      // scale / r_run, so O^T is in units of r_run, and a larger one
      // rescales O^T by the ratio (gfac) with the softmax factors.
      float gfac = 1.f, inv_r = 0.f;
      if constexpr (kSparse) {
        const float* scl = reinterpret_cast<const float*>(stage + Tr::kScaleOffset);
        float a = fmaxf(fabsf(scl[4 * lane + grp]), fabsf(scl[4 * (lane + 32) + grp]));
#pragma unroll
        for (int o = 1; o < 32; o *= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        // Below the smallest normal float r is taken as 0 (1 / r would be
        // infinite, and 0 x inf NaN): such values contribute nothing.
        const float r_new = fmaxf(r_run, a);
        const bool normal = r_new >= 1.17549435e-38f;
        gfac = normal ? r_run / r_new : 1.f;
        inv_r = normal ? 1.f / r_new : 0.f;
        r_run = r_new;
      }
      // Sparse, kN = 32: the V^T factors of step 4 (below) taken now, as
      // other warps refill the scales once both warpgroups are past step 3.
      uint32_t sv_tile[kSplit && kSparse ? 4 : 1][2];
      if constexpr (kSplit && kSparse) {
#pragma unroll
        for (int js = 0; js < 4; ++js) sparse_v_factors_of<Tr>(stage, 16 * js + 2 * quad, grp, inv_r, sv_tile[js]);
      }

      // 2. Column maxima (masked, scaled).
      const int tok0 = (tile_begin + t) * kBlockN;
      const bool all_visible = !kSparse && tok0 + kBlockN <= min_limit;
      float tmax[kColsS];
#pragma unroll
      for (int ci = 0; ci < kColsS; ++ci) tmax[ci] = -INFINITY;
      if (all_visible) {
#pragma unroll
        for (int e = 0; e < kSVals; ++e) {
          const int ci = col_index(e);
          tSrS(e) *= col_scale[ci];
          tmax[ci] = fmaxf(tmax[ci], tSrS(e));
        }
      } else {
        int limit[kColsS];
#pragma unroll
        for (int ci = 0; ci < kColsS; ++ci) limit[ci] = limit_of(ci);
        bool tok_live[2] = {true, true};
        if constexpr (kSparse) {
          tok_live[0] = sparse_checked(p, tok_entry[0]) >= 0;
          tok_live[1] = sparse_checked(p, tok_entry[1]) >= 0;
        }
#pragma unroll
        for (int e = 0; e < kSVals; ++e) {
          const int ci = col_index(e);
          float v = tSrS(e) * col_scale[ci];
          if (tok0 + tok_row0 + 8 * ((e >> 1) & 1) >= limit[ci] || (kSparse && !tok_live[(e >> 1) & 1])) v = -INFINITY;
          tSrS(e) = v;
          tmax[ci] = fmaxf(tmax[ci], v);
        }
      }
      float* red = sRed + wg * 4 * kN;
#pragma unroll
      for (int ci = 0; ci < kColsS; ++ci) {
        tmax[ci] = fmaxf(tmax[ci], __shfl_xor_sync(0xffffffffu, tmax[ci], 4));
        tmax[ci] = fmaxf(tmax[ci], __shfl_xor_sync(0xffffffffu, tmax[ci], 8));
        tmax[ci] = fmaxf(tmax[ci], __shfl_xor_sync(0xffffffffu, tmax[ci], 16));
        if (g == 0) red[warp * kN + col_of(ci)] = tmax[ci];
      }
      NamedBarrier::sync(128, wg);
      float c[kColsS];
      bool rescale = false;
#pragma unroll
      for (int ci = 0; ci < kColsS; ++ci) {
        const int col = col_of(ci);
        float m = fmaxf(fmaxf(red[col], red[kN + col]), fmaxf(red[2 * kN + col], red[3 * kN + col]));
        m = fmaxf(m, m_run[ci]);
        c[ci] = m == -INFINITY ? 1.f : fast_exp2(m_run[ci] - m);
        rescale |= c[ci] != 1.f;
        m_run[ci] = m;
      }
      // 3. P^T (fp16) for the B operand; row sums. kN = 16: the
      // warpgroup's own buffer; kN = 32: the buffer of the tile's parity
      // (its rows 16 wg ..), which O^T(t - 2) of both warpgroups is done
      // with (each completes its O^T before the barrier of the next tile).
      const int p_buf = kSplit ? (t & 1) : wg;
      char* const sP_shared = shared + Tr::kSmemP + p_buf * Tr::kPBytes;
      float sum[kColsS];
#pragma unroll
      for (int ci = 0; ci < kColsS; ++ci) sum[ci] = 0.f;
#pragma unroll
      for (int e = 0; e < kSVals; ++e) {
        const int ci = col_index(e);
        const float pv = fast_exp2(tSrS(e) - (m_run[ci] == -INFINITY ? 0.f : m_run[ci]));
        sum[ci] += pv;
        *reinterpret_cast<__half*>(sP_shared + kmajor_offset<kN>(row0 + col_of(ci), tok_row0 + 8 * ((e >> 1) & 1))) =
            __float2half_rn(pv);
      }
#pragma unroll
      for (int ci = 0; ci < kColsS; ++ci) l_part[ci] = l_part[ci] * c[ci] + sum[ci];
      if constexpr (kSplit) {
        // The rows' rescale factors for both warpgroups' O^T (warp 0's
        // quads hold the warpgroup's 16 rows; every warp has the same c).
        float* resc = sRescale + (t & 1) * kN + row0;
        if (warp == 0 && g == 0) {
#pragma unroll
          for (int ci = 0; ci < kColsS; ++ci) resc[col_of(ci)] = c[ci];
        }
        fence_smem_for_wgmma();
        // P^T and the factors of all 32 rows are in shared memory (and
        // every thread read `red`); barrier ids 0 .. kW - 1 are the
        // warpgroups'.
        NamedBarrier::sync(2 * 128, kW);
        float co[kCols];
        rescale = kSparse && gfac != 1.f;  // sparse: O^T is in units of this warp's r_run
#pragma unroll
        for (int ci = 0; ci < kCols; ++ci) {
          co[ci] = sRescale[(t & 1) * kN + col_of(ci)] * gfac;
          rescale |= co[ci] != 1.f;
        }
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= co[col_index(i % kOVals)];
        }
      } else if constexpr (kSparse) {
        if (__any_sync(0xffffffffu, rescale || gfac != 1.f)) {
#pragma unroll
          for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= c[col_index(i % kOVals)] * gfac;
        }
        fence_smem_for_wgmma();
        NamedBarrier::sync(128, wg);  // P^T is complete (and every thread read `red`)
      } else {
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= c[col_index(i % kOVals)];
        }
        fence_smem_for_wgmma();
        NamedBarrier::sync(128, wg);  // P^T is complete (and every thread read `red`)
      }
      const auto tOrP = p_operand(p_buf);

      // 4. O^T += V^T P^T over four 16-token k-steps. Tokens at or past
      // tok_end hold whatever the cache has there: their values are
      // zeroed, as 0 x NaN would poison the row.
      const int valid = static_cast<int>(min(int64_t{kBlockN}, tok_end - tok0));
      // kTail: the tile ends before its 64th token (its own instantiation,
      // so full tiles carry no selects).
      // A thread's V^T bytes of one token: 16 features (kN = 16), or 8
      // (kN = 32: half a 16-byte chunk of box 2 wg + warp / 2); see
      // swapab_traits.h for which.
      constexpr int kVWords = kMBlocks / 2;  // 32-bit words of e4m3 per token
      using VRaw = uint32_t[4][kVWords];
      auto load_v = [&](int js, VRaw& raw, auto tail_const) __attribute__((always_inline)) {
        const int tau0 = 16 * js + 2 * quad;
        const int taus[4] = {tau0, tau0 + 1, tau0 + 8, tau0 + 9};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const bool zero = decltype(tail_const)::value && taus[q] >= valid;
          if constexpr (kSplit) {
            const int chunk = 4 * (warp & 1) + (g >> 1);
            const uint2 v = *reinterpret_cast<const uint2*>(stage + (2 * wg + (warp >> 1)) * Tr::kCkvBoxBytes +
                                                           taus[q] * 128 + ((chunk ^ (taus[q] & 7)) << 4) + (g & 1) * 8);
            raw[q][0] = zero ? 0u : v.x;
            raw[q][1] = zero ? 0u : v.y;
          } else {
            const uint4 v = lds128(stage + warp * Tr::kCkvBoxBytes + taus[q] * 128 + ((g ^ (taus[q] & 7)) << 4));
            raw[q][0] = zero ? 0u : v.x;
            raw[q][1] = zero ? 0u : v.y;
            raw[q][2] = zero ? 0u : v.z;
            raw[q][3] = zero ? 0u : v.w;
          }
        }
      };
      // Words of m-blocks 2q and 2q + 1 of the V^T fragment from the raw
      // bytes' word q: bytes (token a, token a + 1) of features 4q + {0, 1}
      // and 4q + {2, 3}.
      // Sparse: sv[0] / sv[1] are the fp16 pairs scale / r_run of tokens
      // (a, a + 1) and (a + 8, a + 9) in this warp's group.
      uint32_t sv[2] = {0u, 0u};
      auto convert_pair = [&](const VRaw& x, int q, auto& frag) __attribute__((always_inline)) {
        auto words = recast<uint32_t>(frag);  // word u of m-block mb at u + 4 mb
        const uint32_t lo01 = __byte_perm(x[0][q], x[1][q], 0x5140), hi01 = __byte_perm(x[0][q], x[1][q], 0x7362);
        const uint32_t lo23 = __byte_perm(x[2][q], x[3][q], 0x5140), hi23 = __byte_perm(x[2][q], x[3][q], 0x7362);
        uint32_t w[8];
        e4m3x4_to_f16x2(lo01, w[0], w[1]);
        e4m3x4_to_f16x2(lo23, w[2], w[3]);
        e4m3x4_to_f16x2(hi01, w[4], w[5]);
        e4m3x4_to_f16x2(hi23, w[6], w[7]);
        if constexpr (kSparse) {
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&w[u]),
                                      *reinterpret_cast<const __half2*>(&sv[(u >> 1) & 1]));
            w[u] = *reinterpret_cast<const uint32_t*>(&r);
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) words(4 * (2 * q + u / 4) + u % 4) = w[u];
      };
      // One commit group per m-block pair and k-step, so that a pair's
      // registers are converted for the next k-step while the other pairs'
      // products run: before writing pair q of k-step js, wait until at
      // most kVWords - 1 groups are pending, i.e. pair q of k-step js - 1
      // is done with its registers (groups complete in order).
      auto pv = [&](auto tail) __attribute__((always_inline)) {
        VRaw raw;
        warpgroup_fence_operand(tOrO);
        load_v(0, raw, tail);
        mma.accumulate_ = GMMA::ScaleOut::One;
#pragma unroll
        for (int js = 0; js < 4; ++js) {
          if constexpr (kSparse && kSplit) {
            sv[0] = sv_tile[js][0];
            sv[1] = sv_tile[js][1];
          } else if constexpr (kSparse) {
            sparse_v_factors_of<Tr>(stage, 16 * js + 2 * quad, grp, inv_r, sv);
          }
#pragma unroll
          for (int q = 0; q < kVWords; ++q) {
            if (js > 0) warpgroup_wait<kVWords - 1>();
            convert_pair(raw, q, tVa);
            // The raw words are all converted: load the next k-step's.
            if (q == kVWords - 1 && js < 3) load_v(js + 1, raw, tail);
            // kN = 16: this warp has read its box for the last time (the
            // S^T wgmmas, which read every box, are done): step 5 for it.
            // Sparse kN = 32: the same for its ckv chunks, and both
            // warpgroups are past step 3 (their reads of kpe and scales).
            if constexpr (kSparse) {
              if (q == kVWords - 1 && js == 3) {
                __syncwarp();
                if (t + kS < num_tiles) {
                  const int rows_of[2] = {sparse_checked(p, next_rows[0]), sparse_checked(p, next_rows[1])};
                  MLA_SPARSE_GATHER(t + kS, rows_of);
                }
              }
            } else if constexpr (!kSplit) {
              if (q == kVWords - 1 && js == 3) {
                __syncwarp();
                if (lane == 0 && t + kS < num_tiles) issue_boxes(t + kS, next_entry, warp, 1, warp == 0);
              }
            }
            warpgroup_fence_operand(tVa);
            warpgroup_arrive();
#pragma unroll
            for (int h = 0; h < 2; ++h) gemm(mma, tVa(_, 2 * q + h, 0), tOrP(_, 0, js), tOrO(_, 2 * q + h, 0));
            warpgroup_commit_batch();
          }
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
      };
      if (valid < kBlockN) {
        pv(std::true_type{});
      } else {
        pv(std::false_type{});
      }
      // 5. The stage is free once its readers are done with it: tile t + kS
      // (kN = 16 and sparse: each warp refills its share in step 4; dense
      // kN = 32: once all eight warps are done).
      if constexpr (kSplit && !kSparse) {
        // The eighth warp to finish the tile refills its stage. The counter
        // only grows (by 8 per tile), so it needs no reset.
        __syncwarp();
        if (lane == 0) {
          __threadfence_block();  // this warp's reads of the stage before the count
          const int done = atomicAdd(&s_release[j], 1);
          if ((done & 7) == 7 && t + kS < num_tiles) {
            __threadfence_block();  // the other warps' reads before the refill
            issue_boxes(t + kS, next_entry, 0, 4, true);
          }
        }
      }
    }
    if (first_item) MLA_JAX_PHASE(5);
#pragma unroll
    for (int j = 0; j < kS; ++j) {
      const int uses = num_tiles > j ? (num_tiles - 1 - j) / kS + 1 : 0;
      stage_parity ^= static_cast<uint32_t>(uses & 1) << j;
    }

    // Epilogue: merge the warpgroups' (m, l, O^T) and write (kN = 32: the
    // (m, l) of row r come from warpgroup r / 16, and each warpgroup writes
    // its own features).
#pragma unroll
    for (int ci = 0; ci < kColsS; ++ci) {
      l_part[ci] += __shfl_xor_sync(0xffffffffu, l_part[ci], 4);
      l_part[ci] += __shfl_xor_sync(0xffffffffu, l_part[ci], 8);
      l_part[ci] += __shfl_xor_sync(0xffffffffu, l_part[ci], 16);
      if (g == 0) {
        sRed[(wg * 4 + warp) * kN + row0 + col_of(ci)] = l_part[ci];
        if (warp == 0) sMax[wg * kN + row0 + col_of(ci)] = m_run[ci];
      }
    }
    __syncthreads();
    const bool bad = !it.len_ok || *s_bad_page != 0;
    const bool split = it.splits > 1;
    // Column col's LSE and output scale from its max and sum; the LSE is
    // written by one thread.
    auto finish_column = [&](int ci, float mx, float total) {
      const int col = col_of(ci);
      float lse, scale;
      if (bad) {
        lse = NAN;
        scale = NAN;
      } else if (total > 0.f) {
        lse = mx * kLn2 + logf(total);
        scale = softmax.kv_scale / total;
        if (p.attn_sink != nullptr && !split && col < rows) scale /= 1.f + __expf(p.attn_sink[col % p.num_heads] - lse);
      } else {
        lse = -INFINITY;  // nothing visible: out 0
        scale = 0.f;
      }
      if (wg == 0 && warp == 0 && g == 0 && col < rows) {
        const int64_t out_row = split ? int64_t{item} * rows + col : int64_t{it.b} * rows + col;
        (split ? ws.lse_accum : p.lse)[out_row] = lse;
      }
      return scale;
    };
    // Thread (warp, g) holds features feat0 + 2 mb + h of its columns:
    // kFeat contiguous values of each, written times `scale`.
    constexpr int kFeat = 2 * kMBlocks;
    const int64_t block_row = (split ? int64_t{item} : int64_t{it.b}) * rows;
    const int feat0 = kSplit ? 256 * wg + 64 * warp + 8 * g : 128 * warp + 16 * g;
    auto write_column = [&](int ci, float scale) {
      const int col = col_of(ci);
      if (col >= rows) return;
      float v[kFeat];
#pragma unroll
      for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
        for (int h = 0; h < 2; ++h) v[2 * mb + h] = tOrO((ci & 1) + 4 * (ci >> 1) + 2 * h, mb, 0) * scale;
      }
      // Split requests' partials are stored in T like the output (workspace.h).
      uint4* dst = reinterpret_cast<uint4*>((split ? ws.partials<T>() : static_cast<T*>(p.out)) +
                                            (block_row + col) * Tr::kDimNope + feat0);
#pragma unroll
      for (int k = 0; k < kFeat / 8; ++k)
        dst[k] = make_uint4(smxx::pack2<T>(v[8 * k], v[8 * k + 1]), smxx::pack2<T>(v[8 * k + 2], v[8 * k + 3]),
                            smxx::pack2<T>(v[8 * k + 4], v[8 * k + 5]), smxx::pack2<T>(v[8 * k + 6], v[8 * k + 7]));
    };
    if constexpr (kSplit) {
      // Row col's (m, l) from its owner; each warpgroup writes its
      // features, one column at a time.
#pragma unroll
      for (int ci = 0; ci < kCols; ++ci) {
        const int col = col_of(ci), owner = col / Tr::kNq;
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) total += sRed[(owner * 4 + k) * kN + col];
        // Sparse: O^T is in units of this warp's r_run.
        write_column(ci, finish_column(ci, sMax[owner * kN + col], total) * (kSparse ? r_run : 1.f));
      }
    } else {
      // Warpgroups 1.. hand their O^T, scaled to the common max, to
      // warpgroup 0 through the (idle) stages, which writes the output.
      float* xch = reinterpret_cast<float*>(shared + Tr::kSmemKv);
      float own_factor[kCols], out_scale[kCols];
#pragma unroll
      for (int ci = 0; ci < kCols; ++ci) {
        const int col = col_of(ci);
        float mx = -INFINITY, total = 0.f;
#pragma unroll
        for (int w = 0; w < kW; ++w) mx = fmaxf(mx, sMax[w * kN + col]);
#pragma unroll
        for (int w = 0; w < kW; ++w) {
          const float mw = sMax[w * kN + col];
          const float f = mw == -INFINITY ? 0.f : fast_exp2(mw - mx);
          if (w == wg) own_factor[ci] = kSparse ? f * r_run : f;  // sparse: O^T is in units of r_run
#pragma unroll
          for (int k = 0; k < 4; ++k) total += sRed[(w * 4 + k) * kN + col] * f;
        }
        out_scale[ci] = finish_column(ci, mx, total);
      }
      constexpr int kOPerThread = kMBlocks * kOVals;
      if (wg > 0) {
        float* mine = xch + (wg - 1) * (Tr::kOBytes / 4);
#pragma unroll
        for (int i = 0; i < kOPerThread; ++i) mine[i * 128 + wg_tid] = tOrO(i) * own_factor[col_index(i % kOVals)];
      }
      __syncthreads();
      if (wg == 0) {
#pragma unroll
        for (int i = 0; i < kOPerThread; ++i) {
          float o = tOrO(i) * own_factor[col_index(i % kOVals)];
#pragma unroll
          for (int w = 1; w < kW; ++w) o += xch[(w - 1) * (Tr::kOBytes / 4) + i * 128 + wg_tid];
          tOrO(i) = o;
        }
#pragma unroll
        for (int ci = 0; ci < kCols; ++ci) write_column(ci, out_scale[ci]);
      }
    }
    // The next item's TMA loads (async proxy) overwrite the stages read in
    // this item (and, at kN = 16, written by the epilogue's hand-off), after
    // the barrier that starts it.
    fence_smem_for_wgmma();
    if (first_item) MLA_JAX_PHASE(6);
  }
#undef MLA_SPARSE_ROW
#undef MLA_SPARSE_ENTRY
#undef MLA_SPARSE_GATHER
#endif  // sm_90a
}

}  // namespace sm90
}  // namespace mla_jax
