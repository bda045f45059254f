// Host side of the Hopper decode: when to use it.
#include "csrc/common/env_flag.h"
#include "csrc/sm90/api.h"
#include "csrc/sm90/kv_tma.h"

namespace mla_jax {
namespace sm90 {

bool selected(const PagedDecodeParams& p) {
#if defined(MLA_JAX_SM90A)
  if (env_flag("MLA_JAX_PORTABLE_KERNEL")) return false;
  if (p.kv_format != KvFormat::kPlain || p.kv_type != p.q_type) return false;
  if (p.q_type != ElemType::kBF16 && p.q_type != ElemType::kF16) return false;
  // Fewer than 64 rows (H = 1-32 at q_len 1) run in one 64-row block with the
  // missing rows zero-filled: 4x the tensor work at 16 heads, but these
  // calls are bound by reading the cache, which the seesaw schedule's TMA
  // loads do faster than the portable kernel's cp.async (16-head rows:
  // 85-98 % of the copy ceiling with the portable kernel, 105 % at 64 heads
  // with the seesaw). Without TMA (kv_tma_applies: pages below 64 tokens,
  // sparse indices, unaligned caches), or with the lock-step schedule
  // forced, the portable kernel's 16- and 32-row blocks stay.
  if (sm80::rows_per_cta(p.rows_per_request()) != 64 &&
      (!kv_tma_applies(p) || env_flag("MLA_JAX_SM90_LOCKSTEP")))
    return false;
  // The kernel addresses cache row page * page_size + slot with the token
  // stride alone (true of every cache ffi/decode_args.cc describes).
  if (p.ckv_page_stride != int64_t{p.page_size} * p.ckv_token_stride ||
      p.kpe_page_stride != int64_t{p.page_size} * p.kpe_token_stride)
    return false;
  // Device attributes are host-side queries (no stream work), so this is
  // safe while XLA captures the call into a command buffer.
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major == 9;
#else
  (void)p;
  return false;
#endif
}

}  // namespace sm90
}  // namespace mla_jax
