// Phase probe: per-CTA timestamps of a kernel's phases, for telling apart
// what a call's time is made of where ncu cannot (it serialises kernels and
// flushes caches; this runs inside the timed CUDA-graph replay). Compiled in
// only with MLA_JAX_PHASE_PROBE (CMake option of the same name, for the
// native tools); otherwise the macros below are empty and nothing changes.
//
//   MLA_JAX_PHASE_BEGIN();   // first statement of a probed kernel: mark 0
//   MLA_JAX_PHASE(m);        // mark m (1 .. kMarks - 2; docs/kernels.md lists those
//                            // in use) of this CTA, thread 0
//                            // mark kMarks - 1 when thread 0 leaves the kernel
//
// Thread 0 of each CTA records %globaltimer (comparable across SMs) and
// clock64 (this SM's cycles) at each mark. Launches of the probed kernels
// of one translation unit are counted (the last CTA to leave a launch
// advances the count) and recorded in kSlots rotating slots, so the host
// reads the last few launches after a replay; phase::dump_since (the
// registry in csrc/common/phase_registry.h) prints, per launch since a
// snapshot of the counts, its span (first entry to last exit; a
// programmatic dependent's span includes its wait) and per mark the
// min / median / max delta in cycles from each CTA's own entry (and the
// median in ns). The marks of a launch that a CTA never reaches
// keep an older launch's values and are left out (older than its entry).
// Only a grid's first kCtas CTAs are recorded (all are counted). One call
// at a time: launches of one unit must not overlap.
#pragma once

#if defined(MLA_JAX_PHASE_PROBE)

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "csrc/common/phase_registry.h"

namespace mla_jax {
namespace phase {

constexpr int kSlots = 8, kCtas = 1024, kMarks = 12;

// One set per translation unit (static, whole-program compilation).
static __device__ unsigned long long g_time[kSlots][kCtas][kMarks];
static __device__ long long g_clock[kSlots][kCtas][kMarks];
static __device__ unsigned g_launch, g_left;
static __device__ unsigned g_ctas[kSlots];

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Probe {
  unsigned slot;
  int cta;
  bool on;
  __device__ Probe() {
    cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    on = threadIdx.x == 0 && cta < kCtas;
    // Stable during a launch: only its last CTA to leave advances it.
    slot = *reinterpret_cast<volatile unsigned*>(&g_launch) % kSlots;
    mark(0);
  }
  __device__ void mark(int m) {
    if (on) {
      g_time[slot][cta][m] = global_ns();
      g_clock[slot][cta][m] = clock64();
    }
  }
  __device__ ~Probe() {
    mark(kMarks - 1);
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned n = gridDim.x * gridDim.y * gridDim.z;
      if (atomicAdd(&g_left, 1u) == n - 1) {
        g_ctas[slot] = n;
        g_left = 0;
        __threadfence();
        atomicAdd(&g_launch, 1u);
      }
    }
  }
};

// The host side of this translation unit's records.
static unsigned launches_unit() {
  unsigned launch = 0;
  return cudaMemcpyFromSymbol(&launch, g_launch, sizeof launch) == cudaSuccess ? launch : 0;
}

static void dump_unit(const char* unit, unsigned first, int at_most) {
  using T = unsigned long long;
  const unsigned launch = launches_unit();
  if (launch <= first) return;
  if (const char* slash = std::strrchr(unit, '/')) unit = slash + 1;
  std::vector<T> t(size_t{kSlots} * kCtas * kMarks);
  std::vector<long long> c(t.size());
  unsigned ctas[kSlots] = {};
  cudaMemcpyFromSymbol(t.data(), g_time, t.size() * sizeof(T));
  cudaMemcpyFromSymbol(c.data(), g_clock, c.size() * sizeof(long long));
  cudaMemcpyFromSymbol(ctas, g_ctas, sizeof ctas);
  const unsigned shown = std::min<unsigned>({launch - first, static_cast<unsigned>(std::max(at_most, 0)), kSlots});
  for (unsigned l = launch - shown; l < launch; ++l) {
    const unsigned s = l % kSlots;
    const int n = std::min<int>(static_cast<int>(ctas[s]), kCtas);
    T first_entry = ~T{0}, last_exit = 0, last_entry = 0;
    for (int i = 0; i < n; ++i) {
      const T* r = &t[(size_t{s} * kCtas + i) * kMarks];
      first_entry = std::min(first_entry, r[0]);
      last_entry = std::max(last_entry, r[0]);
      last_exit = std::max(last_exit, r[kMarks - 1]);
    }
    std::printf("PHASE %s launch %u ctas %d%s span_ns %llu last_entry_ns %llu", unit, l, n,
                static_cast<int>(ctas[s]) > kCtas ? " (of more)" : "", last_exit - first_entry,
                last_entry - first_entry);
    for (int m = 1; m < kMarks; ++m) {
      std::vector<long long> cycles, ns;
      for (int i = 0; i < n; ++i) {
        const size_t base = (size_t{s} * kCtas + i) * kMarks;
        if (t[base + m] < t[base]) continue;  // not reached in this launch
        cycles.push_back(c[base + m] - c[base]);
        ns.push_back(static_cast<long long>(t[base + m] - t[base]));
      }
      if (cycles.empty()) continue;
      std::sort(cycles.begin(), cycles.end());
      std::sort(ns.begin(), ns.end());
      std::printf(" m%d:%lld/%lld/%lld cyc,%lld ns", m, cycles.front(), cycles[cycles.size() / 2], cycles.back(),
                  ns[ns.size() / 2]);
    }
    std::printf("\n");
  }
}

// __BASE_FILE__: the translation unit including this header.
static const bool registered =
    register_unit({launches_unit, [](unsigned first, int at_most) { dump_unit(__BASE_FILE__, first, at_most); }});

}  // namespace phase
}  // namespace mla_jax

#define MLA_JAX_PHASE_BEGIN() ::mla_jax::phase::Probe mla_jax_phase_probe_
#define MLA_JAX_PHASE(m) mla_jax_phase_probe_.mark(m)

#else

#define MLA_JAX_PHASE_BEGIN() \
  do {                        \
  } while (0)
#define MLA_JAX_PHASE(m) \
  do {                   \
  } while (0)

#endif  // MLA_JAX_PHASE_PROBE
