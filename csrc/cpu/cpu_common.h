// Pieces shared by the CPU kernels: row conversions to float, a vectorisable
// exp, float dot product, query/output rows and the online-softmax state of
// one query row (float32 throughout).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common/elem_convert.h"
#include "../common/mla_params.h"

// Helpers that vectorised kernels call inside their loops: forced inline so
// that they are compiled as part of the caller, with its target options (the
// paged kernel builds its loops for the baseline ISA and for AVX2 + FMA).
#if defined(__GNUC__) || defined(__clang__)
#define MLA_CPU_INLINE inline __attribute__((always_inline))
#else
#define MLA_CPU_INLINE inline
#endif

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

// --- Row conversions ------------------------------------------------------
// Branch-free bit manipulations over whole rows, written so that GCC
// vectorises them (at the baseline ISA, SSE2, too); the results equal the
// scalar conversions of elem_convert.h bit for bit (NaN payloads aside), including
// subnormals, which are built with integer arithmetic and an exact int ->
// float conversion so that a denormals-are-zero FPU mode cannot flush them.

MLA_CPU_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

MLA_CPU_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Branch-free select: c ? a : b on bit patterns. A `?:` on floats would let
// GCC sink the computation of the unused operand into a branch, which its
// if-conversion then refuses to undo (floating point may trap), and the loop
// would stay scalar.
MLA_CPU_INLINE uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}
MLA_CPU_INLINE float select(bool c, float a, float b) {
  return bits_to_float(select_bits(c, float_to_bits(a), float_to_bits(b)));
}

MLA_CPU_INLINE void bf16_row_to_float(const uint16_t* __restrict src, int n,
                                      float* __restrict dst) {
  for (int i = 0; i < n; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(src[i]) << 16);
}

MLA_CPU_INLINE void f16_row_to_float(const uint16_t* __restrict src, int n,
                                     float* __restrict dst) {
  for (int i = 0; i < n; ++i) {
    const uint32_t h = src[i];
    const uint32_t mag = h & 0x7fffu;
    const uint32_t exp = mag >> 10;
    // Subnormal or zero: mantissa * 2^-24, exact in float and never subnormal.
    const float sub_value = static_cast<float>(static_cast<int32_t>(mag)) * 5.9604644775390625e-8f;
    const uint32_t sub = float_to_bits(sub_value);
    const uint32_t normal = (mag << 13) + (112u << 23);   // rebias 15 -> 127
    const uint32_t special = (mag << 13) | 0x7f800000u;   // inf; NaN keeps a mantissa
    const uint32_t bits = select_bits(exp == 0, sub, select_bits(exp == 31, special, normal));
    dst[i] = bits_to_float(bits | ((h & 0x8000u) << 16));
  }
}

MLA_CPU_INLINE void fp8e4m3_row_to_float(const uint8_t* __restrict src, int n,
                                         float* __restrict dst) {
  for (int i = 0; i < n; ++i) {
    const uint32_t v = src[i];
    const uint32_t mag = v & 0x7fu;
    // Exponent 0: mantissa * 2^-9 (exact); otherwise rebias 7 -> 127.
    const float sub_value = static_cast<float>(static_cast<int32_t>(mag)) * 0.001953125f;
    const uint32_t sub = float_to_bits(sub_value);
    const uint32_t normal = (mag << 20) + (120u << 23);
    const uint32_t finite = select_bits((mag >> 3) == 0, sub, normal);
    const uint32_t bits = select_bits(mag == 0x7fu, 0x7fc00000u, finite);  // S.1111.111 is NaN
    dst[i] = bits_to_float(bits | ((v & 0x80u) << 24));
  }
}

// n stored values of `type` at `src` as float.
MLA_CPU_INLINE void row_to_float(const void* src, ElemType type, int n, float* dst) {
  switch (type) {
    case ElemType::kBF16:
      bf16_row_to_float(static_cast<const uint16_t*>(src), n, dst);
      return;
    case ElemType::kF16:
      f16_row_to_float(static_cast<const uint16_t*>(src), n, dst);
      return;
    case ElemType::kFP8E4M3:
      fp8e4m3_row_to_float(static_cast<const uint8_t*>(src), n, dst);
      return;
  }
}

// exp(x) for x <= 0 (also -inf, giving 0; NaN stays NaN), branch-free so that
// loops over it vectorise. Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
// and the Cephes expf polynomial (about 1 ulp). Results below exp(-86) are
// flushed to 0: as softmax weights next to a weight of 1 they cannot matter,
// and building 2^n for smaller n would need a subnormal.
MLA_CPU_INLINE float exp_nonpositive(float x) {
  const bool tiny = x < -86.0f;
  const float xc = select(tiny, -86.0f, x);
  const float shifted = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: round to integer
  const float n = shifted - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * (r * r) + r + 1.0f;
  const uint32_t k = float_to_bits(shifted) - 0x4B400000u;  // n as a two's-complement integer
  const uint32_t e = float_to_bits(poly) + (k << 23);
  // NaN in, NaN out (its bits through the steps above are not guaranteed).
  return bits_to_float(select_bits(x != x, float_to_bits(x), select_bits(tiny, 0u, e)));
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
