// Tile configuration of the Hopper (sm_90a) swap-AB decode kernel for dense
// FP8 caches with few query rows (decode_swapab.cuh).
//
// With few query rows (32 or fewer: 16 or 32 heads, or fewer heads times
// q_len), a 64-row wgmma block (the other Hopper kernels) spends most of its
// tensor work on zero rows, and an FP8 cache, which halves the bytes, cannot
// show it. Here the operands are swapped so that the 64 tokens of a KV tile
// are wgmma's M and the query rows its N (kN: 16 or 32):
//   S^T = K Q^T     m64n(q kNq)k32 e4m3 x 18 k-steps, kNq = 16 query rows
//                   per warpgroup, both operands in shared memory: A = the
//                   raw stage as TMA wrote it (its boxes are the K-major
//                   swizzled layouts, LayoutKn and LayoutKr), B = the
//                   warpgroup's slab of the query, q = kQTerms e4m3 parts
//                   per row (part j in slab rows j kNq .. j kNq + kNq - 1,
//                   weight 16^-j; after the row is scaled by a power of two
//                   that brings its largest value below 2^8, two parts hold
//                   a bf16 value exactly, three an fp16 one); the sum runs
//                   in groups of kSGroupSteps k-steps added in float
//                   registers, as the tensor core accumulates FP8 products
//                   at less than float precision;
//   O^T += V^T P^T  m64nNk16 fp16 per 64 features x 4 k-steps: A = the tile's
//                   values, as V^T (registers, converted from e4m3, exactly,
//                   one instruction per pair), B = P^T (shared memory).
// No conversion is spent on S^T; a bf16 query's two parts take the shared
// memory it took in fp16, an fp16 query's three half as much again. Either
// is one wgmma per k-step (N = 32 or 48).
//
// The O^T A operand is read from the raw e4m3 tile with 16-byte (kN = 32:
// 8-byte) shared-memory loads: thread (w, l) holds features 128 w + 16 (l /
// 4) + [0, 16), output row (m-block mb, half h) being feature 128 w + 16
// (l / 4) + 2 mb + h, and tokens in their natural order; the epilogue writes
// each thread's 16 features of a query row as contiguous bytes. With kN = 32
// thread (w, l) of warpgroup v holds the 8 features 256 v + 64 w + 8 (l / 4)
// + [0, 8), row (mb, h) being 256 v + 64 w + 8 (l / 4) + 2 mb + h.
//
// With 16 rows or fewer (kN = 16) the CTA's warpgroups work independently
// on interleaved tiles of an item (tile t belongs to warpgroup
// t % kWarpgroups), each with its own running max, sums and O^T; they merge
// at the item's end. The tiles stream through a ring of kStages stages (tile
// t in stage t % kStages, a multiple of kWarpgroups so that every stage has
// one owner), and the owner refills the stage with tile t + kStages once it
// has read tile t (each warp the ckv box that only it reads for V^T, warp 0
// also the kpe box; the stage's barrier takes four arrivals): a stage needs
// no "empty" barrier.
//
// With 17 to 32 rows (kN = 32) an O^T of all 512 features would need 128
// accumulator registers a thread (it spills), so the warpgroups split every
// tile's work by query rows for S^T and by features for O^T: warpgroup v
// computes S^T over all 18 k-steps for query rows [16 v, 16 v + 16) (its
// own slab of the query operand, as at kN = 16), runs their softmax and
// writes their P^T columns and rescale factors into a buffer shared by
// both (two buffers by tile parity); after one barrier of both warpgroups
// each rescales and accumulates O^T for its 256 features over all 32 rows,
// and writes its own half of the output. The running max and sum of a row
// live in the warpgroup that owns the row, which hands them to the other
// through shared memory at the item's end. A stage is free once all eight warps
// have read it: each warp counts itself in (s_release, shared memory) and
// the warp that completes the count refills the stage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
// CuTe's extended wgmma shapes (its op selectors use them only under
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED): m64n48k32 e4m3 for an fp16 query.
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>
#include <cute/tensor.hpp>

#include <type_traits>

#include "csrc/smxx/schedule_inline.cuh"

