// CPU paged MLA decode.
//
// MLA shares one latent row (ckv + kpe) between all heads, so the kernel is
// organised the way the math wants it: a work item is one request (all of
// its q_len * num_heads query rows) over a contiguous range of its tokens.
// The range is walked in tiles of kTile tokens; each tile's cache rows are
// gathered through the block table and converted to float32 once, then used
// by every query row:
//   S = Q K^T           [rows x tile], K = the tile's [ckv | kpe] rows
//   online softmax      per row: running max m, sum l, rescale factor corr
//   O = O * corr + P V  [rows x kv_lora_rank], V = the tile's ckv part
// Long requests are split into several items (split-KV) so that one request
// keeps every thread busy; their partial (m, l, O) land in scratch and a
// second pass merges them with the usual log-sum-exp weights.
//
// Both products are small register blocks over contiguous float arrays with
// fixed-width partial sums ("lanes"), plain C++ loops that GCC vectorises.
// They are instantiated twice: 4 lanes for the baseline ISA (SSE2 on
// x86-64, whatever the build targets elsewhere), and on x86-64 also 8 lanes
// compiled for AVX2 + FMA, chosen at run time when the CPU has both.

// The extension target is built by nanobind_add_module, which appends -Os
// to the Release flags; -Os turns GCC's vectorisers off, and these loops are
// written for them. The pragma comes before every include so that the inline
// helpers (cpu_common.h, the standard library) get the same options: GCC
// does not inline a function optimised for size into one that is not.
// ira-region is named because the pragma does not undo -Os's choice of one
// allocation region per function, which spills accumulators of the AVX2 loops.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3", "ira-region=mixed")
#endif

#include "paged_decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../common/elem_convert.h"
#include "cpu_common.h"

// Building with -DMLA_JAX_CPU_BASELINE_ONLY leaves the AVX2 instantiation out.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MLA_JAX_CPU_BASELINE_ONLY)
#define MLA_CPU_AVX2 1
#define MLA_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define MLA_CPU_AVX2 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MLA_NOINLINE __attribute__((noinline))
#else
#define MLA_NOINLINE
#endif

