// The FFI handler symbols the nanobind module exposes.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace mla_jax {

XLA_FFI_DECLARE_HANDLER_SYMBOL(PagedDecodeCpu);
#ifdef MLA_JAX_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(PagedDecodeCuda);
#endif

}  // namespace mla_jax
