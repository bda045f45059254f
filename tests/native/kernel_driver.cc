// A standalone driver of mla_jax's CUDA decode path, without XLA or Python,
// for compute-sanitizer (memcheck, racecheck, synccheck). compute-sanitizer
// crashes inside the JAX process (docs/kernels.md, "Sanitizer status"); this
// program calls what the FFI handler calls (call_facts, select_kernel,
// workspace_layout, carve_workspace, run_paged_decode / run_sparse_decode)
// on buffers of exactly the sizes a JAX call gives them (the workspace as
// mla_jax/kernels.py sizes it), one cudaMalloc each, so that any access past
// a buffer is reported.
//
//   mla_jax_kernel_driver [N_CASES [SEED [--short-out] [--kernel NAME] [--sparse-heads H]]]
//
// --short-out allocates every output buffer 2 bytes short: a check that
// memcheck sees the kernels' accesses (it must report the last row's
// stores), not a mode for anything else. --kernel draws every case for one
// kernel request (auto, portable, sm90_lockstep, sm90_seesaw, sm90_swapab)
// instead of cycling through them: a sanitizer run aimed at one kernel.
// --sparse-heads H makes every case a sparse one with H heads (1-128), e.g.
// the seesaw kernel's sparse rows at 128 heads; above the swap-AB kernel's
// 32 heads the cycle leaves sm90_swapab out, and --kernel sm90_swapab with
// such an H is a usage error.
//
// Each seeded case draws a paged or sparse call over the input space the
// Python tests cover (query dtype, cache format and layout, page size,
// batch, q_len, heads, kernel configuration, max_num_splits, ragged and
// zero lengths, invalid requests and page ids, -1 and out-of-range top-k
// indices, top-k lengths with garbage after, attention sinks). Every cache
// slot that no valid request may read holds NaN; the outputs start as
// finite sentinels, other ones for the reference, so that a row nobody
// writes fails. The result is checked against the CPU kernel
// (csrc/cpu, itself checked against the float64 reference by the Python
// tests) on the same bytes: NaN exactly where the CPU kernel gives NaN,
// equal infinities, elsewhere an error <= 1e-2 of the row's largest value
// plus one unit in the last place of the output type (both outputs are
// rounded to it) and |d lse| <= 1e-2. Cases cycle through the kernel
// requests auto, portable, sm90_lockstep, sm90_seesaw and sm90_swapab, each drawn from
// the shapes that kernel serves (a kernel that cannot serve its case fails
// it; a schedule or combine request it cannot serve runs as auto, noted in
// the case's line). Exit status 0 when every case matches, 1
// otherwise, 2 on a CUDA error.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "csrc/common/elem_convert.h"
#include "csrc/common/mla_params.h"
#include "csrc/common/workspace.h"
#include "csrc/cpu/paged_decode_cpu.h"
#include "csrc/cpu/sparse_decode_cpu.h"
#include "csrc/dispatch/decode.h"
#include "csrc/dispatch/select.h"
#include "tests/native/cuda_ok.h"

