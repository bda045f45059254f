// Tile configuration of the Hopper (sm_90a) split-KV decode kernel.
//
// A CTA of two warpgroups computes 64 query rows (q_len x heads of one
// request) against 64-token KV tiles, with wgmma reading both operands
// from shared memory:
//   S = Q K^T   warpgroup w: all 64 rows x tokens [32w, 32w + 32), m64n32k16
//               over the 576 features (36 k-steps);
//   O += P V    warpgroup w: all 64 rows x output columns [256w, 256w + 256),
//               m64n256k16 over the 64 tokens (4 k-steps).
// Q, each KV stage and P use the 128-byte-swizzled K-major layout: 8-row
// atoms of 64 elements (one 128-byte line per row). The V operand is the
// same KV bytes read as an MN-major (dims x tokens) matrix; tiling that
// view token-atoms first makes the two views address identical bytes
// (checked on the host by csrc/sm90/layout_check.cu, which
// tests/test_sm90_layout.py builds and runs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include "csrc/smxx/schedule_inline.cuh"

namespace mla_jax {
namespace sm90 {

// How the cache's rows reach the wgmma operands.
enum class KvLoad : int {
  kNative = 0,  // bf16/fp16 rows in the query dtype: copied straight into the swizzled tile
  kFp8 = 1,     // e4m3 ckv and kpe with one kv_scale: staged as bytes, converted exactly
  kDsMla = 2,   // fp8_ds_mla 656-byte rows: e4m3 ckv times its group's float32 scale, bf16 kpe
};

template <typename QType_, KvLoad kLoad_ = KvLoad::kNative>
struct DecodeTraits {
  using QType = QType_;  // __nv_bfloat16 or __half: query, MMA and output type (and the cache's, kNative)
  static constexpr KvLoad kLoad = kLoad_;
  static constexpr bool kConvert = kLoad != KvLoad::kNative;
  using Elem = std::conditional_t<std::is_same_v<QType, __nv_bfloat16>, cute::bfloat16_t, cute::half_t>;

  static constexpr int kDimNope = 512;  // kv_lora_rank (= V and output width)
  static constexpr int kDimRope = 64;   // qk_rope_head_dim
  static constexpr int kDimQK = kDimNope + kDimRope;
  static constexpr int kBlockM = 64;    // query rows per CTA
  static constexpr int kBlockN = 64;    // tokens per KV tile (= the scheduler's block)
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kStages = 2;
  static constexpr int kSCols = kBlockN / kWarpgroups;   // S columns (tokens) per warpgroup
  static constexpr int kOCols = kDimNope / kWarpgroups;  // O columns per warpgroup

  using AtomK = cute::GMMA::Layout_K_SW128_Atom<Elem>;
  using AtomMN = cute::GMMA::Layout_MN_SW128_Atom<Elem>;
  // (row, feature) for Q and for each KV stage (row = token).
  using LayoutQK = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kDimQK>>{}));
  // (row, token) for P.
  using LayoutP = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // (output column, token) for one warpgroup's half of V; token atoms first
  // so that column c, token t lands where LayoutQK puts (t, c).
  using LayoutVHalf = decltype(cute::tile_to_shape(
      AtomMN{}, cute::Shape<cute::Int<kOCols>, cute::Int<kBlockN>>{}, cute::Step<cute::_2, cute::_1>{}));

