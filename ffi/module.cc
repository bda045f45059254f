// nanobind module: exposes the FFI handlers as capsules for
// jax.ffi.register_ffi_target, the kernel selection and the workspace
// layout (used at trace time by mla_jax/kernels.py, so Python and the
// handlers share one implementation of each), and what
// `python -m mla_jax info` reports.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "csrc/common/workspace.h"
#include "csrc/dispatch/select.h"
#include "ffi/handlers.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

template <typename T>
T get(const nb::dict& d, const char* key, T fallback) {
  return d.contains(key) ? nb::cast<T>(d[key]) : fallback;
}

// facts: a dict of DecodeFacts fields by name (missing ones keep their
// defaults); request: format_config text. Returns (config text, error,
// explanation).
std::tuple<std::string, std::string, std::string> select_kernel_py(const nb::dict& facts, const std::string& request) {
  using namespace mla_jax;
  KernelConfig want;
  std::string why;
  if (!parse_config(request, &want, &why)) return {"", "kernel request: " + why, ""};
  DecodeFacts f;
  f.op = get<std::string>(facts, "op", "paged") == "sparse" ? DecodeOp::kSparse : DecodeOp::kPaged;
  f.q_type = static_cast<ElemType>(get<int>(facts, "q_type", 0));
  f.kv_type = static_cast<ElemType>(get<int>(facts, "kv_type", 0));
  f.kv_format = static_cast<KvFormat>(get<int>(facts, "kv_format", 0));
  f.kv_lora_rank = get<int>(facts, "kv_lora_rank", 512);
  f.qk_rope_head_dim = get<int>(facts, "qk_rope_head_dim", 64);
  f.page_size = get<int>(facts, "page_size", 1);
  f.q_len = get<int>(facts, "q_len", 1);
  f.num_heads = get<int>(facts, "num_heads", 1);
  f.batch = get<int64_t>(facts, "batch", kUnknownSize);
  f.num_pages = get<int64_t>(facts, "num_pages", kUnknownSize);
  f.topk = get<int>(facts, "topk", 0);
  f.kv_aligned = get<bool>(facts, "kv_aligned", true);
  f.kv_pages_contiguous = get<bool>(facts, "kv_pages_contiguous", true);
  f.arch = get<int>(facts, "arch", 0);
  f.sm_count = get<int>(facts, "sm_count", 0);
  f.build_sm90a = get<bool>(facts, "build_sm90a", false);
  f.workspace_parts = get<int>(facts, "workspace_parts", kMaxSupportedSmCount);
  f.schedule_operand = get<bool>(facts, "schedule_operand", false);
  std::string explanation;
  const Selection sel = select_kernel(f, want, &explanation);
  return {format_config(sel.config), sel.error, explanation};
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
    d["mla_jax_paged_decode_cuda_v3"] = encapsulate(mla_jax::PagedDecodeCuda);
    d["mla_jax_paged_decode_schedule_cuda_v1"] = encapsulate(mla_jax::PagedDecodeScheduleCuda);
    d["mla_jax_sparse_decode_cuda_v3"] = encapsulate(mla_jax::SparseDecodeCuda);
    d["mla_jax_sparse_decode_schedule_cuda_v1"] = encapsulate(mla_jax::SparseDecodeScheduleCuda);
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
  m.def("has_sm90a", []() {
#ifdef MLA_JAX_SM90A
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
  m.def("select_kernel", &select_kernel_py, nb::arg("facts"), nb::arg("request"));
  m.def("workspace_size", [](int64_t rows, int64_t dv, int64_t parts) {
    const mla_jax::WorkspaceSize s = mla_jax::workspace_size(rows, dv, parts);
    return std::make_tuple(s.per_request, s.fixed);
  });
  m.def("schedule_size", [](int64_t rows, int64_t parts) {
    const mla_jax::WorkspaceSize s = mla_jax::schedule_size(rows, parts);
    return std::make_tuple(s.per_request, s.fixed);
  });
  m.def("max_supported_sm_count", []() { return mla_jax::kMaxSupportedSmCount; });
}
