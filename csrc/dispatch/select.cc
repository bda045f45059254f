#include "csrc/dispatch/select.h"

#include <cstdint>
#include <string>
#include <string_view>

namespace mla_jax {
namespace {

// Thresholds of the choices below. The combine's: few (request, row) pairs
// with many splits each read best with a CTA per row and column slice,
// fewer splits with a warp per column slice, many pairs with a warp per row.
constexpr int64_t kCombineBlockBelowPairs = 2048;  // block grid: fewer pairs than this ...
constexpr int64_t kCombineBlockMinSplits = 32;     // ... and at least this many partitions per request
constexpr int64_t kCombineSliceBelowPairs = 1024;  // a warp per slice below this many pairs
// The fused combine's tasks (csrc/sm90/decode_seesaw.cuh): 128-column slices
// of a 512-column row.
constexpr int64_t kFusedCombineSlices = 4;

const char* family_name(KernelFamily k) {
  switch (k) {
    case KernelFamily::kPortable: return "portable";
    case KernelFamily::kSm90Lockstep: return "sm90_lockstep";
    case KernelFamily::kSm90Seesaw: return "sm90_seesaw";
    case KernelFamily::kSm90SwapAB: return "sm90_swapab";
    default: return "auto";
  }
}

const char* schedule_name(ScheduleMode s) {
  switch (s) {
    case ScheduleMode::kSchedulerKernel: return "kernel";
    case ScheduleMode::kInline: return "inline";
    case ScheduleMode::kBlock: return "block";
    case ScheduleMode::kStep: return "step";
    default: return "auto";
  }
}

const char* grid_name(CombineGrid g) {
  switch (g) {
    case CombineGrid::kBlock: return "block";
    case CombineGrid::kRows: return "rows";
    case CombineGrid::kSlices: return "slices";
    default: return "auto";
  }
}

const char* switch_name(Switch s) {
  switch (s) {
    case Switch::kOn: return "on";
    case Switch::kOff: return "off";
    default: return "auto";
  }
}

template <typename E, size_t N>
bool parse_name(std::string_view field, const char* (&name)(E), const E (&values)[N], E* out) {
  for (E v : values) {
    if (field == name(v)) {
      *out = v;
      return true;
    }
  }
  return false;
}

std::string arch_str(int arch) { return "sm_" + std::to_string(arch); }

}  // namespace

DecodeFacts call_facts(DecodeOp op, const PagedDecodeParams& p, int arch, int sm_count, bool build_sm90a,
                       int workspace_parts) {
  const int64_t eb = elem_bytes(p.kv_type);
  auto aligned = [&](const void* base, int64_t token_stride) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (token_stride * eb) % 16 == 0;
  };
  DecodeFacts f;
  f.op = op;
  f.q_type = p.q_type;
  f.kv_type = p.kv_type;
  f.kv_format = p.kv_format;
  f.kv_lora_rank = p.kv_lora_rank;
  f.qk_rope_head_dim = p.qk_rope_head_dim;
  f.page_size = p.page_size;
  f.q_len = p.q_len;
  f.num_heads = p.num_heads;
  f.batch = p.batch;
  f.num_pages = p.num_pages;
  f.topk = op == DecodeOp::kSparse ? p.topk : 0;
  f.kv_aligned = aligned(p.ckv, p.ckv_token_stride) && aligned(p.kpe, p.kpe_token_stride);
  f.kv_pages_contiguous = p.ckv_page_stride == int64_t{p.page_size} * p.ckv_token_stride &&
                          p.kpe_page_stride == int64_t{p.page_size} * p.kpe_token_stride;
  f.arch = arch;
  f.sm_count = sm_count;
  f.build_sm90a = build_sm90a;
  f.workspace_parts = workspace_parts;
  return f;
}

std::string format_config(const KernelConfig& c) {
  return std::string(family_name(c.kernel)) + "," + schedule_name(c.schedule) + "," + grid_name(c.combine_grid) +
         "," + switch_name(c.programmatic_combine) + "," + switch_name(c.fused_combine);
}