namespace mla_jax {
namespace sm90 {

// Byte offset of element (row, k) of the FP8 query operand [kRows, 576]
// (swapab_traits.h LayoutQn, LayoutQr: features 0..511 in the
// 128-byte-swizzled K-major layout, 8-row x 128-byte atoms, row atoms first,
// then 128-column blocks; the rope features 512..575 after them in the
// 64-byte-swizzled one, 8-row x 64-byte atoms, 16-byte chunk c of row r at
// c ^ ((r / 2) % 4)).
template <int kRows>
__host__ __device__ __forceinline__ int query_fp8_offset(int row, int k) {
  if (k < 512)
    return (k >> 7) * (kRows * 128) + (row >> 3) * 1024 + (row & 7) * 128 + ((((k >> 4) & 7) ^ (row & 7)) << 4) +
           (k & 15);
  k -= 512;
  return kRows * 512 + (row >> 3) * 512 + (row & 7) * 64 + ((((k >> 4) & 3) ^ ((row >> 1) & 3)) << 4) + (k & 15);
}

// Byte offset of element (row, k) of a [rows, cols] 16-bit operand in the
// 128-byte-swizzled K-major layout (CuTe's tile_to_shape of the SW128 atom:
// 8-row x 64-element atoms, row atoms first, then 64-column blocks).
template <int kRows>
__host__ __device__ __forceinline__ int kmajor_offset(int row, int k) {
  return (k >> 6) * (kRows * 128) + (row >> 3) * 1024 + (row & 7) * 128 + ((((k >> 3) & 7) ^ (row & 7)) << 4) +
         (k & 7) * 2;
}

// Warpgroups per CTA and KV stages of the swap-AB kernel. Three warpgroups
// leave 168 registers a thread, and the kernel spills there (slower than
// two, docs/perf.md); four 36 KB stages read as fast as five (which needed
// a cross-warpgroup hand-off, docs/perf.md) and leave room for a 32-row
// query in either type.
constexpr int kSwapAbWarpgroups = 2;
constexpr int kSwapAbStages = 4;

// kSparse_: DeepSeek V3.2 sparse decode over fp8_ds_mla rows (656 bytes:
// 512 e4m3 ckv values, four float32 scales, one per 128 values, 64 bf16 kpe
// values) gathered by top-k index, bf16 query, 16 or 32 rows (see below).
// The kpe part of S^T: its K-major layout for `kRows` rows (64 values each)
// and its wgmma: e4m3 like the ckv part (dense FP8 cache), or bf16
// (fp8_ds_mla, sparse).
template <bool kBf16>
struct SwapAbRope {
  template <int kRows>
  using Layout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW64_Atom<cute::float_e4m3_t>{},
                                              cute::Shape<cute::Int<kRows>, cute::_64>{}));
  template <int kNq, typename MmaS>
  using Mma = MmaS;
};
template <>
struct SwapAbRope<true> {
  template <int kRows>
  using Layout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<cute::bfloat16_t>{},
                                              cute::Shape<cute::Int<kRows>, cute::_64>{}));
  template <int kNq, typename MmaS>
  using Mma = decltype(cute::SM90::GMMA::ss_op_selector<cute::bfloat16_t, cute::bfloat16_t, float,
                                                        cute::Shape<cute::_64, cute::Int<kNq>, cute::_16>,
                                                        cute::GMMA::Major::K, cute::GMMA::Major::K>());
};

template <typename QType_, int kRows_, int kWarpgroups_ = kSwapAbWarpgroups, int kStages_ = kSwapAbStages,
          bool kSparse_ = false>
