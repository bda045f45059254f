// Register-level conversion of staged FP8 cache bytes to the MMA type,
// shared by the portable (sm80) and Hopper (sm90) kernels: 16 e4m3 values
// (one 16-byte chunk) and 8 bf16 values (the fp8_ds_mla rope).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "csrc/smxx/kv_source.cuh"

namespace mla_jax {
namespace smxx {

// 16 e4m3 values -> 16 values of T (times `scale` unless kUnscaled), as two
// 16-byte chunks. e4m3 converts to fp16 exactly, so an unscaled fp16 output
// skips the float step (the same bits as scaling by 1).
template <typename T, bool kUnscaled>
__device__ __forceinline__ void e4m3x16_to(const uint4 raw, float scale, uint4 (&out)[2]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((words[w] >> (16 * h)) & 0xffffu);
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
      if constexpr (kUnscaled && std::is_same_v<T, __half>) {
        o[2 * w + h] = static_cast<uint32_t>(hr.x) | (static_cast<uint32_t>(hr.y) << 16);
      } else {
        const float2 f = __half22float2(__half2(hr));
        o[2 * w + h] = kUnscaled ? pack2<T>(f.x, f.y) : pack2<T>(f.x * scale, f.y * scale);
      }
    }
  }
  out[0] = make_uint4(o[0], o[1], o[2], o[3]);
  out[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// 8 bf16 values -> 8 values of T (one chunk; unchanged for bf16).
template <typename T>
__device__ __forceinline__ uint4 bf16x8_to(uint4 raw) {
  if constexpr (std::is_same_v<T, __half>) {
    uint32_t* w = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      w[i] = pack2<__half>(f.x, f.y);
    }
  }
  return raw;
}

}  // namespace smxx
}  // namespace mla_jax