namespace mla_jax {
namespace {

constexpr int kTile = 64;        // tokens per tile; a multiple of kTokBlock
constexpr int kTokBlock = 4;     // tokens per QK register block
constexpr int kRowBlock = 3;     // query rows per register block (rows padded to a multiple)
constexpr int kDimVecs = 4;      // output vectors (of `lanes` dims) per PV register block
constexpr int64_t kMinSplit = 4 * kTile;  // shortest split: each costs a query load and a merge
constexpr int kItemsPerThread = 4;        // items aimed for per thread, for load balance
constexpr int64_t kScratchBudget = int64_t{64} << 20;  // bytes of split partials, at most

static_assert(kTile % kTokBlock == 0, "tiles hold whole token blocks");
static_assert(kTile % 8 == 0, "softmax runs over whole lane groups of either ISA");

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// True when every page a request reads is inside the cache.
bool request_pages_valid(const PagedDecodeParams& p, int b, int64_t seq_len) {
  const int64_t live_pages = (seq_len + p.page_size - 1) / p.page_size;
  const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
  for (int64_t j = 0; j < live_pages; ++j) {
    if (table[j] < 0 || table[j] >= p.num_pages) return false;
  }
  return true;
}

// Float widths of the per-item buffers for a given lane count.
struct Widths {
  int lanes = 4;
  int dn = 0, dr = 0;
  int dqk = 0;        // dn + dr
  int dim_block = 0;  // output dims per PV register block
  int dn_pad = 0;     // dn rounded up to whole PV blocks (O's row stride)
  int w = 0;          // padded latent width: >= dqk and >= dn_pad, a multiple of lanes.
                      // Q and K are zero in [dqk, w), so padded lanes add nothing to a
                      // score; V holds a converted row's first dn_pad values, and the
                      // O columns past dn that these produce are never written out.
  Widths(const PagedDecodeParams& p, int lanes_)
      : lanes(lanes_), dn(p.kv_lora_rank), dr(p.qk_rope_head_dim), dqk(dn + dr),
        dim_block(kDimVecs * lanes_),
        dn_pad(static_cast<int>(round_up(dn, dim_block))),
        w(static_cast<int>(std::max<int64_t>(round_up(dqk, lanes_), dn_pad))) {}
};

// Packed layouts (L = lanes). The register-block kernels read each operand
// through one pointer with constant offsets and simple steps, which is what
// keeps GCC's accumulators in registers:
//   Q block of 3 rows:    [w / L][kRowBlock][L]      (kRowBlock * w floats)
//   K tile, per 4 tokens: [w / L][kTokBlock][L]      (kTokBlock * w floats)
//   V tile:               [dn_pad / dim_block][kTile][dim_block]
//   P block of 3 rows:    [kTile][kRowBlock][L], each weight repeated L times
//   corr of 3 rows:       [kRowBlock][L], broadcast the same way
// In Q and K, lane l of an L-float group pairs latent dim L*c + l of a query
// row with the same dim of a token. V repeats the tile's ckv part so that PV
// steps through tokens with one pointer increment.

// S[i][j] = q_i . k_j for MR query rows and kTokBlock tokens; acc[i][j][l]
// sums the latent dims congruent to l mod L, added together at the end.
template <int L, int MR>
MLA_CPU_INLINE void qk_block(const float* __restrict q, const float* __restrict k, int w,
                             float* __restrict s, int lds) {
  float acc[MR][kTokBlock][L] = {};
  for (int d = 0; d < w; d += L) {
    const float* qd = q + d * MR;
    const float* kd = k + d * kTokBlock;
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < kTokBlock; ++j) {
        for (int l = 0; l < L; ++l) acc[i][j][l] += qd[i * L + l] * kd[j * L + l];
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kTokBlock; ++j) {
      float sum = 0.0f;
      for (int l = 0; l < L; ++l) sum += acc[i][j][l];
      s[i * lds + j] = sum;
    }
  }
}

// O[i][0, L * kDimVecs) = O * corr[i] + sum_t P[i][t] V[t][..] for MR rows over
// ntok tokens (P is 0 on padding tokens). v points at the V tile's block of
// these dims.
template <int L, int MR>
MLA_CPU_INLINE void pv_block(const float* __restrict pb, const float* __restrict v, int ntok,
                             const float* __restrict corr, float* __restrict o, int ldo) {
  // Starting from O * corr (rather than from zeros, added at the end) spares
  // the zeroing of the accumulator array.
  float acc[MR][kDimVecs][L];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kDimVecs; ++j) {
      for (int l = 0; l < L; ++l) acc[i][j][l] = o[i * ldo + j * L + l] * corr[i * L + l];
    }
  }
  for (int t = 0; t < ntok; ++t) {
    const float* pt = pb + t * MR * L;
    const float* vt = v + t * kDimVecs * L;
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < kDimVecs; ++j) {
        for (int l = 0; l < L; ++l) acc[i][j][l] += pt[i * L + l] * vt[j * L + l];
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kDimVecs; ++j) {
      for (int l = 0; l < L; ++l) o[i * ldo + j * L + l] = acc[i][j][l];
    }
  }
}

// Copies a float row of w values into a packed layout whose L-float groups
// are `group_stride` floats apart.
template <int L>
MLA_CPU_INLINE void scatter_row(const float* __restrict src, int w, float* __restrict dst,
                                int group_stride) {
  for (int c = 0; c < w; c += L) {
    for (int l = 0; l < L; ++l) dst[c / L * group_stride + l] = src[c + l];
  }
}

// The per-tile steps of one ISA (L lanes). Only full kRowBlock blocks are
// ever run: for fewer rows GCC picks a different vectorisation of these
// loops (across tokens) that is several times slower, so the rows are padded
// instead.
template <int L>
struct TileOps {
  // Scores of one row block against the tile's ntok (a multiple of
  // kTokBlock) tokens; s has row stride kTile.
  static MLA_CPU_INLINE void qk(const float* q, const float* k, int w, int ntok, float* s) {
    for (int j = 0; j < ntok; j += kTokBlock) {
      qk_block<L, kRowBlock>(q, k + static_cast<int64_t>(j) * w, w, s + j, kTile);
    }
  }

