// Conversion of staged FP8 cache bytes into the lock-step kernel's MMA
// operand tile (decode_kernel.cuh, Tr::kConvert): 16-byte raw chunks to
// swizzled bf16/fp16 chunks of LayoutQK.
//
// Every thread first loads all of its raw chunks of a tile (load_raw), the
// CTA synchronises, then every thread writes its converted chunks
// (store_converted): the raw bytes share the stage with the output, so no
// output may be written while any thread still reads raw bytes.
//
// Assignment (256 threads, 64 rows): ckv chunk c (16 e4m3 values, features
// [16c, 16c + 16)) of rows tid / 32 + 8k, k = 0..7, with c = tid % 32: eight
// consecutive threads read 128 consecutive bytes of one row (no bank
// conflicts), and a warp's rows share their scale words (broadcast).
#pragma once

#include "csrc/sm90/decode_common.cuh"
#include "csrc/smxx/fp8_convert.cuh"

namespace mla_jax {
namespace sm90 {

template <typename Tr>
struct RawTile {
  static constexpr int kNopeRows = 8;  // rows per thread
  uint4 nope[kNopeRows];
  float scale[Tr::kLoad == KvLoad::kDsMla ? kNopeRows : 1];
  uint4 rope[2];  // kFp8: one chunk of 16 e4m3; kDsMla with an fp16 query: two chunks of 8 bf16
};

// This thread's raw chunks of the tile staged in `stage` (shared memory).
template <typename Tr>
__device__ __forceinline__ void load_raw(const char* stage, int tid, RawTile<Tr>& raw) {
  const int c = tid % 32, r0 = tid / 32;
  const char* base = stage + (c < 16 ? Tr::kRawNopeLo + c * 16 : Tr::kRawNopeHi + (c - 16) * 16);
#pragma unroll
  for (int k = 0; k < RawTile<Tr>::kNopeRows; ++k) {
    const int r = r0 + 8 * k;
    raw.nope[k] = *reinterpret_cast<const uint4*>(base + r * 256);
    if constexpr (Tr::kLoad == KvLoad::kDsMla)
      raw.scale[k] = *reinterpret_cast<const float*>(stage + Tr::kRawScales + r * 16 + (c / 8) * 4);
  }
  if constexpr (Tr::kLoad == KvLoad::kFp8) {
    // 64 rows x 4 chunks: one per thread.
    raw.rope[0] = *reinterpret_cast<const uint4*>(stage + Tr::kRawRope + (tid / 4) * 64 + (tid % 4) * 16);
  } else if constexpr (!Tr::kRopeDirect) {
    // 64 rows x 8 chunks of bf16: two per thread.
#pragma unroll
    for (int j = 0; j < 2; ++j)
      raw.rope[j] = *reinterpret_cast<const uint4*>(stage + Tr::kRawRope + (tid / 8 + 32 * j) * 128 + (tid % 8) * 16);
  }
}

// Writes this thread's converted chunks into `stage` (LayoutQK).
template <typename Tr>
__device__ __forceinline__ void store_converted(char* stage, int tid, const RawTile<Tr>& raw) {
  using T = typename Tr::QType;
  constexpr bool kUnscaled = Tr::kLoad == KvLoad::kFp8;  // kv_scale is folded into the softmax
  const int c = tid % 32, r0 = tid / 32;
#pragma unroll
  for (int k = 0; k < RawTile<Tr>::kNopeRows; ++k) {
    const int r = r0 + 8 * k;
    uint4 out[2];
    smxx::e4m3x16_to<T, kUnscaled>(raw.nope[k], kUnscaled ? 1.f : raw.scale[Tr::kLoad == KvLoad::kDsMla ? k : 0], out);
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, 2 * c)) = out[0];
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, 2 * c + 1)) = out[1];
  }
  if constexpr (Tr::kLoad == KvLoad::kFp8) {
    const int r = tid / 4, q = tid % 4;
    uint4 out[2];
    smxx::e4m3x16_to<T, true>(raw.rope[0], 1.f, out);
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, Tr::kNopeChunks + 2 * q)) = out[0];
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, Tr::kNopeChunks + 2 * q + 1)) = out[1];
  } else if constexpr (!Tr::kRopeDirect) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = tid / 8 + 32 * j, q = tid % 8;
      *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, Tr::kNopeChunks + q)) = smxx::bf16x8_to<__half>(raw.rope[j]);
    }
  }
}

}  // namespace sm90
}  // namespace mla_jax