struct SwapAbTraits {
  using QType = QType_;          // __nv_bfloat16 or __half: query and output type
  using Elem = cute::half_t;     // O^T product operand type
  using ElemS = cute::float_e4m3_t;  // S^T product operand type (ckv part)
  // The kpe part's: e4m3 (dense FP8 cache) or bf16 (fp8_ds_mla).
  using ElemR = std::conditional_t<kSparse_, cute::bfloat16_t, cute::float_e4m3_t>;
  static constexpr int kN = kRows_;  // query rows per CTA (O^T wgmma N)
  static_assert(kN == 16 || kN == 32);
  // Sparse fp8_ds_mla: the rows are gathered by index with cp.async (kN =
  // 16: each warp its own ckv box, its group's scale and two 16-byte chunks
  // of kpe of all 64 tokens; kN = 32: every warp of both warpgroups a share
  // of each tile, decode_swapab.cuh sparse_gather_split); S^T sums each
  // 128-value group (two chains of two k-steps) times the token's scale of
  // that group, plus the kpe part as a bf16 product (the query's kpe part in
  // bf16); O^T takes V^T converted to fp16 times the token's scale over the
  // warp's running maximum of that scale (a warp's O^T features lie in one
  // group: at kN = 16 warp w holds features 128 w .., at kN = 32 warp w of
  // warpgroup v features 256 v + 64 w .., group 2 v + w / 2). bf16 query
  // (the kpe product is bf16).
  static constexpr bool kSparse = kSparse_;
  static_assert(!kSparse || std::is_same_v<QType, __nv_bfloat16>);
  // e4m3 parts per query row: a bf16 value (8 significant bits) is the sum
  // of two, an fp16 one (11) of three.
  static constexpr int kQTerms = std::is_same_v<QType, __half> ? 3 : 2;
  // Both warpgroups on every tile, S^T split by rows, O^T by features (above).
  static constexpr bool kSplitO = kN == 32;
  // Query rows of a warpgroup's S^T and softmax (S^T wgmma N per part), and
  // the query operand's slabs: slab v holds rows [v kNq, v kNq + kNq).
  static constexpr int kNq = kSplitO ? 16 : kN;
  static constexpr int kQSlabs = kN / kNq;
  static constexpr int kNS = kQTerms * kNq;  // S^T wgmma N: part j of slab row r is B row j kNq + r
  static constexpr int kOFeatures = kSplitO ? 256 : 512;  // O^T rows per warpgroup
  static constexpr int kDimNope = 512, kDimRope = 64, kDimQK = 576;
  static constexpr int kSSteps = kDimQK / 32;  // S^T k-steps (dense): 16 of ckv, then 2 of kpe
  static constexpr int kRopeSteps = kSparse ? kDimRope / 16 : kDimRope / 32;  // of the kpe part
  // S^T's k-steps per float accumulation group (decode_swapab.cuh, step 1).
  // The tensor core's FP8 accumulation error grows with the group: one
  // k-step per group at kN = 16, where it costs no time; two at kN = 32,
  // where one step per group is markedly slower (docs/perf.md).
  static constexpr int kSGroupSteps = kN == 16 ? 1 : 2;
  static constexpr int kBlockN = 64;  // tokens per KV tile (wgmma M; the scheduler's block)
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * kWarpgroups;
  static_assert(kSplitO ? kWarpgroups == 2 : kStages % kWarpgroups == 0);
  static constexpr int kColsPerThread = kN / 4;   // query rows in a thread's O^T accumulator columns
  static constexpr int kColsPerThreadS = kNq / 4;  // and in its S^T ones

  // A raw FP8 stage: four 128-byte-swizzled TMA boxes of ckv (64 tokens x
  // 128 features), then the kpe box (64 tokens x 64 bytes, 64-byte-swizzled).
  // Sparse: the same ckv boxes (written by cp.async at the swizzled
  // offsets), kpe as a bf16 box (64 tokens x 128 bytes, 128-byte-swizzled),
  // then the scales [token][group] as float32.
  static constexpr int kCkvBoxBytes = 64 * 128;
  static constexpr int kRopeOffset = 4 * kCkvBoxBytes;
  static constexpr int kRopeBytes = 64 * kDimRope * (kSparse ? 2 : 1);
  static constexpr int kScaleOffset = kRopeOffset + kRopeBytes;
  static constexpr int kStageBytes = kScaleOffset + (kSparse ? 64 * 16 : 0);

