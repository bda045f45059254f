#include "ffi/decode_args.h"

#include <cstdint>
#include <string>

#include "ffi/ffi_util.h"

namespace mla_jax {
namespace {

ffi::Error invalid(const std::string& msg) { return invalid_argument(kPagedDecodeOp, msg); }

// Empty when a separate q_pe is [B, Q, H, rope] with q_nope's [B, Q, H] (the
// kernels read it with q_nope's row count); else the error message.
std::string q_pe_shape_error(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> pd, int64_t dr) {
  if (pd.size() == 4 && pd[0] == qd[0] && pd[1] == qd[1] && pd[2] == qd[2] && pd[3] == dr) return "";
  return "q_pe must be [B, Q, H, rope] matching q_nope " + dims_str(qd) + ", got " + dims_str(pd);
}

// Query row pointers and strides (elements; the query is bf16/fp16). A
// packed query's q_pe starts kv_lora_rank elements into each 576-wide row.
void set_query_rows(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, bool packed, int64_t dn, int64_t dr,
                    PagedDecodeParams* p) {
  constexpr int64_t kQueryBytes = 2;
  p->q_nope = q_nope.untyped_data();
  p->q_nope_row_stride = packed ? dn + dr : dn;
  if (packed) {
    p->q_pe = static_cast<const char*>(q_nope.untyped_data()) + dn * kQueryBytes;
    p->q_pe_row_stride = dn + dr;
  } else {
    p->q_pe = q_pe.untyped_data();
    p->q_pe_row_stride = dr;
  }
}

}  // namespace

ffi::Error fill_decode_params(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                              ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> block_table,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> kv_scale,
                              ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, float sm_scale,
                              bool causal, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                              PagedDecodeParams* p) {
  const int64_t dn = kv_lora_rank, dr = qk_rope_head_dim, dqk = dn + dr;
  if (dn <= 0 || dr <= 0) return invalid("kv_lora_rank and qk_rope_head_dim must be positive");
  auto qd = q_nope.dimensions();
  if (qd.size() != 4) return invalid("q_nope must be [B, Q, H, D], got " + dims_str(qd));
  const bool q_packed = qd[3] == dqk;
  if (!q_packed && qd[3] != dn) return invalid("q_nope last dim must be 512 or 576, got " + dims_str(qd));
  // A packed query carries q_pe in its rows (the q_pe operand is unused).
  if (!q_packed) {
    const std::string err = q_pe_shape_error(qd, q_pe.dimensions(), dr);
    if (!err.empty()) return invalid(err);
    if (q_pe.element_type() != q_nope.element_type()) return invalid("q_nope and q_pe dtypes differ");
  }
  if (kv_scale.element_count() != 1) return invalid("kv_scale must hold one float32");

  auto cd = ckv.dimensions();
  if (cd.size() != 3) return invalid("ckv must be [num_pages, page_size, D], got " + dims_str(cd));
  // page_size divides token positions; page ids and the table width are int32.
  if (cd[1] < 1) return invalid("ckv needs page_size >= 1, got " + dims_str(cd));
  if (cd[0] > INT32_MAX) return invalid("ckv has more than 2^31 - 1 pages: " + dims_str(cd));
  const bool kv_packed = cd[2] == dqk;
  if (!kv_packed && cd[2] != dn) return invalid("ckv last dim must be 512 or 576, got " + dims_str(cd));
  if (!kv_packed && (kpe.dimensions().size() != 3 || kpe.dimensions()[2] != dr))
    return invalid("kpe must be [num_pages, page_size, rope], got " + dims_str(kpe.dimensions()));

  auto bt = block_table.dimensions();
  auto sl = seq_lens.dimensions();
  if (sl.size() != 1 || bt.size() != 2 || bt[0] != sl[0] || qd[0] != sl[0])
    return invalid("batch sizes disagree: q " + dims_str(qd) + ", block_table " + dims_str(bt) +
                   ", seq_lens " + dims_str(sl));
  if (bt[1] > INT32_MAX) return invalid("block_table is wider than 2^31 - 1 pages: " + dims_str(bt));
  if (!elem_type_of(q_nope.element_type(), &p->q_type) || p->q_type == ElemType::kFP8E4M3)
    return invalid("query must be bfloat16 or float16");
  if (!elem_type_of(ckv.element_type(), &p->kv_type)) return invalid("cache must be bf16, f16 or float8_e4m3fn");
  if (p->kv_type != ElemType::kFP8E4M3 && p->kv_type != p->q_type)
    return invalid("query and cache dtypes differ");
  if (out.element_type() != q_nope.element_type()) return invalid("out dtype must equal the query dtype");

  p->batch = static_cast<int>(qd[0]);
  p->q_len = static_cast<int>(qd[1]);
  p->num_heads = static_cast<int>(qd[2]);
  p->num_pages = static_cast<int>(cd[0]);
  p->page_size = static_cast<int>(cd[1]);
  p->max_pages_per_seq = static_cast<int>(bt[1]);
  p->kv_lora_rank = static_cast<int>(dn);
  p->qk_rope_head_dim = static_cast<int>(dr);
  p->sm_scale = sm_scale;
  p->causal = causal;

  const int64_t kv_bytes = elem_bytes(p->kv_type);
  set_query_rows(q_nope, q_pe, q_packed, dn, dr, p);
  p->ckv = ckv.untyped_data();
  p->ckv_token_stride = cd[2];
  p->ckv_page_stride = cd[1] * cd[2];
  if (kv_packed) {
    p->kpe = static_cast<const char*>(ckv.untyped_data()) + dn * kv_bytes;
    p->kpe_token_stride = dqk;
    p->kpe_page_stride = cd[1] * dqk;
  } else {
    if (kpe.element_type() != ckv.element_type()) return invalid("ckv and kpe dtypes differ");
    if (kpe.dimensions()[0] != cd[0] || kpe.dimensions()[1] != cd[1])
      return invalid("ckv " + dims_str(cd) + " and kpe " + dims_str(kpe.dimensions()) + " disagree");
    p->kpe = kpe.untyped_data();
    p->kpe_token_stride = dr;
    p->kpe_page_stride = cd[1] * dr;
  }
  p->block_table = block_table.typed_data();
  p->seq_lens = seq_lens.typed_data();
  p->kv_scale = kv_scale.typed_data();
  p->out = out.untyped_data();
  p->lse = lse.typed_data();
  if (out.element_count() != static_cast<size_t>(p->batch) * p->q_len * p->num_heads * dn ||
      lse.element_count() != static_cast<size_t>(p->batch) * p->q_len * p->num_heads)
    return invalid("out/lse sizes do not match [B, Q, H, 512] / [B, Q, H]");
  return ffi::Error::Success();
}

ffi::Error fill_sparse_params(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer kv,
                              ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_lens,
                              ffi::Buffer<ffi::F32> attn_sink, ffi::Buffer<ffi::F32> kv_scale,
                              ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, float sm_scale,
                              int64_t kv_format, bool has_sink, int64_t kv_lora_rank,
                              int64_t qk_rope_head_dim, PagedDecodeParams* p) {
  auto invalid = [](const std::string& msg) { return invalid_argument(kSparseDecodeOp, msg); };
  const int64_t dn = kv_lora_rank, dr = qk_rope_head_dim, dqk = dn + dr;
  if (dn <= 0 || dr <= 0) return invalid("kv_lora_rank and qk_rope_head_dim must be positive");
  auto qd = q_nope.dimensions();
  if (qd.size() != 4) return invalid("q_nope must be [B, Q, H, D], got " + dims_str(qd));
  const bool q_packed = qd[3] == dqk;
  if (!q_packed && qd[3] != dn)
    return invalid("q_nope last dim must be kv_lora_rank or kv_lora_rank + rope, got " + dims_str(qd));
  if (!q_packed) {
    const std::string err = q_pe_shape_error(qd, q_pe.dimensions(), dr);
    if (!err.empty()) return invalid(err);
  }
  if (!elem_type_of(q_nope.element_type(), &p->q_type) || p->q_type == ElemType::kFP8E4M3)
    return invalid("query must be bfloat16 or float16");
  if (q_pe.element_type() != q_nope.element_type()) return invalid("q_nope and q_pe dtypes differ");
  if (out.element_type() != q_nope.element_type()) return invalid("out dtype must equal the query dtype");

  auto kd = kv.dimensions();
  if (kd.size() != 3) return invalid("kv must be [num_pages, page_size, D], got " + dims_str(kd));
  if (kd[0] < 1 || kd[1] < 1) return invalid("kv needs at least one page and slot, got " + dims_str(kd));
  if (kv_format == static_cast<int64_t>(KvFormat::kPlain)) {
    if (kd[2] != dqk) return invalid("kv_format 0 needs a packed cache [P, S, " + std::to_string(dqk) +
                                     "], got " + dims_str(kd));
    if (kv.element_type() != q_nope.element_type()) return invalid("query and cache dtypes differ");
    p->kv_format = KvFormat::kPlain;
    p->kv_type = p->q_type;
  } else if (kv_format == static_cast<int64_t>(KvFormat::kFp8DsMla)) {
    if (dn != kDsMlaScaleOffset || dr * 2 != kDsMlaRowBytes - kDsMlaRopeOffset)
      return invalid("kv_format 1 (fp8_ds_mla) needs kv_lora_rank 512 and qk_rope_head_dim 64");
    if (kv.element_type() != ffi::DataType::U8) return invalid("kv_format 1 (fp8_ds_mla) needs a uint8 cache");
    if (kd[2] != kDsMlaRowBytes)
      return invalid("kv_format 1 (fp8_ds_mla) needs a cache [P, S, 656], got " + dims_str(kd));
    p->kv_format = KvFormat::kFp8DsMla;
    p->kv_type = ElemType::kFP8E4M3;
  } else {
    return invalid("kv_format must be 0 (plain) or 1 (fp8_ds_mla), got " + std::to_string(kv_format));
  }

  auto id = indices.dimensions();
  if (id.size() != 3 || id[0] != qd[0] || id[1] != qd[1] || id[2] < 1)
    return invalid("indices must be [B, Q, K] with K >= 1 matching q " + dims_str(qd) + ", got " +
                   dims_str(id));
  auto ld = topk_lens.dimensions();
  if (ld.size() != 1 || ld[0] != qd[0])
    return invalid("topk_lens must be [B] matching q " + dims_str(qd) + ", got " + dims_str(ld));
  auto sd = attn_sink.dimensions();
  if (sd.size() != 1 || sd[0] != qd[2])
    return invalid("attn_sink must be [H] matching q " + dims_str(qd) + ", got " + dims_str(sd));
  if (kv_scale.element_count() != 1) return invalid("kv_scale must hold one float32");
  if (kd[0] * kd[1] > (int64_t{1} << 31)) return invalid("num_pages * page_size must fit in int32");
  if (id[2] > (int64_t{1} << 30)) return invalid("topk is too large");

  p->batch = static_cast<int>(qd[0]);
  p->q_len = static_cast<int>(qd[1]);
  p->num_heads = static_cast<int>(qd[2]);
  p->num_pages = static_cast<int>(kd[0]);
  p->page_size = static_cast<int>(kd[1]);
  p->max_pages_per_seq = 0;
  p->kv_lora_rank = static_cast<int>(dn);
  p->qk_rope_head_dim = static_cast<int>(dr);
  p->sm_scale = sm_scale;
  p->causal = false;

  set_query_rows(q_nope, q_pe, q_packed, dn, dr, p);
  p->ckv = kv.untyped_data();
  p->ckv_token_stride = kd[2];
  p->ckv_page_stride = kd[1] * kd[2];
  p->kpe_token_stride = kd[2];
  p->kpe_page_stride = kd[1] * kd[2];
  if (p->kv_format == KvFormat::kFp8DsMla) {
    p->kpe = static_cast<const char*>(kv.untyped_data()) + kDsMlaRopeOffset;  // bytes
  } else {
    p->kpe = static_cast<const char*>(kv.untyped_data()) + dn * elem_bytes(p->kv_type);
  }

  p->block_table = nullptr;
  p->seq_lens = nullptr;
  p->kv_scale = kv_scale.typed_data();
  p->indices = indices.typed_data();
  p->topk_lens = topk_lens.typed_data();
  p->topk = static_cast<int>(id[2]);
  p->attn_sink = has_sink ? attn_sink.typed_data() : nullptr;
  p->out = out.untyped_data();
  p->lse = lse.typed_data();
  if (out.element_count() != static_cast<size_t>(p->batch) * p->q_len * p->num_heads * dn ||
      lse.element_count() != static_cast<size_t>(p->batch) * p->q_len * p->num_heads)
    return invalid("out/lse sizes do not match [B, Q, H, kv_lora_rank] / [B, Q, H]");
  return ffi::Error::Success();
}

}  // namespace mla_jax
