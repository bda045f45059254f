// The split-KV workspace: one byte buffer that XLA allocates as the CUDA
// handler's scratch result, carved into regions by workspace_layout().
//
// Every region starts on a 128-byte line when the buffer does, as a buffer
// of its own would (XLA's GPU allocations are aligned at least that much;
// a less aligned buffer stays correct, only slower): the decode kernels write partial
// outputs and LSEs and the combine reads them, and a row that starts inside
// a line costs an extra sector or line per access. Each region's size is
// its count (items or requests) times a per-unit size rounded up to 128
// bytes, plus a fixed part rounded up to 128, so offsets stay on lines and
// the total is exactly per_request_bytes * R + fixed_bytes for R kernel
// requests (B for paged decode, B * q_len for sparse decode). That lets
// Python size the buffer for a symbolic batch (jax.export) from the same two
// numbers (bound in ffi/module.cc) that the handler uses to find the regions
// again. Plain C++: compiled into every build.
#pragma once

#include <cstdint>

#include "csrc/common/mla_params.h"

namespace mla_jax {

// Largest SM count the workspace is sized for when no CUDA device is
// visible at trace time (an export made on a CPU host). On a device with
// more SMs the schedule uses fewer partitions than SMs; it stays correct.
constexpr int kMaxSupportedSmCount = 160;

// Byte offsets of the regions for R requests (see DecodeWorkspace).
struct WorkspaceLayout {
  int64_t out_accum = 0;     // 16-bit [max_items, rows, dv], the output's dtype
  int64_t lse_accum = 0;     // float [max_items, rows]
  int64_t items = 0;         // int32 [item_regions * max_items, 4]
  int64_t request_meta = 0;  // int32 [R, 2]
  int64_t part_begin = 0;    // int32 [parts + 1]
  int64_t total = 0;
  int64_t max_items = 0;     // R + parts: the scheduler never makes more items
  int item_regions = 1;      // one items region per 64-row block
};

constexpr int64_t kWorkspaceAlign = 128;  // bytes: one L2 line

// Bytes of one partial output value. Split requests store their normalised
// partial outputs in the output's 16-bit dtype (bf16 or fp16, the only
// output dtypes of the CUDA kernels): half the bytes of float32 to write
// in each split's epilogue and to read back in the combine, at the cost of
// one rounding of each partial before the combine weights it (the combine
// still adds in float32). A partial, like the output, is a convex
// combination of V rows, so both lie within max |V| * kv_scale: bf16 has
// float32's range; fp16 partials fit wherever that bound is below 65504
// (beyond it, e.g. an e4m3 cache with kv_scale above 65504 / 448, a partial
// can round to inf where the weighted sum would have been finite).
constexpr int64_t kPartialBytes = 2;

MLA_HOST_DEVICE constexpr int64_t round_up_line(int64_t x) {
  return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// rows: query rows per kernel request; dv: output width (512 for the CUDA
// kernels); parts: the most persistent partitions the schedule may use.
// A region may be larger than its contents (rounded per unit); the kernels
// index each region from its start as the comments above lay it out.
MLA_HOST_DEVICE constexpr WorkspaceLayout workspace_layout(int64_t requests, int64_t rows, int64_t dv,
                                                           int64_t parts) {
  WorkspaceLayout w;
  const int64_t row_blocks = (rows + 63) / 64;
  w.max_items = requests + parts;
  w.item_regions = static_cast<int>(row_blocks);
  w.out_accum = 0;
  w.lse_accum = w.out_accum + w.max_items * round_up_line(rows * dv * kPartialBytes);
  w.items = w.lse_accum + w.max_items * round_up_line(rows * 4);
  w.request_meta = w.items + w.max_items * round_up_line(row_blocks * 16);  // 16 bytes per item and region
  w.part_begin = w.request_meta + requests * round_up_line(8);
  w.total = w.part_begin + round_up_line((parts + 1) * 4);
  return w;
}

// total == per_request * R + fixed for every R (rows, dv, parts fixed).
struct WorkspaceSize {
  int64_t per_request = 0;
  int64_t fixed = 0;
};
MLA_HOST_DEVICE constexpr WorkspaceSize workspace_size(int64_t rows, int64_t dv, int64_t parts) {
  const int64_t fixed = workspace_layout(0, rows, dv, parts).total;
  return {workspace_layout(1, rows, dv, parts).total - fixed, fixed};
}

// The schedule's regions (items, request_meta, part_begin) are the layout's
// tail, from `items` on. A schedule computed into a buffer of its own (the
// result of the ops' schedule calls, ScheduleMode::kStep) holds them at
// the same offsets less `items`; its size is affine in R like the whole.
MLA_HOST_DEVICE constexpr int64_t schedule_bytes(const WorkspaceLayout& w) { return w.total - w.items; }
MLA_HOST_DEVICE constexpr WorkspaceSize schedule_size(int64_t rows, int64_t parts) {
  const int64_t fixed = schedule_bytes(workspace_layout(0, rows, 0, parts));
  return {schedule_bytes(workspace_layout(1, rows, 0, parts)) - fixed, fixed};
}

// The invariants above, checked at compile time on a few shapes (1 to 128
// query rows per request).
constexpr bool line_aligned(const WorkspaceLayout& w) {
  return w.lse_accum % kWorkspaceAlign == 0 && w.items % kWorkspaceAlign == 0 &&
         w.request_meta % kWorkspaceAlign == 0 && w.part_begin % kWorkspaceAlign == 0 &&
         w.total % kWorkspaceAlign == 0;
}
static_assert(line_aligned(workspace_layout(1, 1, 512, 132)) && line_aligned(workspace_layout(7, 3, 512, 160)) &&
                  line_aligned(workspace_layout(5, 12, 512, 132)) && line_aligned(workspace_layout(128, 128, 512, 66)),
              "every workspace region starts on a line");
static_assert(workspace_layout(9, 12, 512, 132).total ==
                  9 * workspace_size(12, 512, 132).per_request + workspace_size(12, 512, 132).fixed,
              "the workspace size is affine in the requests");
static_assert(schedule_bytes(workspace_layout(9, 72, 512, 66)) ==
                  9 * schedule_size(72, 66).per_request + schedule_size(72, 66).fixed,
              "the schedule's size is affine in the requests and independent of dv");

// Persistent KV partitions for a request of `rows` query rows: one per
// group of SMs that together run all of its 64-row blocks, at most the
// workspace's capacity.
MLA_HOST_DEVICE constexpr int num_partitions(int sm_count, int64_t rows, int workspace_parts) {
  const int64_t row_blocks = (rows + 63) / 64;
  const int64_t by_sms = row_blocks > 0 ? sm_count / row_blocks : sm_count;
  const int64_t parts = by_sms < workspace_parts ? by_sms : workspace_parts;
  return parts > 1 ? static_cast<int>(parts) : 1;
}

// The workspace as the kernels see it: buffers and their capacities only.
struct DecodeWorkspace {
  int32_t* request_meta = nullptr;  // [requests, 2]: first item, number of splits
  int32_t* part_begin = nullptr;    // [num_parts + 1]: first item of each partition
  // [item_regions * max_items, 4]: request, block begin, block end, partition
  // (the scheduler kernel writes region 0). When the seesaw kernel
  // schedules in every CTA, the CTAs of row block x write their partition's
  // items to region x as request, block begin, block end, the request's
  // item count.
  int32_t* items = nullptr;
  // [max_items, rows, kv_lora_rank]: normalised partial outputs in the
  // output's dtype T (kPartialBytes each); read and written as partials<T>().
  void* out_accum = nullptr;
  float* lse_accum = nullptr;  // [max_items, rows]: partial LSEs (natural log)
  int max_items = 0;           // >= requests + num_parts
  int item_regions = 1;        // regions of max_items entries in items

  template <typename T>
  MLA_HOST_DEVICE T* partials() const {
    static_assert(sizeof(T) == kPartialBytes, "partials are stored in a 16-bit output dtype");
    return static_cast<T*>(out_accum);
  }
};

// The regions of a workspace buffer at `base` laid out by `layout`.
inline DecodeWorkspace carve_workspace(char* base, const WorkspaceLayout& layout) {
  DecodeWorkspace ws;
  ws.request_meta = reinterpret_cast<int32_t*>(base + layout.request_meta);
  ws.part_begin = reinterpret_cast<int32_t*>(base + layout.part_begin);
  ws.items = reinterpret_cast<int32_t*>(base + layout.items);
  ws.out_accum = base + layout.out_accum;
  ws.lse_accum = reinterpret_cast<float*>(base + layout.lse_accum);
  ws.max_items = static_cast<int>(layout.max_items);
  ws.item_regions = layout.item_regions;
  return ws;
}

// Points ws's schedule regions at a schedule buffer of schedule_bytes(layout)
// (see schedule_bytes); the partial outputs stay where they are.
inline void carve_schedule(char* base, const WorkspaceLayout& layout, DecodeWorkspace* ws) {
  ws->items = reinterpret_cast<int32_t*>(base);
  ws->request_meta = reinterpret_cast<int32_t*>(base + (layout.request_meta - layout.items));
  ws->part_begin = reinterpret_cast<int32_t*>(base + (layout.part_begin - layout.items));
}

// How the split-KV work is cut and who cuts it, fixed by the host per call
// (csrc/dispatch/decode.cu from the kernel configuration).
struct SplitSchedule {
  int num_parts = 1;       // persistent partitions (grid dimension of the decode)
  int max_num_splits = 0;  // cap on splits per request; 0 = none
  // true: the decode kernel schedules inline (smxx/schedule_inline.cuh);
  // items and part_begin are not used, request_meta is written by the
  // decode kernel.
  bool inline_schedule = false;
  // true: each CTA of the seesaw kernel computes the whole schedule
  // (smxx/schedule_block.cuh) and keeps its partition's items (items
  // region of its row block); part_begin is not used, request_meta is
  // written by CTA (0, 0). Needs item_regions >= the grid's row blocks.
  bool schedule_in_decode = false;
  // true (ScheduleMode::kStep): items, part_begin and request_meta already
  // hold this call's schedule, written by an earlier scheduler launch over
  // the same lengths and partitions (run_decode_schedule); no scheduler is
  // launched and the decode reads them as the scheduler kernel's.
  bool schedule_given = false;
  // true (KernelConfig::fused_combine, with inline_schedule): the seesaw
  // kernel, launched cooperatively, merges the split requests' partials
  // itself after a grid-wide barrier; no combine kernel follows.
  // combine_block_order: in the order of the combine's block grid
  // (CombineGrid::kBlock), else in that of its warp grids.
  bool fused_combine = false;
  bool combine_block_order = false;
};

}  // namespace mla_jax
