// Device helpers shared by the portable (sm80) and Hopper (sm90) decode
// kernels: where a request's token lives in the cache, the 16-byte
// cp.async they gather with, and bf16/fp16 packing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm80.hpp>

#include "csrc/common/mla_params.h"

namespace mla_jax {
namespace sm80 {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 16 bytes global -> shared, zero-filled when !pred (the source is not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*static_cast<const cute::uint128_t*>(gmem),
                                                               *static_cast<cute::uint128_t*>(smem), pred);
}

// Where position `tok` of a request is stored. page >= 0: read page/slot.
// page -1: nothing to read (tok >= tok_end, or a sparse padding index; the
// kernels zero-fill and mask it). page -2: a live dense page id outside
// [0, num_pages) (zero-filled; the request's output becomes NaN).
// `table` is the request's block-table row (dense) or index row (sparse).
struct TokenSource {
  int page;
  int slot;
};

__device__ __forceinline__ TokenSource locate_token(const PagedDecodeParams& p, const int32_t* table,
                                                    int64_t tok, int64_t tok_end) {
  if (tok >= tok_end) return {-1, 0};
  if (p.indices != nullptr) {
    const int64_t idx = table[tok];
    if (idx < 0 || idx >= int64_t{p.num_pages} * p.page_size) return {-1, 0};
    return {static_cast<int>(idx / p.page_size), static_cast<int>(idx % p.page_size)};
  }
  const int id = table[tok / p.page_size];
  return {(id >= 0 && id < p.num_pages) ? id : -2, static_cast<int>(tok % p.page_size)};
}

}  // namespace sm80
}  // namespace mla_jax