  // O = O * corr + P V for one row block, all of its dn_pad columns.
  static MLA_CPU_INLINE void pv(const float* pb, const float* v, int ntok, const float* corr,
                                float* o, int dn_pad) {
    for (int d = 0; d < dn_pad; d += kDimVecs * L) {
      pv_block<L, kRowBlock>(pb, v + static_cast<int64_t>(d) * kTile, ntok, corr, o + d, dn_pad);
    }
  }

  // Online-softmax update of the rows of one block for a tile. Row i's
  // scores s[i * kTile + t] at positions t >= visible[i] are -inf; a score of
  // -inf (masked, or a float32 product that overflowed) has weight exactly 0
  // and cannot raise the maximum. Writes the broadcast weights of the ntok
  // tokens into pb (the padding tokens get 0) and the factors rescaling the
  // rows' earlier O into corr.
  static MLA_CPU_INLINE void softmax(float* __restrict s, int ntok, const int* visible,
                                     float score_scale, float* m, float* l,
                                     float* __restrict corr, float* __restrict pb) {
    for (int i = 0; i < kRowBlock; ++i) {
      float* si = s + i * kTile;
      for (int t = 0; t < kTile; ++t) {
        si[t] = cpu::select(t < visible[i], si[t] * score_scale, -INFINITY);
      }
      // The maximum (a short loop: GCC keeps max reductions scalar) lets a
      // NaN score through, so that the row ends NaN instead of skipping it.
      float tile_max = -INFINITY;
      for (int t = 0; t < visible[i]; ++t) {
        if (!(si[t] <= tile_max)) tile_max = si[t];
      }
      const float m_new = !(tile_max <= m[i]) ? tile_max : m[i];
      float factor = 1.0f;
      if (m_new == -INFINITY) {  // nothing seen yet: weights 0, O stays 0
        for (int t = 0; t < kTile; ++t) si[t] = 0.0f;
      } else {
        factor = cpu::exp_nonpositive(m[i] - m_new);  // m = -inf: 0
        float lane_sum[L] = {};
        for (int t = 0; t < kTile; t += L) {
          for (int c = 0; c < L; ++c) {
            const float e = cpu::exp_nonpositive(si[t + c] - m_new);
            si[t + c] = e;
            lane_sum[c] += e;
          }
        }
        float sum = 0.0f;
        for (int c = 0; c < L; ++c) sum += lane_sum[c];
        l[i] = l[i] * factor + sum;
        m[i] = m_new;
      }
      for (int c = 0; c < L; ++c) corr[i * L + c] = factor;
      for (int t = 0; t < ntok; ++t) {
        for (int c = 0; c < L; ++c) pb[(t * kRowBlock + i) * L + c] = si[t];
      }
    }
  }

  // Converts the cache rows of tokens [t0, t0 + n) of request b into the
  // packed K and V tiles and zeroes the padding tokens up to ntok, so that
  // the last token block holds finite values (their weights are 0). The
  // request is valid, so every page id it reads is inside the cache.
  static MLA_CPU_INLINE void load_tile(const PagedDecodeParams& p, const Widths& wd, int b,
                                       int64_t t0, int n, int ntok, float* row, float* k,
                                       float* v) {
    const int64_t kvb = elem_bytes(p.kv_type);
    const int32_t* table = p.block_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
    std::fill(row + wd.dqk, row + wd.w, 0.0f);
    for (int t = 0; t < ntok; ++t) {
      if (t < n) {
        const int64_t pos = t0 + t;
        const int64_t page = table[pos / p.page_size];
        const int64_t slot = pos % p.page_size;
        const char* ckv = static_cast<const char*>(p.ckv) +
                          (page * p.ckv_page_stride + slot * p.ckv_token_stride) * kvb;
        const char* kpe = static_cast<const char*>(p.kpe) +
                          (page * p.kpe_page_stride + slot * p.kpe_token_stride) * kvb;
        cpu::row_to_float(ckv, p.kv_type, wd.dn, row);
        cpu::row_to_float(kpe, p.kv_type, wd.dr, row + wd.dn);
      } else {
        std::fill(row, row + wd.dqk, 0.0f);
      }
      float* k_slot =
          k + static_cast<int64_t>(t / kTokBlock) * kTokBlock * wd.w + (t % kTokBlock) * L;
      scatter_row<L>(row, wd.w, k_slot, kTokBlock * L);
      for (int d = 0; d < wd.dn_pad; d += wd.dim_block) {
        std::copy_n(row + d, wd.dim_block, v + static_cast<int64_t>(d) * kTile + t * wd.dim_block);
      }
    }
  }

