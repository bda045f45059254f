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

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "csrc/sm90/decode_common.cuh"

namespace mla_jax {
namespace sm90 {

template <typename Tr>
struct RawTile {
  static constexpr int kNopeRows = 8;  // rows per thread
  uint4 nope[kNopeRows];
  float scale[Tr::kLoad == KvLoad::kDsMla ? kNopeRows : 1];
  uint4 rope[2];  // kFp8: one chunk of 16 e4m3; kDsMla with an fp16 query: two chunks of 8 bf16
};

// Two e4m3 values (the low 16 bits of `pair`) to two floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3));
  return __half22float2(h);
}

// 16 e4m3 values -> 16 values of T (times `scale` unless kUnscaled), as two
// 16-byte chunks. e4m3 converts to fp16 exactly, so an unscaled fp16 output
// skips the float step.
template <typename T, bool kUnscaled>
__device__ __forceinline__ void convert_e4m3x16(const uint4 raw, float scale, uint4 (&out)[2]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t pair = words[w] >> (16 * h);
      if constexpr (kUnscaled && std::is_same_v<T, __half>) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
        o[2 * w + h] = static_cast<uint32_t>(hr.x) | (static_cast<uint32_t>(hr.y) << 16);
      } else {
        const float2 f = e4m3x2_to_float2(pair);
        o[2 * w + h] = kUnscaled ? smxx::pack2<T>(f.x, f.y) : smxx::pack2<T>(f.x * scale, f.y * scale);
      }
    }
  }
  out[0] = make_uint4(o[0], o[1], o[2], o[3]);
  out[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// 8 bf16 values -> 8 fp16 values (one chunk).
__device__ __forceinline__ uint4 bf16x8_to_half(uint4 raw) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    w[i] = smxx::pack2<__half>(f.x, f.y);
  }
  return raw;
}

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
    convert_e4m3x16<T, kUnscaled>(raw.nope[k], kUnscaled ? 1.f : raw.scale[Tr::kLoad == KvLoad::kDsMla ? k : 0], out);
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, 2 * c)) = out[0];
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, 2 * c + 1)) = out[1];
  }
  if constexpr (Tr::kLoad == KvLoad::kFp8) {
    const int r = tid / 4, q = tid % 4;
    uint4 out[2];
    convert_e4m3x16<T, true>(raw.rope[0], 1.f, out);
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, Tr::kNopeChunks + 2 * q)) = out[0];
    *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, Tr::kNopeChunks + 2 * q + 1)) = out[1];
  } else if constexpr (!Tr::kRopeDirect) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = tid / 8 + 32 * j, q = tid % 8;
      *reinterpret_cast<uint4*>(stage + qk_chunk_offset(r, Tr::kNopeChunks + q)) = bf16x8_to_half(raw.rope[j]);
    }
  }
}

}  // namespace sm90
}  // namespace mla_jax