  using MmaS = decltype(cute::SM90::GMMA::ss_op_selector<
                        Elem, Elem, float, cute::Shape<cute::_64, cute::Int<kSCols>, cute::Int<kDimQK>>,
                        cute::GMMA::Major::K, cute::GMMA::Major::K>());
  // Seesaw kernel (decode_seesaw.cuh): a warpgroup computes S over a whole tile.
  using MmaSTile = decltype(cute::SM90::GMMA::ss_op_selector<
                            Elem, Elem, float, cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kDimQK>>,
                            cute::GMMA::Major::K, cute::GMMA::Major::K>());
  using MmaO = decltype(cute::SM90::GMMA::ss_op_selector<
                        Elem, Elem, float, cute::Shape<cute::_64, cute::Int<kOCols>, cute::Int<kBlockN>>,
                        cute::GMMA::Major::K, cute::GMMA::Major::MN>());
  // Seesaw kernel: a warpgroup multiplies its own tile's P straight from
  // registers (the S accumulator converted in place: the A-operand layout
  // of m64k16 matches the m64n64 accumulator's, element for element;
  // layout_check.cu verifies it).
  using MmaORegs = decltype(cute::SM90::GMMA::rs_op_selector<
                            Elem, Elem, float, cute::Shape<cute::_64, cute::Int<kOCols>, cute::Int<kBlockN>>,
                            cute::GMMA::Major::K, cute::GMMA::Major::MN>());

  // Shared memory (bytes from a 1024-byte aligned base: the 128-byte swizzle
  // pattern repeats every 1024 bytes of address).
  static constexpr int kTileBytes = kBlockM * kDimQK * 2;  // Q, and one KV stage (64 rows each)
  static_assert(kBlockM == kBlockN);
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemKv = kSmemQ + kTileBytes;
  static constexpr int kSmemP = kSmemKv + kStages * kTileBytes;
  static constexpr int kSmemRed = kSmemP + kBlockM * kBlockN * 2;      // [warpgroup][row] floats
  static constexpr int kSmemValid = kSmemRed + kWarpgroups * kBlockM * 4;  // [stage][token] flags
  static constexpr int kSmemFlags = kSmemValid + kStages * kBlockN;      // bad-page flag
  static constexpr int kKvBlocks = kDimQK / 64;                          // 64-feature blocks per KV row
  static constexpr int kSmemBarriers = kSmemFlags + 16;                 // [stage][block] mbarriers
  static constexpr int kSmemItems = kSmemBarriers + kStages * kKvBlocks * 8;  // inline schedule: items, count
  static constexpr int kSmemBytes =
      kSmemItems + smxx::kInlineScheduleMaxBatch * static_cast<int>(sizeof(smxx::PartItem)) + 16;
  static_assert(kSmemBarriers % 8 == 0);
  static constexpr int kSmemAlloc = kSmemBytes + 1024;  // room to align the base
  static_assert(kSmemAlloc <= 227 * 1024, "exceeds the sm_90 shared memory per block");

  // Global->shared copies, 8 threads per row with 16 bytes each. The query
  // is copied by the whole CTA (32 rows a pass). A KV tile is copied by
  // each warpgroup separately, 16 rows a pass: warpgroup w fetches the
  // features its own P V reads (w = 0: [0, 256); w = 1: [256, 512) and the
  // rope part, which only S reads), so it can refill a stage as soon as
  // its own P V is done, without waiting for the other warpgroup.
  static constexpr int kThreadsPerRow = 8;
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static constexpr int kChunks = kDimQK / 8;     // 16-byte chunks per row
  static constexpr int kNopeChunks = kDimNope / 8;
  static constexpr int kChunksPerThread = kChunks / kThreadsPerRow;
  static constexpr int kKvRowsPerPass = 128 / kThreadsPerRow;
  static constexpr int kKvPasses = kBlockN / kKvRowsPerPass;
  static constexpr int kKvChunksWg0 = kOCols / 8 / kThreadsPerRow;                // per thread
  static constexpr int kKvChunksWg1 = (kChunks - kOCols / 8) / kThreadsPerRow;  // per thread
  static_assert(kChunks % kThreadsPerRow == 0 && kBlockN % kKvRowsPerPass == 0);

