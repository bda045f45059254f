// On-device split scheduler (FlashDecoding split-KV, balanced over
// persistent partitions). One CTA; no host synchronisation.
//
// The requests' 64-token KV blocks are laid end to end on one work line,
// each request preceded by a fixed cost (query load and epilogue,
// kSplitOverhead blocks): request b covers [start_b, start_b + overhead +
// n_b). The line is cut into num_parts equal shares; partition p gets the
// work in [bound(p), bound(p+1)). A request crossing a cut is split there,
// so every partition carries the same load and each cut splits at most one
// request: at most batch + num_parts - 1 items, which sizes the scratch.
// max_num_splits > 0 merges a request's pieces into at most that many
// equal splits (still in partition order).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "csrc/sm80/api.h"
#include "csrc/sm80/request.cuh"

namespace mla_jax {
namespace sm80 {
namespace {

constexpr int kThreads = 256;
constexpr int kSplitOverhead = 2;
// Least work (blocks) worth a partition of its own: below it, a split's
// fixed cost (query load, partial write, combine read) outweighs the
// parallelism, so small batches use fewer partitions. Measured on the H200
// for one 4k request at H = 128 (benchmarks/NOTES.md, v5): 2 / 3 / 4 / 8 ->
// 29.1 / 31.4 / 34.9 / 41.0 us device span, 30.9 / 23.3 / - / 36.0 us in the
// benchmark; 1 was slower still with the v2 scheduler (58.7 us).
constexpr int kMinPartWork = 3;

// An invalid request has no blocks: one empty item writes its NaN output.
__device__ __forceinline__ int num_blocks_of(const PagedDecodeParams& p, const DecodeWorkspace& ws, int b) {
  const RequestSpan span = request_span(p, ws, b);
  return static_cast<int>((span.len + kSchedBlockTokens - 1) / kSchedBlockTokens);
}

__device__ __forceinline__ int64_t bound(int part, int64_t total, int parts) {
  return (int64_t{part} * total + parts - 1) / parts;  // first work unit of `part`
}

__device__ __forceinline__ int part_of(int64_t pos, int64_t total, int parts) {
  if (total <= 0) return 0;
  const int64_t p = pos * parts / total;
  return static_cast<int>(p < parts - 1 ? p : parts - 1);
}

// Where a request sits on the work line and how its items cut it: what a
// thread writing one of the request's items needs.
struct RequestCut {
  int64_t first_block_pos;  // line position of the request's first KV block
  int n;                    // KV blocks
  int p_first;              // partition of the first block
  int natural;              // partitions the blocks span
  int count;                // items (natural, or capped by max_num_splits)
};

__global__ void __launch_bounds__(kThreads) schedule_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<longlong2, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t s_total;
  __shared__ longlong2 s_carry;  // (items, work) before the current chunk
  // The current chunk's requests: first item (chunk-relative; entry kThreads
  // = the chunk's item count) and cut. Items are then written one per
  // thread: a single long request split over every partition must not
  // leave one thread writing them all (that took ~35 us for 132 splits).
  __shared__ int s_item_first[kThreads + 1];
  __shared__ RequestCut s_cut[kThreads];
  const int tid = threadIdx.x;
  const int batch = p.batch;

  // 1. Total work on the line.
  int64_t local = 0;
  for (int b = tid; b < batch; b += kThreads) local += num_blocks_of(p, ws, b) + kSplitOverhead;
  const int64_t total = Reduce(tmp.reduce).Sum(local);
  if (tid == 0) {
    s_total = total;
    s_carry = make_longlong2(0, 0);
  }
  __syncthreads();
  const int64_t work = s_total;
  const int64_t wanted = (work + kMinPartWork - 1) / kMinPartWork;
  const int parts = static_cast<int>(wanted < ws.num_parts ? (wanted > 0 ? wanted : 1) : ws.num_parts);
  const auto add = [](const longlong2& x, const longlong2& y) { return make_longlong2(x.x + y.x, x.y + y.y); };

