// Turns the XLA FFI buffers of a paged decode call into PagedDecodeParams.
// Shared by the CPU and CUDA handlers so both accept exactly the same
// layouts and reject the same inconsistencies (which the Python op already
// checks at trace time; these checks guard direct custom-call users).
#pragma once

#include <string>

#include "csrc/common/mla_params.h"
#include "ffi/ffi_util.h"

namespace mla_jax {

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

// Sparse top-k decode (DeepSeek V3.2): q_nope/q_pe as above; kv is one
// packed cache, [P, S, 576] in the query dtype (kv_format 0, KvFormat::kPlain)
// or uint8 [P, S, 656] (kv_format 1, KvFormat::kFp8DsMla); indices
// S32 [B, Q, K]; topk_lens S32 [B]; attn_sink F32 [H] (used only when
// has_sink); kv_scale F32 [1]; out [B, Q, H, 512] in the query dtype and
// lse F32 [B, Q, H]. Fills the sparse fields of PagedDecodeParams
// (indices, topk_lens, topk, attn_sink, kv_format); block_table and
// seq_lens are null, max_pages_per_seq 0, causal false.
//
// For kFp8DsMla, kv_type is kFP8E4M3, ckv points at the first byte of the
// cache and kpe at byte kDsMlaRopeOffset (528); both use token stride 656
// and page stride S * 656. These strides count BYTES (the kv element size
// is 1), i.e. they address whole 656-byte rows: the kernel finds a token's
// scales at ckv row + kDsMlaScaleOffset and reads its 64 rope values as
// bf16 from the kpe pointer (not as kv_type).
ffi::Error fill_sparse_params(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer kv,
                              ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_lens,
                              ffi::Buffer<ffi::F32> attn_sink, ffi::Buffer<ffi::F32> kv_scale,
                              ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, float sm_scale,
                              int64_t kv_format, bool has_sink, int64_t kv_lora_rank,
                              int64_t qk_rope_head_dim, PagedDecodeParams* params);

}  // namespace mla_jax
