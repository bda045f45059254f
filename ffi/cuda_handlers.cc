// XLA FFI handler for the CUDA backend: scheduler + decode + combine on
// XLA's stream, scratch passed in as extra results (XLA allocates it), so
// the handler allocates nothing and is safe inside command buffers.
#include <cuda_runtime.h>

#include <string>

#include "csrc/sm80/api.h"
#include "ffi/decode_args.h"
#include "ffi/handlers.h"

namespace mla_jax {
namespace {

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("mla_jax paged decode: ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error paged_decode_cuda_impl(
    cudaStream_t stream, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv, ffi::AnyBuffer kpe,
    ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> kv_scale,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::S32>> request_meta, ffi::Result<ffi::Buffer<ffi::S32>> part_begin,
    ffi::Result<ffi::Buffer<ffi::S32>> items, ffi::Result<ffi::Buffer<ffi::F32>> out_accum,
    ffi::Result<ffi::Buffer<ffi::F32>> lse_accum, float sm_scale, bool causal, int64_t kv_lora_rank,
    int64_t qk_rope_head_dim, int64_t max_num_splits) {
  PagedDecodeParams params;
  ffi::Error err = fill_decode_params(q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale, *out, *lse,
                                      sm_scale, causal, kv_lora_rank, qk_rope_head_dim, &params);
  if (err.failure()) return err;
  if (const char* why = sm80::check_supported(params)) {
    return ffi::Error::InvalidArgument(std::string("mla_jax paged decode: ") + why);
  }

  // Scratch sizes come from the buffers (they may be symbolic in Python).
  sm80::DecodeWorkspace ws;
  auto parts_dims = part_begin->dimensions();
  auto item_dims = items->dimensions();
  ws.num_parts = static_cast<int>(parts_dims[parts_dims.size() - 1]) - 1;
  ws.max_items = static_cast<int>(item_dims[0]);
  ws.max_num_splits = static_cast<int>(max_num_splits);
  const int64_t rows = params.rows_per_request();
  if (ws.num_parts < 1 || ws.max_items < params.batch + ws.num_parts ||
      request_meta->element_count() < static_cast<size_t>(2 * params.batch) ||
      out_accum->element_count() < static_cast<size_t>(ws.max_items * rows * params.kv_lora_rank) ||
      lse_accum->element_count() < static_cast<size_t>(ws.max_items * rows)) {
    return ffi::Error::InvalidArgument("mla_jax paged decode: scratch buffers are too small");
  }
  ws.request_meta = request_meta->typed_data();
  ws.part_begin = part_begin->typed_data();
  ws.items = items->typed_data();
  ws.out_accum = out_accum->typed_data();
  ws.lse_accum = lse_accum->typed_data();

  cudaError_t status = sm80::paged_decode(params, ws, stream);
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

}  // namespace mla_jax