  // Converts query row g into its slot dst of a packed Q block; a padding
  // row is packed as zeros.
  static MLA_CPU_INLINE void load_query(const PagedDecodeParams& p, const Widths& wd, int64_t g,
                                        bool padding, float* row, float* dst) {
    std::fill(row, row + wd.w, 0.0f);
    if (!padding) {
      const int64_t qb = elem_bytes(p.q_type);
      cpu::row_to_float(static_cast<const char*>(p.q_nope) + g * p.q_nope_row_stride * qb,
                        p.q_type, wd.dn, row);
      cpu::row_to_float(static_cast<const char*>(p.q_pe) + g * p.q_pe_row_stride * qb, p.q_type,
                        wd.dr, row + wd.dn);
    }
    scatter_row<L>(row, wd.w, dst, kRowBlock * L);
  }
};

// Out-of-line entry points per ISA (their register allocation must not
// depend on the caller), as function pointers.
struct IsaOps {
  int lanes;
  void (*qk)(const float*, const float*, int, int, float*);
  void (*pv)(const float*, const float*, int, const float*, float*, int);
  void (*softmax)(float*, int, const int*, float, float*, float*, float*, float*);
  void (*load_tile)(const PagedDecodeParams&, const Widths&, int, int64_t, int, int, float*,
                    float*, float*);
  void (*load_query)(const PagedDecodeParams&, const Widths&, int64_t, bool, float*, float*);
};

#define MLA_DEFINE_ISA_OPS(NAME, ATTR, L)                                                       \
  MLA_NOINLINE ATTR void NAME##_qk(const float* q, const float* k, int w, int ntok, float* s) { \
    TileOps<L>::qk(q, k, w, ntok, s);                                                           \
  }                                                                                             \
  MLA_NOINLINE ATTR void NAME##_pv(const float* pb, const float* v, int ntok, const float* corr, \
                                   float* o, int dn_pad) {                                      \
    TileOps<L>::pv(pb, v, ntok, corr, o, dn_pad);                                               \
  }                                                                                             \
  MLA_NOINLINE ATTR void NAME##_softmax(float* s, int ntok, const int* visible,                 \
                                        float score_scale, float* m, float* l, float* corr,     \
                                        float* pb) {                                            \
    TileOps<L>::softmax(s, ntok, visible, score_scale, m, l, corr, pb);                         \
  }                                                                                             \
  MLA_NOINLINE ATTR void NAME##_load_tile(const PagedDecodeParams& p, const Widths& wd, int b,  \
                                          int64_t t0, int n, int ntok, float* row, float* k,    \
                                          float* v) {                                           \
    TileOps<L>::load_tile(p, wd, b, t0, n, ntok, row, k, v);                                    \
  }                                                                                             \
  MLA_NOINLINE ATTR void NAME##_load_query(const PagedDecodeParams& p, const Widths& wd,        \
                                           int64_t g, bool padding, float* row, float* dst) {   \
    TileOps<L>::load_query(p, wd, g, padding, row, dst);                                        \
  }                                                                                             \
  constexpr IsaOps NAME##_ops{L,              NAME##_qk,        NAME##_pv,                      \
                              NAME##_softmax, NAME##_load_tile, NAME##_load_query};

MLA_DEFINE_ISA_OPS(base, , 4)
#if MLA_CPU_AVX2
MLA_DEFINE_ISA_OPS(avx2, MLA_TARGET_AVX2, 8)
#endif
#undef MLA_DEFINE_ISA_OPS

