// Does compute-sanitizer's racecheck see the ordering that a named-barrier
// hand-off gives (one warpgroup bar.arrive, the other bar.sync)?
//
// The seesaw kernel (csrc/sm90/decode_seesaw.cuh) passes row maxima between
// its two warpgroups through shared memory this way, and racecheck reports
// hazards there (docs/kernels.md, "Sanitizer status"). This program does the
// same hand-off, correctly ordered, with nothing else in the kernel; it also
// checks the values, so a real ordering bug would show as a wrong sum.
//
//   nvcc -arch=sm_90a -lineinfo -o /tmp/racecheck_probe scripts/racecheck_probe.cu
//   compute-sanitizer --tool racecheck /tmp/racecheck_probe
//
// Hazards reported here mean racecheck does not model bar.arrive hand-offs,
// so the seesaw kernel's reports on the same pattern are not evidence of a
// race. No hazards here leave those reports to be explained.
//
// The seesaw kernel's epilogue (write_item_output) also draws reports,
// between accesses that __syncthreads separates, while the lock-step kernel
// runs the same epilogue without any. So the program also runs such a
// __syncthreads-ordered exchange twice: after the hand-off (handoff_then_staging)
// and alone (staging_only); run each alone with --kernel-name kns=<name>.
// Reports located on staging_exchange's lines in the first (its hand-off
// lines draw reports anyway) and none in the second mean that racecheck
// misorders block barriers after a bar.arrive hand-off.
//
// The swap-AB kernel (csrc/sm90/decode_swapab.cuh) has no bar.arrive, yet
// its 16-row epilogue draws reports too: each warpgroup exchanges row maxima
// inside its own 128 threads (bar.sync on the warpgroup's barrier id) in the
// tile loop, and after the loop both warpgroups exchange their sums through
// the same words, ordered by __syncthreads, once per work item.
// warpgroup_sync_then_staging does the same; reports on its epilogue lines
// mean racecheck misorders block barriers after warpgroup-local bar.sync.
// bulk_copy_then_staging instead fills each warp's slot of every tile with
// an asynchronous bulk copy completing an mbarrier's transaction count, each
// warp reading and refilling only its own slot, as the swap-AB kernel's
// dense 16-row form does with its TMA boxes, and then runs the same
// epilogue exchange: reports on its epilogue lines point at the async-proxy
// fills and mbarrier waits.
#include <cstdint>
#include <cstdio>

