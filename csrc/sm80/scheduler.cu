// On-device split scheduler: one CTA writes every request's items, the
// partition bounds and the per-request metadata the combine kernel reads.
// No host synchronisation. The arithmetic of the cut is in
// schedule_math.cuh (shared with the decode kernels that schedule small
// batches themselves).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include "csrc/sm80/api.h"
#include "csrc/sm80/schedule_math.cuh"

namespace mla_jax {
namespace sm80 {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxWholeParts = 1024;  // partitions the whole-request check can count

__global__ void __launch_bounds__(kThreads) schedule_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<longlong2, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t s_total;
  __shared__ int s_max_splits;
  __shared__ longlong2 s_carry;  // (items, work) before the current chunk
  // The current chunk's requests: first item (chunk-relative; entry kThreads
  // = the chunk's item count) and cut. Items are then written one per
  // thread: a single long request split over every partition must not
  // leave one thread writing them all (that took ~35 us for 132 splits).
  __shared__ int s_item_first[kThreads + 1];
  __shared__ RequestCut s_cut[kThreads];
  __shared__ unsigned long long s_part_load[kMaxWholeParts];  // whole-request load per partition
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
  const int parts = partitions_for(work, ws.num_parts);
  const auto add = [](const longlong2& x, const longlong2& y) { return make_longlong2(x.x + y.x, x.y + y.y); };

  // 2. Whole requests or cut ones (schedule_math.cuh): each request's load
  //    goes to the partition of its first block; the busiest decides. More
  //    partitions than kMaxWholeParts (not on today's GPUs) keep the cut;
  //    where requests are too few to fill the partitions the count is
  //    skipped (about 1 us of this kernel).
  int max_splits = ws.max_num_splits;
  if (parts <= kMaxWholeParts && whole_requests_may_fit(work, batch, parts)) {
    for (int q = tid; q < parts; q += kThreads) s_part_load[q] = 0;
    __syncthreads();
    int64_t line_before = 0;  // work before the current chunk
    for (int base = 0; base < batch; base += kThreads) {
      const int b = base + tid;
      const int n = b < batch ? num_blocks_of(p, ws, b) : 0;
      longlong2 before, chunk_total;
      Scan(tmp.scan).ExclusiveScan(make_longlong2(0, b < batch ? n + kSplitOverhead : 0), before,
                                   make_longlong2(0, 0), add, chunk_total);
      if (b < batch) {
        const int q = cut_request(n, line_before + before.y + kSplitOverhead, work, parts, 1).p_first;
        atomicAdd(&s_part_load[q], static_cast<unsigned long long>(n + kSplitOverhead));
      }
      line_before += chunk_total.y;
      __syncthreads();  // tmp.scan is reused
    }
    int64_t busiest = 0;
    for (int q = tid; q < parts; q += kThreads) busiest = max(busiest, static_cast<int64_t>(s_part_load[q]));
    busiest = Reduce(tmp.reduce).Reduce(busiest, cuda::maximum<>{});
    if (tid == 0) s_max_splits = effective_max_splits(busiest, work, parts, ws.max_num_splits);
    __syncthreads();
    max_splits = s_max_splits;
  }
  // Else equal pieces, where each request has two or more partitions and
  // its largest piece is close to the share.
  int stride = max_splits == 1 ? 0 : equal_piece_stride(batch, parts, ws.max_num_splits);
  if (stride > 0) {
    int64_t largest = 0;
    for (int b = tid; b < batch; b += kThreads) largest = max(largest, equal_piece_load(num_blocks_of(p, ws, b), stride));
    __syncthreads();  // tmp.reduce may still be read by the reduction above
    largest = Reduce(tmp.reduce).Reduce(largest, cuda::maximum<>{});
    if (tid == 0) s_max_splits = within_share(largest, work, parts, kEqualPiecesSlackPct) ? stride : 0;
    __syncthreads();
    stride = s_max_splits;
  }

  // 3. Per chunk of requests: place each on the line (scan), find the
  //    partitions its blocks fall in (or its equal pieces') and its item
  //    offsets (second scan), then write the chunk's items, one per thread.
  for (int base = 0; base < batch; base += kThreads) {
    const int b = base + tid;
    int n = 0;
    longlong2 before = make_longlong2(0, 0), chunk_total;
    if (b < batch) n = num_blocks_of(p, ws, b);
    // The work position depends on earlier requests only: scan it first.
    Scan(tmp.scan).ExclusiveScan(make_longlong2(0, b < batch ? n + kSplitOverhead : 0), before,
                                 make_longlong2(0, 0), add, chunk_total);
    const longlong2 carry = s_carry;
    const int64_t first_block_pos = carry.y + before.y + kSplitOverhead;
    RequestCut cut = stride > 0 ? equal_pieces_cut(b, n, first_block_pos, stride)
                                : cut_request(n, first_block_pos, work, parts, max_splits);
    if (b >= batch) cut.count = 0;
    const int count = cut.count;
    __syncthreads();  // tmp.scan is reused
    longlong2 item_before, item_total;
    Scan(tmp.scan).ExclusiveScan(make_longlong2(count, 0), item_before, make_longlong2(0, 0), add, item_total);
    // Every request has at least one item, so s_item_first is strictly
    // increasing over the chunk's requests (entries past the batch hold the
    // chunk's item count).
    s_item_first[tid] = static_cast<int>(item_before.x);
    if (tid == 0) s_item_first[kThreads] = static_cast<int>(item_total.x);
    s_cut[tid] = cut;
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
      const ItemRange r = item_range(s_cut[lo], j - s_item_first[lo], work, parts);
      int4* item = reinterpret_cast<int4*>(ws.items) + carry.x + j;
      *item = make_int4(base + lo, r.begin, r.end, r.part);
    }
    __syncthreads();  // everyone has read s_carry and the chunk's shared arrays
    if (tid == 0) s_carry = make_longlong2(carry.x + item_total.x, carry.y + chunk_total.y);
    __syncthreads();
  }
  const int num_items = static_cast<int>(s_carry.x);

  // 4. Partition boundaries: part_begin[q] = first item whose part >= q
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