const IsaOps& isa_ops() {
#if MLA_CPU_AVX2
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  if (avx2) return avx2_ops;
#endif
  return base_ops;
}

// One work item: request b, tokens [begin, end), all of its query rows.
struct Item {
  int b = 0;
  int64_t begin = 0, end = 0;
  int64_t partial = -1;  // scratch slot of a split request, -1: the item finishes the rows
};

// Buffers of one item, reused across the items a thread runs, over the
// request's rows padded to whole blocks (`rows` here). Padding rows have a
// zero query and see nothing (visible 0), so they stay finite and are never
// written out. Row r's block starts at r0 = r - r % kRowBlock.
struct Workspace {
  std::vector<float> q;     // [rows * w] packed Q blocks
  std::vector<float> k;     // [kTile * w] packed K tile
  std::vector<float> v;     // [kTile * dn_pad] V tile
  std::vector<float> row;   // [w] one converted row
  // Scores, weights and rescale factors of the row block in flight (a row
  // block's softmax and P V follow its scores directly, so one block's
  // worth keeps them in L1).
  std::vector<float> s;     // [kRowBlock][kTile] scores, then weights
  std::vector<float> pb;    // [kTile * kRowBlock * lanes] packed P block
  std::vector<float> corr;  // [kRowBlock * lanes] packed rescale factors
  std::vector<float> o;     // [rows][dn_pad] unnormalised output
  std::vector<float> m, l;  // [rows] running max and sum of exp(s - m)
  std::vector<int64_t> limit;  // [rows] visible positions
  std::vector<int> visible;    // [rows] visible positions of the current tile

  Workspace(int rows, const Widths& wd)
      : q(static_cast<size_t>(rows) * wd.w),
        k(static_cast<size_t>(kTile) * wd.w),
        v(static_cast<size_t>(kTile) * wd.dn_pad),
        row(wd.w),
        s(static_cast<size_t>(kRowBlock) * kTile),
        pb(static_cast<size_t>(kRowBlock) * kTile * wd.lanes),
        corr(static_cast<size_t>(kRowBlock) * wd.lanes),
        o(static_cast<size_t>(rows) * wd.dn_pad),
        m(rows), l(rows), limit(rows), visible(rows) {}
};

// Workspaces handed to parallel_for chunks: at most one per chunk running at
// a time, all freed when the call ends.
class WorkspacePool {
 public:
  WorkspacePool(int rows, const Widths& wd) : rows_(rows), wd_(wd) {}
  std::unique_ptr<Workspace> take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        std::unique_ptr<Workspace> ws = std::move(free_.back());
        free_.pop_back();
        return ws;
      }
    }
    return std::make_unique<Workspace>(rows_, wd_);
  }
  void give(std::unique_ptr<Workspace> ws) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(ws));
  }

 private:
  int rows_;
  Widths wd_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Workspace>> free_;
};

// Writes out and lse of global row g from its softmax state:
// out = kv_scale * o / l, lse = m + ln l; nothing seen (l == 0) gives out 0
// and lse -inf. With an attention sink the output is also scaled by
// exp(lse) / (exp(lse) + exp(sink[h])).
void finish_row(const PagedDecodeParams& p, int64_t g, float m, float l, const float* o,
                float kv_scale) {
  const int dn = p.kv_lora_rank;
  if (l == 0.0f) {
    for (int d = 0; d < dn; ++d) cpu::store_out(p, g, d, 0.0f);
    p.lse[g] = -INFINITY;
    return;
  }
  const float lse = m + std::log(l);
  float scale = kv_scale / l;
  if (p.attn_sink != nullptr) scale /= 1.0f + std::exp(p.attn_sink[g % p.num_heads] - lse);
  for (int d = 0; d < dn; ++d) cpu::store_out(p, g, d, o[d] * scale);
  p.lse[g] = lse;
}

void write_nan_request(const PagedDecodeParams& p, int b) {
  const int rows = p.rows_per_request();
  for (int r = 0; r < rows; ++r) {
    const int64_t g = static_cast<int64_t>(b) * rows + r;
    for (int d = 0; d < p.kv_lora_rank; ++d) cpu::store_out(p, g, d, NAN);
    p.lse[g] = NAN;
  }
}

