// XLA FFI handlers for the CUDA backend. Per call: the buffers become
// kernel parameters, the kernel configuration is the one chosen at trace
// time (re-chosen by the same select_kernel() when the device is not the one
// it was chosen for), the workspace result is carved by workspace_layout(),
// and scheduler + decode + combine are launched on XLA's stream. The handler
// allocates nothing, so it is safe inside command buffers.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "csrc/common/workspace.h"
#include "csrc/dispatch/decode.h"
#include "csrc/dispatch/select.h"
#include "ffi/decode_args.h"
#include "ffi/ffi_util.h"
#include "ffi/handlers.h"

namespace mla_jax {
namespace {

// The kernel-choice attributes every CUDA call carries (mla_jax/kernels.py).
struct KernelAttrs {
  std::string_view kernel_config;   // chosen at trace time (format_config)
  std::string_view kernel_request;  // the plan's request
  int64_t selected_for_arch;        // the device kernel_config was chosen for (0: none)
  int64_t selected_for_sm_count;
  int64_t workspace_parts;          // partitions the workspace holds
};

// What a call launches with.
struct Launch {
  KernelConfig config;  // resolved
  DecodeWorkspace ws;
  int num_parts = 1;
};

// The base of a scratch or schedule buffer (`what`) that must hold `needed`
// bytes at 16-byte alignment; null with *err set otherwise.
char* checked_base(const char* op, const char* what, void* data, size_t size, int64_t needed, ffi::Error* err) {
  char* base = static_cast<char*>(data);
  if (size >= static_cast<size_t>(needed) && reinterpret_cast<uintptr_t>(base) % 16 == 0) return base;
  *err = invalid_argument(op, std::string("the ") + what + " is too small or misaligned for this call (" +
                                  std::to_string(size) + " bytes, needs " + std::to_string(needed) + ")");
  return nullptr;
}

// Resolves the configuration for this device and carves the workspace (and,
// for ScheduleMode::kStep, the schedule operand: empty when the call has none).
ffi::Error prepare(const char* op, DecodeOp kind, int device_ordinal, const PagedDecodeParams& p,
                   const KernelAttrs& attrs, ffi::Result<ffi::AnyBuffer> workspace, const ffi::AnyBuffer* schedule,
                   Launch* launch) {
  const DeviceInfo dev = device_info(device_ordinal);
  if (dev.status != cudaSuccess)
    return internal_error(op, std::string("cannot query the CUDA device: ") + cudaGetErrorString(dev.status));
  if (attrs.workspace_parts < 1 || attrs.workspace_parts > (int64_t{1} << 20))
    return invalid_argument(op, "workspace_parts must be in [1, 2^20], got " + std::to_string(attrs.workspace_parts));

  DecodeFacts f = call_facts(kind, p, dev.arch, dev.sm_count, build_has_sm90a(),
                             static_cast<int>(attrs.workspace_parts));
  f.schedule_operand = schedule != nullptr && schedule->size_bytes() > 0;
  // On the device the configuration was chosen for, it only needs
  // checking; a fact that turns out otherwise than assumed at trace time
  // (a build without sm_90a code, a cache beyond TMA's range) or another
  // device means choosing again from the plan's request, with every fact
  // known now. A forced field that cannot serve the call fails there too.
  KernelConfig request, chosen;
  std::string why;
  if (!parse_config(attrs.kernel_request, &request, &why) || !parse_config(attrs.kernel_config, &chosen, &why))
    return invalid_argument(op, "kernel configuration attribute: " + why);
  const bool same_device = attrs.selected_for_arch == dev.arch && attrs.selected_for_sm_count == dev.sm_count;
  Selection sel = select_kernel(f, same_device ? chosen : request);
  if (same_device && !sel.error.empty()) sel = select_kernel(f, request);
  if (!sel.error.empty()) return invalid_argument(op, sel.error);
  if (!sel.config.resolved()) return internal_error(op, "the kernel configuration is not resolved on the device");
  launch->config = sel.config;

  const int64_t rows = f.rows();
  const WorkspaceLayout layout = workspace_layout(f.requests(), rows, p.kv_lora_rank, attrs.workspace_parts);
  if (layout.max_items > INT32_MAX) return invalid_argument(op, "too many requests for one call");
  ffi::Error err = ffi::Error::Success();
  char* base = checked_base(op, "workspace result", workspace->untyped_data(), workspace->size_bytes(), layout.total,
                            &err);
  if (base == nullptr) return err;
  launch->ws = carve_workspace(base, layout);
  if (launch->config.schedule == ScheduleMode::kStep) {
    // Written by the op's schedule call over this call's block_table and
    // seq_lens (sparse decode: topk_lens) with the same workspace_parts
    // (mla_jax/paged_decode.py, mla_jax/sparse_decode.py).
    char* sched = checked_base(op, "schedule operand", schedule->untyped_data(), schedule->size_bytes(),
                               schedule_bytes(layout), &err);
    if (sched == nullptr) return err;
    carve_schedule(sched, layout, &launch->ws);
  }
  launch->num_parts = num_partitions(dev.sm_count, rows, static_cast<int>(attrs.workspace_parts));
  return ffi::Error::Success();
}

ffi::Error launch_status(const char* op, const Launch& run, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  if (err == cudaErrorNotSupported && run.config.kernel == KernelFamily::kSm90Seesaw)
    return internal_error(op, std::string_view(op) == kSparseDecodeOp
                                  ? "kernel 'sm90_seesaw' cannot gather this cache's rows (fp8_ds_mla rows, 16-byte "
                                    "aligned, pages laid end to end, a bf16 query); plan kernel='sm90_lockstep' or "
                                    "'portable' avoids it"
                                  : "the driver could not encode the cache's TMA descriptors that kernel 'sm90_seesaw' "
                                    "loads with; plan kernel='sm90_lockstep' or 'portable' avoids them");
  if (err == cudaErrorNotSupported && run.config.kernel == KernelFamily::kSm90SwapAB)
    return internal_error(op, std::string_view(op) == kSparseDecodeOp
                                  ? "kernel 'sm90_swapab' cannot gather this cache's rows (they must be 16-byte "
                                    "aligned, pages laid end to end); plan kernel='portable' avoids it"
                                  : "the driver could not encode the cache's TMA descriptors that kernel "
                                    "'sm90_swapab' loads with; plan kernel='sm90_lockstep' or 'portable' avoids them");
  return internal_error(op, std::string("kernel launch failed: ") + cudaGetErrorString(err));
}

using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error paged_decode_cuda_impl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer q_nope,
                                  ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv, ffi::AnyBuffer kpe,
                                  ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                                  ffi::Buffer<ffi::F32> kv_scale, ffi::AnyBuffer schedule,
                                  ffi::Result<ffi::AnyBuffer> out, F32Result lse,
                                  ffi::Result<ffi::AnyBuffer> workspace, float sm_scale, bool causal,
                                  int64_t kv_lora_rank, int64_t qk_rope_head_dim, int64_t max_num_splits,
                                  std::string_view kernel_config, std::string_view kernel_request,
                                  int64_t selected_for_arch, int64_t selected_for_sm_count,
                                  int64_t workspace_parts) {
  PagedDecodeParams params;
  ffi::Error err = fill_decode_params(q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale, *out, *lse, sm_scale,
                                      causal, kv_lora_rank, qk_rope_head_dim, &params);
  if (err.failure()) return err;
  if (max_num_splits < 0 || max_num_splits > INT32_MAX)
    return invalid_argument(kPagedDecodeOp, "max_num_splits must be >= 0, got " + std::to_string(max_num_splits));
  Launch run;
  err = prepare(kPagedDecodeOp, DecodeOp::kPaged, device_ordinal, params,
                {kernel_config, kernel_request, selected_for_arch, selected_for_sm_count, workspace_parts}, workspace,
                &schedule, &run);
  if (err.failure()) return err;
  return launch_status(kPagedDecodeOp, run,
                       run_paged_decode(params, run.ws, run.config, run.num_parts, static_cast<int>(max_num_splits),
                                        stream));
}

ffi::Error sparse_decode_cuda_impl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer q_nope,
                                   ffi::AnyBuffer q_pe, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                                   ffi::Buffer<ffi::S32> topk_lens, ffi::Buffer<ffi::F32> attn_sink,
                                   ffi::Buffer<ffi::F32> kv_scale, ffi::AnyBuffer schedule,
                                   ffi::Result<ffi::AnyBuffer> out, F32Result lse,
                                   ffi::Result<ffi::AnyBuffer> workspace, float sm_scale, int64_t kv_format,
                                   bool has_sink, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                                   std::string_view kernel_config, std::string_view kernel_request,
                                   int64_t selected_for_arch, int64_t selected_for_sm_count,
                                   int64_t workspace_parts) {
  PagedDecodeParams params;
  ffi::Error err = fill_sparse_params(q_nope, q_pe, kv, indices, topk_lens, attn_sink, kv_scale, *out, *lse,
                                      sm_scale, kv_format, has_sink, kv_lora_rank, qk_rope_head_dim, &params);
  if (err.failure()) return err;
  Launch run;
  err = prepare(kSparseDecodeOp, DecodeOp::kSparse, device_ordinal, params,
                {kernel_config, kernel_request, selected_for_arch, selected_for_sm_count, workspace_parts}, workspace,
                &schedule, &run);
  if (err.failure()) return err;
  return launch_status(kSparseDecodeOp, run, run_sparse_decode(params, run.ws, run.config, run.num_parts, stream));
}

