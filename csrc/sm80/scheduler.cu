// On-device split scheduler (FlashDecoding split-KV, balanced over
// persistent partitions). One CTA; no host synchronisation.
//
// Each request b has n_b = ceil(seq_len / 64) KV blocks. With a fixed cost
// per split (query load and epilogue, kSplitOverhead blocks) the total load
// C = sum(n_b + overhead) is cut into num_parts equal shares T. Request b is
// split into s_b = ceil(n_b / T) items of equal block count (capped by
// max_num_splits), and the items, in request order, go to the partition
// that contains their starting load. sum(s_b) <= batch + num_parts, which
// sizes the scratch.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "csrc/sm80/api.h"

namespace mla_jax {
namespace sm80 {
namespace {

constexpr int kThreads = 256;
constexpr int kSplitOverhead = 2;

__device__ __forceinline__ int num_blocks_of(const PagedDecodeParams& p, int b) {
  const int64_t len = p.seq_lens[b];
  if (len < 0 || len > p.max_seq_len()) return 0;  // invalid: one empty item (NaN output)
  return static_cast<int>((len + kSchedBlockTokens - 1) / kSchedBlockTokens);
}

struct Split {
  int count;      // s_b
  int per_split;  // blocks per item (last may have fewer)
};

__device__ __forceinline__ Split split_of(int n, int64_t share, int cap) {
  if (n == 0) return {1, 0};
  int s = static_cast<int>((n + share - 1) / share);
  if (cap > 0 && s > cap) s = cap;
  const int per = (n + s - 1) / s;
  return {(n + per - 1) / per, per};
}

__device__ __forceinline__ int part_of(int64_t start_load, int64_t total_load, int parts) {
  if (total_load <= 0) return 0;
  const int64_t p = start_load * parts / total_load;
  return static_cast<int>(p < parts - 1 ? p : parts - 1);
}

__global__ void __launch_bounds__(kThreads) schedule_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<longlong2, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t s_total;
  __shared__ longlong2 s_carry;  // (items, load) before the current chunk
  const int tid = threadIdx.x;
  const int batch = p.batch;
  const int parts = ws.num_parts;

  // 1. Total load with one split per request.
  int64_t local = 0;
  for (int b = tid; b < batch; b += kThreads) local += num_blocks_of(p, b) + kSplitOverhead;
  const int64_t total = Reduce(tmp.reduce).Sum(local);
  if (tid == 0) {
    s_total = total;
    s_carry = make_longlong2(0, 0);
  }
  __syncthreads();
  const int64_t share_raw = (s_total + parts - 1) / parts;
  const int64_t share = share_raw > 0 ? share_raw : 1;

  // 2. Split counts, item offsets and loads (scan in chunks of kThreads).
  int64_t total_load = 0;
  for (int base = 0; base < batch; base += kThreads) {
    const int b = base + tid;
    Split sp = {0, 0};
    int n = 0;
    if (b < batch) {
      n = num_blocks_of(p, b);
      sp = split_of(n, share, ws.max_num_splits);
    }
    longlong2 mine = make_longlong2(sp.count, static_cast<int64_t>(n) + int64_t{sp.count} * kSplitOverhead);
    longlong2 before, chunk_total;
    Scan(tmp.scan).ExclusiveScan(
        mine, before, make_longlong2(0, 0),
        [](const longlong2& a, const longlong2& c) { return make_longlong2(a.x + c.x, a.y + c.y); },
        chunk_total);
    const longlong2 carry = s_carry;
    if (b < batch) {
      const int first = static_cast<int>(carry.x + before.x);
      const int64_t load0 = carry.y + before.y;
      ws.request_meta[2 * b] = first;
      ws.request_meta[2 * b + 1] = sp.count;
      for (int j = 0; j < sp.count; ++j) {
        int32_t* item = ws.items + 4 * static_cast<int64_t>(first + j);
        item[0] = b;
        item[1] = j * sp.per_split;
        item[2] = min(n, (j + 1) * sp.per_split);
        item[3] = static_cast<int32_t>(load0 + int64_t{j} * (sp.per_split + kSplitOverhead));
      }
    }
    __syncthreads();  // everyone has read s_carry and used tmp.scan
    if (tid == 0) s_carry = make_longlong2(carry.x + chunk_total.x, carry.y + chunk_total.y);
    __syncthreads();
  }
  total_load = s_carry.y;
  const int num_items = static_cast<int>(s_carry.x);

  // 3. Partition boundaries: part_begin[q] = first item whose part >= q.
  for (int i = tid; i < num_items; i += kThreads) {
    const int q = part_of(ws.items[4 * i + 3], total_load, parts);
    const int q_prev = i == 0 ? -1 : part_of(ws.items[4 * (i - 1) + 3], total_load, parts);
    for (int k = q_prev + 1; k <= q; ++k) ws.part_begin[k] = i;
    if (i == num_items - 1) {
      for (int k = q + 1; k <= parts; ++k) ws.part_begin[k] = num_items;
    }
  }
  if (num_items == 0) {
    for (int k = tid; k <= parts; k += kThreads) ws.part_begin[k] = 0;
  }
}

}  // namespace

cudaError_t run_scheduler(const PagedDecodeParams& params, const DecodeWorkspace& ws,
                          cudaStream_t stream) {
  schedule_kernel<<<1, kThreads, 0, stream>>>(params, ws);
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace mla_jax
