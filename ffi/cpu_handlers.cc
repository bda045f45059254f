// XLA FFI handlers for the CPU backend.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "csrc/cpu/paged_decode_cpu.h"
#include "csrc/cpu/sparse_decode_cpu.h"
#include "ffi/decode_args.h"
#include "ffi/handlers.h"

namespace mla_jax {
namespace {

// Splits [0, n) into chunks pulled from a shared counter by the calling
// thread and by tasks scheduled on XLA's intra-op pool. The caller never
// waits for a task that has not started (a busy or tiny pool cannot
// deadlock it); it only waits for chunks already being processed.
struct SharedLoop {
  std::atomic<int64_t> next{0};
  int64_t n = 0, chunk = 1;
  std::function<void(int64_t, int64_t)> body;
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;

  void run() {
    for (;;) {
      const int64_t begin = next.fetch_add(chunk);
      if (begin >= n) return;
      const int64_t end = std::min(n, begin + chunk);
      body(begin, end);
      std::lock_guard<std::mutex> lock(mu);
      done += end - begin;
      if (done == n) cv.notify_all();
    }
  }
};

ParallelFor pool_parallel_for(ffi::ThreadPool pool) {
  return [pool](int64_t n, const std::function<void(int64_t, int64_t)>& body) mutable {
    if (n <= 0) return;
    const int64_t workers = std::max<int64_t>(1, pool.num_threads());
    auto loop = std::make_shared<SharedLoop>();
    loop->n = n;
    loop->chunk = std::max<int64_t>(1, n / (4 * (workers + 1)));
    loop->body = body;
    for (int64_t w = 0; w < std::min(workers, n); ++w) pool.Schedule([loop] { loop->run(); });
    loop->run();
    std::unique_lock<std::mutex> lock(loop->mu);
    loop->cv.wait(lock, [&] { return loop->done == loop->n; });
  };
}

ffi::Error paged_decode_cpu_impl(ffi::ThreadPool pool, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe,
                                 ffi::AnyBuffer ckv, ffi::AnyBuffer kpe,
                                 ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                                 ffi::Buffer<ffi::F32> kv_scale, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, bool causal,
                                 int64_t kv_lora_rank, int64_t qk_rope_head_dim) {
  PagedDecodeParams params;
  ffi::Error err = fill_decode_params(q_nope, q_pe, ckv, kpe, block_table, seq_lens, kv_scale, *out,
                                      *lse, sm_scale, causal, kv_lora_rank, qk_rope_head_dim, &params);
  if (err.failure()) return err;
  paged_decode_cpu(params, pool_parallel_for(pool));
  return ffi::Error::Success();
}

ffi::Error sparse_decode_cpu_impl(ffi::ThreadPool pool, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe,
                                  ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                                  ffi::Buffer<ffi::S32> topk_lens, ffi::Buffer<ffi::F32> attn_sink,
                                  ffi::Buffer<ffi::F32> kv_scale, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale,
                                  int64_t kv_format, bool has_sink, int64_t kv_lora_rank,
                                  int64_t qk_rope_head_dim) {
  PagedDecodeParams params;
  ffi::Error err = fill_sparse_params(q_nope, q_pe, kv, indices, topk_lens, attn_sink, kv_scale, *out,
                                      *lse, sm_scale, kv_format, has_sink, kv_lora_rank,
                                      qk_rope_head_dim, &params);
  if (err.failure()) return err;
  sparse_decode_cpu(params, pool_parallel_for(pool));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeCpu, paged_decode_cpu_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q_nope (or packed query)
                                  .Arg<ffi::AnyBuffer>()  // q_pe
                                  .Arg<ffi::AnyBuffer>()  // ckv (or packed cache)
                                  .Arg<ffi::AnyBuffer>()  // kpe
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scale
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("qk_rope_head_dim"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseDecodeCpu, sparse_decode_cpu_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q_nope (or packed query)
                                  .Arg<ffi::AnyBuffer>()  // q_pe
                                  .Arg<ffi::AnyBuffer>()  // kv: packed [P, S, 576] or uint8 [P, S, 656]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // indices [B, Q, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_lens [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // attn_sink [H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scale [1]
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("kv_format")
                                  .Attr<bool>("has_sink")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("qk_rope_head_dim"));

}  // namespace mla_jax