namespace {

using namespace mla_jax;

constexpr int kDn = 512, kDr = 64, kDqk = kDn + kDr;

// A host array and its device copy of exactly the same size.
struct Buf {
  std::vector<uint8_t> host;
  void* dev = nullptr;
  size_t dev_bytes = 0;
  explicit Buf(size_t bytes, uint8_t fill = 0, size_t shortfall = 0)
      : host(bytes, fill), dev_bytes(bytes - std::min(bytes, shortfall)) {
    if (dev_bytes) CUDA_OK(cudaMalloc(&dev, dev_bytes));
  }
  Buf(const Buf&) = delete;
  ~Buf() {
    if (dev) cudaFree(dev);
  }
  template <typename T>
  T* h() { return reinterpret_cast<T*>(host.data()); }
  void upload() {
    if (dev_bytes) CUDA_OK(cudaMemcpy(dev, host.data(), dev_bytes, cudaMemcpyHostToDevice));
  }
  void download() {
    if (dev_bytes) CUDA_OK(cudaMemcpy(host.data(), dev, dev_bytes, cudaMemcpyDeviceToHost));
  }
};

size_t g_out_shortfall = 0;  // --short-out
int g_sparse_heads = 0;       // --sparse-heads

constexpr uint16_t kBf16NaN = 0x7fc0, kF16NaN = 0x7e00;
constexpr uint8_t kE4m3NaN = 0x7f;

uint16_t to_16(float v, ElemType t) { return t == ElemType::kBF16 ? float_to_bf16(v) : float_to_f16(v); }
float from_16(uint16_t v, ElemType t) { return t == ElemType::kBF16 ? bf16_to_float(v) : f16_to_float(v); }
uint16_t nan_16(ElemType t) { return t == ElemType::kBF16 ? kBf16NaN : kF16NaN; }

// A random finite e4m3 byte (every code but the two NaNs).
uint8_t random_e4m3(std::mt19937_64& rng) {
  for (;;) {
    const uint8_t v = static_cast<uint8_t>(rng() & 0xff);
    if ((v & 0x7f) != 0x7f) return v;
  }
}

struct Case {
  bool sparse = false;
  ElemType q_type = ElemType::kBF16;
  enum Cache { kNative, kFp8, kDsMla } cache = kNative;
  bool q_packed = true, kv_packed = true;
  int batch = 1, q_len = 1, heads = 1, page_size = 64;
  int topk = 0;          // sparse
  bool sink = false;     // sparse
  bool causal = true;    // paged
  bool many = false;     // paged: many short requests
  int max_num_splits = 0;
  std::string request;   // kernel configuration asked for ("kernel,schedule,combine,programmatic,fused")
};

std::string describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s q=%s cache=%s%s B=%d%s q_len=%d H=%d page=%d%s%s splits<=%d request=%s",
                c.sparse ? "sparse" : "paged", c.q_type == ElemType::kBF16 ? "bf16" : "fp16",
                c.cache == Case::kNative ? "native" : c.cache == Case::kFp8 ? "fp8" : "fp8_ds_mla",
                c.sparse ? "" : (c.kv_packed ? " packed" : " split"), c.batch, c.many ? " (short)" : "", c.q_len,
                c.heads, c.page_size,
                c.sparse ? (" topk=" + std::to_string(c.topk) + (c.sink ? " sink" : "")).c_str() : "",
                c.sparse ? "" : (c.causal ? " causal" : ""), c.max_num_splits, c.request.c_str());
  return buf;
}

template <typename T>
T pick(std::mt19937_64& rng, std::initializer_list<T> xs) {
  return *(xs.begin() + rng() % xs.size());
}

// kernel: the kernel requested; the shape is drawn among those it serves
// (sm90_seesaw: paged bf16/fp16 or e4m3 caches with page_size a multiple of 64,
// or sparse fp8_ds_mla with a bf16 query; sm90_swapab: paged e4m3 caches with page_size a multiple of 64 and at
// most 32 query rows, or sparse fp8_ds_mla with a bf16 query and at most 32
// heads; sm90_lockstep: any number of query rows per request).
Case draw_case(std::mt19937_64& rng, const std::string& kernel) {
  Case c;
  const bool seesaw = kernel == "sm90_seesaw";
  const bool swapab = kernel == "sm90_swapab";
  c.sparse = rng() % 3 == 0 || g_sparse_heads > 0;
  c.q_type = rng() % 4 == 0 ? ElemType::kF16 : ElemType::kBF16;
  c.q_packed = rng() % 2;
  c.heads = pick(rng, {1, 3, 12, 16, 32, 48, 64, 96, 128});
  c.page_size = pick(rng, {1, 16, 32, 64, 64, 128});
  c.max_num_splits = pick(rng, {0, 0, 1, 2, 5});
  if (c.sparse) {
    c.cache = !swapab && !seesaw && rng() % 3 == 0 ? Case::kNative : Case::kDsMla;
    if (swapab) {
      c.q_type = ElemType::kBF16;
      c.heads = pick(rng, {1, 3, 8, 12, 16, 17, 24, 32});
    }
    if (seesaw) c.q_type = ElemType::kBF16;
    c.batch = 1 + rng() % 4;
    c.q_len = 1 + rng() % 2;
    c.topk = pick(rng, {1, 33, 64, 100, 130, 257});
    if ((swapab || seesaw || rng() % 4 == 0) && rng() % 2) {
      // Items of many tiles, so that the kernel refills its stages many
      // times (and, past 32 requests, the seesaw kernel's block schedule);
      // unforced, top-k on both sides of kSeesawSparseMinTopk.
      c.batch = 8 + rng() % 17;
      c.topk = pick(rng, {900, 1023, 1024, 2048, 2049});
    }
    c.sink = rng() % 2;
    c.max_num_splits = 0;
    if (g_sparse_heads > 0) c.heads = g_sparse_heads;
  } else {
    c.cache = swapab || rng() % 2 ? Case::kFp8 : Case::kNative;
    c.kv_packed = rng() % 2;
    if (seesaw || swapab) c.page_size = pick(rng, {64, 128});
    c.batch = 1 + rng() % 6;
    c.q_len = pick(rng, {1, 1, 2, 3, 4});
    c.causal = rng() % 4 != 0;
    if (swapab) {  // q_len x heads <= 32: both of its row blocks (16, 32)
      c.heads = pick(rng, {1, 3, 8, 12, 16, 20, 32});
      c.q_len = std::max(1, std::min(c.q_len, 32 / c.heads));
    } else if (rng() % 4 == 0) {
      // Many short requests: whole requests, several items to a CTA, so
      // that a CTA's buffers pass from one item to the next many times.
      c.many = true;
      c.batch = 40 + static_cast<int>(rng() % 121);
      c.q_len = pick(rng, {1, 1, 2});
    }
  }
  const std::string schedule = pick<const char*>(rng, {"auto", "auto", "kernel", "inline", "block", "step"});
  const std::string combine = pick<const char*>(rng, {"auto", "auto", "block", "rows", "slices"});
  const std::string programmatic = pick<const char*>(rng, {"auto", "off", "on"});
  const std::string fused = pick<const char*>(rng, {"auto", "auto", "off", "on"});
  c.request = kernel + "," + schedule + "," + combine + "," + programmatic + "," + fused;
  return c;
}

