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

#include <cutlass/arch/barrier.h>

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

// Where thread wg_tid's accesses of convert_seesaw_half fall (bytes from
// the stage). Every one is a per-thread base plus a constant (the kernel
// keeps these bases live across its tile loop, so few of them): thread
// (i = wg_tid % 8, r0 = wg_tid / 8) handles ckv raw chunk i of rows
// r0 + 16 k, k = 0..3, of both boxes; row r0 + 16 k is 2048 k bytes further
// in both layouts and the swizzles' XOR depends on r0 % 8 alone. Its
// output chunks are 2 i and 2 i + 1 (box 1: 16 chunks = two blocks later),
// the odd one differing from the even one in bit 4 only. kpe: thread
// (q = wg_tid % 4, rq = wg_tid / 4) handles chunk q of rows rq and rq + 32.
// csrc/sm90/layout_check.cu checks these against the TMA swizzles and
// qk_chunk_offset, their coverage, and the barrier phases below.
struct SeesawConvertMap {
  static constexpr int kRawBoxStride = 8192, kOutBoxStride = 16384, kRowStride = 2048;
  static constexpr int kRopeRawStride = 2048, kRopeOutStride = 4096;
  // Chunk i of row r0 of the raw box (64 rows x 128 bytes, 128-byte
  // swizzle) that starts at byte `box` of the stage.
  __host__ __device__ static int box_chunk(int box, int wg_tid) {
    const int i = wg_tid % 8, r0 = wg_tid / 8;
    return box + r0 * 128 + ((i ^ (r0 & 7)) << 4);
  }
  template <typename Tr, bool kHigh>
  __host__ __device__ static int raw_ckv(int wg_tid) {
    return box_chunk(kHigh ? Tr::kSeeRawHi : Tr::kSeeRawLo, wg_tid);
  }
  template <bool kHigh>
  __host__ __device__ static int out_ckv(int wg_tid) {  // the even chunk; the odd one is ^ 16
    const int i = wg_tid % 8, r0 = wg_tid / 8;
    return qk_chunk_offset(r0, 2 * i) + (kHigh ? 4 * 8192 : 0);
  }
  template <typename Tr>
  __host__ __device__ static int raw_rope(int wg_tid) {
    const int q = wg_tid % 4, rq = wg_tid / 4;
    return Tr::kSeeRawRope + rq * 64 + ((q ^ ((rq >> 1) & 3)) << 4);
  }
  template <typename Tr>
  __host__ __device__ static int out_rope(int wg_tid) {
    return qk_chunk_offset(wg_tid / 4, Tr::kNopeChunks + 2 * (wg_tid % 4));
  }
};

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
  using M = SeesawConvertMap;
  static_assert(Tr::kLoad == KvLoad::kFp8, "dense e4m3 rows only");
  const int raw_base = M::raw_ckv<Tr, kHigh>(wg_tid);
  const int out_even = M::out_ckv<kHigh>(wg_tid);
  const int out_odd = out_even ^ 16;
  auto store = [&](int at_even, int at_odd, const uint4 raw) {
    uint4 out[2];
    smxx::e4m3x16_to<T, true>(raw, 1.f, out);
    *reinterpret_cast<uint4*>(stage + at_even) = out[0];
    *reinterpret_cast<uint4*>(stage + at_odd) = out[1];
  };
  auto raw_chunk = [&](int box, int k) {
    return *reinterpret_cast<const uint4*>(stage + raw_base + box * M::kRawBoxStride + k * M::kRowStride);
  };
  auto store_ckv = [&](int box, int k, const uint4 raw) {
    const int at = box * M::kOutBoxStride + k * M::kRowStride;
    store(out_even + at, out_odd + at, raw);
  };
  // Phase 0 (before the first barrier): box 0 read and written.
#pragma unroll
  for (int k = 0; k < 4; ++k) store_ckv(0, k, raw_chunk(0, k));
  if constexpr (!kHigh) {
    // Phase 0: box 1 read; phase 1: written.
    uint4 box1[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) box1[k] = raw_chunk(1, k);
    sync();
#pragma unroll
    for (int k = 0; k < 4; ++k) store_ckv(1, k, box1[k]);
  } else {
    // Phase 0: kpe read; phase 1: box 1 read and written; phase 2: kpe written.
    const int rope_raw = M::raw_rope<Tr>(wg_tid), rope_out = M::out_rope<Tr>(wg_tid);
    uint4 rope[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) rope[k] = *reinterpret_cast<const uint4*>(stage + rope_raw + k * M::kRopeRawStride);
    sync();
#pragma unroll
    for (int k = 0; k < 4; ++k) store_ckv(1, k, raw_chunk(1, k));
    sync();
#pragma unroll
    for (int k = 0; k < 2; ++k)
      store(rope_out + k * M::kRopeOutStride, (rope_out ^ 16) + k * M::kRopeOutStride, rope[k]);
  }
}

