// Which CUDA kernels a decode call runs: the configuration that
// csrc/dispatch/select.cc chooses from a problem's static facts, that
// travels to the handler as FFI attributes (so it is visible in the HLO and
// fixed in an export), and that csrc/dispatch/decode.cu executes.
//
// Every field has an "auto" value. A plan may force a field (tests and A/B
// runs do); select_kernel() resolves the auto ones. Plain C++ (no CUDA).
// The integer values are the attribute encoding: mla_jax/kernels.py
// mirrors them and must change with them.
#pragma once

#include <cstdint>

namespace mla_jax {

// Requests up to which the seesaw and swap-AB kernels' inline schedule serves a batch
// (one per lane of a warp; smxx/schedule_inline.cuh).
constexpr int kInlineScheduleMaxRequests = 32;

enum class DecodeOp : int { kPaged = 0, kSparse = 1 };

enum class KernelFamily : int {
  kAuto = 0,
  kPortable = 1,      // sm80/: mma.sync, cp.async; any CUDA architecture
  kSm90Lockstep = 2,  // sm90/decode_kernel.cuh: wgmma, 64-row blocks, cp.async or TMA loads
  kSm90Seesaw = 3,    // sm90/decode_seesaw.cuh: wgmma, TMA loads, warpgroups take turns
  kSm90SwapAB = 4,    // sm90/decode_swapab.cuh: dense e4m3 cache, <= 32 rows, tokens as wgmma's M
};

enum class ScheduleMode : int {
  kAuto = 0,
  kSchedulerKernel = 1,  // smxx/scheduler.cu runs before the decode kernel
  kInline = 2,           // the seesaw or swap-AB kernel schedules with one warp (<= 32 requests)
  kBlock = 3,            // the seesaw kernel schedules with the whole CTA, in every CTA
  // The call's schedule operand holds the schedule: the op's own schedule
  // call (the scheduler kernel) wrote it, once for every decode call of a
  // program over the same block_table and seq_lens, or sparse decode's
  // topk_lens (XLA merges identical pure calls); the decode launches no
  // scheduler.
  kStep = 4,
};

enum class CombineGrid : int { kAuto = 0, kBlock = 1, kRows = 2, kSlices = 3 };

enum class Switch : int { kAuto = 0, kOff = 1, kOn = 2 };

struct KernelConfig {
  KernelFamily kernel = KernelFamily::kAuto;
  ScheduleMode schedule = ScheduleMode::kAuto;
  CombineGrid combine_grid = CombineGrid::kAuto;
  Switch programmatic_combine = Switch::kAuto;  // combine launched with programmatic dependent launch
  // The seesaw kernel with the inline schedule merges the splits itself
  // after a grid-wide barrier (a cooperative launch), in the order of
  // combine_grid's kernel, instead of launching the combine kernel.
  Switch fused_combine = Switch::kAuto;

  bool resolved() const {
    return kernel != KernelFamily::kAuto && schedule != ScheduleMode::kAuto &&
           combine_grid != CombineGrid::kAuto && programmatic_combine != Switch::kAuto &&
           fused_combine != Switch::kAuto;
  }
};

inline bool operator==(const KernelConfig& a, const KernelConfig& b) {
  return a.kernel == b.kernel && a.schedule == b.schedule && a.combine_grid == b.combine_grid &&
         a.programmatic_combine == b.programmatic_combine && a.fused_combine == b.fused_combine;
}

}  // namespace mla_jax