bool parse_config(std::string_view text, KernelConfig* c, std::string* why) {
  // Five fields; four (no fused_combine: auto) in programs exported before
  // that field existed.
  constexpr int kFields = 5;
  std::string_view fields[kFields] = {{}, {}, {}, {}, "auto"};
  int count = 1;
  for (char ch : text) count += ch == ',';
  if (count != kFields && count != kFields - 1) {
    *why = "expected " + std::to_string(kFields) + " comma-separated fields, got '" + std::string(text) + "'";
    return false;
  }
  size_t start = 0;
  for (int i = 0; i < count; ++i) {
    const size_t comma = text.find(',', start);
    fields[i] = text.substr(start, i == count - 1 ? std::string_view::npos : comma - start);
    start = comma + 1;
  }
  static constexpr KernelFamily kFamilies[] = {KernelFamily::kAuto, KernelFamily::kPortable,
                                               KernelFamily::kSm90Lockstep, KernelFamily::kSm90Seesaw,
                                               KernelFamily::kSm90SwapAB};
  static constexpr ScheduleMode kSchedules[] = {ScheduleMode::kAuto, ScheduleMode::kSchedulerKernel,
                                                ScheduleMode::kInline, ScheduleMode::kBlock, ScheduleMode::kStep};
  static constexpr CombineGrid kGrids[] = {CombineGrid::kAuto, CombineGrid::kBlock, CombineGrid::kRows,
                                           CombineGrid::kSlices};
  static constexpr Switch kSwitches[] = {Switch::kAuto, Switch::kOff, Switch::kOn};
  const char* bad = !parse_name(fields[0], family_name, kFamilies, &c->kernel)       ? "kernel"
                    : !parse_name(fields[1], schedule_name, kSchedules, &c->schedule) ? "schedule"
                    : !parse_name(fields[2], grid_name, kGrids, &c->combine_grid)     ? "combine_grid"
                    : !parse_name(fields[3], switch_name, kSwitches, &c->programmatic_combine)
                        ? "programmatic_combine"
                    : !parse_name(fields[4], switch_name, kSwitches, &c->fused_combine) ? "fused_combine"
                                                                                        : nullptr;
  if (bad != nullptr) {
    *why = std::string("unknown ") + bad + " in '" + std::string(text) + "'";
    return false;
  }
  return true;
}

