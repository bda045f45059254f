// Pieces shared by the CPU kernels: float dot product, query/output rows and
// the online-softmax state of one query row (float32 throughout).
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/elem_convert.h"
#include "../common/mla_params.h"

namespace mla_jax {
namespace cpu {

// Dot product with 8 independent partial sums (lets the compiler vectorise
// without reassociating a single chain).
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float tail = 0.0f;
  for (; d < n; ++d) tail += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

inline void store_out(const PagedDecodeParams& p, int64_t row, int64_t d, float v) {
  const int64_t idx = row * p.kv_lora_rank + d;
  if (p.q_type == ElemType::kBF16) {
    static_cast<uint16_t*>(p.out)[idx] = float_to_bf16(v);
  } else {
    static_cast<uint16_t*>(p.out)[idx] = float_to_f16(v);
  }
}

// Query row `row` (flattened [B, Q, H]) as kv_lora_rank + rope floats.
inline void load_query_row(const PagedDecodeParams& p, int64_t row, float* q) {
  const int dn = p.kv_lora_rank, dr = p.qk_rope_head_dim;
  const int64_t qb = elem_bytes(p.q_type);
  const char* qn = static_cast<const char*>(p.q_nope) + row * p.q_nope_row_stride * qb;
  const char* qp = static_cast<const char*>(p.q_pe) + row * p.q_pe_row_stride * qb;
  for (int d = 0; d < dn; ++d) q[d] = load_elem(qn, d, p.q_type);
  for (int d = 0; d < dr; ++d) q[dn + d] = load_elem(qp, d, p.q_type);
}

// Online softmax of one query row: running max and sum of exp(s - max),
// with the weighted value sum kept by the caller in `acc` (dn floats).
struct SoftmaxRow {
  float max = -INFINITY;
  float sum = 0.0f;

  void add(float s, const float* v, float* acc, int dn) {
    // A score of -inf (e.g. a float32 product that overflowed) has weight 0
    // wherever it comes; first in a row it would make exp(-inf - -inf) NaN.
    if (s == -INFINITY) return;
    if (s > max) {
      const float correction = std::exp(max - s);  // exp(-inf) = 0 the first time
      sum *= correction;
      for (int d = 0; d < dn; ++d) acc[d] *= correction;
      max = s;
    }
    const float w = std::exp(s - max);
    sum += w;
    for (int d = 0; d < dn; ++d) acc[d] += w * v[d];
  }

  // Writes out = kv_scale * acc / sum and lse = ln(sum exp(s)); a row that
  // saw nothing gets out 0 and lse -inf. With an attention sink the output
  // is also scaled by exp(lse) / (exp(lse) + exp(sink[h])).
  void finish(const PagedDecodeParams& p, int64_t row, const float* acc, float kv_scale) const {
    const int dn = p.kv_lora_rank;
    if (sum == 0.0f) {
      for (int d = 0; d < dn; ++d) store_out(p, row, d, 0.0f);
      p.lse[row] = -INFINITY;
      return;
    }
    const float lse = max + std::log(sum);
    float scale = kv_scale / sum;
    if (p.attn_sink != nullptr) scale /= 1.0f + std::exp(p.attn_sink[row % p.num_heads] - lse);
    for (int d = 0; d < dn; ++d) store_out(p, row, d, acc[d] * scale);
    p.lse[row] = lse;
  }
};

}  // namespace cpu
}  // namespace mla_jax
