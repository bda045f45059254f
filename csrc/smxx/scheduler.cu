// On-device split scheduler: one CTA writes every request's items, the
// partition bounds and the per-request metadata the combine kernel reads.
// No host synchronisation. The schedule itself is in schedule_block.cuh
// (shared with the Hopper kernel that schedules inside its CTAs) and its
// arithmetic in schedule_math.cuh.
#include "csrc/smxx/api.h"
#include "csrc/smxx/pdl.cuh"
#include "csrc/smxx/schedule_block.cuh"

namespace mla_jax {
namespace smxx {
namespace {

__global__ void __launch_bounds__(kScheduleThreads)
    schedule_kernel(PagedDecodeParams p, DecodeWorkspace ws, SplitSchedule schedule) {
  // A decode kernel launched after this one as its programmatic dependent
  // may be dispatched now (CTA dispatch and its set-up overlap the
  // schedule); it waits for this grid to complete before reading the
  // schedule (csrc/smxx/pdl.cuh).
  pdl_allow_dependents();
  __shared__ BlockScheduleSmem smem;
  schedule_block(p, ws, schedule, smem, /*only_part=*/-1, /*part_items=*/nullptr, /*write_meta=*/true);
}

}  // namespace

cudaError_t run_scheduler(const PagedDecodeParams& params, const DecodeWorkspace& ws, const SplitSchedule& schedule,
                          cudaStream_t stream) {
  schedule_kernel<<<1, kScheduleThreads, 0, stream>>>(params, ws, schedule);
  return cudaGetLastError();
}

}  // namespace smxx
}  // namespace mla_jax
