// Per-request length and validity, shared by the scheduler and the decode
// kernel so both always agree on how much KV a request has.
#pragma once

#include "csrc/common/mla_params.h"

namespace mla_jax {
namespace smxx {

struct RequestSpan {
  int64_t len;  // positions to stream (tokens of the cache, or top-k entries)
  bool valid;   // false: the request's output is NaN (dense-mode bad length)
};

// Dense mode: seq_lens[r], valid when 0 <= len <= max_pages_per_seq * page_size.
// Sparse mode: request r is query token r % group of batch entry r / group; it
// streams min(topk_lens[b], topk) index entries (all topk without topk_lens).
// The split schedule calls this with only the fields it reads set: batch,
// and seq_lens and max_pages_per_seq * page_size, or indices as a flag (never
// read: the sparse schedule call points it at topk_lens), topk, topk_lens and
// sparse_group (ffi/cuda_handlers.cc).
__device__ __forceinline__ RequestSpan request_span(const PagedDecodeParams& p, int r) {
  if (p.indices != nullptr) {
    int64_t len = p.topk;
    if (p.topk_lens != nullptr) {
      const int64_t l = p.topk_lens[r / p.sparse_group];
      len = l < 0 ? 0 : (l < len ? l : len);
    }
    return {len, true};
  }
  const int64_t len = p.seq_lens[r];
  const bool valid = len >= 0 && len <= p.max_seq_len();
  return {valid ? len : 0, valid};
}

}  // namespace smxx
}  // namespace mla_jax
