// The arithmetic of the split schedule (FlashDecoding split-KV over
// persistent partitions), shared by the scheduler kernel (scheduler.cu) and
// the decode kernels that schedule small batches themselves
// (schedule_inline.cuh), so both cut every request the same way.
//
// The requests' 64-token KV blocks are laid end to end on one work line,
// each request preceded by a fixed cost (query load and epilogue,
// kSplitOverhead blocks): request b covers [start_b, start_b + overhead +
// n_b). The line is cut into `parts` equal shares; partition q gets the work
// in [bound(q), bound(q+1)). A request crossing a cut is split there, so
// every partition carries the same load and each cut splits at most one
// request: at most batch + num_parts - 1 items, which sizes the scratch.
// max_num_splits > 0 merges a request's pieces into at most that many equal
// splits (still in partition order). Alternatives to the cut, each taken
// when its busiest partition stays close to the equal share: whole requests
// (every request one item, in the partition of its first block, or, in the
// block schedule, dealt by load in snake order) and equal pieces (request b
// cut into k equal pieces in partitions [b k, b k + k), k = parts / batch),
// see below. Items are numbered request by request (snake: partition by
// partition).
#pragma once

#include <cstdint>

#include "csrc/common/mla_params.h"
#include "csrc/smxx/api.h"
#include "csrc/smxx/request.cuh"