struct Buffers {
  Buf *q_nope, *q_pe, *ckv, *kpe, *block_table, *seq_lens, *kv_scale, *out, *lse;
  Buf *indices, *topk_lens, *sink;
};

// Fills `p` as ffi/decode_args.cc does for the given buffers (host or device
// pointers, per `dev`).
void fill_params(const Case& c, Buffers& b, int num_pages, int max_pages, bool dev, PagedDecodeParams* p) {
  auto ptr = [dev](Buf* x) -> void* { return x == nullptr ? nullptr : dev ? x->dev : x->host.data(); };
  *p = PagedDecodeParams{};
  p->q_type = c.q_type;
  p->batch = c.batch;
  p->q_len = c.q_len;
  p->num_heads = c.heads;
  p->num_pages = num_pages;
  p->page_size = c.page_size;
  p->kv_lora_rank = kDn;
  p->qk_rope_head_dim = kDr;
  p->sm_scale = 1.0f / std::sqrt(192.0f);
  p->q_nope = ptr(b.q_nope);
  if (c.q_packed) {
    p->q_nope_row_stride = kDqk;
    p->q_pe = static_cast<char*>(ptr(b.q_nope)) + kDn * 2;
    p->q_pe_row_stride = kDqk;
  } else {
    p->q_nope_row_stride = kDn;
    p->q_pe = ptr(b.q_pe);
    p->q_pe_row_stride = kDr;
  }
  p->kv_scale = static_cast<const float*>(ptr(b.kv_scale));
  p->out = ptr(b.out);
  p->lse = static_cast<float*>(ptr(b.lse));
  char* ckv = static_cast<char*>(ptr(b.ckv));
  p->ckv = ckv;
  if (c.cache == Case::kDsMla) {
    p->kv_format = KvFormat::kFp8DsMla;
    p->kv_type = ElemType::kFP8E4M3;
    p->ckv_token_stride = p->kpe_token_stride = kDsMlaRowBytes;
    p->kpe = ckv + kDsMlaRopeOffset;
  } else {
    p->kv_type = c.cache == Case::kFp8 ? ElemType::kFP8E4M3 : c.q_type;
    const int eb = elem_bytes(p->kv_type);
    if (c.kv_packed) {
      p->ckv_token_stride = p->kpe_token_stride = kDqk;
      p->kpe = ckv + kDn * eb;
    } else {
      p->ckv_token_stride = kDn;
      p->kpe_token_stride = kDr;
      p->kpe = ptr(b.kpe);
    }
  }
  p->ckv_page_stride = int64_t{c.page_size} * p->ckv_token_stride;
  p->kpe_page_stride = int64_t{c.page_size} * p->kpe_token_stride;
  if (c.sparse) {
    p->causal = false;
    p->indices = static_cast<const int32_t*>(ptr(b.indices));
    p->topk_lens = static_cast<const int32_t*>(ptr(b.topk_lens));
    p->topk = c.topk;
    p->attn_sink = c.sink ? static_cast<const float*>(ptr(b.sink)) : nullptr;
  } else {
    p->causal = c.causal;
    p->block_table = static_cast<const int32_t*>(ptr(b.block_table));
    p->seq_lens = static_cast<const int32_t*>(ptr(b.seq_lens));
    p->max_pages_per_seq = max_pages;
  }
}