namespace {

constexpr int kIters = 64;
constexpr int kBarFull = 1;   // warpgroup 0 -> 1: the slot holds this iteration's values
constexpr int kBarEmpty = 2;  // warpgroup 1 -> 0: the slot has been read

__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Every thread writes its own word, the block synchronises, every thread
// reads another thread's word, the block synchronises again.
__device__ __forceinline__ void staging_exchange(float* stage, int* out) {
  for (int it = 0; it < 8; ++it) {
    stage[threadIdx.x] = static_cast<float>(it * 256 + threadIdx.x);
    __syncthreads();
    const int from = (threadIdx.x + 37) % 256;
    if (stage[from] != static_cast<float>(it * 256 + from)) atomicAdd(out, 1);
    __syncthreads();
  }
}

__device__ __forceinline__ void handoff_body(float* slot, int* out) {
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  float acc = 0.f;
  for (int it = 0; it < kIters; ++it) {
    if (wg == 0) {
      if (it > 0) bar_sync(kBarEmpty, 256);  // warpgroup 1 is done reading the previous values
      slot[t] = static_cast<float>(it * 128 + t);
      bar_arrive(kBarFull, 256);
    } else {
      bar_sync(kBarFull, 256);
      acc += slot[(t + 1) % 128];             // another thread's value, as in the row-max exchange
      if (it + 1 < kIters) bar_arrive(kBarEmpty, 256);
    }
  }
  if (wg == 1) {
    float want = 0.f;
    for (int it = 0; it < kIters; ++it) want += static_cast<float>(it * 128 + (t + 1) % 128);
    if (acc != want) atomicAdd(out, 1);
  }
}

__global__ void __launch_bounds__(256) handoff(int* out) {
  __shared__ float slot[128];
  handoff_body(slot, out);
}

__global__ void __launch_bounds__(256) handoff_then_staging(int* out) {
  __shared__ float slot[128];
  __shared__ float stage[256];
  handoff_body(slot, out);
  __syncthreads();
  staging_exchange(stage, out);
}

__global__ void __launch_bounds__(256) staging_only(int* out) {
  __shared__ float stage[256];
  staging_exchange(stage, out);
}

// Per item: a tile loop in which each warpgroup's four warps exchange values
// in the warpgroup's half of `red` (bar.sync on its own id, 128 threads),
// then an epilogue in which warp leaders write their word of `red`, the block
// synchronises, every thread reads a word of the other warpgroup, and the
// block synchronises before the next item, as the swap-AB kernel does.
__global__ void __launch_bounds__(256) warpgroup_sync_then_staging(int* out) {
  __shared__ float red[2 * 4 * 16];
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  for (int item = 0; item < 8; ++item) {
    __syncthreads();  // the previous item is done with `red`
    float* mine = red + wg * 64;
    for (int tile = 0; tile < 16; ++tile) {
      const float v = static_cast<float>(item * 1000 + tile * 10 + warp);
      if (lane < 16) mine[warp * 16 + lane] = v;
      bar_sync(1 + wg, 128);
      const float other = mine[((warp + 1) % 4) * 16 + lane % 16];
      if (other != static_cast<float>(item * 1000 + tile * 10 + (warp + 1) % 4)) atomicAdd(out, 1);
      bar_sync(1 + wg, 128);  // every warp read before the next tile's writes
    }
    if (lane < 16) red[(wg * 4 + warp) * 16 + lane] = static_cast<float>(item * 100 + wg * 10 + warp);
    __syncthreads();
    const int owg = 1 - wg, ow = (warp + lane) % 4;
    if (red[(owg * 4 + ow) * 16 + lane % 16] != static_cast<float>(item * 100 + owg * 10 + ow)) atomicAdd(out, 1);
    __syncthreads();
  }
}

constexpr int kBulkTiles = 16;
constexpr int kSlotFloats = 128;  // one warp's 512-byte slot

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Per item: kBulkTiles tiles, each warp's lane 0 announcing its slot's bytes
// on the tile's mbarrier and copying them from global memory with
// cp.async.bulk; every thread waits for the phase and checks its warp's
// slot; then the __syncthreads-ordered exchange of the other kernels.
__global__ void __launch_bounds__(256) bulk_copy_then_staging(const float* src, int* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ alignas(128) float slot[8 * kSlotFloats];
  __shared__ float red[2 * 4 * 16];
  __shared__ alignas(8) uint64_t full;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 8;" ::"r"(smem_addr(&full)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t phase = 0;
  for (int item = 0; item < 4; ++item) {
    __syncthreads();  // the previous item is done with `red`
    for (int tile = 0; tile < kBulkTiles; ++tile) {
      __syncwarp();  // this warp's reads of its slot are done
      if (lane == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before the async refill
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&full)),
                     "r"(kSlotFloats * 4) : "memory");
        const float* from = src + (static_cast<size_t>(item * kBulkTiles + tile) * 8 + warp) * kSlotFloats;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(slot + warp * kSlotFloats)), "l"(from), "r"(kSlotFloats * 4),
                     "r"(smem_addr(&full)) : "memory");
      }
      uint32_t done = 0;
      while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(&full)), "r"(phase) : "memory");
      }
      phase ^= 1;
      const int i = (lane + 5) % 32;  // another lane's value of this warp's slot
      const float want = static_cast<float>(((item * kBulkTiles + tile) * 8 + warp) * kSlotFloats + i);
      if (slot[warp * kSlotFloats + i] != want) atomicAdd(out, 1);
    }
    if (lane < 16) red[warp * 16 + lane] = static_cast<float>(item * 100 + warp);
    __syncthreads();
    const int ow = (1 - wg) * 4 + (warp + lane) % 4;
    if (red[ow * 16 + lane % 16] != static_cast<float>(item * 100 + ow)) atomicAdd(out, 1);
    __syncthreads();
  }
#endif
}

__global__ void fill_iota(float* p, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = static_cast<float>(i);
}

}  // namespace

int main() {
  constexpr int kKernels = 5;  // a wrong-value counter each
  const char* const names[kKernels] = {"handoff", "handoff_then_staging", "staging_only",
                                       "warpgroup_sync_then_staging", "bulk_copy_then_staging"};
  int* d_out = nullptr;
  if (cudaMalloc(&d_out, kKernels * sizeof(int)) != cudaSuccess) return 2;
  cudaMemset(d_out, 0, kKernels * sizeof(int));
  handoff<<<4, 256>>>(d_out);
  handoff_then_staging<<<4, 256>>>(d_out + 1);
  staging_only<<<4, 256>>>(d_out + 2);
  warpgroup_sync_then_staging<<<4, 256>>>(d_out + 3);
  constexpr int kSrcFloats = 4 * kBulkTiles * 8 * kSlotFloats;  // exact in float: below 2^24
  float* d_src = nullptr;
  if (cudaMalloc(&d_src, kSrcFloats * sizeof(float)) != cudaSuccess) return 2;
  fill_iota<<<64, 256>>>(d_src, kSrcFloats);
  bulk_copy_then_staging<<<4, 256>>>(d_src, d_out + 4);
  int wrong[kKernels] = {-1, -1, -1, -1, -1};
  const cudaError_t err = cudaMemcpy(wrong, d_out, sizeof(wrong), cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  cudaFree(d_src);
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 2;
  }
  int rc = 0;
  for (int k = 0; k < kKernels; ++k) {
    std::printf("%s %s: %d threads saw a wrong value\n", wrong[k] == 0 ? "ok" : "WRONG", names[k], wrong[k]);
    rc |= wrong[k] != 0;
  }
  return rc;
}
