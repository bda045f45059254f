// Times mla_jax's CUDA decode path without XLA, the way serving stacks time
// FlashMLA: n calls captured in one CUDA graph, replayed, per call = the
// slope between two n (CUDA events). Beside it, the host time of what the
// FFI handler does per call (ffi/cuda_handlers.cc prepare(): parse the two
// kernel configuration attributes, call_facts, select_kernel, workspace
// layout; then the launches, which encode the cache's TMA descriptors), so
// that a JAX-level figure (bench_paged_decode.py) can be set beside the
// kernels' own time. The replica leaves out the handler's cheaper steps
// (buffer checks, the device lookup), so its host figure is a slight
// underestimate.
//
//   mla_jax_decode_timing [--rows "B,Q,H,SEQ[,v|,@FILE];..."] [--request CONFIG] [--splits N]
//                         [--fp8] [--normal-data] [--own-outputs] [--no-schedule-operand] [--l2-mb M]
//                         [--reps N] [--json PATH]
//
// --request: the plan's kernel configuration ("kernel,schedule,combine,
// programmatic,fused" as mla_jax.KernelChoice names them; default all auto),
// resolved by select_kernel as a trace would; --splits: max_num_splits
// (default 0, the scheduler's choice). The calls carry a schedule operand
// as mla_jax.paged_decode's do, so above 32 requests auto picks schedule
// "step": the schedule is computed once before the timed calls, as XLA runs
// one schedule call for every decode call of a program over the same metadata;
// --no-schedule-operand leaves it out (the decode schedules itself, as a
// call without the op's schedule call would). --normal-data fills the query and
// cache from std::normal_distribution instead of the faster sum of four
// uniforms; --own-outputs gives every call its own output, LSE and
// workspace (as XLA does) instead of one set the calls share; --fp8 stores
// the cache as float8_e4m3fn with kv_scale kFp8Scale (each value the e4m3
// code nearest to value / kFp8Scale, as bench_fp8_decode.py quantises but
// for how ties round), the query staying bf16; bytes then count one per
// cached value.
// Rows default to bench_paged_decode.py's ROWS (bf16, page 64, values with
// mean 0 and variance 1, pages a random permutation of the pool plus 3
// spare pages, sm_scale 1/sqrt(192), causal for Q > 1). A row ending in
// ",v" draws N(SEQ, SEQ/2) lengths clipped to [Q, 2 SEQ] from this
// program's own generator (not the Python script's lengths); ",@FILE" reads
// the B lengths from FILE (whitespace-separated), as the Python script
// passes them. Every call reads its own query copy and cache copy i % R
// (R copies over 2x an L2 of --l2-mb MB, default 60). Before a last replay
// the outputs are poisoned (NaN); then request 0 of the last call is
// checked against the CPU kernel (csrc/cpu) on the same bytes: relative
// error (Frobenius norm over the request's output) <= 1e-2, |d lse| <= 1e-2,
// no NaN. Exit status 0 when every row passes its check, 1 when one fails,
// 2 on a usage error, a row no kernel serves, or a CUDA error.
// Built with the phase probe (CMake MLA_JAX_PHASE_PROBE), it also prints,
// after each row's last replay, the per-CTA phase records of the last
// launches (PHASE lines; benchmarks/README.md, docs/kernels.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "csrc/common/elem_convert.h"
#include "csrc/common/mla_params.h"
#include "csrc/common/phase_registry.h"
#include "csrc/common/workspace.h"
#include "csrc/cpu/paged_decode_cpu.h"
#include "csrc/dispatch/decode.h"
#include "csrc/dispatch/select.h"
#include "csrc/sm90/kv_tma.h"
#include "tests/native/cuda_ok.h"