void run_item(const PagedDecodeParams& p, const IsaOps& isa, const Widths& wd, const Item& it,
              float kv_scale, float* scratch, Workspace& ws) {
  const int rows = p.rows_per_request();
  const int padded_rows = static_cast<int>(round_up(rows, kRowBlock));
  const int lanes = wd.lanes;
  const int64_t seq_len = p.seq_lens[it.b];
  const int64_t g0 = static_cast<int64_t>(it.b) * rows;
  const float score_scale = p.sm_scale * kv_scale;

  for (int r = 0; r < padded_rows; ++r) {
    const int r0 = r - r % kRowBlock;
    isa.load_query(p, wd, g0 + r, r >= rows, ws.row.data(),
                   ws.q.data() + static_cast<size_t>(r0) * wd.w + (r - r0) * lanes);
    const int64_t limit = visible_len(seq_len, p.q_len, r / p.num_heads, p.causal);
    ws.limit[r] = r >= rows ? 0 : std::clamp<int64_t>(limit, 0, seq_len);
  }
  std::fill(ws.o.begin(), ws.o.end(), 0.0f);
  std::fill(ws.m.begin(), ws.m.end(), -INFINITY);
  std::fill(ws.l.begin(), ws.l.end(), 0.0f);

  for (int64_t t0 = it.begin; t0 < it.end; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, it.end - t0));
    const int ntok = static_cast<int>(round_up(n, kTokBlock));
    isa.load_tile(p, wd, it.b, t0, n, ntok, ws.row.data(), ws.k.data(), ws.v.data());
    for (int r = 0; r < padded_rows; ++r) {
      ws.visible[r] = static_cast<int>(std::clamp<int64_t>(ws.limit[r] - t0, 0, n));
    }
    // Per row block: scores, softmax update, then P V while the block's
    // weights are in L1; the K and V tiles stay in L2 for all blocks.
    for (int r0 = 0; r0 < padded_rows; r0 += kRowBlock) {
      float* s = ws.s.data();
      float* pb = ws.pb.data();
      float* corr = ws.corr.data();
      isa.qk(ws.q.data() + static_cast<size_t>(r0) * wd.w, ws.k.data(), wd.w, ntok, s);
      isa.softmax(s, ntok, ws.visible.data() + r0, score_scale, ws.m.data() + r0, ws.l.data() + r0,
                  corr, pb);
      isa.pv(pb, ws.v.data(), ntok, corr, ws.o.data() + static_cast<size_t>(r0) * wd.dn_pad,
             wd.dn_pad);
    }
  }

  if (it.partial < 0) {
    for (int r = 0; r < rows; ++r) {
      finish_row(p, g0 + r, ws.m[r], ws.l[r], ws.o.data() + static_cast<size_t>(r) * wd.dn_pad,
                 kv_scale);
    }
    return;
  }
  // Partial slot: [rows] m, [rows] l, [rows x dn] o.
  float* slot = scratch + it.partial * static_cast<int64_t>(rows) * (wd.dn + 2);
  for (int r = 0; r < rows; ++r) {
    slot[r] = ws.m[r];
    slot[rows + r] = ws.l[r];
    std::copy_n(ws.o.data() + static_cast<size_t>(r) * wd.dn_pad, wd.dn,
                slot + 2 * rows + static_cast<int64_t>(r) * wd.dn);
  }
}

// Merges the `splits` partial slots starting at `first` for row r of
// request b: weights exp(m_s - M) with M the largest m_s (a split that saw
// nothing has m -inf, l 0 and weight 0; a NaN m, from NaN scores, becomes M
// so that the row ends NaN as it would unsplit).
void merge_row(const PagedDecodeParams& p, int b, int r, const float* scratch, int64_t first,
               int splits, float kv_scale, float* acc) {
  const int rows = p.rows_per_request();
  const int dn = p.kv_lora_rank;
  const int64_t slot_floats = static_cast<int64_t>(rows) * (dn + 2);
  float big = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    const float m = scratch[(first + s) * slot_floats + r];
    if (!(m <= big)) big = m;
  }
  std::fill_n(acc, dn, 0.0f);
  float l = 0.0f;
  if (big != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      const float* slot = scratch + (first + s) * slot_floats;
      const float w = cpu::exp_nonpositive(slot[r] - big);
      l += w * slot[rows + r];
      const float* o = slot + 2 * rows + static_cast<int64_t>(r) * dn;
      for (int d = 0; d < dn; ++d) acc[d] += w * o[d];
    }
  }
  finish_row(p, static_cast<int64_t>(b) * rows + r, big, l, acc, kv_scale);
}

}  // namespace