// What both schedule calls share: the schedule result of `requests` kernel
// requests of `rows` query rows, carved as the decode calls will find it
// (prepare()), and the partitions they will use (num_partitions of this
// device with the same workspace_parts).
ffi::Error carve_schedule_result(const char* op, int32_t device_ordinal, ffi::Result<ffi::AnyBuffer>& schedule,
                                 int64_t requests, int64_t rows, int64_t workspace_parts, DecodeWorkspace* ws,
                                 int* parts) {
  if (workspace_parts < 1 || workspace_parts > (int64_t{1} << 20))
    return invalid_argument(op, "workspace_parts must be in [1, 2^20], got " + std::to_string(workspace_parts));
  const DeviceInfo dev = device_info(device_ordinal);
  if (dev.status != cudaSuccess)
    return internal_error(op, std::string("cannot query the CUDA device: ") + cudaGetErrorString(dev.status));
  const WorkspaceLayout layout = workspace_layout(requests, rows, 0, workspace_parts);
  if (layout.max_items > INT32_MAX) return invalid_argument(op, "too many requests for one call");
  ffi::Error err = ffi::Error::Success();
  char* base = checked_base(op, "schedule result", schedule->untyped_data(), schedule->size_bytes(),
                            schedule_bytes(layout), &err);
  if (base == nullptr) return err;
  ws->max_items = static_cast<int>(layout.max_items);
  ws->item_regions = layout.item_regions;
  carve_schedule(base, layout, ws);
  *parts = num_partitions(dev.sm_count, rows, static_cast<int>(workspace_parts));
  return ffi::Error::Success();
}