// Writes random finite values into cache slot `slot` (every other slot keeps
// its NaN poison).
void fill_slot(const Case& c, ElemType kv_type, Buf& ckv, Buf* kpe, int64_t slot, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  if (c.cache == Case::kDsMla) {
    uint8_t* row = ckv.h<uint8_t>() + slot * kDsMlaRowBytes;
    for (int i = 0; i < kDn; ++i) row[i] = random_e4m3(rng);
    for (int g = 0; g < 4; ++g) {
      const float s = std::ldexp(1.0f + 0.5f * (rng() % 100) / 100.0f, -9 - static_cast<int>(rng() % 4));
      std::memcpy(row + kDsMlaScaleOffset + 4 * g, &s, 4);
    }
    uint16_t* rope = reinterpret_cast<uint16_t*>(row + kDsMlaRopeOffset);
    for (int i = 0; i < kDr; ++i) rope[i] = float_to_bf16(normal(rng));
    return;
  }
  const int64_t ckv_stride = c.kv_packed ? kDqk : kDn;
  if (kv_type == ElemType::kFP8E4M3) {
    uint8_t* row = ckv.h<uint8_t>() + slot * ckv_stride;
    uint8_t* rope = c.kv_packed ? row + kDn : kpe->h<uint8_t>() + slot * kDr;
    for (int i = 0; i < kDn; ++i) row[i] = random_e4m3(rng);
    for (int i = 0; i < kDr; ++i) rope[i] = random_e4m3(rng);
  } else {
    uint16_t* row = ckv.h<uint16_t>() + slot * ckv_stride;
    uint16_t* rope = c.kv_packed ? row + kDn : kpe->h<uint16_t>() + slot * kDr;
    for (int i = 0; i < kDn; ++i) row[i] = to_16(normal(rng), kv_type);
    for (int i = 0; i < kDr; ++i) rope[i] = to_16(normal(rng), kv_type);
  }
}

void poison_cache(const Case& c, ElemType kv_type, Buf& ckv, Buf* kpe) {
  if (c.cache == Case::kDsMla) {
    const int64_t rows = static_cast<int64_t>(ckv.host.size()) / kDsMlaRowBytes;
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* row = ckv.h<uint8_t>() + r * kDsMlaRowBytes;
      std::memset(row, kE4m3NaN, kDn);
      const float nan = NAN;
      for (int g = 0; g < 4; ++g) std::memcpy(row + kDsMlaScaleOffset + 4 * g, &nan, 4);
      uint16_t* rope = reinterpret_cast<uint16_t*>(row + kDsMlaRopeOffset);
      for (int i = 0; i < kDr; ++i) rope[i] = kBf16NaN;
    }
  } else if (kv_type == ElemType::kFP8E4M3) {
    std::fill(ckv.host.begin(), ckv.host.end(), kE4m3NaN);
    if (kpe) std::fill(kpe->host.begin(), kpe->host.end(), kE4m3NaN);
  } else {
    std::fill_n(ckv.h<uint16_t>(), ckv.host.size() / 2, nan_16(kv_type));
    if (kpe) std::fill_n(kpe->h<uint16_t>(), kpe->host.size() / 2, nan_16(kv_type));
  }
}

struct Outcome {
  bool ok = true;
  std::string config;  // the configuration that ran
  std::string what;
};