Selection select_kernel(const DecodeFacts& f, const KernelConfig& requested, std::string* explain) {
  Selection sel;
  KernelConfig& c = sel.config;
  c = requested;
  // The handler calls this on every call with explain == nullptr: a line is
  // only built (by its lambda) when it is asked for.
  auto note = [&](auto&& line) {
    if (explain != nullptr) *explain += line() + "\n";
  };
  auto fail = [&](const std::string& why) {
    sel.error = why;
    if (explain != nullptr) *explain += "error: " + why + "\n";
    return sel;
  };

  if (f.kv_lora_rank != 512 || f.qk_rope_head_dim != 64)
    return fail("the CUDA kernels need kv_lora_rank 512 and qk_rope_head_dim 64, got " +
                std::to_string(f.kv_lora_rank) + " and " + std::to_string(f.qk_rope_head_dim));
  if (f.q_type != ElemType::kBF16 && f.q_type != ElemType::kF16) return fail("the query must be bf16 or fp16");
  if (f.page_size < 1) return fail("page_size must be positive");
  // Sparse selection depends on top-k (the seesaw kernel's threshold): a
  // caller that leaves it out must not silently get the short-item choice.
  if (f.op == DecodeOp::kSparse && f.topk < 1)
    return fail("sparse decode facts need topk >= 1, got " + std::to_string(f.topk));

  const int64_t rows = f.rows();
  const int64_t requests = f.requests();
  const bool arch_known = f.arch > 0;
  const bool sm90_device = f.arch / 10 == 9;
  const bool plain16 = f.kv_format == KvFormat::kPlain && f.kv_type == f.q_type && f.kv_pages_contiguous;
  // FP8 caches the lock-step kernel gathers and converts on chip.
  const bool fp8 = f.kv_format == KvFormat::kFp8DsMla || (f.kv_format == KvFormat::kPlain && f.kv_type == ElemType::kFP8E4M3);
  const bool fp8_lockstep = fp8 && f.kv_pages_contiguous && f.kv_aligned;
  const int64_t slots = f.num_pages < 0 ? kUnknownSize : f.num_pages * f.page_size;
  // TMA boxes copy whole 64-token tiles of one page, with int32 row coordinates.
  const bool tma_tiles = f.op == DecodeOp::kPaged && f.page_size % 64 == 0 && f.kv_aligned &&
                         (slots < 0 || (slots > 0 && slots <= INT32_MAX));
  const bool tma = tma_tiles && plain16;
  // Dense e4m3 rows whose pages TMA can load: the seesaw kernel takes their
  // raw bytes and converts them on chip.
  const bool fp8_plain = f.kv_format == KvFormat::kPlain && f.kv_type == ElemType::kFP8E4M3 && f.kv_pages_contiguous;
  const bool tma_fp8 = tma_tiles && fp8_plain;
  const bool wide = portable_rows_per_cta(rows) == 64;
  // FP8 rows: the lock-step kernel's cost per tile hardly depends on how many
  // of its 64 rows are live (query rows past the request's are zero), and
  // the portable kernel's 32-row block costs about as much per tile as its
  // 64-row one, so from 17 query rows on the lock-step kernel is the faster
  // (docs/perf.md, "FP8 caches"); with 16 rows or fewer the portable
  // kernel's 16-row block is. Sparse bf16/fp16 rows, gathered one by one:
  // with 32 rows or fewer both kernels wait on the gathers, and the
  // lock-step kernel is the faster (bf16, 8 to 32 heads measured; fewer
  // heads and fp16 assumed alike: docs/perf.md, "Sparse bf16 rows").
  const bool lockstep_rows = fp8 ? rows > 16 : wide || f.op == DecodeOp::kSparse;
  // The swap-AB kernel: a dense e4m3 cache TMA loads tile by tile (its
  // boxes land the raw bytes), 32 query rows or fewer (wgmma's N). It is
  // chosen before the lock-step kernel (docs/perf.md, "FP8 caches").
  // Its sparse form: fp8_ds_mla rows gathered by index (cp.async, 16-byte
  // aligned), a bf16 query, 32 heads or fewer.
  // The seesaw kernel's sparse form: the same rows, any number of heads;
  // above the swap-AB kernel's rows it takes the place of the lock-step
  // kernel.
  const bool seesaw_sparse = f.op == DecodeOp::kSparse && f.kv_format == KvFormat::kFp8DsMla &&
                             f.q_type == ElemType::kBF16 && f.kv_pages_contiguous && f.kv_aligned;
  const bool swapab_sparse = seesaw_sparse && rows <= kSwapAbSparseMaxRows;
  const bool swapab = (tma_tiles && f.kv_format == KvFormat::kPlain && f.kv_type == ElemType::kFP8E4M3 &&
                       f.kv_pages_contiguous && rows <= kSwapAbMaxRows) ||
                      swapab_sparse;

  // 1. The decode kernel.
  if (c.kernel == KernelFamily::kAuto) {
    if (!arch_known) {
      note([&] { return std::string("kernel: auto, chosen on the device (no CUDA device was visible when the call was traced)"); });
    } else if (!sm90_device || !f.build_sm90a) {
      c.kernel = KernelFamily::kPortable;
      note([&] { return std::string(std::string("kernel: portable (") +
           (!sm90_device ? "the Hopper kernels are for sm_90; this device is " + arch_str(f.arch)
                         : std::string("this build has no sm_90a code")) + ")"); });
    } else if (!plain16 && !fp8_lockstep) {
      c.kernel = KernelFamily::kPortable;
      note([&] { return std::string(!f.kv_pages_contiguous ? "kernel: portable (the cache's pages are not laid end to end)"
               : fp8 ? "kernel: portable (FP8 cache rows not 16-byte aligned)"
                     : "kernel: portable (the cache's dtype differs from the query's)"); });
    } else if (swapab_sparse) {
      c.kernel = KernelFamily::kSm90SwapAB;
      note([&] { return std::string("kernel: sm90_swapab (sm_90, sparse decode over fp8_ds_mla rows with a bf16 query and " +
           std::to_string(rows) + " heads: the rows gathered by index, tokens as wgmma's M, the heads as its N)"); });
    } else if (swapab) {
      c.kernel = KernelFamily::kSm90SwapAB;
      note([&] { return std::string("kernel: sm90_swapab (sm_90, a float8_e4m3fn cache with page_size a multiple of 64 and " +
           std::to_string(rows) + " query rows per request: tokens as wgmma's M, the rows as its N, e4m3 converted "
           "into fp16 registers)"); });
    } else if (tma) {
      c.kernel = KernelFamily::kSm90Seesaw;
      note([&] { return std::string("kernel: sm90_seesaw (sm_90, a paged cache whose page_size is a multiple of 64: TMA loads whole "
           "64-token tiles; " + std::to_string(rows) + " query rows per request in 64-row blocks)"); });
    } else if (seesaw_sparse && lockstep_rows && f.topk >= kSeesawSparseMinTopk) {
      c.kernel = KernelFamily::kSm90Seesaw;
      note([&] { return std::string("kernel: sm90_seesaw (sm_90, sparse decode over fp8_ds_mla rows with a bf16 query and " +
           std::to_string(rows) + " heads, more than sm90_swapab takes: each warpgroup gathers the halves of the tiles "
           "it frees by index and converts the tiles it multiplies first)"); });
    } else if (tma_fp8 && lockstep_rows) {
      c.kernel = KernelFamily::kSm90Seesaw;
      note([&] { return std::string("kernel: sm90_seesaw (sm_90, a float8_e4m3fn cache whose page_size is a multiple of 64 and " +
           std::to_string(rows) + " query rows per request, more than sm90_swapab takes: TMA loads the raw 64-token tiles, "
           "each warpgroup converts the tiles it multiplies first)"); });
    } else if (lockstep_rows) {
      c.kernel = KernelFamily::kSm90Lockstep;
      note([&] { return std::string("kernel: sm90_lockstep (sm_90, " + std::to_string(rows) + " query rows per request; the cache is "
           "gathered row by row: " + (fp8 ? "FP8 rows, converted on chip" : f.op == DecodeOp::kSparse ? "sparse indices" :
           "page_size below 64 or not a multiple of 64") + (seesaw_sparse ? "; top-k " + std::to_string(f.topk) +
           " is below the " + std::to_string(kSeesawSparseMinTopk) + " from which sm90_seesaw takes sparse fp8_ds_mla rows" : "") +
           ")"); });
    } else {
      c.kernel = KernelFamily::kPortable;
      note([&] { return std::string("kernel: portable (" + std::to_string(rows) + " query rows per request and a cache TMA cannot load "
           "tile by tile: the portable kernel's " + std::to_string(portable_rows_per_cta(rows)) + "-row blocks)"); });
    }
  } else {
    const bool sm90 = c.kernel == KernelFamily::kSm90Lockstep || c.kernel == KernelFamily::kSm90Seesaw ||
                      c.kernel == KernelFamily::kSm90SwapAB;
    if (sm90) {
      if (arch_known && !sm90_device)
        return fail(std::string("kernel '") + family_name(c.kernel) + "' needs an sm_90 device, this one is " + arch_str(f.arch));
      if (!f.build_sm90a)
        return fail(std::string("kernel '") + family_name(c.kernel) + "' needs a build with sm_90a code (MLA_JAX_CUDA_ARCHS)");
      if (c.kernel == KernelFamily::kSm90Seesaw && !plain16 && !fp8_plain && !seesaw_sparse)
        return fail("kernel 'sm90_seesaw' serves bf16/fp16 caches in the query dtype and float8_e4m3fn caches, "
                    "pages laid end to end, and sparse decode over fp8_ds_mla rows (pages laid end to end, 16-byte "
                    "aligned) with a bf16 query, only");
      if (c.kernel == KernelFamily::kSm90Lockstep && !plain16 && !fp8_lockstep)
        return fail("kernel 'sm90_lockstep' serves bf16/fp16 caches in the query dtype with pages laid end to end, "
                    "and FP8 caches (e4m3 with kv_scale, fp8_ds_mla) with pages laid end to end and 16-byte "
                    "aligned rows, only");
      if (c.kernel == KernelFamily::kSm90SwapAB && !swapab)
        return fail("kernel 'sm90_swapab' serves paged decode over a float8_e4m3fn cache with page_size a multiple "
                    "of 64, pages laid end to end, 16-byte aligned rows and at most " +
                    std::to_string(kSwapAbMaxRows) + " query rows per request (q_len x heads), and sparse decode "
                    "over fp8_ds_mla rows (pages laid end to end, 16-byte aligned) with a bf16 query and at most " +
                    std::to_string(kSwapAbSparseMaxRows) + " heads, only");
      if (c.kernel == KernelFamily::kSm90Seesaw && !tma && !tma_fp8 && !seesaw_sparse)
        return fail("kernel 'sm90_seesaw' needs TMA loads: paged decode with page_size a multiple of 64 and "
                    "16-byte aligned cache rows");
    }
    note([&] { return std::string(std::string("kernel: ") + family_name(c.kernel) + " (requested by the plan)"); });
  }

  // 2. Who schedules the splits. A call with a schedule operand (the JAX
  //    ops' CUDA calls) may read the one its own schedule call wrote. Otherwise the
  //    seesaw kernel can schedule inside its CTAs (one warp up to 32
  //    requests, the whole block above); the swap-AB kernel with one warp up
  //    to 32 requests; every other case runs the scheduler kernel first.
  const bool seesaw = c.kernel == KernelFamily::kSm90Seesaw;
  const bool swapab_kernel = c.kernel == KernelFamily::kSm90SwapAB;
  if (c.schedule == ScheduleMode::kAuto) {
    if (f.schedule_operand && (requests < 0 || requests > kInlineScheduleMaxRequests)) {
      // Every kernel reads a schedule written before it as the scheduler
      // kernel's. Computed once for all the decode calls of a program over
      // the same metadata (unrolled layers), it takes the schedule's latency
      // out of each; inside a lax.scan over layers XLA keeps it in the loop
      // body, where above 32 requests it costs about what the block schedule
      // does (docs/perf.md). Up to 32 requests the inline schedule is the
      // safer default: cheaper in a scan, about even unrolled.
      c.schedule = ScheduleMode::kStep;
      note([&] { return std::string("schedule: step (") + (requests < 0 ? std::string("a symbolic batch") : std::to_string(requests) + " requests") +
                        ": the op's schedule call computes it; XLA runs it once for every call over the same " +
                        (f.op == DecodeOp::kSparse ? "topk_lens" : "block_table and seq_lens") + ")"; });
    } else if (c.kernel == KernelFamily::kAuto) {
      // decided with the kernel
    } else if (!seesaw && !swapab_kernel) {
      c.schedule = ScheduleMode::kSchedulerKernel;
      note([&] { return std::string("schedule: kernel (the scheduler kernel runs before the decode)"); });
    } else if (requests < 0) {
      note([&] { return std::string("schedule: auto, chosen on the device (the batch size is symbolic)"); });
    } else if (requests <= kInlineScheduleMaxRequests) {
      c.schedule = ScheduleMode::kInline;
      note([&] { return std::string("schedule: inline (" + std::to_string(requests) + " requests: one warp of every decode CTA schedules)"); });
    } else if (swapab_kernel) {
      c.schedule = ScheduleMode::kSchedulerKernel;
      note([&] { return std::string("schedule: kernel (" + std::to_string(requests) + " requests, more than sm90_swapab "
           "schedules itself: the scheduler kernel runs before the decode)"); });
    } else {
      c.schedule = ScheduleMode::kBlock;
      note([&] { return std::string("schedule: block (" + std::to_string(requests) + " requests: every decode CTA computes the schedule)"); });
    }
  } else {
    if (c.schedule == ScheduleMode::kInline && c.kernel != KernelFamily::kAuto && !seesaw && !swapab_kernel)
      return fail(std::string("schedule 'inline' is the sm90_seesaw and sm90_swapab kernels'; kernel '") +
                  family_name(c.kernel) + "' uses schedule 'kernel'");
    if (c.schedule == ScheduleMode::kBlock && c.kernel != KernelFamily::kAuto && !seesaw)
      return fail(std::string("schedule 'block' is the sm90_seesaw kernel's; kernel '") + family_name(c.kernel) +
                  "' uses schedule 'kernel'" + (swapab_kernel ? " or 'inline'" : ""));
    if (c.schedule == ScheduleMode::kStep && !f.schedule_operand)
      return fail("schedule 'step' reads the schedule operand of the op's CUDA call; this call has none");
    if (c.schedule == ScheduleMode::kInline && requests > kInlineScheduleMaxRequests)
      return fail("schedule 'inline' serves at most " + std::to_string(kInlineScheduleMaxRequests) +
                  " requests, got " + std::to_string(requests));
    note([&] { return std::string(std::string("schedule: ") + schedule_name(c.schedule) + " (requested by the plan)"); });
  }

  // 3. The combine's grid: by (request, row) pairs and partitions per request.
  if (c.combine_grid == CombineGrid::kAuto) {
    if (requests < 0 || f.sm_count <= 0) {
      note([&] { return std::string("combine grid: auto, chosen on the device (it depends on the batch size and the SM count)"); });
    } else {
      const int parts = num_partitions(f.sm_count, rows, f.workspace_parts);
      const int64_t pairs = requests * rows;
      if (pairs < kCombineBlockBelowPairs && requests * kCombineBlockMinSplits <= parts) {
        c.combine_grid = CombineGrid::kBlock;
      } else if (pairs < kCombineSliceBelowPairs) {
        c.combine_grid = CombineGrid::kSlices;
      } else {
        c.combine_grid = CombineGrid::kRows;
      }
      note([&] { return std::string(std::string("combine grid: ") + grid_name(c.combine_grid) + " (" + std::to_string(pairs) +
           " (request, row) pairs, " + std::to_string(parts) + " partitions)"); });
    }
  } else {
    note([&] { return std::string(std::string("combine grid: ") + grid_name(c.combine_grid) + " (requested by the plan)"); });
  }

  // 4. The combine fused into the decode kernel: the seesaw kernel with the
  //    inline schedule (one CTA per SM, persistent) can wait for the whole
  //    grid and merge the splits itself, which saves the combine kernel's
  //    launch and the gap before it. But the grid holds one CTA per SM, 8
  //    warps each, where the combine kernel's grid fills every SM, and each
  //    (request, row, 128-column slice) task is a chain of dependent loads:
  //    measured (docs/perf.md), the block grid's order gained where every
  //    CTA takes at most one task, while the warp grids' order gained at
  //    most 1 % at 12 heads and lost at 128 heads even with fewer tasks than
  //    warps; with more tasks than units both lost. Auto fuses the first
  //    case only. A plan that asks for a programmatic combine launch gets
  //    the combine kernel.
  const bool fusable = seesaw && c.schedule == ScheduleMode::kInline;
  if (c.fused_combine == Switch::kAuto) {
    if (c.programmatic_combine == Switch::kOn) {
      c.fused_combine = Switch::kOff;
      note([&] { return std::string("fused combine: off (the plan asks for a programmatic combine launch)"); });
    } else if (c.kernel == KernelFamily::kAuto || (seesaw && c.schedule == ScheduleMode::kAuto) ||
               (fusable && (c.combine_grid == CombineGrid::kAuto || f.sm_count <= 0 || requests < 0))) {
      note([&] { return std::string("fused combine: auto, chosen on the device"); });
    } else if (!fusable) {
      c.fused_combine = Switch::kOff;
      note([&] { return std::string("fused combine: off (sm90_seesaw with the inline schedule only)"); });
    } else {
      const int64_t ctas = (rows + 63) / 64 * num_partitions(f.sm_count, rows, f.workspace_parts);
      const bool block_order = c.combine_grid == CombineGrid::kBlock;
      const int64_t tasks = requests * rows * kFusedCombineSlices;
      const bool on = block_order && tasks <= ctas;
      c.fused_combine = on ? Switch::kOn : Switch::kOff;
      note([&] { return std::string("fused combine: ") + (on ? "on (" : "off (") +
                        (!block_order ? std::string("the combine kernel: a warp grid's order")
                         : std::to_string(tasks) + " (request, row, slice) tasks " + (on ? "within" : "over") + " one round of " +
                               std::to_string(ctas) + " CTAs" +
                               (on ? ": the decode kernel merges the splits after a grid-wide barrier, in the block grid's order"
                                   : ": the combine kernel")) + ")"; });
    }
  } else {
    const bool resolved = c.kernel != KernelFamily::kAuto && c.schedule != ScheduleMode::kAuto;
    if (c.fused_combine == Switch::kOn && resolved && !fusable)
      return fail(std::string("fused combine is the sm90_seesaw kernel's with schedule 'inline'; this call runs '") +
                  family_name(c.kernel) + "' with schedule '" + schedule_name(c.schedule) + "'");
    note([&] { return std::string(std::string("fused combine: ") + (c.fused_combine == Switch::kOn ? "on" : "off") +
         " (requested by the plan)"); });
  }

  // 5. Programmatic launch of the combine: worth it after the seesaw kernel
  //    when its CTAs run several items each (more requests than the inline
  //    schedule takes), so the combine's launch hides behind the last ones.
  //    A fused combine launches no combine kernel.
  if (c.programmatic_combine == Switch::kAuto) {
    if (c.fused_combine == Switch::kOn) {
      c.programmatic_combine = Switch::kOff;
      note([&] { return std::string("programmatic combine: off (no combine kernel: the combine is fused)"); });
    } else if (c.kernel == KernelFamily::kAuto || (seesaw && requests < 0) || c.fused_combine == Switch::kAuto) {
      note([&] { return std::string("programmatic combine: auto, chosen on the device"); });
    } else {
      const bool on = seesaw && requests > kInlineScheduleMaxRequests;
      c.programmatic_combine = on ? Switch::kOn : Switch::kOff;
      note([&] { return std::string(std::string("programmatic combine: ") + (on ? "on (sm90_seesaw with more than 32 requests)" : "off")); });
    }
  } else {
    if (c.programmatic_combine == Switch::kOn && arch_known && f.arch < 90)
      return fail("programmatic combine needs sm_90 or later, this device is " + arch_str(f.arch));
    if (c.programmatic_combine == Switch::kOn && c.fused_combine == Switch::kOn)
      return fail("programmatic combine and fused combine exclude each other: a fused combine launches no combine kernel");
    note([&] { return std::string(std::string("programmatic combine: ") + (c.programmatic_combine == Switch::kOn ? "on" : "off") +
         " (requested by the plan)"); });
  }
  return sel;
}

}  // namespace mla_jax
