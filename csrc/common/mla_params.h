// Parameters shared by every paged MLA decode kernel (CPU and CUDA).
//
// The math (DeepSeek-V2, absorbed weights): for request b, query row r
// (r = i * num_heads + h for query token i and head h), visible positions p:
//   score[p] = sm_scale * kv_scale * (q_nope[r] . ckv[p] + q_pe[r] . kpe[p])
//   out[r]   = kv_scale * softmax(score) . ckv
//   lse[r]   = ln(sum_p exp(score[p]))            (natural log)
// Token p of request b lives at page block_table[b, p / page_size], slot
// p % page_size. Every pointer here addresses a row-major array; the strides
// let one struct describe both the packed ([.., 576]) and the split
// ([.., 512] + [.., 64]) layouts of query and cache without copying.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MLA_HOST_DEVICE __host__ __device__
#else
#define MLA_HOST_DEVICE
#endif

namespace mla_jax {

enum class ElemType : int { kBF16 = 0, kF16 = 1, kFP8E4M3 = 2 };

MLA_HOST_DEVICE inline int elem_bytes(ElemType type) { return type == ElemType::kFP8E4M3 ? 1 : 2; }

// How one cached token is stored.
enum class KvFormat : int {
  // ckv and kpe rows of kv_type (bf16, fp16, or e4m3 with one per-tensor
  // kv_scale), packed [.., 576] or split [.., 512] + [.., 64].
  kPlain = 0,
  // DeepSeek V3.2 "fp8_ds_mla": 656 bytes per token = 512 e4m3 ckv values,
  // 4 float32 scales (one per 128 values), 64 bf16 kpe values.
  kFp8DsMla = 1,
};

// Byte offsets inside one fp8_ds_mla token row.
constexpr int kDsMlaRowBytes = 656;
constexpr int kDsMlaScaleOffset = 512;
constexpr int kDsMlaRopeOffset = 528;
constexpr int kDsMlaGroup = 128;  // ckv values per float32 scale

struct PagedDecodeParams {
  // Query rows, flattened over [B, q_len, num_heads]: row index
  // (b * q_len + i) * num_heads + h. Strides are in elements.
  const void* q_nope = nullptr;
  const void* q_pe = nullptr;
  int64_t q_nope_row_stride = 0;
  int64_t q_pe_row_stride = 0;

  // Latent cache [num_pages, page_size, ...]; strides in elements.
  const void* ckv = nullptr;
  const void* kpe = nullptr;
  int64_t ckv_page_stride = 0, ckv_token_stride = 0;
  int64_t kpe_page_stride = 0, kpe_token_stride = 0;

  const int32_t* block_table = nullptr;  // [batch, max_pages_per_seq]
  const int32_t* seq_lens = nullptr;     // [batch]
  const float* kv_scale = nullptr;       // scalar on the device, or nullptr (= 1)

  void* out = nullptr;    // [batch, q_len, num_heads, kv_lora_rank], query dtype
  float* lse = nullptr;   // [batch, q_len, num_heads]

  int batch = 0;
  int q_len = 1;
  int num_heads = 0;
  int num_pages = 0;
  int page_size = 0;
  int max_pages_per_seq = 0;
  int kv_lora_rank = 512;      // ckv width == output width
  int qk_rope_head_dim = 64;   // kpe width
  float sm_scale = 1.0f;
  bool causal = true;
  ElemType q_type = ElemType::kBF16;   // also the output type
  ElemType kv_type = ElemType::kBF16;
  KvFormat kv_format = KvFormat::kPlain;   // kFp8DsMla: ckv points at uint8 [P, S, 656] rows

  // Sparse top-k mode (DeepSeek V3.2), active when indices != nullptr: each
  // query token is its own request r = b * q_len + i with q_len 1 and the
  // heads as rows; its positions are indices[r * topk + t] for
  // t < min(topk_lens[b], topk) (all topk when topk_lens is null). A
  // position is a global slot page * page_size + offset; -1 or any value
  // outside [0, num_pages * page_size) is padding: never read, masked out.
  // block_table and causal are unused then.
  const int32_t* indices = nullptr;    // [batch, q_len, topk]
  const int32_t* topk_lens = nullptr;  // [batch] or nullptr
  int topk = 0;
  // Optional per-head attention sink (FlashMLA semantics): out is scaled by
  // exp(lse) / (exp(lse) + exp(sink[h])); lse is unchanged.
  const float* attn_sink = nullptr;    // [num_heads] or nullptr
  // Sparse mode as the CUDA kernels run it (batch B * q_len requests of one
  // token each): query tokens per batch entry, so request r reads
  // topk_lens[r / sparse_group].
  int sparse_group = 1;

  MLA_HOST_DEVICE int rows_per_request() const { return q_len * num_heads; }
  // Largest valid seq_lens value: longer requests are rejected (NaN output).
  MLA_HOST_DEVICE int64_t max_seq_len() const {
    return static_cast<int64_t>(max_pages_per_seq) * page_size;
  }
};

// Number of positions query token i (0-based, of q_len) of a request of
// seq_len cached tokens may attend to. Negative results mean none.
MLA_HOST_DEVICE inline int64_t visible_len(int64_t seq_len, int q_len, int i, bool causal) {
  return causal ? seq_len - q_len + i + 1 : seq_len;
}

}  // namespace mla_jax
