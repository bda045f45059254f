// XLA FFI handler for the CUDA backend: scheduler + decode + combine on
// XLA's stream, scratch passed in as extra results (XLA allocates it), so
// the handler allocates nothing and is safe inside command buffers.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "csrc/common/env_flag.h"
#include "csrc/sm80/api.h"
#include "ffi/decode_args.h"
#include "ffi/handlers.h"

namespace mla_jax {
namespace {

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("mla_jax paged decode: ") + what + ": " + cudaGetErrorString(err));
}

// The A/B switches with a fixed set of values (README "Which CUDA kernel
// runs"); the boolean ones accept any value.
ffi::Error check_env_switches() {
  const std::string why = env_choice_error("MLA_JAX_COMBINE_GRID", {"block", "rows", "slices"});
  return why.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(why);
}

using S32Result = ffi::Result<ffi::Buffer<ffi::S32>>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

// Scratch sizes come from the buffers (they may be symbolic in Python):
// num_parts from part_begin's last dim, max_items from out_accum's first
// dim, item_regions from how many max_items x 4 regions items holds.
ffi::Error make_workspace(int64_t requests, int64_t rows, int64_t dv, int64_t max_num_splits,
                          S32Result request_meta, S32Result part_begin, S32Result items,
                          F32Result out_accum, F32Result lse_accum, sm80::DecodeWorkspace* ws) {
  auto parts_dims = part_begin->dimensions();
  auto accum_dims = out_accum->dimensions();
  if (parts_dims.size() < 1 || accum_dims.size() < 1 || max_num_splits < 0 ||
      parts_dims[parts_dims.size() - 1] > INT32_MAX || accum_dims[0] > INT32_MAX || accum_dims[0] < 1) {
    return ffi::Error::InvalidArgument("mla_jax: malformed scratch buffers or max_num_splits");
  }
  ws->num_parts = static_cast<int>(parts_dims[parts_dims.size() - 1]) - 1;
  ws->max_items = static_cast<int>(accum_dims[0]);
  ws->max_num_splits = static_cast<int>(max_num_splits);
  const size_t max_items = static_cast<size_t>(ws->max_items);
  // The scheduler writes part_begin[0 .. num_parts] and reads every item slot.
  if (ws->num_parts < 1 || part_begin->element_count() < static_cast<size_t>(ws->num_parts) + 1 ||
      ws->max_items < requests + ws->num_parts ||
      request_meta->element_count() < static_cast<size_t>(2 * requests) ||
      items->element_count() < 4 * max_items ||
      out_accum->element_count() < max_items * rows * dv || lse_accum->element_count() < max_items * rows) {
    return ffi::Error::InvalidArgument("mla_jax: scratch buffers are too small for this call");
  }
  ws->item_regions = static_cast<int>(items->element_count() / (4 * max_items));
  ws->request_meta = request_meta->typed_data();
  ws->part_begin = part_begin->typed_data();
  ws->items = items->typed_data();
  ws->out_accum = out_accum->typed_data();
  ws->lse_accum = lse_accum->typed_data();
  return ffi::Error::Success();
}

ffi::Error paged_decode_cuda_impl(
    cudaStream_t stream, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv, ffi::AnyBuffer kpe,
    ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> kv_scale,
    ffi::Result<ffi::AnyBuffer> out, F32Result lse, S32Result request_meta, S32Result part_begin,
    S32Result items, F32Result out_accum, F32Result lse_accum, float sm_scale, bool causal,
    int64_t kv_lora_rank, int64_t qk_rope_head_dim, int64_t max_num_splits) {
  PagedDecodeParams params;
  ffi::Error err = fill_decode_params(q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale, *out, *lse,
                                      sm_scale, causal, kv_lora_rank, qk_rope_head_dim, &params);
  if (err.failure()) return err;
  if (const char* why = sm80::check_supported(params)) {
    return ffi::Error::InvalidArgument(std::string("mla_jax paged decode: ") + why);
  }
  err = check_env_switches();
  if (err.failure()) return err;
  sm80::DecodeWorkspace ws;
  err = make_workspace(params.batch, params.rows_per_request(), params.kv_lora_rank, max_num_splits,
                       request_meta, part_begin, items, out_accum, lse_accum, &ws);
  if (err.failure()) return err;
  cudaError_t status = sm80::paged_decode(params, ws, stream);
  if (status != cudaSuccess) return cuda_error("kernel launch failed", status);
  return ffi::Error::Success();
}

// Sparse top-k decode: B*Q single-token requests of H rows each, so the
// scratch is [B*Q, 2], [P + 1], [B*Q + P, 4], [B*Q + P, H, 512], [B*Q + P, H].
ffi::Error sparse_decode_cuda_impl(
    cudaStream_t stream, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer kv,
    ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_lens, ffi::Buffer<ffi::F32> attn_sink,
    ffi::Buffer<ffi::F32> kv_scale, ffi::Result<ffi::AnyBuffer> out, F32Result lse, S32Result request_meta,
    S32Result part_begin, S32Result items, F32Result out_accum, F32Result lse_accum, float sm_scale,
    int64_t kv_format, bool has_sink, int64_t kv_lora_rank, int64_t qk_rope_head_dim) {
  PagedDecodeParams params;
  ffi::Error err = fill_sparse_params(q_nope, q_pe, kv, indices, topk_lens, attn_sink, kv_scale, *out, *lse,
                                      sm_scale, kv_format, has_sink, kv_lora_rank, qk_rope_head_dim, &params);
  if (err.failure()) return err;
  if (const char* why = sm80::check_supported(params)) {
    return ffi::Error::InvalidArgument(std::string("mla_jax sparse decode: ") + why);
  }
  err = check_env_switches();
  if (err.failure()) return err;
  sm80::DecodeWorkspace ws;
  err = make_workspace(int64_t{params.batch} * params.q_len, params.num_heads, params.kv_lora_rank, 0,
                       request_meta, part_begin, items, out_accum, lse_accum, &ws);
  if (err.failure()) return err;
  cudaError_t status = sm80::sparse_decode(params, ws, stream);
  if (status != cudaSuccess) return cuda_error("kernel launch failed", status);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeCuda, paged_decode_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // q_nope (or packed query)
                                  .Arg<ffi::AnyBuffer>()         // q_pe
                                  .Arg<ffi::AnyBuffer>()         // ckv (or packed cache)
                                  .Arg<ffi::AnyBuffer>()         // kpe
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scale
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()  // scratch: request_meta
                                  .Ret<ffi::Buffer<ffi::S32>>()  // scratch: part_begin
                                  .Ret<ffi::Buffer<ffi::S32>>()  // scratch: items
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scratch: out_accum
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scratch: lse_accum
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("qk_rope_head_dim")
                                  .Attr<int64_t>("max_num_splits"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseDecodeCuda, sparse_decode_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // q_nope (or packed query)
                                  .Arg<ffi::AnyBuffer>()         // q_pe
                                  .Arg<ffi::AnyBuffer>()         // kv: [P, S, 576] or uint8 [P, S, 656]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // indices [B, Q, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_lens [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // attn_sink [H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scale [1]
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()  // scratch: request_meta
                                  .Ret<ffi::Buffer<ffi::S32>>()  // scratch: part_begin
                                  .Ret<ffi::Buffer<ffi::S32>>()  // scratch: items
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scratch: out_accum
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scratch: lse_accum
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("kv_format")
                                  .Attr<bool>("has_sink")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("qk_rope_head_dim"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace mla_jax