namespace mla_jax {
namespace smxx {

constexpr int kSplitOverhead = 2;
// Least work (blocks) worth a partition of its own on a line longer than
// num_parts: there the longest partition is two units or more whatever the
// count, and fewer, longer partitions save splits' fixed cost (query load,
// partial write, combine read). 2 was faster than 3 on the small-batch rows
// measured and 4 no faster. A line of at most num_parts units gets a
// partition per unit instead: its longest partition is one unit, not two
// (docs/perf.md, What was tried).
constexpr int kMinPartWork = 2;

// num / den for num >= 0, den > 0: one 32-bit unsigned division where both
// fit in 32 bits (the usual case: the schedule's work lines are short),
// else the 64-bit one. The same quotient either way, so every schedule that
// uses it still agrees bit for bit.
__device__ __forceinline__ int64_t div_nonneg(int64_t num, int64_t den) {
  if (((static_cast<uint64_t>(num) | static_cast<uint64_t>(den)) >> 32) == 0)
    return static_cast<uint32_t>(num) / static_cast<uint32_t>(den);
  return num / den;
}

// An invalid request has no blocks: one empty item writes its NaN output.
__device__ __forceinline__ int num_blocks_of(const PagedDecodeParams& p, int b) {
  const RequestSpan span = request_span(p, b);
  return static_cast<int>((span.len + kSchedBlockTokens - 1) / kSchedBlockTokens);
}

// Partitions used for `work` blocks on the line: at most num_parts, at least 1.
// Every schedule (inline, block, the scheduler kernel) cuts with it, so all
// of them agree bit for bit.
__device__ __forceinline__ int partitions_for(int64_t work, int num_parts) {
  if (work <= num_parts) return work > 0 ? static_cast<int>(work) : 1;
  const int64_t wanted = (work + kMinPartWork - 1) / kMinPartWork;
  return static_cast<int>(wanted < num_parts ? (wanted > 0 ? wanted : 1) : num_parts);
}

__device__ __forceinline__ int64_t bound(int part, int64_t total, int parts) {
  return div_nonneg(int64_t{part} * total + parts - 1, parts);  // first work unit of `part`
}

__device__ __forceinline__ int part_of(int64_t pos, int64_t total, int parts) {
  if (total <= 0) return 0;
  const int64_t p = div_nonneg(pos * parts, total);
  return static_cast<int>(p < parts - 1 ? p : parts - 1);
}

// Whole requests: placing every request, uncut, in the partition of its
// first block avoids the split pieces' partials and their combine,
// at the price of a less even load. The schedulers take it (by capping
// every request at one item) when the busiest partition then carries at
// most kWholeRequestSlackPct % more than the equal share of the cut
// schedule. Where requests are fewer than partitions the slack is far above
// it, and whole requests would leave most SMs idle.
constexpr int kWholeRequestSlackPct = 5;

// Equal pieces: with at least two partitions per request, cutting every
// request into k = parts / batch equal pieces, one per partition, gives
// each CTA one item where the cut schedule gives it about two (a piece of
// each of two requests), and an item has a fixed cost of several 64-token
// blocks beyond its own. Taken when the largest piece (plus
// kSplitOverhead) is within kEqualPiecesSlackPct % of the equal share, so
// requests of very different lengths keep the cut.
constexpr int kEqualPiecesSlackPct = 10;

// Where a request sits on the work line and how its items cut it.
struct RequestCut {
  int64_t first_block_pos;  // line position of the request's first KV block
  int n;                    // KV blocks
  int p_first;              // partition of the first block
  int natural;              // partitions the blocks span
  int count;                // items (natural, or capped by max_num_splits)
  bool equal;               // equal pieces in partitions p_first, p_first + 1, ...
};

// The cut of a request with n blocks whose first block sits at
// first_block_pos (after its kSplitOverhead units).
__device__ __forceinline__ RequestCut cut_request(int n, int64_t first_block_pos, int64_t work, int parts,
                                                  int max_num_splits) {
  int p_first, p_last;
  if (n == 0) {
    p_first = p_last = part_of(first_block_pos - kSplitOverhead, work, parts);
  } else {
    p_first = part_of(first_block_pos, work, parts);
    p_last = part_of(first_block_pos + n - 1, work, parts);
  }
  int count = p_last - p_first + 1;
  if (max_num_splits > 0 && count > max_num_splits) count = max_num_splits;
  return RequestCut{first_block_pos, n, p_first, p_last - p_first + 1, count, false};
}

// Equal pieces: partitions per request (k = parts / batch, at most
// max_num_splits when that is set), or 0 when there are fewer than two.
__device__ __forceinline__ int equal_piece_stride(int batch, int parts, int max_num_splits) {
  int k = batch > 0 ? parts / batch : 0;
  if (max_num_splits > 0 && k > max_num_splits) k = max_num_splits;
  return k >= 2 ? k : 0;
}

// Pieces of a request with n blocks: min(stride, n), one if it is empty.
__device__ __forceinline__ int equal_piece_count(int n, int stride) {
  return n < stride ? (n > 0 ? n : 1) : stride;
}

// Request b (n blocks) cut into equal_piece_count pieces in partitions
// [b stride, b stride + pieces).
__device__ __forceinline__ RequestCut equal_pieces_cut(int b, int n, int64_t first_block_pos, int stride) {
  const int count = equal_piece_count(n, stride);
  return RequestCut{first_block_pos, n, b * stride, count, count, true};
}

// Work units of a request's largest equal piece (its blocks rounded up,
// plus the fixed cost).
__device__ __forceinline__ int64_t equal_piece_load(int n, int stride) {
  const int count = equal_piece_count(n, stride);
  return (n + count - 1) / count + kSplitOverhead;
}

__device__ __forceinline__ bool within_share(int64_t busiest, int64_t work, int parts, int slack_pct) {
  const int64_t share = div_nonneg(work + parts - 1, parts);
  return busiest * 100 <= share * (100 + slack_pct);
}

// Whether the whole-request placement can be within the slack at all: its
// busiest partition carries at least the average request (rounded up, as
// the largest request's load is an integer), so when that alone exceeds
// the slack the schedulers skip counting the placement (same decision).
__device__ __forceinline__ bool whole_requests_may_fit(int64_t work, int batch, int parts) {
  return batch > 0 && within_share(div_nonneg(work + batch - 1, batch), work, parts, kWholeRequestSlackPct);
}

// Whole requests in snake order, for lengths that differ: where placing
// each request in the partition of its first block leaves the busiest
// partition over the slack, sorting the requests by load (largest first,
// ties by request number) and dealing them to partitions 0, 1, ..., P-1,
// then P-1, ..., 0, and so on, usually does not. For the benchmark's varlen
// row (128 requests of N(4096, 2048) tokens clipped to [1, 8192], 66
// partitions) the first-block placement's busiest partition carries 1.81x
// the equal share, the snake's 1.03x (largest-first greedy: also 1.03x).
// Taken under the same kWholeRequestSlackPct, by the block schedule only
// (more than kInlineScheduleMaxBatch requests, at most kSnakeMaxBatch).
// Items are numbered partition by partition, so a partition's items stay
// consecutive: rank r is round r / P of partition snake_slot(r, ...).part.
struct SnakeSlot {
  int part;    // partition of the request
  int number;  // its item number
};

__device__ __forceinline__ SnakeSlot snake_slot(int rank, int batch, int parts) {
  const int round = rank / parts, pos = rank % parts;
  const int part = round % 2 == 0 ? pos : parts - 1 - pos;
  // Every partition gets `full` requests, and those the last, partial round
  // reaches one more: partitions [0, last) when that round runs forward,
  // [parts - last, parts) when it runs backward.
  const int full = batch / parts, last = batch % parts;
  const int partial_before = full % 2 == 0 ? min(part, last) : max(0, part - (parts - last));
  return SnakeSlot{part, full * part + partial_before + round};
}

// The cap on items per request for this line: 1 (whole requests) when the
// busiest partition of the whole-request placement (`busiest`, in work
// units) is within the slack of an equal share, else max_num_splits.
__device__ __forceinline__ int effective_max_splits(int64_t busiest, int64_t work, int parts, int max_num_splits) {
  return within_share(busiest, work, parts, kWholeRequestSlackPct) ? 1 : max_num_splits;
}

// Item k of a cut request: its blocks [begin, end) and its partition. Distinct
// k of one request fall in distinct partitions (count <= natural).
struct ItemRange {
  int begin;
  int end;
  int part;
};

__device__ __forceinline__ ItemRange item_range(const RequestCut& c, int k, int64_t work, int parts) {
  ItemRange r;
  if (c.count == c.natural && !c.equal) {  // cut at the partition bounds
    r.part = c.p_first + k;
    r.begin = k == 0 ? 0 : static_cast<int>(bound(r.part, work, parts) - c.first_block_pos);
    r.end = k == c.count - 1 ? c.n : static_cast<int>(bound(r.part + 1, work, parts) - c.first_block_pos);
  } else {  // capped or equal: equal pieces, each in the partition of its start or its own
    r.begin = static_cast<int>(div_nonneg(int64_t{k} * c.n, c.count));
    r.end = static_cast<int>(div_nonneg(int64_t{k + 1} * c.n, c.count));
    r.part = c.p_first + static_cast<int>(div_nonneg(int64_t{k} * c.natural, c.count));
  }
  return r;
}

}  // namespace smxx
}  // namespace mla_jax
