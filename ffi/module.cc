// nanobind module: exposes the FFI handlers as capsules for
// jax.ffi.register_ffi_target, plus what `python -m mla_jax info` reports.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/handlers.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_mla_jax_ext, m) {
  m.def("cpu_registrations", []() {
    nb::dict d;
    d["mla_jax_paged_decode_cpu"] = encapsulate(mla_jax::PagedDecodeCpu);
    d["mla_jax_sparse_decode_cpu"] = encapsulate(mla_jax::SparseDecodeCpu);
    return d;
  });
  m.def("cuda_registrations", []() {
    nb::dict d;
#ifdef MLA_JAX_WITH_CUDA
    d["mla_jax_paged_decode_cuda"] = encapsulate(mla_jax::PagedDecodeCuda);
    d["mla_jax_sparse_decode_cuda"] = encapsulate(mla_jax::SparseDecodeCuda);
#endif
    return d;
  });
  m.def("has_cuda", []() {
#ifdef MLA_JAX_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("cuda_archs", []() -> std::string {
#ifdef MLA_JAX_CUDA_ARCHS
    return MLA_JAX_CUDA_ARCHS;
#else
    return "";
#endif
  });
}
