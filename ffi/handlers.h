// The FFI handler symbols the nanobind module exposes.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace mla_jax {

XLA_FFI_DECLARE_HANDLER_SYMBOL(PagedDecodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDecodeCpu);
#ifdef MLA_JAX_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(PagedDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PagedDecodeScheduleCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDecodeScheduleCuda);
#endif

}  // namespace mla_jax