// fp8_ds_mla rows in the seesaw kernel (decode_traits.h, kDs*): where thread
// wg_tid of a warpgroup gathers one half of a tile and where it converts it.
// Thread (i = wg_tid % 8, r0 = wg_tid / 8) handles rows r0 + 16 k, k = 0..3:
// ckv chunk i of both raw boxes (8 lanes on one row's 128 contiguous bytes,
// in the copy and in the conversion), kpe chunk i (high half), and the
// scales of row r0 + 16 i when i < 4. Row r0 + 16 k is 2048 k bytes further
// in the raw boxes and in LayoutQK; the output chunks are those of
// SeesawConvertMap::out_ckv. csrc/sm90/layout_check.cu checks the map, its
// coverage and the conversion's barrier phases.
struct SeesawDsMap {
  static constexpr int kRowStride = SeesawConvertMap::kRowStride, kOutBoxStride = SeesawConvertMap::kOutBoxStride;
  template <typename Tr, bool kHigh>
  __host__ __device__ static int raw_box(int box) {
    return kHigh ? (box == 0 ? Tr::kDsHiBox0 : Tr::kDsHiBox1) : (box == 0 ? Tr::kDsLoBox0 : Tr::kDsLoBox1);
  }
  // Chunk i of row r0 of raw box `box` (row r0 + 16 k: + k kRowStride).
  template <typename Tr, bool kHigh>
  __host__ __device__ static int raw_ckv(int wg_tid, int box) {
    return SeesawConvertMap::box_chunk(raw_box<Tr, kHigh>(box), wg_tid);
  }
  // The two scales (groups 2 kHigh and 2 kHigh + 1) of row r.
  template <typename Tr, bool kHigh>
  __host__ __device__ static int scales(int r) {
    return (kHigh ? Tr::kDsHiScales : Tr::kDsLoScales) + r * 8;
  }
  // First byte of the row that chunk i of box `box` copies (from the row's start).
  template <bool kHigh>
  __host__ __device__ static int source_ckv(int wg_tid, int box) {
    return 256 * kHigh + 128 * box + 16 * (wg_tid % 8);
  }
  // High half: where the kpe chunk of row r0 goes (its LayoutQK place in
  // block 8; row r0 + 16 k: + k kRowStride), and its first byte in the row.
  template <typename Tr>
  __host__ __device__ static int kpe(int wg_tid) {
    return qk_chunk_offset(wg_tid / 8, Tr::kNopeChunks + wg_tid % 8);
  }
  __host__ __device__ static int source_kpe(int wg_tid) { return kDsMlaRopeOffset + 16 * (wg_tid % 8); }
  // The rows come from fetch_rows in decode_seesaw.cuh: lane l looked up
  // tokens l (word 0) and l + 32 (word 1) of the tile; token r0 + 16 k is
  // word k / 2 of lane row_lane(wg_tid, k).
  __host__ __device__ static int row_lane(int wg_tid, int k) { return (wg_tid / 8 + 16 * k) & 31; }
  // The softmax mask (decode_seesaw.cuh, tile_mask): the ballots of those
  // two words, each shifted right by mask_shift so that the thread's own
  // S columns (accumulator_col: 2 (wg_tid % 4) + e + 8 j) land on bits
  // kMaskKeep, the second word's then moved up by 2, in one register;
  // accumulator element i's token is bit mask_bit(i).
  static constexpr uint32_t kMaskKeep = 0x03030303u;
  __host__ __device__ static int mask_shift(int wg_tid) { return 2 * (wg_tid % 4); }
  __host__ __device__ static int mask_bit(int i) { return 8 * ((i >> 2) & 3) + (i & 1) + 2 * ((i >> 4) & 1); }
  // The k whose row's scales this thread copies (none when >= 4).
  __host__ __device__ static int scale_k(int wg_tid) { return wg_tid % 8; }
  template <bool kHigh>
  __host__ __device__ static int source_scales() { return kDsMlaScaleOffset + 8 * kHigh; }
};

