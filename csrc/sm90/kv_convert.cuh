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

// Seesaw kernel, dense e4m3 rows (Tr::kLoad == kFp8): one warpgroup (128
// threads, wg_tid) converts one half of a stage in place, from the raw
// bytes TMA left there (decode_traits.h, kSeeRaw*) into LayoutQK chunks:
// the low half (kHigh = false) is ckv features [0, 256) = blocks 0-3, the
// high half ckv [256, 512) and the rope part = blocks 4-8. `sync` is a
// barrier of the 128 threads. The caller fences for wgmma and synchronises
// before any wgmma reads the half.
//
// Each raw ckv box holds 64 rows x 8 chunks of 16 e4m3 values (128-byte
// swizzle: chunk i of row r at r * 128 + ((i ^ r % 8) << 4)); thread
// (i = wg_tid % 8, r = wg_tid / 8 + 16 k) converts chunk i of four rows,
// eight threads on one 128-byte row. No thread may write a block before
// every thread has read the raw bytes there, and the fewer raw chunks a
// thread holds across a barrier the fewer registers the kernel needs
// (it runs beside the 128 O and 32 S accumulator registers):
//   low half:  box 0 (block 2) -> blocks 0-1 at once; box 1 (block 3) read,
//              barrier, -> blocks 2-3;
//   high half: box 0 (block 7) -> blocks 4-5 at once; kpe (block 6) read,
//              barrier; box 1 (block 8) -> blocks 6-7; barrier; kpe -> block 8.
template <typename Tr, bool kHigh, typename Sync>
__device__ __forceinline__ void convert_seesaw_half(char* stage, int wg_tid, Sync&& sync) {
  using T = typename Tr::QType;
  static_assert(Tr::kLoad == KvLoad::kFp8, "dense e4m3 rows only");
  constexpr int kRaw = kHigh ? Tr::kSeeRawHi : Tr::kSeeRawLo;
  constexpr int kBlock0 = kHigh ? 4 : 0;  // first output block of box 0
  // Every address below is one of four per-thread bases plus a constant
  // (the kernel keeps these bases live across its tile loop, so few of
  // them): row r0 + 16 k is 2048 k bytes further in both layouts, and
  // the swizzle's XOR depends on r0 % 8 alone. Output chunk 2 i of row r0
  // is qk_chunk_offset(r0, 2 i); chunk 2 i + 1 differs in bit 4 only.
  const int i = wg_tid % 8, r0 = wg_tid / 8;
  const int raw_base = kRaw + r0 * 128 + ((i ^ (r0 & 7)) << 4);
  const int out_even = qk_chunk_offset(r0, 2 * i) + kBlock0 * 8192;
  const int out_odd = out_even ^ 16;
  auto store = [&](int at_even, int at_odd, const uint4 raw) {
    uint4 out[2];
    smxx::e4m3x16_to<T, true>(raw, 1.f, out);
    *reinterpret_cast<uint4*>(stage + at_even) = out[0];
    *reinterpret_cast<uint4*>(stage + at_odd) = out[1];
  };
  auto raw_chunk = [&](int box, int k) {
    return *reinterpret_cast<const uint4*>(stage + raw_base + box * 8192 + k * 2048);
  };
  // Box 1 lands two blocks (16 chunks) after box 0.
#pragma unroll
  for (int k = 0; k < 4; ++k) store(out_even + k * 2048, out_odd + k * 2048, raw_chunk(0, k));
  if constexpr (!kHigh) {
    uint4 box1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) box1[k] = raw_chunk(1, k);
    sync();
#pragma unroll
    for (int k = 0; k < 4; ++k) store(out_even + 16384 + k * 2048, out_odd + 16384 + k * 2048, box1[k]);
  } else {
    // kpe: 64 rows x 4 chunks (64-byte swizzle: chunk q of row r at
    // r * 64 + ((q ^ (r / 2) % 4) << 4)), rows rq and rq + 32 per thread
    // (the same XOR; 2048 bytes apart raw, 4096 in the output).
    const int q = wg_tid % 4, rq = wg_tid / 4;
    const int rope_raw = Tr::kSeeRawRope + rq * 64 + ((q ^ ((rq >> 1) & 3)) << 4);
    uint4 rope[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) rope[k] = *reinterpret_cast<const uint4*>(stage + rope_raw + k * 2048);
    sync();
#pragma unroll
    for (int k = 0; k < 4; ++k) store(out_even + 16384 + k * 2048, out_odd + 16384 + k * 2048, raw_chunk(1, k));
    sync();
    const int rope_even = qk_chunk_offset(rq, Tr::kNopeChunks + 2 * q);
#pragma unroll
    for (int k = 0; k < 2; ++k) store(rope_even + k * 4096, (rope_even ^ 16) + k * 4096, rope[k]);
  }
}

}  // namespace sm90
}  // namespace mla_jax
