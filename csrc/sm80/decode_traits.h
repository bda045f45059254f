// Tile configuration of the portable split-KV decode kernel.
//
// A CTA of 8 warps computes kBlockM query rows (q_len x heads of one
// request) against kBlockN-token KV tiles. For S = Q K^T the warps form a
// kWarpsM x kWarpsN grid (16 rows x kBlockN/kWarpsN tokens each); for
// O += P V the same grid splits O's 512 columns kWarpsN ways, so each warp
// owns 16 rows x 512/kWarpsN outputs in registers. Rows padded by 8
// elements (16 bytes) make every ldmatrix phase hit 8 distinct bank groups.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

namespace mla_jax {
namespace sm80 {

// How a cache row arrives in shared memory (bytes per token row, and
// whether it must be converted to the MMA type there).
struct KvNative {      // bf16 / fp16 rows, same type as the query
  static constexpr int kRowBytes = 1152, kNopeBytes = 1024;
  static constexpr bool kConvert = false, kContiguousRow = false;
};
struct KvFp8 {         // e4m3 rows with one per-tensor kv_scale
  static constexpr int kRowBytes = 576, kNopeBytes = 512;
  static constexpr bool kConvert = true, kContiguousRow = false;
};
struct KvDsMla {       // DeepSeek V3.2 656-byte rows: e4m3 ckv, 4 f32 scales, bf16 kpe
  static constexpr int kRowBytes = 656, kNopeBytes = 512;
  static constexpr bool kConvert = true, kContiguousRow = true;
};

// kMTiles: 16-row MMA tiles per warp (2 halves the times each K/V element
// is read from shared memory). kSwizzle: XOR-swizzled 16-byte chunks instead
// of padded rows (saves the padding, so 64-token tiles fit beside a 64-row Q).
template <typename QType_, typename KvTag_, int kBlockM_, int kBlockN_, int kMTiles_ = 1,
          bool kSwizzle_ = false>
struct DecodeTraits {
  using QType = QType_;  // __nv_bfloat16 or __half; also the MMA and output type
  using KvTag = KvTag_;
  static constexpr bool kFp8Kv = KvTag::kConvert;  // converted to QType in smem

  static constexpr int kDimNope = 512;  // kv_lora_rank
  static constexpr int kDimRope = 64;   // qk_rope_head_dim
  static constexpr int kDimQK = kDimNope + kDimRope;

  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMTiles = kMTiles_;
  static constexpr bool kSwizzle = kSwizzle_;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kWarpsM = kBlockM / kWarpRows;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kSCols = kBlockN / kWarpsN;   // S columns per warp (8 or 16)
  static constexpr int kSTiles = kSCols / 8;
  static constexpr int kOCols = kDimNope / kWarpsN;  // O columns per warp
  static constexpr int kOTiles = kOCols / 8;
  static constexpr int kStages = 2;
  static_assert(kBlockM % kWarpRows == 0 && kWarps % kWarpsM == 0);
  static_assert(!(kSwizzle && KvTag::kConvert), "swizzled tiles hold native bf16/fp16 rows only");
  static_assert(kSTiles == 1 || kSTiles == 2);
  static_assert(kBlockN % 16 == 0 && 64 % kBlockN == 0);

  // Shared memory (bytes). Q and the MMA-ready KV tile hold QType rows of
  // kRowStride elements; an FP8 cache lands in a byte staging buffer first.
  static constexpr int kRowStride = kSwizzle ? kDimQK : kDimQK + 8;
  static constexpr int kPStride = kBlockN + 8;
  static constexpr int kKvChunks = KvTag::kRowBytes / 16;  // 16-byte chunks per cache row
  static constexpr int kNopeChunks = KvTag::kNopeBytes / 16;
  static constexpr int kKvRowBytes = kFp8Kv ? KvTag::kRowBytes + 16 : kRowStride * 2;
  static constexpr int kQBytes = kBlockM * kRowStride * 2;
  static constexpr int kStageBytes = kBlockN * kKvRowBytes;
  static constexpr int kConvertedBytes = kFp8Kv ? kBlockN * kRowStride * 2 : 0;
  static constexpr int kPBytes = kBlockM * kPStride * 2;
  static constexpr int kRedBytes = kWarpsN * kBlockM * 4;
  static constexpr int kValidBytes = kStages * kBlockN;  // per-token "not padding" flags
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemKv = kSmemQ + kQBytes;
  static constexpr int kSmemConverted = kSmemKv + kStages * kStageBytes;
  static constexpr int kSmemP = kSmemConverted + kConvertedBytes;
  static constexpr int kSmemRed = kSmemP + kPBytes;
  static constexpr int kSmemValid = kSmemRed + kRedBytes;
  static constexpr int kSmemBytes = kSmemValid + kValidBytes;

  // Global->shared copies: 8 threads per row, 16 bytes each, 32 rows a pass.
  static constexpr int kThreadsPerRow = 8;
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static constexpr int kKvPasses = (kBlockN + kRowsPerPass - 1) / kRowsPerPass;
  static constexpr int kKvChunksPerThread = (kKvChunks + kThreadsPerRow - 1) / kThreadsPerRow;
};

}  // namespace sm80
}  // namespace mla_jax
