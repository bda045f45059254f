// Per-kernel, per-device host facts, asked of the runtime once and cached:
// a decode call repeats none of these queries.
#include <mutex>
#include <vector>

#include "csrc/smxx/api.h"

namespace mla_jax {
namespace smxx {
namespace {

struct Entry {
  const void* kernel;
  int device;
  int value;  // smem bytes set, or ptx version
};

struct Cache {
  std::mutex mu;
  std::vector<Entry> smem, ptx;
};

Cache& cache() {
  static Cache c;
  return c;
}

Entry* find(std::vector<Entry>& v, const void* kernel, int device) {
  for (Entry& e : v)
    if (e.kernel == kernel && e.device == device) return &e;
  return nullptr;
}

}  // namespace

cudaError_t set_max_dynamic_smem_once(const void* kernel, int bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  Entry* e = find(c.smem, kernel, device);
  if (e != nullptr && e->value >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) {
    if (e != nullptr) {
      e->value = bytes;
    } else {
      c.smem.push_back({kernel, device, bytes});
    }
  }
  return err;
}

bool kernel_has_sm90_code(const void* kernel) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (const Entry* e = find(c.ptx, kernel, device)) return e->value >= 90;
  cudaFuncAttributes attrs;
  if (cudaFuncGetAttributes(&attrs, kernel) != cudaSuccess) {
    cudaGetLastError();  // not cached: asked again on the next call
    return false;
  }
  c.ptx.push_back({kernel, device, attrs.ptxVersion});
  return attrs.ptxVersion >= 90;
}

}  // namespace smxx
}  // namespace mla_jax
