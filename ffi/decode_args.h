// Turns the XLA FFI buffers of a paged decode call into PagedDecodeParams.
// Shared by the CPU and CUDA handlers so both accept exactly the same
// layouts and reject the same inconsistencies (which the Python op already
// checks at trace time; these checks guard direct custom-call users).
#pragma once

#include <string>

#include "csrc/common/mla_params.h"
#include "xla/ffi/api/ffi.h"

namespace mla_jax {

namespace ffi = xla::ffi;

// query arguments: q_nope [B, Q, H, 512 or 576] and q_pe [B, Q, H, 64]; when
// q_nope's last dim is kv_lora_rank + qk_rope_head_dim the query is packed
// and q_pe is ignored (the op passes the packed buffer twice). The cache
// follows the same rule: ckv [P, S, 512 or 576], kpe [P, S, 64].
ffi::Error fill_decode_params(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                              ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> block_table,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> kv_scale,
                              ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, float sm_scale,
                              bool causal, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                              PagedDecodeParams* params);

}  // namespace mla_jax
