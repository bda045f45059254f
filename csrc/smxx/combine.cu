// Combine kernel: merges the split partial results of each request,
// weighting each split's normalised output by exp(lse_i - lse)
// (FlashDecoding). Requests with one split were written by the decode
// kernel directly and are skipped.
#include "csrc/smxx/combine_tasks.cuh"
#include "csrc/smxx/pdl.cuh"
#include "csrc/smxx/phase_probe.cuh"
#include "csrc/smxx/api.h"

namespace mla_jax {
namespace smxx {
namespace {

// Three grids (which one a call uses is part of the kernel configuration,
// csrc/dispatch/select.cc), over the tasks of csrc/smxx/combine_tasks.cuh:
// * combine_kernel: few pairs with many splits each (one long request at
//   few heads). A CTA per row and 128-column slice (a block task).
// * combine_rows_kernel, a warp per 128-column slice of a row: few pairs
//   with fewer splits each.
// * combine_rows_kernel, a warp per row over all of its columns: many pairs.
// Every grid gives the right answer for every shape; the two warp grids add
// the splits in the same order, so they agree bit for bit.
constexpr int kRowWarps = 8;  // warps per CTA of combine_rows_kernel
constexpr int kRowGroups = kCombineSlices;  // groups of four columns per lane of a 512-column row

// grid: (batch, rows, dv / kCombineSliceColumns).
template <typename OutT>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  MLA_JAX_PHASE_BEGIN();  // diagnostic builds: mark 1 once the decode kernel is waited for
  pdl_wait_for_previous();  // may be dispatched before the decode kernel ends (csrc/smxx/pdl.cuh)
  MLA_JAX_PHASE(1);
  __shared__ CombineBlockSmem smem;
  combine_block_task<OutT>(p, ws, blockIdx.x, blockIdx.y, blockIdx.z, p.kv_lora_rank / gridDim.z, smem);
}

// grid: (batch, ceil(rows / kRowWarps), 4 / kGroups); warp w of CTA
// (b, y, z) merges columns [128 kGroups z, 128 kGroups (z + 1)) of row
// y * kRowWarps + w of request b (a warp task). dv must be 512.
template <typename OutT, int kGroups>
__global__ void __launch_bounds__(kRowWarps * 32) combine_rows_kernel(PagedDecodeParams p, DecodeWorkspace ws) {
  MLA_JAX_PHASE_BEGIN();  // diagnostic builds: mark 1 once the decode kernel is waited for
  pdl_wait_for_previous();  // may be dispatched before the decode kernel ends (csrc/smxx/pdl.cuh)
  MLA_JAX_PHASE(1);
  const int row = blockIdx.y * kRowWarps + static_cast<int>(threadIdx.x) / 32;
  if (row >= p.rows_per_request()) return;  // warp-uniform; no block barriers follow
  combine_warp_task<OutT, kGroups>(p, ws, blockIdx.x, row, blockIdx.z);
}

}  // namespace

cudaError_t run_combine(const PagedDecodeParams& params, const DecodeWorkspace& ws, CombineGrid grid,
                        bool programmatic, cudaStream_t stream) {
  const int rows = params.rows_per_request();
  if (params.batch == 0 || rows == 0) return cudaSuccess;
  // dv is 512 here (checked by the caller): four 128-column slices, the
  // row width combine_rows_kernel assumes. The decode kernel is the
  // previous launch.
  const bool bf16 = params.q_type == ElemType::kBF16;
  const int row_ctas = (rows + kRowWarps - 1) / kRowWarps;
  switch (grid) {
    case CombineGrid::kBlock: {
      auto kernel = bf16 ? combine_kernel<__nv_bfloat16> : combine_kernel<__half>;
      return launch_kernel(kernel, dim3(params.batch, rows, params.kv_lora_rank / kCombineSliceColumns), dim3(kCombineThreads), 0,
                           stream, programmatic, params, ws);
    }
    case CombineGrid::kSlices: {
      auto kernel = bf16 ? combine_rows_kernel<__nv_bfloat16, 1> : combine_rows_kernel<__half, 1>;
      return launch_kernel(kernel, dim3(params.batch, row_ctas, kRowGroups), dim3(kRowWarps * 32), 0, stream,
                           programmatic, params, ws);
    }
    case CombineGrid::kRows:
    default: {
      auto kernel = bf16 ? combine_rows_kernel<__nv_bfloat16, kRowGroups> : combine_rows_kernel<__half, kRowGroups>;
      return launch_kernel(kernel, dim3(params.batch, row_ctas, 1), dim3(kRowWarps * 32), 0, stream, programmatic,
                           params, ws);
    }
  }
}

}  // namespace smxx
}  // namespace mla_jax
