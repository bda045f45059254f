#include "sparse_decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/elem_convert.h"
#include "cpu_common.h"

namespace mla_jax {
namespace {

using cpu::dot;
using cpu::SoftmaxRow;

// Heads handled by one task: each gathered cache row is converted to float
// once per task and shared by these heads.
constexpr int kHeadsPerTask = 8;
constexpr int kDsMlaScales = (kDsMlaRopeOffset - kDsMlaScaleOffset) / 4;

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
  for (int j = 0; j < nh; ++j) cpu::load_query_row(p, r * p.num_heads + h0 + j, &q[j * dqk]);

  const float score_scale = p.sm_scale * kv_scale;
  std::vector<float> acc(static_cast<size_t>(nh) * dn, 0.0f);
  std::vector<SoftmaxRow> rows(nh);
  std::vector<float> kv(dqk);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = idx[t];
    if (slot < 0 || slot >= num_slots) continue;  // padding: never read
    load_kv_row(p, slot, kv.data());
    for (int j = 0; j < nh; ++j) {
      const float s = dot(&q[j * dqk], kv.data(), dqk) * score_scale;
      rows[j].add(s, kv.data(), &acc[static_cast<size_t>(j) * dn], dn);
    }
  }
  for (int j = 0; j < nh; ++j) {
    rows[j].finish(p, r * p.num_heads + h0 + j, &acc[static_cast<size_t>(j) * dn], kv_scale);
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
