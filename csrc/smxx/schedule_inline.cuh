// Small batches scheduled by the decode kernel itself: the first warp of
// every CTA recomputes the whole (small) schedule with warp shuffles and
// keeps its own partition's items; CTA (0, 0) also writes the per-request
// metadata the combine kernel reads. The same arithmetic as the scheduler
// kernel (schedule_math.cuh), so the items, their numbering and the
// combine's view are identical; what it saves is the scheduler kernel and
// the launch gap before the decode.
#pragma once

#include "csrc/smxx/schedule_math.cuh"

namespace mla_jax {
namespace smxx {

// Requests up to which a decode kernel that supports it schedules inline:
// one per lane of a warp.
constexpr int kInlineScheduleMaxBatch = kInlineScheduleMaxRequests;  // csrc/common/kernel_config.h

// The maximum over a warp of one value a lane: one instruction from sm_80
// (the decode kernels' targets); the shuffle tree where a host-side tool
// compiles this header for an older default architecture.
__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// One item of this CTA's partition.
struct PartItem {
  int b;            // request
  int block_begin;  // its 64-token blocks [block_begin, block_end)
  int block_end;
  int item;         // global item number (the partial-output slot when split)
  int splits;       // items request b was cut into
};

// Called by all 32 lanes of one warp, p.batch <= kInlineScheduleMaxBatch.
// Writes this partition's items to out (request order, at most one per
// request) and returns how many; with write_meta also writes
// ws.request_meta for every request.
__device__ __forceinline__ int schedule_partition_inline(const PagedDecodeParams& p, const DecodeWorkspace& ws,
                                                         const SplitSchedule& s, int part, bool write_meta,
                                                         PartItem* out) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32;
  const int b = lane;
  const bool live = b < p.batch;
  const int n = live ? num_blocks_of(p, b) : 0;
  const int64_t w = live ? n + kSplitOverhead : 0;
  int64_t end_pos = w;  // inclusive scan: end of request b on the work line
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int64_t t = __shfl_up_sync(kAll, end_pos, o);
    if (lane >= o) end_pos += t;
  }
  const int64_t work = __shfl_sync(kAll, end_pos, 31);
  const int parts = partitions_for(work, s.num_parts);
  const int64_t first_block_pos = end_pos - w + kSplitOverhead;
  // Equal pieces' stride depends on the batch alone: ready before the load.
  const int piece_stride = equal_piece_stride(p.batch, parts, s.max_num_splits);
  // Whole requests or cut ones, as the scheduler kernel decides. Whole
  // requests only where the average request can fit the slack at all (the
  // block schedule's gate; the same decision, as the busiest partition
  // carries at least the average): then the load of each whole-request
  // partition (the lanes whose first block falls in it; 0 in lanes past the
  // batch) and the busiest. Partitions do not decrease over the requests,
  // so a partition's lanes are consecutive and its load is the difference of
  // two line positions.
  int max_splits = s.max_num_splits;
  if (whole_requests_may_fit(work, p.batch, parts)) {
    const int whole_part = live ? cut_request(n, first_block_pos, work, parts, 1).p_first : -1;
    const int prev_part = __shfl_up_sync(kAll, whole_part, 1);
    const unsigned starts = __ballot_sync(kAll, live && (lane == 0 || whole_part != prev_part));
    const unsigned upto = starts & (0xffffffffu >> (31 - lane));  // segment starts at or before this lane
    const unsigned after = starts & ~(0xffffffffu >> (31 - lane));
    const int seg_first = 31 - __clz(upto | 1u);
    const int seg_last = (after != 0 ? __ffs(after) - 1 : p.batch) - 1;
    const int64_t seg_begin = __shfl_sync(kAll, end_pos - w, seg_first);
    const int64_t seg_end = __shfl_sync(kAll, end_pos, seg_last < 0 ? 0 : seg_last);
    int64_t load = live ? seg_end - seg_begin : 0;
    if (work <= 0xffffffffll) {  // warp-uniform; every load is at most the work
      load = warp_max_u32(static_cast<unsigned>(load));
    } else {
#pragma unroll
      for (int o = 16; o > 0; o /= 2) load = max(load, __shfl_xor_sync(kAll, load, o));
    }
    max_splits = effective_max_splits(load, work, parts, s.max_num_splits);
  }
  // Else equal pieces, as the scheduler kernel decides: the largest piece.
  int stride = max_splits == 1 ? 0 : piece_stride;
  if (stride > 0) {
    // A piece's load is at most its request's blocks plus the overhead: 32 bits.
    const unsigned largest = warp_max_u32(live ? static_cast<unsigned>(equal_piece_load(n, stride)) : 0u);
    if (!within_share(largest, work, parts, kEqualPiecesSlackPct)) stride = 0;
  }
  const RequestCut cut = stride > 0 ? equal_pieces_cut(b, n, first_block_pos, stride)
                                    : cut_request(n, first_block_pos, work, parts, max_splits);
  const int count = live ? cut.count : 0;
  int first = count;  // inclusive, then exclusive scan of the item counts
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int t = __shfl_up_sync(kAll, first, o);
    if (lane >= o) first += t;
  }
  first -= count;
  if (write_meta && live) {
    ws.request_meta[2 * b] = first;
    ws.request_meta[2 * b + 1] = count;
  }
  // This partition's item of request b, if any.
  int k_here = -1;
  ItemRange r{0, 0, 0};
  if (live && part >= cut.p_first && part < cut.p_first + cut.natural) {
    if (cut.count == cut.natural) {
      k_here = part - cut.p_first;
      r = item_range(cut, k_here, work, parts);
    } else {  // capped: find the piece that starts in this partition
      for (int k = 0; k < cut.count; ++k) {
        const ItemRange t = item_range(cut, k, work, parts);
        if (t.part > part) break;
        if (t.part == part) {
          k_here = k;
          r = t;
          break;
        }
      }
    }
  }
  const unsigned has = __ballot_sync(kAll, k_here >= 0);
  if (k_here >= 0) out[__popc(has & ((1u << lane) - 1u))] = PartItem{b, r.begin, r.end, first + k_here, count};
  return __popc(has);
}

}  // namespace smxx
}  // namespace mla_jax
