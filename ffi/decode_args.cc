#include "ffi/decode_args.h"

#include <sstream>

namespace mla_jax {
namespace {

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << "]";
  return s.str();
}

ffi::Error invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("mla_jax paged decode: " + msg);
}

bool elem_type_of(ffi::DataType dt, ElemType* out) {
  switch (dt) {
    case ffi::DataType::BF16: *out = ElemType::kBF16; return true;
    case ffi::DataType::F16: *out = ElemType::kF16; return true;
    case ffi::DataType::F8E4M3FN: *out = ElemType::kFP8E4M3; return true;
    default: return false;
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
  auto qd = q_nope.dimensions();
  if (qd.size() != 4) return invalid("q_nope must be [B, Q, H, D], got " + dims_str(qd));
  const bool q_packed = qd[3] == dqk;
  if (!q_packed && qd[3] != dn) return invalid("q_nope last dim must be 512 or 576, got " + dims_str(qd));
  if (!q_packed && (q_pe.dimensions().size() != 4 || q_pe.dimensions()[3] != dr))
    return invalid("q_pe must be [B, Q, H, rope], got " + dims_str(q_pe.dimensions()));

  auto cd = ckv.dimensions();
  if (cd.size() != 3) return invalid("ckv must be [num_pages, page_size, D], got " + dims_str(cd));
  const bool kv_packed = cd[2] == dqk;
  if (!kv_packed && cd[2] != dn) return invalid("ckv last dim must be 512 or 576, got " + dims_str(cd));
  if (!kv_packed && (kpe.dimensions().size() != 3 || kpe.dimensions()[2] != dr))
    return invalid("kpe must be [num_pages, page_size, rope], got " + dims_str(kpe.dimensions()));

  auto bt = block_table.dimensions();
  auto sl = seq_lens.dimensions();
  if (sl.size() != 1 || bt.size() != 2 || bt[0] != sl[0] || qd[0] != sl[0])
    return invalid("batch sizes disagree: q " + dims_str(qd) + ", block_table " + dims_str(bt) +
                   ", seq_lens " + dims_str(sl));
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

  const int64_t q_bytes = 2;
  const int64_t kv_bytes = p->kv_type == ElemType::kFP8E4M3 ? 1 : 2;
  p->q_nope = q_nope.untyped_data();
  p->q_nope_row_stride = qd[3];
  if (q_packed) {
    p->q_pe = static_cast<const char*>(q_nope.untyped_data()) + dn * q_bytes;
    p->q_pe_row_stride = dqk;
  } else {
    p->q_pe = q_pe.untyped_data();
    p->q_pe_row_stride = dr;
  }
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

}  // namespace mla_jax
