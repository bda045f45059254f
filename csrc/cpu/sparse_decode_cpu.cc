#include "sparse_decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/elem_convert.h"

namespace mla_jax {
namespace {

// Heads handled by one task: each gathered cache row is converted to float
// once per task and shared by these heads.
constexpr int kHeadsPerTask = 8;
constexpr int kDsMlaScales = (kDsMlaRopeOffset - kDsMlaScaleOffset) / 4;

// Dot product with 8 independent partial sums (lets the compiler vectorise
// without reassociating a single chain).
float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float tail = 0.0f;
  for (; d < n; ++d) tail += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

void store_out(const PagedDecodeParams& p, int64_t row, int64_t d, float v) {
  const int64_t idx = row * p.kv_lora_rank + d;
  if (p.q_type == ElemType::kBF16) {
    static_cast<uint16_t*>(p.out)[idx] = float_to_bf16(v);
  } else {
    static_cast<uint16_t*>(p.out)[idx] = float_to_f16(v);
  }
}

// Converts cache slot `slot` (a valid global index) to float: kv[0, dn) is
// ckv, kv[dn, dn + dr) is kpe, both dequantised.
void load_kv_row(const PagedDecodeParams& p, int64_t slot, float* kv) {
  const int dn = p.kv_lora_rank, dr = p.qk_rope_head_dim;
  const int64_t page = slot / p.page_size, off = slot % p.page_size;
  if (p.kv_format == KvFormat::kFp8DsMla) {
    // Strides count bytes: one 656-byte row per token.
    const uint8_t* row = static_cast<const uint8_t*>(p.ckv) + page * p.ckv_page_stride +
                         off * p.ckv_token_stride;
    float scales[kDsMlaScales];
    std::memcpy(scales, row + kDsMlaScaleOffset, sizeof(scales));  // little-endian float32
    for (int d = 0; d < dn; ++d) kv[d] = fp8e4m3_to_float(row[d]) * scales[d / kDsMlaGroup];
    const uint8_t* rope = static_cast<const uint8_t*>(p.kpe) + page * p.kpe_page_stride +
                          off * p.kpe_token_stride;
    for (int d = 0; d < dr; ++d) {
      uint16_t v;
      std::memcpy(&v, rope + 2 * d, sizeof(v));
      kv[dn + d] = bf16_to_float(v);
    }
    return;
  }
  const int64_t kvb = elem_bytes(p.kv_type);
  const char* ckv = static_cast<const char*>(p.ckv) +
                    (page * p.ckv_page_stride + off * p.ckv_token_stride) * kvb;
  const char* kpe = static_cast<const char*>(p.kpe) +
                    (page * p.kpe_page_stride + off * p.kpe_token_stride) * kvb;
  for (int d = 0; d < dn; ++d) kv[d] = load_elem(ckv, d, p.kv_type);
  for (int d = 0; d < dr; ++d) kv[dn + d] = load_elem(kpe, d, p.kv_type);
}

// Query token r = b * q_len + i, heads [h0, h1): online softmax over the
// token's valid indices.
void decode_token_heads(const PagedDecodeParams& p, int64_t r, int h0, int h1, float kv_scale) {
  const int dn = p.kv_lora_rank, dr = p.qk_rope_head_dim, dqk = dn + dr;
  const int nh = h1 - h0;
  const int64_t b = r / p.q_len;
  int64_t n = p.topk;
  if (p.topk_lens != nullptr) n = std::min<int64_t>(std::max<int64_t>(p.topk_lens[b], 0), p.topk);
  const int64_t num_slots = static_cast<int64_t>(p.num_pages) * p.page_size;
  const int32_t* idx = p.indices + r * p.topk;

  std::vector<float> q(static_cast<size_t>(nh) * dqk);
  const int64_t qb = elem_bytes(p.q_type);
  for (int j = 0; j < nh; ++j) {
    const int64_t row = r * p.num_heads + h0 + j;
    const char* qn = static_cast<const char*>(p.q_nope) + row * p.q_nope_row_stride * qb;
    const char* qp = static_cast<const char*>(p.q_pe) + row * p.q_pe_row_stride * qb;
    for (int d = 0; d < dn; ++d) q[j * dqk + d] = load_elem(qn, d, p.q_type);
    for (int d = 0; d < dr; ++d) q[j * dqk + dn + d] = load_elem(qp, d, p.q_type);
  }

  const float score_scale = p.sm_scale * kv_scale;
  std::vector<float> acc(static_cast<size_t>(nh) * dn, 0.0f);
  std::vector<float> row_max(nh, -INFINITY), row_sum(nh, 0.0f);
  std::vector<float> kv(dqk);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = idx[t];
    if (slot < 0 || slot >= num_slots) continue;  // padding: never read
    load_kv_row(p, slot, kv.data());
    for (int j = 0; j < nh; ++j) {
      const float s = dot(&q[j * dqk], kv.data(), dqk) * score_scale;
      float* a = &acc[static_cast<size_t>(j) * dn];
      if (s > row_max[j]) {
        const float correction = std::exp(row_max[j] - s);  // exp(-inf) = 0 the first time
        row_sum[j] *= correction;
        for (int d = 0; d < dn; ++d) a[d] *= correction;
        row_max[j] = s;
      }
      const float w = std::exp(s - row_max[j]);
      row_sum[j] += w;
      for (int d = 0; d < dn; ++d) a[d] += w * kv[d];
    }
  }

  for (int j = 0; j < nh; ++j) {
    const int64_t row = r * p.num_heads + h0 + j;
    if (row_sum[j] == 0.0f) {  // no valid index: out 0, lse -inf
      for (int d = 0; d < dn; ++d) store_out(p, row, d, 0.0f);
      p.lse[row] = -INFINITY;
      continue;
    }
    const float lse = row_max[j] + std::log(row_sum[j]);
    float scale = kv_scale / row_sum[j];
    if (p.attn_sink != nullptr) {
      // exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse)).
      scale /= 1.0f + std::exp(p.attn_sink[h0 + j] - lse);
    }
    const float* a = &acc[static_cast<size_t>(j) * dn];
    for (int d = 0; d < dn; ++d) store_out(p, row, d, a[d] * scale);
    p.lse[row] = lse;
  }
}

}  // namespace

void sparse_decode_cpu(const PagedDecodeParams& params, const ParallelFor& parallel_for) {
  const float kv_scale = params.kv_scale ? *params.kv_scale : 1.0f;
  const int64_t tokens = static_cast<int64_t>(params.batch) * params.q_len;
  const int groups = (params.num_heads + kHeadsPerTask - 1) / kHeadsPerTask;
  parallel_for(tokens * groups, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int g = static_cast<int>(t % groups);
      const int h0 = g * kHeadsPerTask;
      const int h1 = std::min(params.num_heads, h0 + kHeadsPerTask);
      decode_token_heads(params, t / groups, h0, h1, kv_scale);
    }
  });
}

}  // namespace mla_jax
