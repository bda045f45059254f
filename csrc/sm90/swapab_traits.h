// Tile configuration of the Hopper (sm_90a) swap-AB decode kernel for dense
// FP8 caches with few query rows (decode_swapab.cuh).
//
// With few query rows (32 or fewer: 16 or 32 heads, or fewer heads times
// q_len), a 64-row wgmma block (the other Hopper kernels) spends most of its
// tensor work on zero rows, and an FP8 cache, which halves the bytes, cannot
// show it. Here the operands are swapped so that the 64 tokens of a KV tile
// are wgmma's M and the query rows its N (kN: 16 or 32):
//   S^T = K Q^T     m64nNk16 x 36 k-steps: A = the tile's keys (registers,
//                   converted from e4m3), B = the query (shared memory, fp16);
//   O^T += V^T P^T  m64nNk16 per 64 features x 4 k-steps: A = the tile's values, as
//                   V^T (registers, converted), B = P^T (shared memory).
// e4m3 converts to fp16 exactly in one instruction per pair, so the products
// run in fp16; the query is brought into fp16 range per row by a power of
// two that the softmax scale undoes.
//
// Both A operands come straight from the raw e4m3 tile: since a product only
// pairs A's and B's k indices, each operand's k (and A's m) may be any
// permutation of the features, provided the other operand uses the same one.
// The kernel picks the permutations that let a thread read its fragment with
// 16-byte shared-memory loads:
//   - S^T: thread (warp w, lane l) holds tokens 16 w + l / 4 (+ 8); its 16
//     contiguous features 64 s + 16 (l % 4) + [0, 16) of 64-feature block s
//     are the k positions {2 c, 2 c + 1, 2 c + 8, 2 c + 9} (c = l % 4) of the
//     block's four k-steps, in that order (query_k() maps a feature to its
//     k position; the query is stored permuted the same way);
//   - O^T: thread (w, l) holds features 128 w + 16 (l / 4) + [0, 16), output
//     row (m-block mb, half h) being feature 128 w + 16 (l / 4) + 2 mb + h,
//     and tokens in their natural order; the epilogue writes each thread's
//     16 features of a query row as contiguous bytes. With kN = 32 thread
//     (w, l) of warpgroup v holds the 8 features 256 v + 64 w + 8 (l / 4) +
//     [0, 8), row (mb, h) being 256 v + 64 w + 8 (l / 4) + 2 mb + h.
//
// With 16 rows or fewer (kN = 16) the CTA's warpgroups work independently
// on interleaved tiles of an item (tile t belongs to warpgroup
// t % kWarpgroups), each with its own running max, sums and O^T; they merge
// at the item's end. The tiles stream through a ring of kStages stages (tile
// t in stage t % kStages, a multiple of kWarpgroups so that every stage has
// one owner), and the warpgroup that has finished tile t refills its stage
// with tile t + kStages: a stage needs no "empty" barrier.
//
// With 17 to 32 rows (kN = 32) an O^T of all 512 features would need 128
// accumulator registers a thread (it spills), so the warpgroups split the
// work of every tile instead: each computes S^T over part of the features
// (kSBlocksWg0 of the nine 64-feature blocks, or the rest), the two partial
// sums meet in shared memory (one barrier of both warpgroups), each then
// runs the same softmax on the same values and O^T for its 256 features,
// and writes its own half of the output. A stage is free once all eight
// warps have read it: each warp counts itself in (s_release, shared memory)
// and the warp that completes the count refills the stage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