namespace {

using namespace mla_jax;

constexpr int kDn = 512, kDr = 64, kDqk = kDn + kDr, kPage = 64;
constexpr float kFp8Scale = 0.05f;

// The finite e4m3 code nearest to v (ties to the lower magnitude; beyond
// the largest, the largest).
uint8_t nearest_e4m3(float v) {
  static const std::vector<float> mags = [] {
    std::vector<float> m(127);  // codes 0x00-0x7e: increasing magnitudes
    for (int c = 0; c < 127; ++c) m[c] = fp8e4m3_to_float(static_cast<uint8_t>(c));
    return m;
  }();
  const float a = std::fabs(v);
  const auto it = std::lower_bound(mags.begin(), mags.end(), a);
  int c = static_cast<int>(it - mags.begin());
  if (c == 127 || (c > 0 && a - mags[c - 1] <= mags[c] - a)) c -= 1;
  return static_cast<uint8_t>(c | (v < 0 ? 0x80 : 0));
}

struct Row {
  int b, q, h, seq;
  bool varlen;
  std::vector<int32_t> lens;  // from ",@FILE": the B lengths
  std::string name() const {
    return "b" + std::to_string(b) + "q" + std::to_string(q) + "h" + std::to_string(h) + "s" + std::to_string(seq) +
           (varlen ? "v" : "");
  }
};

const std::vector<Row> kDefaultRows = {
    {128, 1, 128, 4096, false}, {128, 1, 128, 8192, false}, {128, 2, 128, 4096, false}, {128, 1, 64, 8192, false},
    {128, 1, 16, 4096, false},  {128, 1, 16, 8192, false},  {128, 1, 16, 32768, false}, {64, 1, 16, 8192, false},
    {1, 1, 128, 4096, false},   {32, 1, 128, 4096, false},  {16, 1, 128, 32768, false}, {128, 1, 128, 4096, true},
    {1, 1, 12, 76800, false},   {8, 1, 12, 42000, false},   {8, 1, 96, 42000, false},   {8, 2, 12, 42000, false},
    {8, 4, 12, 42000, false},   {128, 1, 128, 1024, false}, {128, 8, 16, 4096, false},
};

std::vector<Row> parse_rows(const std::string& spec) {
  std::vector<Row> rows;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(';', pos);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(pos, end - pos);
    Row r{};
    int consumed = 0;
    const int n = std::sscanf(item.c_str(), "%d,%d,%d,%d%n", &r.b, &r.q, &r.h, &r.seq, &consumed);
    const std::string rest = n == 4 ? item.substr(consumed) : "";
    if (n < 4 || r.b < 1 || r.q < 1 || r.h < 1 || r.seq < 1 ||
        !(rest.empty() || rest == ",v" || rest.rfind(",@", 0) == 0)) {
      std::fprintf(stderr, "bad row '%s' (want B,Q,H,SEQ[,v|,@FILE])\n", item.c_str());
      std::exit(2);
    }
    r.varlen = !rest.empty();
    if (rest.rfind(",@", 0) == 0) {
      FILE* f = std::fopen(rest.c_str() + 2, "r");
      int v = 0;
      while (f && std::fscanf(f, "%d", &v) == 1) r.lens.push_back(v);
      if (f) std::fclose(f);
      if (static_cast<int>(r.lens.size()) != r.b ||
          std::any_of(r.lens.begin(), r.lens.end(), [&](int x) { return x < r.q; })) {
        std::fprintf(stderr, "row '%s': the file must hold %d lengths >= %d\n", item.c_str(), r.b, r.q);
        std::exit(2);
      }
    }
    rows.push_back(r);
    pos = end + 1;
  }
  return rows;
}

