// Host side of csrc/sm90/kv_tma.h: encodes the cache's tensor maps through
// the driver entry point that the CUDA runtime hands out (no link-time
// dependency on libcuda).
#include "csrc/sm90/kv_tma.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace mla_jax {
namespace sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows, cols] matrix of 1- or 2-byte elements with `row_stride` elements
// between rows, read in boxes of 64 rows x box_cols elements.
bool encode_box(CUtensorMap* map, const void* base, int elem, int64_t rows, int64_t cols, int64_t row_stride,
                int box_cols, CUtensorMapSwizzle swizzle) {
  auto fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride * elem)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), 64};
  const cuuint32_t elem_strides[2] = {1, 1};
  return fn(map, elem == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
            const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A [rows, cols] 16-bit matrix with `row_stride` elements between rows, read
// in 64 x 64 boxes that land in the 128-byte-swizzled K-major layout the
// wgmma operands use (decode_traits.h LayoutQK: row r of a 64-column block
// at r * 128 bytes, 16-byte chunks XORed with r % 8).
bool encode(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, int64_t row_stride) {
  return encode_box(map, base, 2, rows, cols, row_stride, 64, CU_TENSOR_MAP_SWIZZLE_128B);
}

bool aligned16(const void* base, int64_t row_stride, int elem = 2) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (row_stride * elem) % 16 == 0;
}

}  // namespace

bool kv_tma_applies(const PagedDecodeParams& p) {
  if (p.indices != nullptr || p.page_size % 64 != 0) return false;
  const int64_t rows = int64_t{p.num_pages} * p.page_size;
  // Row coordinates are int32 in the copy instruction.
  if (rows <= 0 || rows > INT32_MAX) return false;
  return aligned16(p.ckv, p.ckv_token_stride) && aligned16(p.kpe, p.kpe_token_stride);
}

void make_kv_tma(const PagedDecodeParams& p, KvTma* tma) {
  tma->enabled = 0;
  if (!kv_tma_applies(p)) return;
  const int64_t rows = int64_t{p.num_pages} * p.page_size;
  if (!encode(&tma->ckv, p.ckv, rows, 512, p.ckv_token_stride)) return;
  if (!encode(&tma->kpe, p.kpe, rows, 64, p.kpe_token_stride)) return;
  tma->enabled = 1;
}

bool kv_tma_fp8_applies(const PagedDecodeParams& p) {
  if (p.indices != nullptr || p.page_size % 64 != 0 || p.kv_format != KvFormat::kPlain ||
      p.kv_type != ElemType::kFP8E4M3)
    return false;
  const int64_t rows = int64_t{p.num_pages} * p.page_size;
  if (rows <= 0 || rows > INT32_MAX) return false;
  return aligned16(p.ckv, p.ckv_token_stride, 1) && aligned16(p.kpe, p.kpe_token_stride, 1);
}

void make_kv_tma_fp8(const PagedDecodeParams& p, KvTma* tma) {
  tma->enabled = 0;
  if (!kv_tma_fp8_applies(p)) return;
  const int64_t rows = int64_t{p.num_pages} * p.page_size;
  if (!encode_box(&tma->ckv, p.ckv, 1, rows, 512, p.ckv_token_stride, 128, CU_TENSOR_MAP_SWIZZLE_128B)) return;
  if (!encode_box(&tma->kpe, p.kpe, 1, rows, 64, p.kpe_token_stride, 64, CU_TENSOR_MAP_SWIZZLE_64B)) return;
  tma->enabled = 1;
}

}  // namespace sm90
}  // namespace mla_jax