  // FP8 caches in the lock-step kernel (kConvert): the copies bring a tile's
  // raw bytes into its own stage, at offsets inside the region of the
  // warpgroup that issues them (warpgroup 0: bytes [0, 32 KB), the V half
  // its P V reads; warpgroup 1: the rest), and the CTA converts them in
  // place before S reads the tile: every thread reads all of its raw bytes
  // into registers, one barrier, then writes the converted chunks. So the
  // raw offsets only need to stay clear of each other, not of the output.
  // The ds_mla rope is bf16 already: with a bf16 query it is copied
  // straight into its block like a native row.
  static constexpr int kRawNopeLo = 0;       // ckv bytes [0, 256) of 64 rows, 256 bytes a row (warpgroup 0)
  static constexpr int kRawScales = 16384;   // kDsMla: the 4 float32 scales of 64 rows (warpgroup 0)
  static constexpr int kRawNopeHi = 32768;   // ckv bytes [256, 512) of 64 rows (warpgroup 1)
  static constexpr int kRawRope = 49152;     // kpe: 64 e4m3 (kFp8) or 64 bf16 (kDsMla, fp16 query) a row
  static constexpr bool kRopeDirect = kLoad == KvLoad::kDsMla && std::is_same_v<QType, __nv_bfloat16>;
  static constexpr int kRawRopeBytes = kLoad == KvLoad::kFp8 ? 64 : 128;  // per row
  static_assert(kRawScales + kBlockN * 16 <= kRawNopeHi && kRawRope + kBlockN * 128 <= 8 * 8192);

  // Dense e4m3 rows in the seesaw kernel (kFp8 only): TMA brings a stage's
  // raw bytes in the two halves its warpgroups refill (decode_seesaw.cuh),
  // each inside the 64-feature blocks that half converts into, and placed so
  // that the conversion can write its first output blocks before it has read
  // all of its input (kv_convert.cuh, convert_seesaw_half):
  //   low half (blocks 0-3): ckv bytes [0, 128) in block 2, [128, 256) in block 3;
  //   high half (blocks 4-8): ckv bytes [256, 384) in block 7, [384, 512) in
  //   block 8, kpe (64 bytes a row) in block 6.
  // ckv boxes are 64 rows x 128 bytes, 128-byte swizzled; the kpe box
  // 64 rows x 64 bytes, 64-byte swizzled (make_kv_tma_fp8): 1024- and
  // 512-byte aligned destinations.
  static constexpr int kSeeRawLo = 2 * 8192;
  static constexpr int kSeeRawHi = 7 * 8192;
  static constexpr int kSeeRawRope = 6 * 8192;
  static constexpr uint32_t kSeeRawLoBytes = 2 * 64 * 128;
  static constexpr uint32_t kSeeRawHiBytes = 2 * 64 * 128 + 64 * 64;
  static_assert(kSeeRawLo % 1024 == 0 && kSeeRawHi % 1024 == 0 && kSeeRawRope % 512 == 0 && kTileBytes % 1024 == 0);

  // fp8_ds_mla rows in the seesaw kernel (sparse decode, bf16 query): the
  // warpgroup that frees a half gathers the next tile's bytes into it with
  // cp.async (decode_seesaw.cuh), each inside the blocks the half converts
  // into, placed so that each conversion phase writes only bytes no thread
  // reads later (kv_convert.cuh, convert_seesaw_half_ds):
  //   low half (blocks 0-3): the float32 scales of groups 0 and 1 (8 bytes a
  //   row) at the start of block 0, ckv bytes [0, 128) in block 2 and
  //   [128, 256) in block 3;
  //   high half (blocks 4-8): the scales of groups 2 and 3 at the start of
  //   block 4, ckv bytes [256, 384) in block 7 and [384, 512) in block 6, and
  //   the bf16 kpe straight into block 8, its place in LayoutQK.
  // A raw ckv box is 64 rows x 128 bytes with 16-byte chunk i of row r at
  // r * 128 + ((i ^ r % 8) << 4), the same swizzle as the e4m3 TMA boxes.
  static constexpr int kDsLoScales = 0;
  static constexpr int kDsLoBox0 = 2 * 8192, kDsLoBox1 = 3 * 8192;
  static constexpr int kDsHiScales = 4 * 8192;
  static constexpr int kDsHiBox0 = 7 * 8192, kDsHiBox1 = 6 * 8192;
  static_assert(kWarpgroups == 2 && (kOCols / 8) % kThreadsPerRow == 0);
};

}  // namespace sm90
}  // namespace mla_jax
