// Small helpers every FFI handler uses: shape text for messages, errors
// that name the op, and the XLA -> mla_jax element type mapping.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/common/mla_params.h"
#include "xla/ffi/api/ffi.h"

namespace mla_jax {

namespace ffi = xla::ffi;

// The ops' names as users call them; every error message starts with one.
inline constexpr const char* kPagedDecodeOp = "mla_jax.paged_decode";
inline constexpr const char* kPagedDecodeScheduleOp = "mla_jax.paged_decode (schedule)";
inline constexpr const char* kSparseDecodeScheduleOp = "mla_jax.sparse_decode (schedule)";
inline constexpr const char* kSparseDecodeOp = "mla_jax.sparse_decode";

// "[2, 3, 576]". Plain std::string building, no iostreams: with jaxlib 0.11
// loaded in the process, constructing a std::ostringstream on the error
// path crashed (segfault).
inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline ffi::Error invalid_argument(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + msg);
}

inline ffi::Error internal_error(const char* op, const std::string& msg) {
  return ffi::Error::Internal(std::string(op) + ": " + msg);
}

inline bool elem_type_of(ffi::DataType dt, ElemType* out) {
  switch (dt) {
    case ffi::DataType::BF16: *out = ElemType::kBF16; return true;
    case ffi::DataType::F16: *out = ElemType::kF16; return true;
    case ffi::DataType::F8E4M3FN: *out = ElemType::kFP8E4M3; return true;
    default: return false;
  }
}

}  // namespace mla_jax