  // S^T operands, both K-major e4m3 in shared memory: the stage as the
  // wgmma A operand (the TMA boxes are these layouts) and the query as B.
  using LayoutKn = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<ElemS>{},
                                                cute::Shape<cute::Int<kBlockN>, cute::Int<kDimNope>>{}));
  using LayoutKr = typename SwapAbRope<kSparse>::template Layout<kBlockN>;
  using LayoutQn = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<ElemS>{},
                                                cute::Shape<cute::Int<kNS>, cute::Int<kDimNope>>{}));
  // Sparse: the kpe part of the query in bf16, kNq rows (no parts).
  using LayoutQr = typename SwapAbRope<kSparse>::template Layout<kSparse ? kNq : kNS>;
  // N = 48 (fp16 query) named outright: the default selector would issue
  // three m64n16k32 per k-step, each reading the A tile again.
  using MmaS = std::conditional_t<kNS == 48, cute::SM90::GMMA::MMA_64x48x32_F32E4M3E4M3_SS_TN<>,
                                  decltype(cute::SM90::GMMA::ss_op_selector<
                                           ElemS, ElemS, float, cute::Shape<cute::_64, cute::Int<kNS>, cute::_32>,
                                           cute::GMMA::Major::K, cute::GMMA::Major::K>())>;
  static_assert(cute::size<1>(typename cute::MMA_Traits<MmaS>::Shape_MNK{}) == kNS, "one S^T wgmma per k-step");
  // The kpe part of S^T: MmaS (dense), or m64n(kNq)k16 bf16 (sparse).
  using MmaSr = typename SwapAbRope<kSparse>::template Mma<kNq, MmaS>;
  // O^T: P^T (fp16, B) in shared memory.
  using AtomK = cute::GMMA::Layout_K_SW128_Atom<Elem>;
  using LayoutP = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kN>, cute::Int<kBlockN>>{}));
  using MmaO = decltype(cute::SM90::GMMA::rs_op_selector<Elem, Elem, float,
                                                         cute::Shape<cute::_64, cute::Int<kN>, cute::_16>,
                                                         cute::GMMA::Major::K, cute::GMMA::Major::K>());

  // Shared memory, from a 1024-byte aligned base.
  static constexpr int kQRopeOffset = kNS * kDimNope;                 // in a slab: LayoutQn, then LayoutQr
  static constexpr int kQSlabBytes = kNS * kDimNope + (kSparse ? kNq * kDimRope * 2 : kNS * kDimRope);
  static constexpr int kSmemQ = 0;                                    // [slab]
  static constexpr int kSmemKv = kSmemQ + kQSlabs * kQSlabBytes;      // [stage]
  // P^T buffers: kN = 16 one per warpgroup, kN = 32 one per tile parity.
  static constexpr int kSmemP = kSmemKv + kStages * kStageBytes;
  static constexpr int kPBytes = kN * kBlockN * 2;
  static constexpr int kPBuffers = kSplitO ? 2 : kWarpgroups;
  static constexpr int kSmemRed = kSmemP + kPBuffers * kPBytes;         // [warpgroup][warp][kN] floats
  static constexpr int kSmemMax = kSmemRed + kWarpgroups * 4 * kN * 4;  // [warpgroup][kN] running maxima
  static constexpr int kSmemColScale = kSmemMax + kWarpgroups * kN * 4;  // [kN] per-row softmax scales
  // kN = 32: [tile parity][kN] the rows' O^T rescale factors.
  static constexpr int kSmemRescale = kSmemColScale + kN * 4;
  static constexpr int kSmemFlags = kSmemRescale + (kSplitO ? 2 * kN * 4 : 0);  // bad-page flag
  static constexpr int kSmemRelease = kSmemFlags + 16;                // [stage] warps done (kSplitO)
  static constexpr int kSmemBarriers = kSmemRelease + (kStages * 4 + 7) / 8 * 8;  // [stage] mbarriers
  // Small batches: this partition's items from the inline schedule
  // (smxx::PartItem[kInlineScheduleMaxBatch], then their count).
  static constexpr int kSmemItems = kSmemBarriers + kStages * 8;
  static constexpr int kSmemBytes =
      kSmemItems + smxx::kInlineScheduleMaxBatch * static_cast<int>(sizeof(smxx::PartItem)) + 16;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kQRopeOffset % 512 == 0 && kRopeOffset % 512 == 0);
  static_assert(kQSlabBytes % 1024 == 0 && kSmemKv % 1024 == 0 && kSmemP % 1024 == 0 && kPBytes % 1024 == 0 &&
                kStageBytes % 1024 == 0);
  static_assert(kSmemBarriers % 8 == 0);
  static_assert(kSmemAlloc <= 227 * 1024, "exceeds the sm_90 shared memory per block");
  // With kN = 16 the epilogue hands warpgroups 1.. 's O^T (float) to
  // warpgroup 0 through the stages.
  static constexpr int kOBytes = 128 * 8 * (kN / 2) * 4;
  static_assert(kSplitO || (kWarpgroups - 1) * kOBytes <= kStages * kStageBytes);
};

}  // namespace sm90
}  // namespace mla_jax
