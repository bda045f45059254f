// Scalar conversions of the storage types to float for the CPU kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mla_params.h"

namespace mla_jax {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    f = mant ? NAN : INFINITY;
  } else {
    f = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(f));
  bits |= sign;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
// S.1111.111 is NaN.
inline float fp8e4m3_to_float(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(f));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline uint16_t float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(f));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;           // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00;          // overflow -> inf
  if (abs < 0x38800000u) {                               // subnormal or zero
    float a;
    std::memcpy(&a, &abs, sizeof(a));
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  // Normal: rebias exponent, round mantissa to nearest even.
  uint32_t m = abs + 0xc8000fffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>(m >> 13);
}

// Reads element `i` of a row stored as `type`.
inline float load_elem(const void* row, int64_t i, ElemType type) {
  switch (type) {
    case ElemType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
    case ElemType::kF16:
      return f16_to_float(static_cast<const uint16_t*>(row)[i]);
    case ElemType::kFP8E4M3:
      return fp8e4m3_to_float(static_cast<const uint8_t*>(row)[i]);
  }
  return NAN;
}

}  // namespace mla_jax