void paged_decode_cpu(const PagedDecodeParams& params, const ParallelFor& parallel_for) {
  const PagedDecodeParams& p = params;
  if (p.batch <= 0 || p.rows_per_request() <= 0) return;
  const float kv_scale = p.kv_scale ? *p.kv_scale : 1.0f;
  const IsaOps& isa = isa_ops();
  const Widths wd(p, isa.lanes);
  const int rows = p.rows_per_request();

  // Validity first: an invalid request is answered with NaN and never read.
  std::vector<char> valid(p.batch);
  int64_t total = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t n = p.seq_lens[b];
    valid[b] = n >= 0 && n <= p.max_seq_len() && request_pages_valid(p, b, n);
    if (valid[b]) total += n;
    else write_nan_request(p, b);
  }

  // Split length: long enough to amortise a split's fixed costs (query
  // conversion, the merge), short enough to give every thread several items.
  // Only requests longer than split_len are split, so there are fewer than
  // 2 * total / split_len partial slots; the last term keeps their scratch
  // under kScratchBudget on machines with many threads.
  const int64_t threads = std::max(1u, std::thread::hardware_concurrency());
  const int64_t target = threads * kItemsPerThread;
  const int64_t slot_bytes = static_cast<int64_t>(rows) * (wd.dn + 2) * sizeof(float);
  const int64_t max_slots = std::max<int64_t>(2, kScratchBudget / slot_bytes);
  const int64_t split_len = round_up(
      std::max({kMinSplit, (total + target - 1) / target, (2 * total + max_slots - 1) / max_slots}),
      kTile);

  std::vector<Item> items;
  struct Merge {
    int b;
    int64_t first;
    int splits;
  };
  std::vector<Merge> merges;
  int64_t partials = 0;
  for (int b = 0; b < p.batch; ++b) {
    if (!valid[b]) continue;
    const int64_t n = p.seq_lens[b];
    if (n <= split_len) {
      items.push_back(Item{b, 0, n, -1});
      continue;
    }
    // Even splits in whole tiles.
    const int64_t splits = (n + split_len - 1) / split_len;
    const int64_t per = round_up((n + splits - 1) / splits, kTile);
    int s = 0;
    for (int64_t t = 0; t < n; t += per, ++s) {
      items.push_back(Item{b, t, std::min(n, t + per), partials + s});
    }
    merges.push_back(Merge{b, partials, s});
    partials += s;
  }
  // Longest first, so that the dynamic chunks of parallel_for end together.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& c) {
    return a.end - a.begin > c.end - c.begin;
  });

  std::vector<float> scratch(static_cast<size_t>(partials) * rows * (wd.dn + 2));
  WorkspacePool pool(static_cast<int>(round_up(rows, kRowBlock)), wd);
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t begin, int64_t end) {
    std::unique_ptr<Workspace> ws = pool.take();
    for (int64_t i = begin; i < end; ++i) {
      run_item(p, isa, wd, items[i], kv_scale, scratch.data(), *ws);
    }
    pool.give(std::move(ws));
  });

  if (merges.empty()) return;
  const int64_t merge_rows = static_cast<int64_t>(merges.size()) * rows;
  parallel_for(merge_rows, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(wd.dn);
    for (int64_t i = begin; i < end; ++i) {
      const Merge& mg = merges[i / rows];
      merge_row(p, mg.b, static_cast<int>(i % rows), scratch.data(), mg.first, mg.splits, kv_scale,
                acc.data());
    }
  });
}

}  // namespace mla_jax