Outcome run_case(const Case& c, std::mt19937_64& rng, const DeviceInfo& dev) {
  Outcome res;
  std::normal_distribution<float> normal;
  const ElemType kv_type = c.cache == Case::kNative ? c.q_type : ElemType::kFP8E4M3;
  const int rows_total = c.batch * c.q_len * c.heads;

  // Cache geometry and metadata.
  std::vector<int32_t> seq_lens, table, indices, topk_lens;
  int num_pages = 0, max_pages = 0;
  std::vector<int64_t> live;  // slots a valid request reads
  if (!c.sparse) {
    std::vector<int> lens(c.batch);
    for (int b = 0; b < c.batch; ++b) {
      const int kind = static_cast<int>(rng() % 10);
      lens[b] = kind == 0 ? 0 : kind == 1 ? c.q_len : static_cast<int>(rng() % (c.many ? 300 : 700));
      if (c.causal && lens[b] > 0 && lens[b] < c.q_len) lens[b] = c.q_len;
    }
    int longest = *std::max_element(lens.begin(), lens.end());
    max_pages = (longest + c.page_size - 1) / c.page_size + static_cast<int>(rng() % 3);
    int used = 0;
    for (int b = 0; b < c.batch; ++b) used += (lens[b] + c.page_size - 1) / c.page_size;
    num_pages = used + 1 + static_cast<int>(rng() % 4);
    std::vector<int32_t> perm(num_pages);
    for (int i = 0; i < num_pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(static_cast<size_t>(c.batch) * max_pages, 0);
    int next = 0;
    for (int b = 0; b < c.batch; ++b) {
      const int pages = (lens[b] + c.page_size - 1) / c.page_size;
      for (int j = 0; j < max_pages; ++j) {
        // Entries past the live pages are garbage the kernels must not read.
        table[static_cast<size_t>(b) * max_pages + j] =
            j < pages ? perm[next++] : pick<int32_t>(rng, {-1, num_pages, 1 << 30, -(1 << 30), 0});
      }
    }
    seq_lens.assign(lens.begin(), lens.end());
    // Invalid requests (NaN output): a length past the table or negative, or
    // a live page id outside [0, num_pages).
    for (int b = 0; b < c.batch; ++b) {
      const int kind = static_cast<int>(rng() % 12);
      const int pages = (lens[b] + c.page_size - 1) / c.page_size;
      if (kind == 0) seq_lens[b] = -1 - static_cast<int>(rng() % 5);
      else if (kind == 1) seq_lens[b] = max_pages * c.page_size + 1 + static_cast<int>(rng() % 100);
      else if (kind == 2 && pages > 0)
        table[static_cast<size_t>(b) * max_pages + rng() % pages] = pick<int32_t>(rng, {-2, num_pages, 1 << 29});
    }
    for (int b = 0; b < c.batch; ++b) {
      if (seq_lens[b] <= 0 || seq_lens[b] > max_pages * c.page_size) continue;
      bool ok = true;
      const int pages = (seq_lens[b] + c.page_size - 1) / c.page_size;
      for (int j = 0; j < pages; ++j) {
        const int32_t pg = table[static_cast<size_t>(b) * max_pages + j];
        ok = ok && pg >= 0 && pg < num_pages;
      }
      if (!ok) continue;
      for (int t = 0; t < seq_lens[b]; ++t)
        live.push_back(int64_t{table[static_cast<size_t>(b) * max_pages + t / c.page_size]} * c.page_size +
                       t % c.page_size);
    }
  } else {
    num_pages = 1 + static_cast<int>(rng() % 6);
    const int64_t slots = int64_t{num_pages} * c.page_size;
    indices.resize(static_cast<size_t>(c.batch) * c.q_len * c.topk);
    topk_lens.resize(c.batch);
    for (int b = 0; b < c.batch; ++b) {
      const int kind = static_cast<int>(rng() % 6);
      topk_lens[b] = kind == 0 ? 0 : kind == 1 ? -3 : kind == 2 ? c.topk + 5 : static_cast<int>(rng() % (c.topk + 1));
    }
    for (int b = 0; b < c.batch; ++b) {
      const int n = std::min(std::max(topk_lens[b], 0), c.topk);
      const bool all_pad = rng() % 8 == 0;
      for (int i = 0; i < c.q_len; ++i) {
        for (int t = 0; t < c.topk; ++t) {
          int32_t v;
          const int kind = static_cast<int>(rng() % 10);
          if (all_pad || kind == 0) v = -1;
          else if (kind == 1) v = static_cast<int32_t>(slots + rng() % 1000);  // past the cache
          else if (kind == 2) v = -2 - static_cast<int32_t>(rng() % 1000);
          else v = static_cast<int32_t>(rng() % slots);
          // Past the top-k length: garbage, never read (may be anything).
          if (t >= n && rng() % 2) v = pick<int32_t>(rng, {1 << 30, -(1 << 30), static_cast<int32_t>(slots)});
          indices[(static_cast<size_t>(b) * c.q_len + i) * c.topk + t] = v;
          if (t < n && v >= 0 && v < slots) live.push_back(v);
        }
      }
    }
  }
  const int64_t slots = int64_t{num_pages} * c.page_size;

  // Buffers, one allocation each.
  const int qb = 2;
  Buf q_nope(static_cast<size_t>(rows_total) * (c.q_packed ? kDqk : kDn) * qb);
  Buf q_pe(c.q_packed ? 0 : static_cast<size_t>(rows_total) * kDr * qb);
  size_t ckv_bytes, kpe_bytes = 0;
  if (c.cache == Case::kDsMla) {
    ckv_bytes = static_cast<size_t>(slots) * kDsMlaRowBytes;
  } else {
    const int eb = elem_bytes(kv_type);
    ckv_bytes = static_cast<size_t>(slots) * (c.kv_packed ? kDqk : kDn) * eb;
    if (!c.kv_packed) kpe_bytes = static_cast<size_t>(slots) * kDr * eb;
  }
  Buf ckv(ckv_bytes), kpe(kpe_bytes);
  Buf block_table(table.size() * 4), seq(seq_lens.size() * 4), idx(indices.size() * 4), tkl(topk_lens.size() * 4);
  Buf kv_scale(4), sink(static_cast<size_t>(c.heads) * 4);
  Buf out(static_cast<size_t>(rows_total) * kDn * qb, 0, g_out_shortfall);
  Buf lse(static_cast<size_t>(rows_total) * 4, 0, g_out_shortfall);

  {
    uint16_t* q = q_nope.h<uint16_t>();
    for (size_t i = 0; i < q_nope.host.size() / 2; ++i) q[i] = to_16(normal(rng), c.q_type);
    uint16_t* qp = q_pe.h<uint16_t>();
    for (size_t i = 0; i < q_pe.host.size() / 2; ++i) qp[i] = to_16(normal(rng), c.q_type);
  }
  poison_cache(c, kv_type, ckv, c.kv_packed || c.cache == Case::kDsMla ? nullptr : &kpe);
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());
  for (const int64_t s : live) fill_slot(c, kv_type, ckv, &kpe, s, rng);
  std::memcpy(block_table.host.data(), table.data(), block_table.host.size());
  std::memcpy(seq.host.data(), seq_lens.data(), seq.host.size());
  std::memcpy(idx.host.data(), indices.data(), idx.host.size());
  std::memcpy(tkl.host.data(), topk_lens.data(), tkl.host.size());
  *kv_scale.h<float>() = c.cache == Case::kFp8 ? 0.0125f * (1 + rng() % 4) : 1.0f;
  for (int h = 0; h < c.heads; ++h) sink.h<float>()[h] = normal(rng);
  // Finite sentinels, different from the reference's: a row the kernels do
  // not write cannot pass for a NaN (invalid) row or for a computed one.
  std::fill(out.host.begin(), out.host.end(), 0x5a);
  std::fill_n(lse.h<float>(), rows_total, 7777.f);
  for (Buf* x : {&q_nope, &q_pe, &ckv, &kpe, &block_table, &seq, &idx, &tkl, &kv_scale, &sink, &out, &lse}) x->upload();

  Buffers bufs{&q_nope, c.q_packed ? nullptr : &q_pe, &ckv, &kpe, &block_table, &seq, &kv_scale, &out, &lse,
               &idx, &tkl, &sink};
  PagedDecodeParams dp, hp;
  fill_params(c, bufs, num_pages, max_pages, true, &dp);
  fill_params(c, bufs, num_pages, max_pages, false, &hp);

  // Kernel configuration as the handler resolves it, the workspace sized as
  // mla_jax/kernels.py sizes it (workspace_parts). A schedule or combine
  // request the call cannot serve (the Python tests check those errors)
  // keeps its kernel with the other fields auto, and the case says so; a
  // kernel that cannot serve the drawn case fails it.
  const DecodeOp op = c.sparse ? DecodeOp::kSparse : DecodeOp::kPaged;
  const int64_t rows = c.sparse ? c.heads : int64_t{c.heads} * c.q_len;
  const int workspace_parts = std::max<int>(1, dev.sm_count / static_cast<int>((rows + 63) / 64));
  DecodeFacts facts = call_facts(op, dp, dev.arch, dev.sm_count, build_has_sm90a(), workspace_parts);
  // The call carries the schedule operand, as the JAX ops' CUDA calls do.
  facts.schedule_operand = true;
  KernelConfig request;
  std::string why;
  if (!parse_config(c.request, &request, &why)) {
    res.ok = false;
    res.what = "bad request " + c.request + ": " + why;
    return res;
  }
  Selection sel = select_kernel(facts, request);
  std::string fallback;
  if (!sel.error.empty()) {
    fallback = " (schedule/combine request not served: " + sel.error + ")";
    KernelConfig kernel_only;
    kernel_only.kernel = request.kernel;
    sel = select_kernel(facts, kernel_only);
  }
  if (!sel.error.empty() || !sel.config.resolved()) {
    res.ok = false;
    res.what = "the requested kernel cannot serve the drawn case: " + sel.error;
    return res;
  }
  res.config = format_config(sel.config);
  const WorkspaceLayout layout = workspace_layout(facts.requests(), facts.rows(), kDn, workspace_parts);
  Buf workspace(static_cast<size_t>(layout.total), 0xff);
  workspace.upload();
  DecodeWorkspace ws = carve_workspace(static_cast<char*>(workspace.dev), layout);
  const int parts = num_partitions(dev.sm_count, facts.rows(), workspace_parts);
  // Schedule "step": the schedule in a buffer of its own, written first, as
  // the op's schedule call writes it.
  Buf schedule(static_cast<size_t>(schedule_bytes(layout)), 0xff);
  if (sel.config.schedule == ScheduleMode::kStep) {
    schedule.upload();
    carve_schedule(static_cast<char*>(schedule.dev), layout, &ws);
    CUDA_OK(c.sparse ? run_sparse_decode_schedule(dp, ws, parts, nullptr)
                     : run_decode_schedule(dp, ws, parts, c.max_num_splits, nullptr));
  }
  cudaError_t err = c.sparse ? run_sparse_decode(dp, ws, sel.config, parts, nullptr)
                             : run_paged_decode(dp, ws, sel.config, parts, c.max_num_splits, nullptr);
  CUDA_OK(err);
  CUDA_OK(cudaDeviceSynchronize());
  out.download();
  lse.download();

  // The CPU kernel on the same bytes.
  std::vector<uint8_t> ref_out(out.host.size(), 0x3c);
  std::vector<float> ref_lse(rows_total, -7777.f);
  hp.out = ref_out.data();
  hp.lse = ref_lse.data();
  const ParallelFor serial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) { body(0, n); };
  if (c.sparse) sparse_decode_cpu(hp, serial);
  else paged_decode_cpu(hp, serial);

  const uint16_t* got = out.h<uint16_t>();
  const uint16_t* want = reinterpret_cast<const uint16_t*>(ref_out.data());
  double worst = 0, worst_lse = 0;
  for (int r = 0; r < rows_total && res.ok; ++r) {
    const float lg = lse.h<float>()[r], lw = ref_lse[r];
    if (std::isnan(lw) != std::isnan(lg) || (std::isinf(lw) && lg != lw)) {
      res.ok = false;
      res.what = "row " + std::to_string(r) + ": lse " + std::to_string(lg) + ", reference " + std::to_string(lw);
      break;
    }
    if (std::isfinite(lw)) worst_lse = std::max(worst_lse, static_cast<double>(std::fabs(lg - lw)));
    double scale = 0;
    for (int d = 0; d < kDn; ++d) {
      const float w = from_16(want[static_cast<size_t>(r) * kDn + d], c.q_type);
      if (std::isfinite(w)) scale = std::max(scale, static_cast<double>(std::fabs(w)));
    }
    for (int d = 0; d < kDn; ++d) {
      const float g = from_16(got[static_cast<size_t>(r) * kDn + d], c.q_type);
      const float w = from_16(want[static_cast<size_t>(r) * kDn + d], c.q_type);
      if (std::isnan(w) != std::isnan(g)) {
        res.ok = false;
        res.what = "row " + std::to_string(r) + " col " + std::to_string(d) + ": " + std::to_string(g) +
                   ", reference " + std::to_string(w);
        break;
      }
      if (!std::isnan(w)) worst = std::max(worst, std::fabs(static_cast<double>(g) - w) / std::max(scale, 1e-6));
    }
  }
  const double ulp = c.q_type == ElemType::kBF16 ? 0x1p-7 : 0x1p-10;  // relative, at most
  if (res.ok && (worst > 1e-2 + ulp || worst_lse > 1e-2)) {
    res.ok = false;
    res.what = "error " + std::to_string(worst) + ", lse error " + std::to_string(worst_lse);
  }
  if (res.ok) res.what = "error " + std::to_string(worst) + ", lse error " + std::to_string(worst_lse) + fallback;
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  // sm90_swapab last: a cycle without it takes the ones before.
  static const char* const kKernels[] = {"auto", "portable", "sm90_lockstep", "sm90_seesaw", "sm90_swapab"};
  auto usage = [&] {
    std::fprintf(stderr,
                 "usage: %s [N_CASES [SEED [--short-out] [--kernel NAME] [--sparse-heads H]]]\n"
                 "  N_CASES > 0, SEED an unsigned integer; NAME one of auto, portable, sm90_lockstep, "
                 "sm90_seesaw, sm90_swapab; H in 1..128 (at most 32 with sm90_swapab)\n",
                 argv[0]);
    return 2;
  };
  // Positional numbers, whole arguments only: a flag in their place is a
  // usage error, not zero cases.
  char* end = nullptr;
  const long n_arg = argc > 1 ? std::strtol(argv[1], &end, 10) : 40;
  if (argc > 1 && (*end != '\0' || n_arg <= 0 || n_arg > 1000000)) return usage();
  const int n = static_cast<int>(n_arg);
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], &end, 10) : 20261202;
  if (argc > 2 && (*end != '\0' || argv[2][0] == '-')) return usage();
  const char* only = nullptr;
  for (int a = 3; a < argc; ++a) {
    if (std::strcmp(argv[a], "--short-out") == 0) {
      g_out_shortfall = 2;
    } else if (std::strcmp(argv[a], "--kernel") == 0 && a + 1 < argc &&
               std::any_of(std::begin(kKernels), std::end(kKernels),
                           [&](const char* k) { return std::strcmp(k, argv[a + 1]) == 0; })) {
      only = argv[++a];
    } else if (std::strcmp(argv[a], "--sparse-heads") == 0 && a + 1 < argc) {
      const long h = std::strtol(argv[++a], &end, 10);
      if (*end != '\0' || h < 1 || h > 128) return usage();
      g_sparse_heads = static_cast<int>(h);
    } else {
      return usage();
    }
  }
  // Sparse cases with more heads than the swap-AB kernel serves: it is not
  // asked for them.
  const bool swapab_out = g_sparse_heads > kSwapAbSparseMaxRows;
  if (swapab_out && only != nullptr && std::strcmp(only, "sm90_swapab") == 0) return usage();
  const size_t cycle = std::size(kKernels) - (swapab_out ? 1 : 0);
  const DeviceInfo dev = device_info(0);
  CUDA_OK(dev.status);
  std::printf("device arch %d, %d SMs, sm_90a code %s; %d cases from seed %llu\n", dev.arch, dev.sm_count,
              build_has_sm90a() ? "yes" : "no", n, static_cast<unsigned long long>(seed));
  int failed = 0;
  std::map<std::string, int> ran;  // configurations that ran, with their counts
  for (int i = 0; i < n; ++i) {
    std::mt19937_64 rng(seed + static_cast<uint64_t>(i));
    const Case c = draw_case(rng, only != nullptr ? only : kKernels[i % cycle]);
    const Outcome o = run_case(c, rng, dev);
    std::printf("%s case %d: %s -> %s: %s\n", o.ok ? "ok  " : "FAIL", i, describe(c).c_str(), o.config.c_str(),
                o.what.c_str());
    std::fflush(stdout);
    failed += !o.ok;
    ++ran[(c.sparse ? "sparse " : "paged ") + o.config];
  }
  for (const auto& [config, count] : ran) std::printf("  %3d x %s\n", count, config.c_str());
  std::printf("%d of %d cases matched the CPU kernel\n", n - failed, n);
  return failed ? 1 : 0;
}
