// TMA (bulk tensor copy) descriptors of the latent cache, for the Hopper
// kernel's page-aligned load path.
//
// When every 64-token KV tile lies inside one page (dense decode with
// page_size a multiple of 64), a tile is 64 consecutive cache rows, so one
// 2D box of 64 rows x 64 features per 128-byte-swizzled block copies it:
// nine boxes per tile (eight of ckv, one of kpe) issued by one thread per
// warpgroup instead of 4,608 cp.async by 256 threads. Other caches (sparse
// indices, page sizes 1-32 or not a multiple of 64) keep the cp.async path.
#pragma once

#include <cuda.h>

#include "csrc/common/mla_params.h"

namespace mla_jax {
namespace sm90 {

struct KvTma {
  CUtensorMap ckv;  // [num_pages * page_size rows, 512], box 64 x 64, SWIZZLE_128B (FP8: see below)
  CUtensorMap kpe;  // [num_pages * page_size rows, 64], same box
  int enabled = 0;  // 0: use the cp.async path
};

// True when the call's cache qualifies for TMA loads: dense decode, pages a
// multiple of 64 tokens, 16-byte aligned bases and row strides, row
// coordinates within int32. Host only.
bool kv_tma_applies(const PagedDecodeParams& p);

// Fills `tma` for the call's cache, or leaves enabled = 0 when the call
// does not qualify (kv_tma_applies) or the driver cannot encode the
// descriptors. Host only; no stream work, so it is safe while XLA
// captures the call into a command buffer.
void make_kv_tma(const PagedDecodeParams& p, KvTma* tma);

// The same for a dense float8_e4m3fn cache (the swap-AB kernel,
// decode_swapab.cuh, and the seesaw kernel's raw tiles): ckv in boxes of 64
// rows x 128 bytes, SWIZZLE_128B; kpe in boxes of 64 rows x 64 bytes,
// SWIZZLE_64B (the K-major layouts of the swap-AB kernel's FP8 wgmma A
// operand). Host only.
bool kv_tma_fp8_applies(const PagedDecodeParams& p);
void make_kv_tma_fp8(const PagedDecodeParams& p, KvTma* tma);

}  // namespace sm90
}  // namespace mla_jax
