// Kernel selection: the one place that decides which CUDA kernels serve a
// decode call. Plain C++ (no CUDA), compiled into every build: Python calls
// it at trace time through the extension (mla_jax/kernels.py) with what is
// known then, and the CUDA handler calls it on the device with everything
// known (ffi/cuda_handlers.cc). Capability table: docs/design.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "csrc/common/kernel_config.h"
#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"

namespace mla_jax {

constexpr int64_t kUnknownSize = -1;

// The static facts of one call. Shapes may be unknown (symbolic under
// jax.export); so may the device (tracing on a host without a CUDA device).
struct DecodeFacts {
  DecodeOp op = DecodeOp::kPaged;
  ElemType q_type = ElemType::kBF16;
  ElemType kv_type = ElemType::kBF16;
  KvFormat kv_format = KvFormat::kPlain;
  int kv_lora_rank = 512;
  int qk_rope_head_dim = 64;
  int page_size = 1;
  int q_len = 1;
  int num_heads = 1;
  int64_t batch = kUnknownSize;      // B as the op sees it
  int64_t num_pages = kUnknownSize;
  int topk = 0;  // sparse decode: top-k entries of each query token (0: paged decode)
  // ckv/kpe bases and row strides 16-byte aligned (TMA needs it; the
  // handler checks the actual pointers).
  bool kv_aligned = true;
  // Page stride = page_size * token stride for ckv and kpe: the Hopper
  // kernels address cache row page * page_size + slot with the token stride
  // alone (true of every layout ffi/decode_args.cc describes).
  bool kv_pages_contiguous = true;
  int arch = 0;          // compute capability as 10 * major + minor; 0: unknown
  int sm_count = 0;      // 0: unknown
  bool build_sm90a = false;  // this build carries sm_90a code
  int workspace_parts = kMaxSupportedSmCount;
  // The call carries a schedule operand (a CUDA call made by the JAX ops,
  // with their schedule call): ScheduleMode::kStep is possible.
  bool schedule_operand = false;

  // Kernel requests: sparse decode runs every query token as its own.
  int64_t requests() const { return batch < 0 ? kUnknownSize : op == DecodeOp::kSparse ? batch * q_len : batch; }
  // Query rows per kernel request.
  int64_t rows() const { return op == DecodeOp::kSparse ? int64_t{num_heads} : int64_t{q_len} * num_heads; }
};

// The facts of a call whose buffers are all known (the CUDA handler's view,
// and tests/native's): pointer alignment and page contiguity read off the
// parameters, the device's facts as given.
DecodeFacts call_facts(DecodeOp op, const PagedDecodeParams& params, int arch, int sm_count, bool build_sm90a,
                       int workspace_parts);

struct Selection {
  KernelConfig config;  // auto only where a fact it depends on is unknown
  std::string error;    // non-empty: the requested configuration cannot serve this call
};

// Resolves the auto fields of `requested` and checks the forced ones.
// When `explain` is not null, one line per decision is appended to it.
Selection select_kernel(const DecodeFacts& facts, const KernelConfig& requested, std::string* explain = nullptr);

// The attribute form of a configuration: "kernel,schedule,combine_grid,
// programmatic_combine" with the names of mla_jax.KernelChoice, e.g.
// "sm90_seesaw,inline,slices,off" ("auto" for an open field).
std::string format_config(const KernelConfig& config);
// false (and *why set) for a string format_config cannot have written.
bool parse_config(std::string_view text, KernelConfig* config, std::string* why);

// Query rows per request up to which the swap-AB kernel serves a call.
constexpr int kSwapAbMaxRows = 32;
// Its sparse form (fp8_ds_mla, bf16 query): heads per request.
constexpr int kSwapAbSparseMaxRows = 32;
// Top-k entries per query token from which the seesaw kernel's sparse form
// is auto-selected over the lock-step kernel: each item fills and drains
// its two-tile pipeline on its own, which short items cannot hide. The
// smallest top-k of those measured at which the seesaw kernel was not behind
// at any head count tried (H100; docs/perf.md, "Current results", FP8).
constexpr int kSeesawSparseMinTopk = 1024;

// Rows of the portable kernel's row block for `rows` query rows per request.
constexpr int portable_rows_per_cta(int64_t rows) { return rows <= 16 ? 16 : rows <= 32 ? 32 : 64; }

}  // namespace mla_jax