  // 2. Per chunk of requests: place each on the line (scan), find the
  //    partitions its blocks fall in and its item offsets (second scan),
  //    then write the chunk's items, one per thread.
  for (int base = 0; base < batch; base += kThreads) {
    const int b = base + tid;
    int n = 0, count = 0, p_first = 0, p_last = 0;
    longlong2 before = make_longlong2(0, 0), chunk_total;
    if (b < batch) n = num_blocks_of(p, ws, b);
    // The work position depends on earlier requests only: scan it first.
    Scan(tmp.scan).ExclusiveScan(make_longlong2(0, b < batch ? n + kSplitOverhead : 0), before,
                                 make_longlong2(0, 0), add, chunk_total);
    const longlong2 carry = s_carry;
    const int64_t first_block_pos = carry.y + before.y + kSplitOverhead;
    if (b < batch) {
      if (n == 0) {
        p_first = p_last = part_of(first_block_pos - kSplitOverhead, work, parts);
      } else {
        p_first = part_of(first_block_pos, work, parts);
        p_last = part_of(first_block_pos + n - 1, work, parts);
      }
      count = p_last - p_first + 1;
      if (ws.max_num_splits > 0 && count > ws.max_num_splits) count = ws.max_num_splits;
    }
    __syncthreads();  // tmp.scan is reused
    longlong2 item_before, item_total;
    Scan(tmp.scan).ExclusiveScan(make_longlong2(count, 0), item_before, make_longlong2(0, 0), add, item_total);
    // Every request has at least one item, so s_item_first is strictly
    // increasing over the chunk's requests (entries past the batch hold the
    // chunk's item count).
    s_item_first[tid] = static_cast<int>(item_before.x);
    if (tid == 0) s_item_first[kThreads] = static_cast<int>(item_total.x);
    s_cut[tid] = RequestCut{first_block_pos, n, p_first, p_last - p_first + 1, count};
    if (b < batch) {
      ws.request_meta[2 * b] = static_cast<int>(carry.x + item_before.x);
      ws.request_meta[2 * b + 1] = count;
    }
    __syncthreads();
    for (int j = tid; j < item_total.x; j += kThreads) {
      int lo = 0, hi = kThreads - 1;  // the last request whose first item is <= j
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (s_item_first[mid] <= j) lo = mid; else hi = mid - 1;
      }
      const RequestCut c = s_cut[lo];
      const int k = j - s_item_first[lo];
      int begin, end, part;
      if (c.count == c.natural) {  // cut at the partition bounds
        part = c.p_first + k;
        begin = k == 0 ? 0 : static_cast<int>(bound(part, work, parts) - c.first_block_pos);
        end = k == c.count - 1 ? c.n : static_cast<int>(bound(part + 1, work, parts) - c.first_block_pos);
      } else {  // capped: equal pieces, each placed in the partition of its start
        begin = static_cast<int>(int64_t{k} * c.n / c.count);
        end = static_cast<int>(int64_t{k + 1} * c.n / c.count);
        part = c.p_first + static_cast<int>(int64_t{k} * c.natural / c.count);
      }
      int4* item = reinterpret_cast<int4*>(ws.items) + carry.x + j;
      *item = make_int4(base + lo, begin, end, part);
    }
    __syncthreads();  // everyone has read s_carry and the chunk's shared arrays
    if (tid == 0) s_carry = make_longlong2(carry.x + item_total.x, carry.y + chunk_total.y);
    __syncthreads();
  }
  const int num_items = static_cast<int>(s_carry.x);

  // 3. Partition boundaries: part_begin[q] = first item whose part >= q
  //    (the items' writes above are visible after the block barrier).
  for (int i = tid; i < num_items; i += kThreads) {
    const int q = ws.items[4 * i + 3];
    const int q_prev = i == 0 ? -1 : ws.items[4 * (i - 1) + 3];
    for (int k = q_prev + 1; k <= q; ++k) ws.part_begin[k] = i;
  }
  // Partitions after the last item's (unused ones included) get no items.
  const int last_part = num_items > 0 ? ws.items[4 * (num_items - 1) + 3] : -1;
  for (int k = last_part + 1 + tid; k <= ws.num_parts; k += kThreads) ws.part_begin[k] = num_items;
}

}  // namespace

cudaError_t run_scheduler(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                          cudaStream_t stream) {
  schedule_kernel<<<1, kThreads, 0, stream>>>(params, ws);
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace mla_jax