// Cheap normal-ish bf16 values (sum of four uniforms, variance 1): the
// caches reach gigabytes, which std::normal_distribution fills slowly.
struct FastRandom {
  uint64_t s;
  explicit FastRandom(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<uint32_t>(s >> 16);
  }
  float normal() {
    float acc = 0;
    for (int i = 0; i < 4; ++i) acc += static_cast<float>(next() & 0xffff) * (1.0f / 65536.0f);
    return (acc - 2.0f) * 1.7320508f;
  }
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? NAN : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  Dev(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
};

// What the FFI handler does on the host before the launches
// (ffi/cuda_handlers.cc prepare()), with its inputs.
struct HostPath {
  std::string request_attr, config_attr;
  int arch, sm_count, workspace_parts;
  bool schedule_operand;
};

struct Prepared {
  KernelConfig config;
  DecodeWorkspace ws;
  int parts = 1;
  bool ok = false;
  std::string error;
};

Prepared prepare(const HostPath& h, const PagedDecodeParams& p, char* workspace) {
  Prepared out;
  KernelConfig request, chosen;
  std::string why;
  if (!parse_config(h.request_attr, &request, &why) || !parse_config(h.config_attr, &chosen, &why)) {
    out.error = why;
    return out;
  }
  DecodeFacts f = call_facts(DecodeOp::kPaged, p, h.arch, h.sm_count, build_has_sm90a(), h.workspace_parts);
  f.schedule_operand = h.schedule_operand;
  Selection sel = select_kernel(f, chosen);
  if (!sel.error.empty()) sel = select_kernel(f, request);
  if (!sel.error.empty() || !sel.config.resolved()) {
    out.error = sel.error.empty() ? "unresolved" : sel.error;
    return out;
  }
  out.config = sel.config;
  const WorkspaceLayout layout = workspace_layout(f.requests(), f.rows(), p.kv_lora_rank, h.workspace_parts);
  out.ws = carve_workspace(workspace, layout);
  out.parts = num_partitions(h.sm_count, f.rows(), h.workspace_parts);
  out.ok = true;
  return out;
}

struct Result {
  std::string json;
  bool ok = true;
};

struct Options {
  KernelConfig request;
  int max_num_splits = 0;
  int reps = 10;
  bool normal_data = false;  // std::normal_distribution values (slower to fill)
  bool fp8 = false;          // float8_e4m3fn cache with kv_scale kFp8Scale
  bool own_outputs = false;  // every call its own output, LSE and workspace, as XLA gives them
  // The calls carry a schedule operand, as mla_jax.paged_decode's CUDA calls
  // do: schedule "step" is possible (auto picks it above 32 requests).
  bool schedule_operand = true;
  double l2_bytes = 60e6;    // the rotation of cache copies covers twice this
};

Result run_row(const Row& row, int index, const Options& opt, const DeviceInfo& dev, cudaStream_t stream) {
  const int reps = opt.reps;
  std::mt19937_64 rng(1000 + index);
  FastRandom fr(7 + index);
  // Lengths, pages.
  std::vector<int32_t> seq(row.b, row.seq);
  if (!row.lens.empty()) {
    seq = row.lens;
  } else if (row.varlen) {
    std::normal_distribution<double> nd(row.seq, row.seq / 2.0);
    for (auto& s : seq) s = static_cast<int32_t>(std::clamp(nd(rng), double(row.q), 2.0 * row.seq));
  }
  int64_t sum_seq = 0;
  int max_pages = 1, used = 0;
  for (int s : seq) {
    sum_seq += s;
    max_pages = std::max(max_pages, (s + kPage - 1) / kPage);
    used += (s + kPage - 1) / kPage;
  }
  const int num_pages = used + 3;
  std::vector<int32_t> perm(num_pages), table(static_cast<size_t>(row.b) * max_pages, -1);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int b = 0, k = 0; b < row.b; ++b)
    for (int j = 0; j < (seq[b] + kPage - 1) / kPage; ++j) table[static_cast<size_t>(b) * max_pages + j] = perm[k++];

  const double flops = 2.0 * row.q * double(sum_seq) * row.h * (kDqk + kDn);
  const int kv_bytes = opt.fp8 ? 1 : 2;
  const double bytes = double(sum_seq) * kDqk * kv_bytes + double(row.b) * row.q * row.h * (kDqk + kDn) * 2;
  const double floor_us = std::max(bytes / 4.3e12, flops / 790e12) * 1e6;
  const int n_hi = std::clamp(static_cast<int>(std::lround(10000.0 / std::max(1.5 * floor_us, 1e-3))), 8, 128);
  const int n_lo = n_hi / 2;

  const int64_t rows_total = int64_t{row.b} * row.q * row.h;
  const size_t q_bytes = static_cast<size_t>(rows_total) * kDqk * 2;
  const size_t cache_bytes = static_cast<size_t>(num_pages) * kPage * kDqk * kv_bytes;
  const int copies = static_cast<int>(std::clamp(std::ceil(2 * opt.l2_bytes / double(cache_bytes)), 1.0, 64.0));

