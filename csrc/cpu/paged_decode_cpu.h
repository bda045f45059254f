// CPU paged MLA decode: same semantics as the CUDA kernels, used by CI,
// laptops and the demo when no GPU is present.
#pragma once

#include <cstdint>
#include <functional>

#include "../common/mla_params.h"

namespace mla_jax {

// Runs `body(begin, end)` over [0, n) in chunks, possibly on several threads.
using ParallelFor =
    std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)>;

// Computes out and lse for every request. Requests whose inputs are invalid
// (negative or over-long seq_lens, a live page id outside [0, num_pages))
// get NaN out and lse; nothing outside the buffers is read.
void paged_decode_cpu(const PagedDecodeParams& params, const ParallelFor& parallel_for);

}  // namespace mla_jax
