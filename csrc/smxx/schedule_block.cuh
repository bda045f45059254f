// The split schedule computed by one CTA of 256 threads (schedule_math.cuh
// holds the arithmetic). Two users, one code path, so they agree bit for
// bit:
// * the scheduler kernel (scheduler.cu) writes every item, the partition
//   bounds and the combine's per-request metadata;
// * the Hopper seesaw kernel (csrc/sm90/decode_seesaw.cuh) runs it in each
//   CTA before its first load, for batches too large for the warp-level
//   inline schedule, and keeps only its own partition's items (no
//   scheduler kernel, no launch gap before the decode).
#pragma once

#include <climits>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include "csrc/smxx/api.h"
#include "csrc/smxx/schedule_inline.cuh"
#include "csrc/smxx/schedule_math.cuh"

namespace mla_jax {
namespace smxx {

constexpr int kScheduleThreads = 256;
constexpr int kMaxWholeParts = 1024;  // partitions the whole-request check can count
constexpr int kSnakeItemsPerThread = 4;
constexpr int kSnakeMaxBatch = kScheduleThreads * kSnakeItemsPerThread;  // requests the snake can sort

// Shared memory of one schedule (about 35 KB). The decode kernel places it
// in a KV stage, which no load has touched yet.
struct BlockScheduleSmem {
  using Reduce = cub::BlockReduce<int64_t, kScheduleThreads>;
  using Scan = cub::BlockScan<longlong2, kScheduleThreads>;
  using RadixSort = cub::BlockRadixSort<unsigned, kScheduleThreads, kSnakeItemsPerThread, int>;
  union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
    typename RadixSort::TempStorage sort;
  } tmp;
  int64_t total;
  int max_splits;
  int snake;      // whole requests in snake order (schedule_math.cuh)
  int sort_bits;  // significant bits of the largest load (the sort's passes)
  longlong2 carry;  // (items, work) before the current chunk
  // The current chunk's requests: first item (chunk-relative; entry
  // kScheduleThreads = the chunk's item count) and cut. Items are then
  // written one per thread: a single long request split over every
  // partition must not leave one thread writing them all.
  int item_first[kScheduleThreads + 1];
  RequestCut cut[kScheduleThreads];
  unsigned long long part_load[kMaxWholeParts];  // whole-request load per partition
  int rank_of[kSnakeMaxBatch];                   // snake: each request's place by load
  int blocks_of[kSnakeMaxBatch];                 // snake: each request's blocks
  int part_first_item;  // one-partition mode: the partition's first item (INT_MAX: none yet)
  int part_num_items;   // one-partition mode: its item count
};

// The snake placement's check and its items (schedule_math.cuh), kept out
// of line: they run for varied lengths only, yet inlined into the seesaw
// kernel they slowed equal-length calls, which never reach them (code
// generation of the whole kernel). Loads come through shared memory so that
// no parameter struct is copied to the stack for the call.
// Called by all kScheduleThreads threads of the block; returns whether the
// snake placement's busiest partition is within the slack (sm.rank_of then
// holds each request's place by load).
static __device__ __noinline__ bool snake_placement_fits(BlockScheduleSmem& sm, int64_t work, int batch, int parts) {
  using Reduce = BlockScheduleSmem::Reduce;
  constexpr int kThreads = kScheduleThreads;
  const int tid = threadIdx.x;
  // Blocked arrangement in request order; padding (key 0, below any
  // request's load of at least kSplitOverhead) sorts last. The radix
  // passes are stable, so equal loads keep request order; either way the
  // order is deterministic and the same in every CTA.
  unsigned keys[kSnakeItemsPerThread];
  int requests[kSnakeItemsPerThread];
  int64_t largest = 0;
#pragma unroll
  for (int i = 0; i < kSnakeItemsPerThread; ++i) {
    const int b = tid * kSnakeItemsPerThread + i;
    keys[i] = b < batch ? static_cast<unsigned>(sm.blocks_of[b] + kSplitOverhead) : 0u;
    requests[i] = b;
    largest = max(largest, static_cast<int64_t>(keys[i]));
  }
  // A request larger than the slack allows rules the placement out
  // without sorting (0 bits); else sort only the bits a load can have: a
  // few radix passes, not eight (every seesaw CTA sorts before its first
  // load).
  largest = Reduce(sm.tmp.reduce).Reduce(largest, cuda::maximum<>{});
  if (tid == 0) {
    sm.sort_bits = within_share(largest, work, parts, kWholeRequestSlackPct)
                       ? 32 - __clz(static_cast<unsigned>(largest)) : 0;
    sm.snake = 0;
  }
  __syncthreads();
  if (sm.sort_bits > 0) {
    BlockScheduleSmem::RadixSort(sm.tmp.sort).SortDescending(keys, requests, 0, sm.sort_bits);
#pragma unroll
    for (int i = 0; i < kSnakeItemsPerThread; ++i) {
      if (requests[i] < batch) sm.rank_of[requests[i]] = tid * kSnakeItemsPerThread + i;
    }
    for (int q = tid; q < parts; q += kThreads) sm.part_load[q] = 0;
    __syncthreads();
    for (int b = tid; b < batch; b += kThreads) {
      const int q = snake_slot(sm.rank_of[b], batch, parts).part;
      atomicAdd(&sm.part_load[q], static_cast<unsigned long long>(sm.blocks_of[b] + kSplitOverhead));
    }
    __syncthreads();
    int64_t busiest = 0;
    for (int q = tid; q < parts; q += kThreads) busiest = max(busiest, static_cast<int64_t>(sm.part_load[q]));
    busiest = Reduce(sm.tmp.reduce).Reduce(busiest, cuda::maximum<>{});
    if (tid == 0) sm.snake = within_share(busiest, work, parts, kWholeRequestSlackPct);
    __syncthreads();
  }
  return sm.snake;
}

// Writes one item per request in snake order (see schedule_block for
// only_part and part_items; request_meta nullptr: not written).
static __device__ __noinline__ void write_snake_items(BlockScheduleSmem& sm, int64_t work, int batch, int parts,
                                                      int32_t* items, int32_t* request_meta, int only_part,
                                                      int32_t* part_items) {
  constexpr int kThreads = kScheduleThreads;
  const int tid = threadIdx.x;
  for (int b = tid; b < batch; b += kThreads) {
    const SnakeSlot slot = snake_slot(sm.rank_of[b], batch, parts);
    const int n = sm.blocks_of[b];
    if (request_meta != nullptr) {
      request_meta[2 * b] = slot.number;
      request_meta[2 * b + 1] = 1;
    }
    if (only_part < 0) {
      reinterpret_cast<int4*>(items)[slot.number] = make_int4(b, 0, n, slot.part);
    } else if (slot.part == only_part) {
      reinterpret_cast<int4*>(part_items)[slot.number] = make_int4(b, 0, n, 1);
      atomicMin(&sm.part_first_item, slot.number);
      atomicAdd(&sm.part_num_items, 1);
    }
  }
  if (tid == 0) sm.carry = make_longlong2(batch, work);
  __syncthreads();
}

// only_part < 0: every item into ws.items as (request, block begin, block
// end, partition), ws.part_begin and ws.request_meta (the scheduler
// kernel). only_part >= 0: that partition's items only, into part_items at
// their global numbers as (request, block begin, block end, the request's
// item count), their range in sm.part_first_item / part_num_items, and
// ws.request_meta when write_meta. A partition's items are consecutive
// numbers (items go request by request with partitions never decreasing,
// or, in snake order, partition by partition).
// Called by all kScheduleThreads threads of the block.
__device__ __forceinline__ void schedule_block(const PagedDecodeParams& p, const DecodeWorkspace& ws,
                                               const SplitSchedule& s, BlockScheduleSmem& sm, int only_part, int32_t* part_items,
                                               bool write_meta) {
  using Reduce = BlockScheduleSmem::Reduce;
  using Scan = BlockScheduleSmem::Scan;
  constexpr int kThreads = kScheduleThreads;
  const int tid = threadIdx.x;
  const int batch = p.batch;

  // 1. Total work on the line.
  int64_t local = 0;
  for (int b = tid; b < batch; b += kThreads) local += num_blocks_of(p, b) + kSplitOverhead;
  const int64_t total = Reduce(sm.tmp.reduce).Sum(local);
  if (tid == 0) {
    sm.total = total;
    sm.carry = make_longlong2(0, 0);
    sm.part_first_item = INT_MAX;
    sm.part_num_items = 0;
  }
  __syncthreads();
  const int64_t work = sm.total;
  const int parts = partitions_for(work, s.num_parts);
  const auto add = [](const longlong2& x, const longlong2& y) { return make_longlong2(x.x + y.x, x.y + y.y); };

  // 2. Whole requests or cut ones (schedule_math.cuh): each request's load
  //    goes to the partition of its first block; the busiest decides. More
  //    partitions than kMaxWholeParts (not on today's GPUs) keep the cut;
  //    where requests are too few to fill the partitions the count is
  //    skipped.
  int max_splits = s.max_num_splits;
  if (parts <= kMaxWholeParts && whole_requests_may_fit(work, batch, parts)) {
    for (int q = tid; q < parts; q += kThreads) sm.part_load[q] = 0;
    __syncthreads();
    int64_t line_before = 0;  // work before the current chunk
    for (int base = 0; base < batch; base += kThreads) {
      const int b = base + tid;
      const int n = b < batch ? num_blocks_of(p, b) : 0;
      longlong2 before, chunk_total;
      Scan(sm.tmp.scan).ExclusiveScan(make_longlong2(0, b < batch ? n + kSplitOverhead : 0), before,
                                      make_longlong2(0, 0), add, chunk_total);
      if (b < batch) {
        const int q = cut_request(n, line_before + before.y + kSplitOverhead, work, parts, 1).p_first;
        atomicAdd(&sm.part_load[q], static_cast<unsigned long long>(n + kSplitOverhead));
      }
      line_before += chunk_total.y;
      __syncthreads();  // tmp.scan is reused
    }
    int64_t busiest = 0;
    for (int q = tid; q < parts; q += kThreads) busiest = max(busiest, static_cast<int64_t>(sm.part_load[q]));
    busiest = Reduce(sm.tmp.reduce).Reduce(busiest, cuda::maximum<>{});
    if (tid == 0) sm.max_splits = effective_max_splits(busiest, work, parts, s.max_num_splits);
    __syncthreads();
    max_splits = sm.max_splits;
  }
  // 2b. Else whole requests in snake order by load, if that placement's
  //     busiest partition is within the same slack. Not for batches the
  //     inline schedule takes (schedule_inline.cuh has no sort), so both
  //     schedules still agree for every batch.
  bool snake = false;
  if (max_splits != 1 && batch > kInlineScheduleMaxBatch && batch <= kSnakeMaxBatch && parts <= kMaxWholeParts &&
      whole_requests_may_fit(work, batch, parts)) {
    for (int b = tid; b < batch; b += kThreads) sm.blocks_of[b] = num_blocks_of(p, b);
    __syncthreads();
    snake = snake_placement_fits(sm, work, batch, parts);
    if (snake) max_splits = 1;
  }
  // Else equal pieces, where each request has two or more partitions and
  // its largest piece is close to the share.
  int stride = max_splits == 1 ? 0 : equal_piece_stride(batch, parts, s.max_num_splits);
  if (stride > 0) {
    int64_t largest = 0;
    for (int b = tid; b < batch; b += kThreads) largest = max(largest, equal_piece_load(num_blocks_of(p, b), stride));
    __syncthreads();  // tmp.reduce may still be read by the reduction above
    largest = Reduce(sm.tmp.reduce).Reduce(largest, cuda::maximum<>{});
    if (tid == 0) sm.max_splits = within_share(largest, work, parts, kEqualPiecesSlackPct) ? stride : 0;
    __syncthreads();
    stride = sm.max_splits;
  }

  // 3 (snake). One item per request, numbered partition by partition.
  if (snake) write_snake_items(sm, work, batch, parts, ws.items, write_meta ? ws.request_meta : nullptr, only_part, part_items);

  // 3. Per chunk of requests: place each on the line (scan), find the
  //    partitions its blocks fall in (or its equal pieces') and its item
  //    offsets (second scan), then write the chunk's items, one per thread.
  for (int base = 0; base < (snake ? 0 : batch); base += kThreads) {
    const int b = base + tid;
    int n = 0;
    longlong2 before = make_longlong2(0, 0), chunk_total;
    if (b < batch) n = num_blocks_of(p, b);
    // The work position depends on earlier requests only: scan it first.
    Scan(sm.tmp.scan).ExclusiveScan(make_longlong2(0, b < batch ? n + kSplitOverhead : 0), before,
                                    make_longlong2(0, 0), add, chunk_total);
    const longlong2 carry = sm.carry;
    const int64_t first_block_pos = carry.y + before.y + kSplitOverhead;
    RequestCut cut = stride > 0 ? equal_pieces_cut(b, n, first_block_pos, stride)
                                : cut_request(n, first_block_pos, work, parts, max_splits);
    if (b >= batch) cut.count = 0;
    const int count = cut.count;
    __syncthreads();  // tmp.scan is reused
    longlong2 item_before, item_total;
    Scan(sm.tmp.scan).ExclusiveScan(make_longlong2(count, 0), item_before, make_longlong2(0, 0), add, item_total);
    // Every request has at least one item, so item_first is strictly
    // increasing over the chunk's requests (entries past the batch hold the
    // chunk's item count).
    sm.item_first[tid] = static_cast<int>(item_before.x);
    if (tid == 0) sm.item_first[kThreads] = static_cast<int>(item_total.x);
    sm.cut[tid] = cut;
    if (b < batch && write_meta) {
      ws.request_meta[2 * b] = static_cast<int>(carry.x + item_before.x);
      ws.request_meta[2 * b + 1] = count;
    }
    __syncthreads();
    for (int j = tid; j < item_total.x; j += kThreads) {
      int lo = 0, hi = kThreads - 1;  // the last request whose first item is <= j
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (sm.item_first[mid] <= j) lo = mid; else hi = mid - 1;
      }
      const ItemRange r = item_range(sm.cut[lo], j - sm.item_first[lo], work, parts);
      const int number = static_cast<int>(carry.x) + j;
      if (only_part < 0) {
        reinterpret_cast<int4*>(ws.items)[number] = make_int4(base + lo, r.begin, r.end, r.part);
      } else if (r.part == only_part) {
        reinterpret_cast<int4*>(part_items)[number] = make_int4(base + lo, r.begin, r.end, sm.cut[lo].count);
        atomicMin(&sm.part_first_item, number);
        atomicAdd(&sm.part_num_items, 1);
      }
    }
    __syncthreads();  // everyone has read carry and the chunk's shared arrays
    if (tid == 0) sm.carry = make_longlong2(carry.x + item_total.x, carry.y + chunk_total.y);
    __syncthreads();
  }
  if (only_part >= 0) return;
  const int num_items = static_cast<int>(sm.carry.x);

  // 4. Partition boundaries: part_begin[q] = first item whose part >= q
  //    (the items' writes above are visible after the block barrier).
  for (int i = tid; i < num_items; i += kThreads) {
    const int q = ws.items[4 * i + 3];
    const int q_prev = i == 0 ? -1 : ws.items[4 * (i - 1) + 3];
    for (int k = q_prev + 1; k <= q; ++k) ws.part_begin[k] = i;
  }
  // Partitions after the last item's (unused ones included) get no items.
  const int last_part = num_items > 0 ? ws.items[4 * (num_items - 1) + 3] : -1;
  for (int k = last_part + 1 + tid; k <= s.num_parts; k += kThreads) ws.part_begin[k] = num_items;
}

}  // namespace smxx
}  // namespace mla_jax