// Paged decode's schedule (ScheduleMode::kStep): the scheduler kernel over
// block_table's width and seq_lens, into a buffer laid out as the tail of the
// decode's workspace (schedule_bytes). Pure: XLA runs it once for all the
// decode calls of a program over the same metadata and attributes.
ffi::Error paged_decode_schedule_cuda_impl(cudaStream_t stream, int32_t device_ordinal,
                                           ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                                           ffi::Result<ffi::AnyBuffer> schedule, int64_t q_len, int64_t num_heads,
                                           int64_t page_size, int64_t max_num_splits, int64_t workspace_parts) {
  constexpr const char* op = kPagedDecodeScheduleOp;
  const auto bt = block_table.dimensions();
  const auto sl = seq_lens.dimensions();
  if (bt.size() != 2 || sl.size() != 1 || bt[0] != sl[0])
    return invalid_argument(op, "expected block_table [B, max_pages] and seq_lens [B]");
  if (q_len < 1 || num_heads < 1 || q_len * num_heads > (int64_t{1} << 20) || page_size < 1 ||
      page_size > (int64_t{1} << 20) || bt[1] > INT32_MAX / page_size || bt[0] > INT32_MAX)
    return invalid_argument(op, "q_len, num_heads, page_size or the block table's shape out of range");
  if (max_num_splits < 0 || max_num_splits > INT32_MAX)
    return invalid_argument(op, "max_num_splits must be >= 0, got " + std::to_string(max_num_splits));
  DecodeWorkspace ws;
  int parts = 1;
  ffi::Error check = carve_schedule_result(op, device_ordinal, schedule, bt[0], q_len * num_heads, workspace_parts,
                                           &ws, &parts);
  if (check.failure()) return check;
  PagedDecodeParams p;
  p.batch = static_cast<int>(bt[0]);
  p.q_len = static_cast<int>(q_len);
  p.num_heads = static_cast<int>(num_heads);
  p.page_size = static_cast<int>(page_size);
  p.max_pages_per_seq = static_cast<int>(bt[1]);
  p.block_table = block_table.typed_data();
  p.seq_lens = seq_lens.typed_data();
  const cudaError_t err = run_decode_schedule(p, ws, parts, static_cast<int>(max_num_splits), stream);
  if (err != cudaSuccess) return internal_error(op, std::string("kernel launch failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Sparse decode's schedule (ScheduleMode::kStep): every query token is a
// request of min(topk_lens[b], topk) entries (run_sparse_decode); the
// schedule reads only topk_lens and the shapes, so it is the same for every
// layer of a step (whose top-k indices differ) and XLA runs one for them.
ffi::Error sparse_decode_schedule_cuda_impl(cudaStream_t stream, int32_t device_ordinal,
                                            ffi::Buffer<ffi::S32> topk_lens, ffi::Result<ffi::AnyBuffer> schedule,
                                            int64_t q_len, int64_t topk, int64_t num_heads,
                                            int64_t workspace_parts) {
  constexpr const char* op = kSparseDecodeScheduleOp;
  const auto ld = topk_lens.dimensions();
  if (ld.size() != 1) return invalid_argument(op, "expected topk_lens [B]");
  if (q_len < 1 || q_len > 1024 || num_heads < 1 || num_heads > 1024 || topk < 1 || topk > (int64_t{1} << 30) ||
      ld[0] * q_len > INT32_MAX)
    return invalid_argument(op, "q_len, topk, num_heads or the batch out of range");
  // Every query token is a request of num_heads rows (run_sparse_decode).
  DecodeWorkspace ws;
  int parts = 1;
  ffi::Error check = carve_schedule_result(op, device_ordinal, schedule, ld[0] * q_len, num_heads, workspace_parts,
                                           &ws, &parts);
  if (check.failure()) return check;
  // The schedule reads the request lengths only: indices must be set (it
  // marks the sparse form) but is never read, so it points at topk_lens.
  PagedDecodeParams p;
  p.batch = static_cast<int>(ld[0]);
  p.q_len = static_cast<int>(q_len);
  p.num_heads = static_cast<int>(num_heads);
  p.topk = static_cast<int>(topk);
  p.topk_lens = topk_lens.typed_data();
  p.indices = topk_lens.typed_data();
  const cudaError_t err = run_sparse_decode_schedule(p, ws, parts, stream);
  if (err != cudaSuccess) return internal_error(op, std::string("kernel launch failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseDecodeScheduleCuda, sparse_decode_schedule_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_lens [B]
                                  .Ret<ffi::AnyBuffer>()         // schedule (uint8, schedule_bytes)
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("topk")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("workspace_parts"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeScheduleCuda, paged_decode_schedule_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table [B, max_pages] (its width is read)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [B]
                                  .Ret<ffi::AnyBuffer>()         // schedule (uint8, schedule_bytes)
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("max_num_splits")
                                  .Attr<int64_t>("workspace_parts"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeCuda, paged_decode_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // q_nope (or packed query)
                                  .Arg<ffi::AnyBuffer>()         // q_pe
                                  .Arg<ffi::AnyBuffer>()         // ckv (or packed cache)
                                  .Arg<ffi::AnyBuffer>()         // kpe
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scale
                                  .Arg<ffi::AnyBuffer>()         // schedule (uint8; empty: none)
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::AnyBuffer>()         // workspace (uint8, workspace_layout)
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("qk_rope_head_dim")
                                  .Attr<int64_t>("max_num_splits")
                                  .Attr<std::string_view>("kernel_config")
                                  .Attr<std::string_view>("kernel_request")
                                  .Attr<int64_t>("selected_for_arch")
                                  .Attr<int64_t>("selected_for_sm_count")
                                  .Attr<int64_t>("workspace_parts"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseDecodeCuda, sparse_decode_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // q_nope (or packed query)
                                  .Arg<ffi::AnyBuffer>()         // q_pe
                                  .Arg<ffi::AnyBuffer>()         // kv: [P, S, 576] or uint8 [P, S, 656]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // indices [B, Q, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_lens [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // attn_sink [H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scale [1]
                                  .Arg<ffi::AnyBuffer>()         // schedule (uint8; empty: none)
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::AnyBuffer>()         // workspace (uint8, workspace_layout)
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("kv_format")
                                  .Attr<bool>("has_sink")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("qk_rope_head_dim")
                                  .Attr<std::string_view>("kernel_config")
                                  .Attr<std::string_view>("kernel_request")
                                  .Attr<int64_t>("selected_for_arch")
                                  .Attr<int64_t>("selected_for_sm_count")
                                  .Attr<int64_t>("workspace_parts"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace mla_jax
