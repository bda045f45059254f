// Host entry points of the portable (sm_80+) split-KV paged MLA decode.
//
// One call runs three kernels on `stream`: the scheduler (splits the
// requests' KV blocks over persistent partitions, on the device, from
// seq_lens), the decode kernel (one CTA per partition x row block) and the
// combine kernel (merges the splits of each request by their LSE,
// FlashDecoding). All scratch comes from the caller (XLA), so the sequence
// can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "csrc/common/mla_params.h"

namespace mla_jax {
namespace sm80 {

// KV blocks the scheduler deals in (tokens); every kernel tile divides it.
constexpr int kSchedBlockTokens = 64;

struct DecodeWorkspace {
  int32_t* request_meta = nullptr;  // [batch, 2]: first item, number of splits
  int32_t* part_begin = nullptr;    // [num_parts + 1]: first item of each partition
  // [item_regions * max_items, 4]: request, block begin, block end, partition
  // (the scheduler kernel writes region 0). With schedule_in_decode, the
  // Hopper kernel's CTAs of row block x write their partition's items to
  // region x as request, block begin, block end, the request's item count.
  int32_t* items = nullptr;
  float* out_accum = nullptr;       // [max_items, rows, kv_lora_rank]: normalised partial outputs
  float* lse_accum = nullptr;       // [max_items, rows]: partial LSEs (natural log)
  int num_parts = 1;
  int max_items = 0;                // >= batch + num_parts
  int item_regions = 1;             // regions of max_items entries in items
  int max_num_splits = 0;           // cap on splits per request; 0 = none
  int sparse_group = 1;             // sparse mode: query tokens per batch entry
  // true: the decode kernel schedules inline (schedule_inline.cuh); items
  // and part_begin are not used, request_meta is written by the decode kernel.
  bool inline_schedule = false;
  // true: each CTA of the Hopper seesaw kernel computes the whole schedule
  // (schedule_block.cuh) and keeps its partition's items (items region of
  // its row block); part_begin is not used, request_meta is written by CTA
  // (0, 0). Needs item_regions >= the grid's row blocks.
  bool schedule_in_decode = false;
};

// Rows (q_len x heads) handled by one CTA for a given request row count.
int rows_per_cta(int rows_per_request);

// Validates shapes the kernels rely on; returns nullptr or a message.
const char* check_supported(const PagedDecodeParams& params);

cudaError_t run_scheduler(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                          cudaStream_t stream);
// programmatic_by_default: launch it with programmatic dependent launch
// when MLA_JAX_PDL is unset (csrc/common/pdl.h).
cudaError_t run_combine(const PagedDecodeParams& params, const DecodeWorkspace& ws, cudaStream_t stream,
                        bool programmatic_by_default);

// Decode kernels, one per (query dtype, cache dtype); see decode_*.cu. Each
// launches the scheduler, then its kernel.
cudaError_t run_decode_bf16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            cudaStream_t stream);
cudaError_t run_decode_fp16(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                            cudaStream_t stream);
cudaError_t run_decode_fp8(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                           cudaStream_t stream);

// Sparse (top-k) decode: params as filled for the sparse op (batch B,
// q_len Q); runs as B*Q single-token requests of num_heads rows.
cudaError_t sparse_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                          cudaStream_t stream);
cudaError_t run_decode_ds_mla(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                              cudaStream_t stream);

// Scheduler + decode + combine.
cudaError_t paged_decode(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                         cudaStream_t stream);

}  // namespace sm80
}  // namespace mla_jax