// This warpgroup's gather of one half of a tile (kHigh: ckv [256, 512),
// scales 2-3 and kpe; else ckv [0, 256) and scales 0-1) into `stage`, for
// the cache rows rows[k] of tokens r0 + 16 k (-1: padding or past the end,
// zero-filled, never read), then one arrival per thread on `bar` once its
// copies have landed (the barrier expects 128).
template <typename Tr, bool kHigh>
__device__ __forceinline__ void gather_seesaw_half_ds(const PagedDecodeParams& p, char* stage, uint64_t* bar,
                                                      int wg_tid, const int (&rows)[4]) {
  using M = SeesawDsMap;
  static_assert(Tr::kLoad == KvLoad::kDsMla && Tr::kRopeDirect, "fp8_ds_mla rows with a bf16 query");
  const char* ckv = static_cast<const char*>(p.ckv);
  const int r0 = wg_tid / 8;
  const int raw0 = M::raw_ckv<Tr, kHigh>(wg_tid, 0), raw1 = M::raw_ckv<Tr, kHigh>(wg_tid, 1);
  const int kpe_at = M::kpe<Tr>(wg_tid);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool live = rows[k] >= 0;
    const int64_t row = live ? rows[k] : 0;
    const char* src = ckv + row * p.ckv_token_stride;
    smxx::cp_async_16(stage + raw0 + k * M::kRowStride, src + M::source_ckv<kHigh>(wg_tid, 0), live);
    smxx::cp_async_16(stage + raw1 + k * M::kRowStride, src + M::source_ckv<kHigh>(wg_tid, 1), live);
    // The kpe part sits in the same 656-byte row (ffi/decode_args.cc sets
    // p.kpe to byte kDsMlaRopeOffset of p.ckv, with the same token stride).
    if constexpr (kHigh) smxx::cp_async_16(stage + kpe_at + k * M::kRowStride, src + M::source_kpe(wg_tid), live);
    if (M::scale_k(wg_tid) == k)
      smxx::cp_async_8(stage + M::scales<Tr, kHigh>(r0 + 16 * k), src + M::source_scales<kHigh>(), live);
  }
  cutlass::arch::cpasync_barrier_arrive_noinc(bar);
}

// Seesaw kernel, fp8_ds_mla rows: one warpgroup converts one half of a
// stage in place, from the bytes gather_seesaw_half_ds left there, into
// LayoutQK chunks (e4m3 times its group's scale, rounded to bf16; the kpe
// is in place already). `sync` is a barrier of the 128 threads; the caller
// fences for wgmma and synchronises before any wgmma reads the half.
//   phase 0: the scales of this thread's rows read; barrier (they sit
//            where box 0's output goes);
//   phase 1: box 0 -> its two blocks; box 1 read; barrier;
//   phase 2: box 1 -> its two blocks (where the raw boxes were).
template <typename Tr, bool kHigh, typename Sync>
__device__ __forceinline__ void convert_seesaw_half_ds(char* stage, int wg_tid, Sync&& sync) {
  using T = typename Tr::QType;
  using M = SeesawDsMap;
  static_assert(Tr::kLoad == KvLoad::kDsMla && Tr::kRopeDirect, "fp8_ds_mla rows with a bf16 query");
  const int r0 = wg_tid / 8;
  float2 scale[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) scale[k] = *reinterpret_cast<const float2*>(stage + M::scales<Tr, kHigh>(r0 + 16 * k));
  sync();
  const int raw0 = M::raw_ckv<Tr, kHigh>(wg_tid, 0), raw1 = M::raw_ckv<Tr, kHigh>(wg_tid, 1);
  const int out_even = SeesawConvertMap::out_ckv<kHigh>(wg_tid);
  auto store = [&](int at, const uint4 raw, float s) {
    uint4 out[2];
    smxx::e4m3x16_to<T, false>(raw, s, out);
    *reinterpret_cast<uint4*>(stage + at) = out[0];
    *reinterpret_cast<uint4*>(stage + (at ^ 16)) = out[1];
  };
#pragma unroll
  for (int k = 0; k < 4; ++k)
    store(out_even + k * M::kRowStride, *reinterpret_cast<const uint4*>(stage + raw0 + k * M::kRowStride), scale[k].x);
  uint4 box1[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) box1[k] = *reinterpret_cast<const uint4*>(stage + raw1 + k * M::kRowStride);
  sync();
#pragma unroll
  for (int k = 0; k < 4; ++k) store(out_even + M::kOutBoxStride + k * M::kRowStride, box1[k], scale[k].y);
}

}  // namespace sm90
}  // namespace mla_jax
