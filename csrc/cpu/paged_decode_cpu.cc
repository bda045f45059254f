#include "paged_decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../common/elem_convert.h"
#include "cpu_common.h"

namespace mla_jax {
namespace {

// True when every page a request reads is inside the cache.
bool request_pages_valid(const PagedDecodeParams& p, int b, int64_t seq_len) {
  const int64_t live_pages = (seq_len + p.page_size - 1) / p.page_size;
  const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
  for (int64_t j = 0; j < live_pages; ++j) {
    if (table[j] < 0 || table[j] >= p.num_pages) return false;
  }
  return true;
}

// One (request, head) pair: all q_len query rows of that head share each
// cache row read, which is converted to float once.
void decode_request_head(const PagedDecodeParams& p, int b, int h, float kv_scale) {
  const int q_len = p.q_len;
  const int dn = p.kv_lora_rank;
  const int dr = p.qk_rope_head_dim;
  const int64_t seq_len = p.seq_lens[b];
  const bool valid = seq_len >= 0 && seq_len <= p.max_seq_len() &&
                     request_pages_valid(p, b, seq_len);
  auto row_of = [&](int i) {
    return (static_cast<int64_t>(b) * q_len + i) * p.num_heads + h;
  };
  if (!valid) {
    for (int i = 0; i < q_len; ++i) {
      for (int d = 0; d < dn; ++d) cpu::store_out(p, row_of(i), d, NAN);
      p.lse[row_of(i)] = NAN;
    }
    return;
  }

  // Query rows in float.
  const float score_scale = p.sm_scale * kv_scale;
  std::vector<float> q(static_cast<size_t>(q_len) * (dn + dr));
  for (int i = 0; i < q_len; ++i) cpu::load_query_row(p, row_of(i), &q[i * (dn + dr)]);

  std::vector<float> acc(static_cast<size_t>(q_len) * dn, 0.0f);
  std::vector<cpu::SoftmaxRow> rows(q_len);
  std::vector<int64_t> limit(q_len);
  int64_t longest = 0;
  for (int i = 0; i < q_len; ++i) {
    limit[i] = std::max<int64_t>(0, visible_len(seq_len, q_len, i, p.causal));
    longest = std::max(longest, limit[i]);
  }

  std::vector<float> kv(dn + dr);
  const int64_t kvb = elem_bytes(p.kv_type);
  const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
  for (int64_t pos = 0; pos < longest; ++pos) {
    const int64_t page = table[pos / p.page_size];
    const int64_t slot = pos % p.page_size;
    const char* ckv = static_cast<const char*>(p.ckv) +
                      (page * p.ckv_page_stride + slot * p.ckv_token_stride) * kvb;
    const char* kpe = static_cast<const char*>(p.kpe) +
                      (page * p.kpe_page_stride + slot * p.kpe_token_stride) * kvb;
    for (int d = 0; d < dn; ++d) kv[d] = load_elem(ckv, d, p.kv_type);
    for (int d = 0; d < dr; ++d) kv[dn + d] = load_elem(kpe, d, p.kv_type);
    for (int i = 0; i < q_len; ++i) {
      if (pos >= limit[i]) continue;
      const float s = cpu::dot(&q[i * (dn + dr)], kv.data(), dn + dr) * score_scale;
      rows[i].add(s, kv.data(), &acc[static_cast<size_t>(i) * dn], dn);
    }
  }

  for (int i = 0; i < q_len; ++i) {
    rows[i].finish(p, row_of(i), &acc[static_cast<size_t>(i) * dn], kv_scale);
  }
}

}  // namespace

void paged_decode_cpu(const PagedDecodeParams& params, const ParallelFor& parallel_for) {
  const float kv_scale = params.kv_scale ? *params.kv_scale : 1.0f;
  const int64_t tasks = static_cast<int64_t>(params.batch) * params.num_heads;
  parallel_for(tasks, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      decode_request_head(params, static_cast<int>(t / params.num_heads),
                          static_cast<int>(t % params.num_heads), kv_scale);
    }
  });
}

}  // namespace mla_jax
