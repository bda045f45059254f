#include "paged_decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../common/elem_convert.h"

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

void store_out(const PagedDecodeParams& p, int64_t row, int64_t d, float v) {
  const int64_t idx = row * p.kv_lora_rank + d;
  if (p.q_type == ElemType::kBF16) {
    static_cast<uint16_t*>(p.out)[idx] = float_to_bf16(v);
  } else {
    static_cast<uint16_t*>(p.out)[idx] = float_to_f16(v);
  }
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
      for (int d = 0; d < dn; ++d) store_out(p, row_of(i), d, NAN);
      p.lse[row_of(i)] = NAN;
    }
    return;
  }

  // Query rows in float, pre-multiplied by the softmax scale (in log2 units).
  const float score_scale = p.sm_scale * kv_scale;
  std::vector<float> q(static_cast<size_t>(q_len) * (dn + dr));
  for (int i = 0; i < q_len; ++i) {
    const int64_t r = row_of(i);
    const int64_t qb = elem_bytes(p.q_type);
    const char* qn = static_cast<const char*>(p.q_nope) + r * p.q_nope_row_stride * qb;
    const char* qp = static_cast<const char*>(p.q_pe) + r * p.q_pe_row_stride * qb;
    for (int d = 0; d < dn; ++d) q[i * (dn + dr) + d] = load_elem(qn, d, p.q_type);
    for (int d = 0; d < dr; ++d) q[i * (dn + dr) + dn + d] = load_elem(qp, d, p.q_type);
  }

  std::vector<float> acc(static_cast<size_t>(q_len) * dn, 0.0f);
  std::vector<float> row_max(q_len, -INFINITY), row_sum(q_len, 0.0f);
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
      const float* qi = &q[i * (dn + dr)];
      float dot = 0.0f;
      for (int d = 0; d < dn + dr; ++d) dot += qi[d] * kv[d];
      const float s = dot * score_scale;
      float* a = &acc[static_cast<size_t>(i) * dn];
      if (s > row_max[i]) {
        const float correction = std::exp(row_max[i] - s);  // exp(-inf) = 0 first time
        row_sum[i] *= correction;
        for (int d = 0; d < dn; ++d) a[d] *= correction;
        row_max[i] = s;
      }
      const float w = std::exp(s - row_max[i]);
      row_sum[i] += w;
      for (int d = 0; d < dn; ++d) a[d] += w * kv[d];
    }
  }

  for (int i = 0; i < q_len; ++i) {
    const int64_t r = row_of(i);
    if (row_sum[i] == 0.0f) {  // nothing visible: out 0, lse -inf
      for (int d = 0; d < dn; ++d) store_out(p, r, d, 0.0f);
      p.lse[r] = -INFINITY;
      continue;
    }
    const float inv = kv_scale / row_sum[i];
    for (int d = 0; d < dn; ++d) store_out(p, r, d, acc[static_cast<size_t>(i) * dn + d] * inv);
    p.lse[r] = row_max[i] + std::log(row_sum[i]);
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