namespace mla_jax {
namespace sm90 {

// Position in the permuted k order of the query (and of the S^T A
// operand) of query feature f (0..575): see the comment above.
__host__ __device__ __forceinline__ int query_k(int f) {
  const int block = f / 64, in = f % 64;
  const int c = in / 16, r = in % 16, step = r / 4, e = r % 4;
  return 64 * block + 16 * step + 2 * c + (e & 1) + 8 * (e >> 1);
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
// a cross-warpgroup hand-off, docs/perf.md) and leave room for the 32-row
// query.
constexpr int kSwapAbWarpgroups = 2;
constexpr int kSwapAbStages = 4;

template <typename QType_, int kRows_, int kWarpgroups_ = kSwapAbWarpgroups, int kStages_ = kSwapAbStages>
struct SwapAbTraits {
  using QType = QType_;          // __nv_bfloat16 or __half: query and output type
  using Elem = cute::half_t;     // MMA operand type
  static constexpr int kN = kRows_;  // query rows per CTA (wgmma N)
  static_assert(kN == 16 || kN == 32);
  // Both warpgroups on every tile, each with half of O^T's features (above).
  static constexpr bool kSplitO = kN == 32;
  static constexpr int kOFeatures = kSplitO ? 256 : 512;  // O^T rows per warpgroup
  // kN = 32: warpgroup 0 computes S^T over 64-feature blocks [0, 5), warpgroup 1 over [5, 9).
  static constexpr int kSBlocksWg0 = 5;
  static constexpr int kDimNope = 512, kDimRope = 64, kDimQK = 576;
  static constexpr int kBlockN = 64;  // tokens per KV tile (wgmma M; the scheduler's block)
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * kWarpgroups;
  static_assert(kSplitO ? kWarpgroups == 2 : kStages % kWarpgroups == 0);
  static constexpr int kColsPerThread = kN / 4;  // query rows in a thread's accumulator columns

  // A raw FP8 stage: four 128-byte-swizzled TMA boxes of ckv (64 tokens x
  // 128 features), then the kpe box (64 tokens x 64 bytes, unswizzled).
  static constexpr int kCkvBoxBytes = 64 * 128;
  static constexpr int kRopeOffset = 4 * kCkvBoxBytes;
  static constexpr int kStageBytes = kRopeOffset + 64 * 64;

  using AtomK = cute::GMMA::Layout_K_SW128_Atom<Elem>;
  using LayoutQ = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kN>, cute::Int<kDimQK>>{}));
  using LayoutP = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kN>, cute::Int<kBlockN>>{}));
  using Mma = decltype(cute::SM90::GMMA::rs_op_selector<Elem, Elem, float,
                                                        cute::Shape<cute::_64, cute::Int<kN>, cute::_16>,
                                                        cute::GMMA::Major::K, cute::GMMA::Major::K>());

  // Shared memory, from a 1024-byte aligned base.
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemKv = kSmemQ + kN * kDimQK * 2;            // [stage]
  static constexpr int kSmemP = kSmemKv + kStages * kStageBytes;      // [warpgroup] P^T
  static constexpr int kPBytes = kN * kBlockN * 2;
  // kN = 32: the partial S^T sums, [tile parity][warpgroup][value / 4][thread] float4.
  static constexpr int kXBytes = kSplitO ? 128 * (kN / 2) * 4 : 0;
  static constexpr int kSmemX = kSmemP + kWarpgroups * kPBytes;
  static constexpr int kSmemRed = kSmemX + 2 * 2 * kXBytes;             // [warpgroup][warp][kN] floats
  static constexpr int kSmemMax = kSmemRed + kWarpgroups * 4 * kN * 4;  // [warpgroup][kN] running maxima
  static constexpr int kSmemColScale = kSmemMax + kWarpgroups * kN * 4;  // [kN] per-row softmax scales
  static constexpr int kSmemFlags = kSmemColScale + kN * 4;             // bad-page flag
  static constexpr int kSmemRelease = kSmemFlags + 16;                // [stage] warps done (kSplitO)
  static constexpr int kSmemBarriers = kSmemRelease + (kStages * 4 + 7) / 8 * 8;  // [stage] mbarriers
  static constexpr int kSmemBytes = kSmemBarriers + kStages * 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kSmemQ % 1024 == 0 && kSmemKv % 1024 == 0 && kSmemP % 1024 == 0 && kStageBytes % 1024 == 0);
  static_assert(kSmemBarriers % 8 == 0);
  static_assert(kSmemAlloc <= 227 * 1024, "exceeds the sm_90 shared memory per block");
  // With kN = 16 the epilogue hands warpgroups 1.. 's O^T (float) to
  // warpgroup 0 through the stages.
  static constexpr int kOBytes = 128 * 8 * (kN / 2) * 4;
  static_assert(kSplitO || (kWarpgroups - 1) * kOBytes <= kStages * kStageBytes);
};

}  // namespace sm90
}  // namespace mla_jax