  // Host data, device copies.
  std::vector<uint16_t> hq(q_bytes / 2);
  std::vector<uint8_t> hcache(cache_bytes);  // bf16 (two bytes a value) or e4m3 codes
  std::normal_distribution<float> nd;
  auto draw = [&] { return opt.normal_data ? nd(rng) : fr.normal(); };
  for (auto& x : hq) x = float_to_bf16(draw());
  if (opt.fp8) {
    for (auto& x : hcache) x = nearest_e4m3(draw() / kFp8Scale);
  } else {
    for (size_t i = 0; i < cache_bytes; i += 2) {
      const uint16_t v = float_to_bf16(draw());
      std::memcpy(&hcache[i], &v, 2);
    }
  }
  std::vector<Dev*> qs, caches;
  for (int i = 0; i < n_hi; ++i) {
    qs.push_back(new Dev(q_bytes));
    CUDA_OK(cudaMemcpy(qs.back()->p, hq.data(), q_bytes, cudaMemcpyHostToDevice));
  }
  for (int i = 0; i < copies; ++i) {
    caches.push_back(new Dev(cache_bytes));
    CUDA_OK(cudaMemcpy(caches.back()->p, hcache.data(), cache_bytes, cudaMemcpyHostToDevice));
  }
  Dev d_table(table.size() * 4), d_seq(seq.size() * 4), d_scale(4);
  const int n_out = opt.own_outputs ? n_hi : 1;
  std::vector<Dev*> outs, lses;
  for (int i = 0; i < n_out; ++i) {
    outs.push_back(new Dev(static_cast<size_t>(rows_total) * kDn * 2));
    lses.push_back(new Dev(static_cast<size_t>(rows_total) * 4));
  }
  Dev& d_out = *outs[n_out - 1];
  Dev& d_lse = *lses[n_out - 1];
  const float kv_scale = opt.fp8 ? kFp8Scale : 1.0f;
  CUDA_OK(cudaMemcpy(d_table.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_seq.p, seq.data(), seq.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_scale.p, &kv_scale, 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(d_out.p, 0xff, static_cast<size_t>(rows_total) * kDn * 2));  // bf16 NaN
  CUDA_OK(cudaMemset(d_lse.p, 0xff, static_cast<size_t>(rows_total) * 4));
  // The copies ran on the legacy stream; the timed stream does not wait for it.
  CUDA_OK(cudaDeviceSynchronize());

  auto params_for = [&](int i) {
    PagedDecodeParams p{};
    p.q_type = ElemType::kBF16;
    p.kv_type = opt.fp8 ? ElemType::kFP8E4M3 : ElemType::kBF16;
    p.batch = row.b;
    p.q_len = row.q;
    p.num_heads = row.h;
    p.num_pages = num_pages;
    p.page_size = kPage;
    p.kv_lora_rank = kDn;
    p.qk_rope_head_dim = kDr;
    p.sm_scale = 1.0f / std::sqrt(192.0f);
    p.causal = row.q > 1;
    p.q_nope = qs[i]->p;
    p.q_pe = static_cast<char*>(qs[i]->p) + kDn * 2;
    p.q_nope_row_stride = p.q_pe_row_stride = kDqk;
    char* ckv = static_cast<char*>(caches[i % copies]->p);
    p.ckv = ckv;
    p.kpe = ckv + kDn * kv_bytes;
    p.ckv_token_stride = p.kpe_token_stride = kDqk;
    p.ckv_page_stride = p.kpe_page_stride = int64_t{kPage} * kDqk;
    p.kv_scale = static_cast<const float*>(d_scale.p);
    p.out = outs[i % n_out]->p;
    p.lse = static_cast<float*>(lses[i % n_out]->p);
    p.block_table = static_cast<const int32_t*>(d_table.p);
    p.seq_lens = static_cast<const int32_t*>(d_seq.p);
    p.max_pages_per_seq = max_pages;
    return p;
  };
  std::vector<PagedDecodeParams> params;
  for (int i = 0; i < n_hi; ++i) params.push_back(params_for(i));

  // The attributes a JAX call would carry: the configuration select_kernel
  // picks with the device known, and the plan's request (all auto).
  const int64_t rows = int64_t{row.q} * row.h;
  const int workspace_parts = std::max<int>(1, dev.sm_count / static_cast<int>((rows + 63) / 64));
  DecodeFacts facts = call_facts(DecodeOp::kPaged, params[0], dev.arch, dev.sm_count, build_has_sm90a(),
                                 workspace_parts);
  facts.schedule_operand = opt.schedule_operand;
  const Selection chosen = select_kernel(facts, opt.request);
  if (!chosen.error.empty()) {
    std::fprintf(stderr, "%s: no kernel: %s\n", row.name().c_str(), chosen.error.c_str());
    std::exit(2);
  }
  const HostPath host{format_config(opt.request), format_config(chosen.config), dev.arch, dev.sm_count,
                      workspace_parts, opt.schedule_operand};
  const WorkspaceLayout layout = workspace_layout(facts.requests(), facts.rows(), kDn, workspace_parts);
  std::vector<Dev*> wss;
  for (int i = 0; i < n_out; ++i) wss.push_back(new Dev(static_cast<size_t>(layout.total)));
  auto ws_of = [&](int i) { return static_cast<char*>(wss[i % n_out]->p); };

  auto dispatch = [&](int i) {
    const Prepared pr = prepare(host, params[i], ws_of(i));
    if (!pr.ok) {
      std::fprintf(stderr, "%s: prepare failed: %s\n", row.name().c_str(), pr.error.c_str());
      std::exit(2);
    }
    CUDA_OK(run_paged_decode(params[i], pr.ws, pr.config, pr.parts, opt.max_num_splits, stream));
  };
  // Schedule "step": the schedule is computed once, before every timed call,
  // as XLA runs one schedule call for all the decode calls of a program over
  // the same metadata; each workspace holds it at the offset the op's
  // schedule buffer maps to (carve_schedule at layout.items).
  if (chosen.config.schedule == ScheduleMode::kStep) {
    for (int i = 0; i < n_out; ++i) {
      const Prepared pr = prepare(host, params[i], ws_of(i));
      if (!pr.ok) std::exit(2);
      CUDA_OK(run_decode_schedule(params[i], pr.ws, pr.parts, opt.max_num_splits, stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
  }

  // Host costs, per call. The handler's preparation and the TMA encoding
  // alone (no GPU work), then whole dispatches enqueued behind a busy GPU.
  constexpr int kHostIters = 2000;
  double t0 = now_s();
  for (int k = 0; k < kHostIters; ++k) {
    const Prepared pr = prepare(host, params[k % n_hi], ws_of(k % n_hi));
    if (!pr.ok) std::exit(2);
  }
  const double prepare_us = (now_s() - t0) / kHostIters * 1e6;
  sm90::KvTma tma;
  t0 = now_s();
  for (int k = 0; k < kHostIters; ++k) {
    if (opt.fp8) sm90::make_kv_tma_fp8(params[k % n_hi], &tma);
    else sm90::make_kv_tma(params[k % n_hi], &tma);
  }
  const double tma_us = (now_s() - t0) / kHostIters * 1e6;
  for (int i = 0; i < n_hi; ++i) dispatch(i);  // warm-up (function attributes, modules)
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<double> enqueue;
  for (int r = 0; r < 3; ++r) {
    t0 = now_s();
    for (int i = 0; i < n_hi; ++i) dispatch(i);
    enqueue.push_back((now_s() - t0) / n_hi * 1e6);
    CUDA_OK(cudaStreamSynchronize(stream));
  }

  // Stream launches (no graph), by events: slope between n_lo and n_hi.
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  auto timed = [&](const std::function<void()>& fn) {
    CUDA_OK(cudaEventRecord(e0, stream));
    fn();
    CUDA_OK(cudaEventRecord(e1, stream));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    return double(ms) * 1e-3;
  };
  std::vector<double> stream_slopes;
  for (int r = 0; r < reps; ++r) {
    const double lo = timed([&] { for (int i = 0; i < n_lo; ++i) dispatch(i); });
    const double hi = timed([&] { for (int i = 0; i < n_hi; ++i) dispatch(i); });
    stream_slopes.push_back((hi - lo) / (n_hi - n_lo) * 1e6);
  }

  // CUDA graphs of n_lo and n_hi calls, captured as a serving stack
  // captures them (the handler's host path runs during the capture).
  std::vector<double> capture_us;
  auto capture = [&](int n) {
    cudaGraph_t g;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const double c0 = now_s();
    for (int i = 0; i < n; ++i) dispatch(i);
    capture_us.push_back((now_s() - c0) / n * 1e6);
    CUDA_OK(cudaStreamEndCapture(stream, &g));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
    CUDA_OK(cudaGraphDestroy(g));
    return exec;
  };
  cudaGraphExec_t g_lo = capture(n_lo), g_hi = capture(n_hi);
  CUDA_OK(cudaGraphUpload(g_lo, stream));
  CUDA_OK(cudaGraphUpload(g_hi, stream));
  timed([&] { CUDA_OK(cudaGraphLaunch(g_lo, stream)); });
  timed([&] { CUDA_OK(cudaGraphLaunch(g_hi, stream)); });
  std::vector<double> graph_slopes, graph_per_call;
  for (int r = 0; r < reps; ++r) {
    const double lo = timed([&] { CUDA_OK(cudaGraphLaunch(g_lo, stream)); });
    const double hi = timed([&] { CUDA_OK(cudaGraphLaunch(g_hi, stream)); });
    graph_slopes.push_back((hi - lo) / (n_hi - n_lo) * 1e6);
    graph_per_call.push_back(hi / n_hi * 1e6);
  }
  // One more replay over poisoned outputs: the check sees what the graph wrote.
  CUDA_OK(cudaMemsetAsync(d_out.p, 0xff, static_cast<size_t>(rows_total) * kDn * 2, stream));
  CUDA_OK(cudaMemsetAsync(d_lse.p, 0xff, static_cast<size_t>(rows_total) * 4, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<unsigned> phase_before = phase::snapshot();
  CUDA_OK(cudaGraphLaunch(g_hi, stream));
  CUDA_OK(cudaStreamSynchronize(stream));

  // A build with the phase probe (CMake MLA_JAX_PHASE_PROBE) prints what the
  // probed kernels recorded in the last launches of that replay (a kernel
  // the row does not run prints nothing).
  if (!phase::registry().empty()) {
    std::printf("PHASEROW %s kv %s\n", row.name().c_str(), opt.fp8 ? "e4m3" : "bf16");
    phase::dump_since(phase_before, 4);
    std::fflush(stdout);
  }

  // Check request 0 of the last call against the CPU kernel.
  std::vector<uint16_t> out(static_cast<size_t>(row.q) * row.h * kDn);
  std::vector<float> lse(static_cast<size_t>(row.q) * row.h);
  CUDA_OK(cudaMemcpy(out.data(), d_out.p, out.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(lse.data(), d_lse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
  PagedDecodeParams hp = params[0];
  std::vector<uint16_t> ref_out(out.size());
  std::vector<float> ref_lse(lse.size());
  hp.batch = 1;
  hp.q_nope = hq.data();
  hp.q_pe = hq.data() + kDn;
  hp.ckv = hcache.data();
  hp.kpe = hcache.data() + kDn * kv_bytes;
  hp.kv_scale = &kv_scale;
  hp.block_table = table.data();
  hp.seq_lens = seq.data();
  hp.out = ref_out.data();
  hp.lse = ref_lse.data();
  const ParallelFor serial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) { body(0, n); };
  paged_decode_cpu(hp, serial);
  double diff2 = 0, ref2 = 0, worst_lse = 0;
  bool finite = true;
  for (size_t i = 0; i < out.size(); ++i) {
    const double g = bf16_to_float(out[i]), w = bf16_to_float(ref_out[i]);
    finite = finite && std::isfinite(g);
    diff2 += (g - w) * (g - w);
    ref2 += w * w;
  }
  for (size_t r = 0; r < lse.size(); ++r) {
    finite = finite && std::isfinite(lse[r]);
    worst_lse = std::max(worst_lse, double(std::fabs(lse[r] - ref_lse[r])));
  }
  const double worst = std::sqrt(diff2 / std::max(ref2, 1e-300));
  const bool ok = finite && worst <= 1e-2 && worst_lse <= 1e-2;

  const double graph_us = median(graph_slopes), stream_us = median(stream_slopes);
  char buf[2048];
  std::snprintf(buf, sizeof buf,
                "{\"name\": \"%s\", \"kv\": \"%s\", \"b\": %d, \"q_len\": %d, \"h\": %d, \"seq\": %d, \"varlen\": %s, "
                "\"sum_seq\": %lld, \"kernel_config\": \"%s\", \"max_num_splits\": %d, \"n_lo\": %d, \"n_hi\": %d, \"reps\": %d, "
                "\"cache_copies\": %d, \"graph_us\": %.2f, \"graph_us_per_call_hi\": %.2f, \"stream_us\": %.2f, "
                "\"tflops\": %.1f, \"gbs\": %.1f, \"host_prepare_us\": %.3f, \"host_tma_encode_us\": %.3f, "
                "\"host_dispatch_us\": %.2f, \"host_capture_us\": %.2f, \"check_relerr\": %.2e, "
                "\"check_dlse\": %.2e, \"check_ok\": %s}",
                row.name().c_str(), opt.fp8 ? "e4m3" : "bf16", row.b, row.q, row.h, row.seq, row.varlen ? "true" : "false",
                static_cast<long long>(sum_seq), host.config_attr.c_str(), opt.max_num_splits, n_lo, n_hi, reps, copies, graph_us,
                median(graph_per_call), stream_us, flops / graph_us * 1e-6, bytes / graph_us * 1e-3, prepare_us,
                tma_us, median(enqueue), median(capture_us), worst, worst_lse, ok ? "true" : "false");
  CUDA_OK(cudaGraphExecDestroy(g_lo));
  CUDA_OK(cudaGraphExecDestroy(g_hi));
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  for (std::vector<Dev*>* v : {&outs, &lses, &wss})
    for (Dev* d : *v) delete d;
  for (Dev* d : qs) delete d;
  for (Dev* d : caches) delete d;
  return {buf, ok};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Row> rows = kDefaultRows;
  Options opt;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--rows" && i + 1 < argc) rows = parse_rows(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) opt.reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--normal-data") opt.normal_data = true;
    else if (a == "--fp8") opt.fp8 = true;
    else if (a == "--own-outputs") opt.own_outputs = true;
    else if (a == "--no-schedule-operand") opt.schedule_operand = false;
    else if (a == "--l2-mb" && i + 1 < argc) opt.l2_bytes = std::max(0.0, std::atof(argv[++i])) * 1e6;
    else if (a == "--splits" && i + 1 < argc) opt.max_num_splits = std::max(0, std::atoi(argv[++i]));
    else if (a == "--request" && i + 1 < argc) {
      std::string why;
      if (!parse_config(argv[++i], &opt.request, &why)) {
        std::fprintf(stderr, "bad --request: %s\n", why.c_str());
        return 2;
      }
    }
    else if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--rows \"B,Q,H,SEQ[,v|,@FILE];...\"] [--request CONFIG] [--splits N] [--reps N] "
                   "[--fp8] [--normal-data] [--own-outputs] [--no-schedule-operand] [--l2-mb M] [--json PATH]\n",
                   argv[0]);
      return 2;
    }
  }
  const DeviceInfo dev = device_info(0);
  CUDA_OK(dev.status);
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("# %s, sm_%d, %d SMs, sm_90a code %s\n", prop.name, dev.arch, dev.sm_count,
              build_has_sm90a() ? "yes" : "no");
  std::vector<std::string> lines;
  int failed = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Result r = run_row(rows[i], static_cast<int>(i), opt, dev, stream);
    std::printf("%s\n", r.json.c_str());
    std::fflush(stdout);
    lines.push_back(r.json);
    failed += !r.ok;
  }
  if (json_path) {
    FILE* f = std::fopen(json_path, "w");
    if (!f) return 2;
    std::fprintf(f, "{\"device\": \"%s\", \"sm_count\": %d, \"rows\": [\n", prop.name, dev.sm_count);
    for (size_t i = 0; i < lines.size(); ++i) std::fprintf(f, "  %s%s\n", lines[i].c_str(), i + 1 < lines.size() ? "," : "");
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  std::printf("# %d of %zu rows passed the check\n", static_cast<int>(rows.size()) - failed, rows.size());
  return failed ? 1 : 0;
}
