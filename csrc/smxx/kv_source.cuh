// Device helpers shared by the portable (sm80) and Hopper (sm90) decode
// kernels: where a request's token lives in the cache, the 16-byte
// cp.async they gather with, and bf16/fp16 packing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm80.hpp>

#include "csrc/common/mla_params.h"

namespace mla_jax {
namespace smxx {

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

// The inverse: two packed bf16/fp16 values as floats (exact).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// 16 bytes global -> shared, zero-filled when !pred (the source is not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*static_cast<const cute::uint128_t*>(gmem),
                                                               *static_cast<cute::uint128_t*>(smem), pred);
}

// 8 bytes global -> shared (through L1: an 8-byte copy has no L2-only
// form), zero-filled when !pred.
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint64_t>::copy(*static_cast<const uint64_t*>(gmem),
                                                         *static_cast<uint64_t*>(smem), pred);
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

// Quotient and remainder by the page size: a shift and a mask for the usual
// power-of-two sizes (a general division costs tens of instructions, and
// the kernels call this for every KV row they copy). x >= 0.
__device__ __forceinline__ void div_page(const PagedDecodeParams& p, int x, int& q, int& r) {
  const unsigned ps = static_cast<unsigned>(p.page_size);
  if ((ps & (ps - 1)) == 0) {
    q = static_cast<int>(static_cast<unsigned>(x) >> (__ffs(ps) - 1));
    r = static_cast<int>(static_cast<unsigned>(x) & (ps - 1));
  } else {
    q = static_cast<int>(static_cast<unsigned>(x) / ps);
    r = static_cast<int>(static_cast<unsigned>(x) - static_cast<unsigned>(q) * ps);
  }
}

// Positions and sequence lengths are int32 on the host (seq_lens, indices),
// so tok < tok_end < 2^31 and 32-bit arithmetic is exact.
__device__ __forceinline__ TokenSource locate_token(const PagedDecodeParams& p, const int32_t* table,
                                                    int64_t tok, int64_t tok_end) {
  if (tok >= tok_end) return {-1, 0};
  int page, slot;
  if (p.indices != nullptr) {
    const int idx = table[tok];
    if (idx < 0 || int64_t{idx} >= int64_t{p.num_pages} * p.page_size) return {-1, 0};
    div_page(p, idx, page, slot);
    return {page, slot};
  }
  div_page(p, static_cast<int>(tok), page, slot);
  const int id = table[page];
  return {(id >= 0 && id < p.num_pages) ? id : -2, slot};
}

}  // namespace smxx
}  // namespace mla_jax
