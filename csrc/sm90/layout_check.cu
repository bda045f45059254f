// Host-side check of the layout facts the Hopper kernel relies on (it
// needs no GPU; tests/test_sm90_layout.py builds and runs it with nvcc):
//   - qk_chunk_offset() is where CuTe's LayoutQK puts each 16-byte chunk
//     (the cp.async copies write there, wgmma reads through CuTe), and
//     where LayoutP puts P's (the softmax stores P there);
//   - each warpgroup's MN-major V view addresses the same bytes as the
//     K-major KV tile, and local_tile's token half is the tile's rows;
//   - the wgmma accumulator layouts: thread t's element i lies in row
//     accumulator_row_base(t) + 8 * accumulator_row_half(i), i.e.
//     (t / 32) * 16 + (t % 32) / 4 + 8 * ((i / 2) % 2), and column
//     accumulator_col(t, i) = 2 * (t % 4) + i % 2 + 8 * (i / 4), so
//     elements 2k, 2k + 1 are adjacent columns of one row.
//   - the swap-AB kernel (swapab_traits.h): kmajor_offset() is where its
//     LayoutP puts each element, query_fp8_offset() where LayoutQn and
//     LayoutQr put the FP8 query's, and its S^T A operand layouts (LayoutKn,
//     LayoutKr) are the TMA boxes' bytes; its register A operand (m64k16)
//     and its accumulators hold, in element e of thread t, row
//     accumulator_row_base(t) + 8 * ((e / 2) % 2) and column (k)
//     accumulator_col(t, e), the mapping its conversions fill them by;
//     its sparse form's bf16 kpe operands (LayoutKr, LayoutQr) are where
//     the cp.async gathers and kmajor_offset() put them, and its kpe S^T
//     accumulator (MmaSr) is laid out as the ckv one.
//   - the seesaw kernel's in-place conversion of dense e4m3 tiles
//     (kv_convert.cuh, SeesawConvertMap / convert_seesaw_half): every raw
//     16-byte chunk a thread reads is where the TMA boxes' swizzle put the
//     cache bytes it converts, every output chunk is qk_chunk_offset's for
//     those features, each half's raw and output chunks are covered exactly
//     once, inside that half's own blocks, and no chunk is written before
//     every read of its bytes is behind a barrier of the warpgroup.
// Exit status 0 when every check holds.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "csrc/sm90/decode_kernel.cuh"
#include "csrc/sm90/kv_convert.cuh"
#include "csrc/sm90/swapab_traits.h"

using namespace cute;

template <typename Tr>
int check_traits(const char* name) {
  int bad = 0;
  alignas(1024) static typename Tr::Elem buf[Tr::kBlockM * Tr::kDimQK];
  auto sK = make_tensor(make_smem_ptr(buf), typename Tr::LayoutQK{});
  const char* base = reinterpret_cast<const char*>(buf);
  for (int r = 0; r < Tr::kBlockN; ++r) {
    for (int c = 0; c < Tr::kDimQK; ++c) {
      const long at = reinterpret_cast<const char*>(&sK(r, c)) - base;
      const long want = mla_jax::sm90::qk_chunk_offset(r, c / 8) + (c % 8) * 2;
      if (at != want && bad++ < 5) std::printf("%s: tile(%d, %d) at %ld, qk_chunk_offset says %ld\n", name, r, c, at, want);
      if (c < Tr::kDimNope) {
        const int w = c / Tr::kOCols;
        auto sV = make_tensor(make_smem_ptr(buf + w * (Tr::kOCols / 64) * 4096), typename Tr::LayoutVHalf{});
        const long v_at = reinterpret_cast<const char*>(&sV(c % Tr::kOCols, r)) - base;
        if (v_at != at && bad++ < 5) std::printf("%s: V(%d, %d) at %ld, K(%d, %d) at %ld\n", name, c, r, v_at, r, c, at);
      }
      const int w = r / Tr::kSCols;
      auto half = local_tile(sK, Shape<Int<Tr::kSCols>, Int<Tr::kDimQK>>{}, make_coord(w, 0));
      if (&half(r % Tr::kSCols, c) != &sK(r, c) && bad++ < 5) std::printf("%s: K half mismatch at (%d, %d)\n", name, r, c);
    }
  }
  // P: the kernel stores it at qk_chunk_offset(row, col / 8) + (col % 8) * 2.
  auto sP = make_tensor(make_smem_ptr(buf), typename Tr::LayoutP{});
  for (int r = 0; r < Tr::kBlockM; ++r) {
    for (int c = 0; c < Tr::kBlockN; ++c) {
      const long at = reinterpret_cast<const char*>(&sP(r, c)) - base;
      const long want = mla_jax::sm90::qk_chunk_offset(r, c / 8) + (c % 8) * 2;
      if (at != want && bad++ < 5) std::printf("%s: P(%d, %d) at %ld, expected %ld\n", name, r, c, at, want);
    }
  }
  auto check_acc = [&](auto mma, auto shape, const char* which) {
    for (int t = 0; t < 128; ++t) {
      auto coords = mma.get_thread_slice(t).partition_C(make_identity_tensor(shape));
      for (int i = 0; i < size(coords); ++i) {
        const int row = get<0>(coords(i)), col = get<1>(coords(i));
        const int want_row =
            mla_jax::sm90::accumulator_row_base(t) + 8 * mla_jax::sm90::accumulator_row_half(i);
        if (row != want_row && bad++ < 5) std::printf("%s %s: thread %d element %d in row %d, expected %d\n", name, which, t, i, row, want_row);
        const int want_col = mla_jax::sm90::accumulator_col(t, i);
        if (col != want_col && bad++ < 5) std::printf("%s %s: thread %d element %d in column %d, expected %d\n", name, which, t, i, col, want_col);
        if (i % 2 == 1) {
          const int prow = get<0>(coords(i - 1)), pcol = get<1>(coords(i - 1));
          if ((prow != row || pcol + 1 != col) && bad++ < 5) std::printf("%s %s: elements %d, %d not adjacent\n", name, which, i - 1, i);
        }
      }
    }
  };
  check_acc(make_tiled_mma(typename Tr::MmaS{}), Shape<Int<Tr::kBlockM>, Int<Tr::kSCols>>{}, "S");
  check_acc(make_tiled_mma(typename Tr::MmaO{}), Shape<Int<Tr::kBlockM>, Int<Tr::kOCols>>{}, "O");
  // The seesaw kernel's P from registers: element i of the m64n256k16 A
  // fragment (4 k-steps over 64 tokens) is element i of the m64n64 S
  // accumulator, for every thread.
  {
    auto mma_s = make_tiled_mma(typename Tr::MmaSTile{});
    auto mma_p = make_tiled_mma(typename Tr::MmaORegs{});
    auto ident = make_identity_tensor(Shape<Int<Tr::kBlockM>, Int<Tr::kBlockN>>{});
    for (int t = 0; t < 128; ++t) {
      auto c_coords = mma_s.get_thread_slice(t).partition_C(ident);
      auto a_coords = mma_p.get_thread_slice(t).partition_A(ident);
      auto frag = mma_p.get_thread_slice(t).partition_fragment_A(sP);
      // (as ints: CuTe's operators on static sizes do not short-circuit)
      const int n_c = int(size(c_coords)), n_a = int(size(a_coords)), n_f = int(size(frag));
      if ((n_a != n_c || n_f != n_c) && bad++ < 5)
        std::printf("%s: P fragment size %d, S accumulator %d\n", name, n_a, n_c);
      for (int i = 0; i < n_c && i < n_a; ++i) {
        const bool same = get<0>(a_coords(i)) == get<0>(c_coords(i)) && get<1>(a_coords(i)) == get<1>(c_coords(i));
        if (!same && bad++ < 5)
          std::printf("%s: thread %d P element %d at (%d, %d), S element at (%d, %d)\n", name, t, i,
                      int(get<0>(a_coords(i))), int(get<1>(a_coords(i))), int(get<0>(c_coords(i))),
                      int(get<1>(c_coords(i))));
      }
    }
  }
  check_acc(make_tiled_mma(typename Tr::MmaSTile{}), Shape<Int<Tr::kBlockM>, Int<Tr::kBlockN>>{}, "S tile");
  std::printf("%s: %s\n", name, bad ? "FAILED" : "ok");
  return bad;
}

template <typename Tr>
int check_swapab(const char* name) {
  using mla_jax::sm90::accumulator_col;
  using mla_jax::sm90::accumulator_row_base;
  int bad = 0;
  constexpr int kN = Tr::kN;
  constexpr int kNS = Tr::kNS;
  alignas(1024) static typename Tr::Elem buf[kN * Tr::kDimQK];
  alignas(1024) static typename Tr::ElemS buf8[Tr::kStageBytes > kNS * Tr::kDimQK ? Tr::kStageBytes : kNS * Tr::kDimQK];
  const char* base = reinterpret_cast<const char*>(buf);
  const char* base8 = reinterpret_cast<const char*>(buf8);
  auto sP = make_tensor(make_smem_ptr(buf), typename Tr::LayoutP{});
  for (int r = 0; r < kN; ++r) {
    for (int k = 0; k < Tr::kBlockN; ++k) {
      const long p_at = reinterpret_cast<const char*>(&sP(r, k)) - base;
      if (p_at != mla_jax::sm90::kmajor_offset<kN>(r, k) && bad++ < 5) std::printf("%s: P(%d, %d) misplaced\n", name, r, k);
    }
  }
  // The FP8 query operand (LayoutQn, then LayoutQr) is where
  // query_fp8_offset() writes it.
  using ElemR = typename Tr::ElemR;
  auto sQn = make_tensor(make_smem_ptr(buf8), typename Tr::LayoutQn{});
  auto sQr = make_tensor(make_smem_ptr(reinterpret_cast<ElemR*>(buf8 + Tr::kQRopeOffset)), typename Tr::LayoutQr{});
  for (int r = 0; r < kNS; ++r) {
    for (int k = 0; k < (Tr::kSparse ? 512 : Tr::kDimQK); ++k) {
      const long at = k < 512 ? reinterpret_cast<const char*>(&sQn(r, k)) - base8
                              : reinterpret_cast<const char*>(&sQr(r, k - 512)) - base8;
      if (at != mla_jax::sm90::query_fp8_offset<kNS>(r, k) && bad++ < 5)
        std::printf("%s: Q(%d, %d) at %ld, query_fp8_offset says %d\n", name, r, k, at,
                    mla_jax::sm90::query_fp8_offset<kNS>(r, k));
    }
  }
  if constexpr (Tr::kSparse) {
    // The bf16 kpe part of the query: kNq rows, written at kmajor_offset().
    for (int r = 0; r < Tr::kNq; ++r) {
      for (int k = 0; k < Tr::kDimRope; ++k) {
        const long at = reinterpret_cast<const char*>(&sQr(r, k)) - base8;
        const long want = Tr::kQRopeOffset + mla_jax::sm90::kmajor_offset<Tr::kNq>(r, k);
        if (at != want && bad++ < 5) std::printf("%s: Q rope(%d, %d) at %ld, expected %ld\n", name, r, k, at, want);
      }
    }
  }
  // The stage as the S^T A operand (LayoutKn, LayoutKr) is the bytes the
  // TMA boxes write: ckv box f / 128 with 16-byte chunk c of row r at
  // c ^ (r % 8) (SWIZZLE_128B), the kpe box with chunk c at c ^ ((r / 2) % 4)
  // (SWIZZLE_64B: address bits 4-5 XOR bits 7-8).
  auto sKn = make_tensor(make_smem_ptr(buf8), typename Tr::LayoutKn{});
  // Sparse: the kpe part is bf16, 16-byte chunk c (8 values) of token r at
  // r * 128 + (c ^ (r % 8)) * 16, where the gathers write it.
  auto sKr = make_tensor(make_smem_ptr(reinterpret_cast<ElemR*>(buf8 + Tr::kRopeOffset)), typename Tr::LayoutKr{});
  for (int r = 0; r < Tr::kBlockN; ++r) {
    for (int f = 0; f < Tr::kDimQK; ++f) {
      const long at = f < 512 ? reinterpret_cast<const char*>(&sKn(r, f)) - base8
                              : reinterpret_cast<const char*>(&sKr(r, f - 512)) - base8;
      const int fr = f - 512;
      const long want = f < 512 ? (f / 128) * Tr::kCkvBoxBytes + r * 128 + ((((f / 16) % 8) ^ (r % 8)) * 16) + f % 16
                        : Tr::kSparse ? Tr::kRopeOffset + r * 128 + ((((fr / 8) % 8) ^ (r % 8)) * 16) + (fr % 8) * 2
                                      : Tr::kRopeOffset + r * 64 + ((((fr / 16) % 4) ^ ((r / 2) % 4)) * 16) + fr % 16;
      if (at != want && bad++ < 5) std::printf("%s: K(%d, %d) at %ld, the TMA box puts it at %ld\n", name, r, f, at, want);
    }
  }
  auto mma = make_tiled_mma(typename Tr::MmaO{});
  auto mma_s = make_tiled_mma(typename Tr::MmaS{});
  auto check = [&](auto coords, int t, const char* which) {
    for (int e = 0; e < int(size(coords)); ++e) {
      const int row = get<0>(coords(e)), col = get<1>(coords(e));
      const int want_row = accumulator_row_base(t) + 8 * ((e >> 1) & 1), want_col = accumulator_col(t, e);
      if ((row != want_row || col != want_col) && bad++ < 5)
        std::printf("%s %s: thread %d element %d at (%d, %d), expected (%d, %d)\n", name, which, t, e, row, col,
                    want_row, want_col);
    }
  };
  for (int t = 0; t < 128; ++t) {
    auto thr = mma.get_thread_slice(t);
    check(thr.partition_A(make_identity_tensor(Shape<_64, _16>{})), t, "A");
    check(thr.partition_C(make_identity_tensor(Shape<_64, Int<kN>>{})), t, "C");
    check(mma_s.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, Int<kNS>>{})), t, "S^T C");
    check(make_tiled_mma(typename Tr::MmaSr{}).get_thread_slice(t).partition_C(
              make_identity_tensor(Shape<_64, Int<Tr::kSparse ? Tr::kNq : kNS>>{})),
          t, "S^T kpe C");
    // The O^T accumulator's m-block mb holds rows 64 mb + the same rows.
    auto o = thr.partition_C(make_identity_tensor(Shape<Int<Tr::kOFeatures>, Int<kN>>{}));
    for (int i = 0; i < int(size(o)); ++i) {
      const int e = i % (kN / 2), mb = i / (kN / 2);
      if ((get<0>(o(i)) != 64 * mb + accumulator_row_base(t) + 8 * ((e >> 1) & 1) || get<1>(o(i)) != accumulator_col(t, e)) &&
          bad++ < 5)
        std::printf("%s O: thread %d element %d at (%d, %d)\n", name, t, i, int(get<0>(o(i))), int(get<1>(o(i))));
    }
  }
  std::printf("%s: %s\n", name, bad ? "FAILED" : "ok");
  return bad;
}

// The TMA swizzles as functions of a byte offset inside a box whose base is
// aligned to the pattern's period (1024 and 512 bytes): 16-byte chunk bits
// [4, 7) (128B) or [4, 6) (64B) XORed with bits [7, 10) or [7, 9).
int swizzle128(int x) { return x ^ (((x >> 7) & 7) << 4); }
int swizzle64(int x) { return x ^ (((x >> 7) & 3) << 4); }

template <typename Tr, bool kHigh>
int check_seesaw_half(const char* name) {
  using mla_jax::sm90::qk_chunk_offset;
  using M = mla_jax::sm90::SeesawConvertMap;
  struct Access {
    int off;
    bool write;
    int phase;  // warpgroup barriers passed before it (convert_seesaw_half's comments)
  };
  std::vector<Access> acc;
  int bad = 0;
  auto expect = [&](int got, int want, const char* what, int t, int k) {
    if (got != want && bad++ < 5)
      std::printf("%s: %s of thread %d, k %d at %d, expected %d\n", name, what, t, k, got, want);
  };
  for (int t = 0; t < 128; ++t) {
    const int i = t % 8, out_even = M::out_ckv<kHigh>(t);
    for (int box = 0; box < 2; ++box) {
      for (int k = 0; k < 4; ++k) {
        const int r = t / 8 + 16 * k;
        const int feature = 256 * kHigh + 128 * box + 16 * i;  // first of the chunk's 16 e4m3 values
        const int raw = M::raw_ckv<Tr, kHigh>(t) + box * M::kRawBoxStride + k * M::kRowStride;
        const int out = out_even + box * M::kOutBoxStride + k * M::kRowStride;
        const int out_odd = (out_even ^ 16) + box * M::kOutBoxStride + k * M::kRowStride;
        expect(raw, (kHigh ? Tr::kSeeRawHi : Tr::kSeeRawLo) + box * 8192 + swizzle128(r * 128 + 16 * i), "raw ckv", t, k);
        expect(out, qk_chunk_offset(r, feature / 8), "ckv output", t, k);
        expect(out_odd, qk_chunk_offset(r, feature / 8 + 1), "ckv output (odd)", t, k);
        const int read_phase = kHigh && box == 1 ? 1 : 0;
        const int write_phase = box == 0 ? 0 : 1;
        acc.push_back({raw, false, read_phase});
        acc.push_back({out, true, write_phase});
        acc.push_back({out_odd, true, write_phase});
      }
    }
    if (kHigh) {
      const int rope_raw = M::raw_rope<Tr>(t), rope_out = M::out_rope<Tr>(t);
      for (int k = 0; k < 2; ++k) {
        const int r = t / 4 + 32 * k, q = t % 4;
        const int raw = rope_raw + k * M::kRopeRawStride;
        const int out = rope_out + k * M::kRopeOutStride, out_odd = (rope_out ^ 16) + k * M::kRopeOutStride;
        expect(raw, Tr::kSeeRawRope + swizzle64(r * 64 + 16 * q), "raw kpe", t, k);
        expect(out, qk_chunk_offset(r, Tr::kNopeChunks + 2 * q), "kpe output", t, k);
        expect(out_odd, qk_chunk_offset(r, Tr::kNopeChunks + 2 * q + 1), "kpe output (odd)", t, k);
        acc.push_back({raw, false, 0});
        acc.push_back({out, true, 2});
        acc.push_back({out_odd, true, 2});
      }
    }
  }
  // Coverage, containment and ordering, by 16-byte chunk of the stage.
  const int lo = kHigh ? 4 * 8192 : 0, hi = kHigh ? 9 * 8192 : 4 * 8192;
  std::vector<int> writes(Tr::kTileBytes / 16, 0), reads(Tr::kTileBytes / 16, 0), last_read(Tr::kTileBytes / 16, -1);
  for (const Access& a : acc) {
    if (a.off % 16 != 0 || a.off < lo || a.off >= hi) {
      if (bad++ < 5) std::printf("%s: %s at %d outside the half's blocks\n", name, a.write ? "write" : "read", a.off);
      continue;
    }
    if (a.write) {
      ++writes[a.off / 16];
    } else {
      ++reads[a.off / 16];
      last_read[a.off / 16] = std::max(last_read[a.off / 16], a.phase);
    }
  }
  int raw_chunks = 0;
  for (int c = lo / 16; c < hi / 16; ++c) {
    if (writes[c] != 1 && bad++ < 5) std::printf("%s: output chunk at %d written %d times\n", name, c * 16, writes[c]);
    if (reads[c] > 1 && bad++ < 5) std::printf("%s: raw chunk at %d read %d times\n", name, c * 16, reads[c]);
    raw_chunks += reads[c];
  }
  const int want_raw = (2 * 64 * 128 + (kHigh ? 64 * 64 : 0)) / 16;
  if (raw_chunks != want_raw && bad++ < 5) std::printf("%s: %d raw chunks read, expected %d\n", name, raw_chunks, want_raw);
  for (const Access& a : acc) {
    if (a.write && a.off >= lo && a.off < hi && last_read[a.off / 16] >= a.phase && bad++ < 5)
      std::printf("%s: chunk at %d written in phase %d, read in phase %d\n", name, a.off, a.phase, last_read[a.off / 16]);
  }
  return bad;
}

template <typename Tr>
int check_seesaw_convert(const char* name) {
  const int bad = check_seesaw_half<Tr, false>(name) + check_seesaw_half<Tr, true>(name);
  if (!bad) std::printf("%s: ok\n", name);
  return bad;
}

// fp8_ds_mla rows in the seesaw kernel (kv_convert.cuh: SeesawDsMap,
// gather_seesaw_half_ds, convert_seesaw_half_ds), byte by byte over one half:
// what each thread's gather copies where (source byte of the 656-byte row
// -> stage byte), that the conversion turns every gathered ckv chunk into the
// LayoutQK chunks of its features with its own group's scale, that the gathers
// and the converted output each cover the half exactly once (the kpe block by
// the gather alone), and that no conversion phase writes a byte that any
// thread reads in that phase or a later one.
template <typename Tr, bool kHigh>
int check_seesaw_ds_half(const char* name) {
  using mla_jax::kDsMlaRopeOffset;
  using mla_jax::kDsMlaScaleOffset;
  using mla_jax::sm90::qk_chunk_offset;
  using M = mla_jax::sm90::SeesawDsMap;
  using C = mla_jax::sm90::SeesawConvertMap;
  int bad = 0;
  const int lo = kHigh ? 4 * 8192 : 0, hi = kHigh ? 9 * 8192 : 4 * 8192;
  // Per stage byte: (row, source byte) the gathers put there, or -1.
  std::vector<int> src_row(Tr::kTileBytes, -1), src_byte(Tr::kTileBytes, -1);
  std::vector<int> written(Tr::kTileBytes, 0), last_read(Tr::kTileBytes, -1), first_write(Tr::kTileBytes, 99);
  auto gathered = [&](int at, int row, int byte, int n) {
    for (int j = 0; j < n; ++j) {
      if (at + j < lo || at + j >= hi) {
        if (bad++ < 5) std::printf("%s: gather of row %d byte %d lands at %d, outside the half\n", name, row, byte + j, at + j);
        return;
      }
      if (src_row[at + j] >= 0 && bad++ < 5) std::printf("%s: two gathers write stage byte %d\n", name, at + j);
      src_row[at + j] = row;
      src_byte[at + j] = byte + j;
    }
  };
  for (int t = 0; t < 128; ++t) {
    const int i = t % 8, r0 = t / 8;
    for (int k = 0; k < 4; ++k) {
      const int r = r0 + 16 * k;
      for (int box = 0; box < 2; ++box) {
        const int at = M::raw_ckv<Tr, kHigh>(t, box) + k * M::kRowStride;
        const int byte = M::source_ckv<kHigh>(t, box);
        if (at != M::raw_box<Tr, kHigh>(box) + swizzle128(r * 128 + 16 * i) && bad++ < 5)
          std::printf("%s: raw ckv of thread %d k %d box %d at %d, not the box's swizzled chunk\n", name, t, k, box, at);
        gathered(at, r, byte, 16);
      }
      if (kHigh) {
        const int at = M::kpe<Tr>(t) + k * M::kRowStride;
        gathered(at, r, M::source_kpe(t), 16);
        if (at != qk_chunk_offset(r, Tr::kNopeChunks + i) || M::source_kpe(t) != kDsMlaRopeOffset + 16 * i)
          if (bad++ < 5) std::printf("%s: kpe chunk of thread %d k %d misplaced\n", name, t, k);
      }
      if (M::scale_k(t) == k) gathered(M::scales<Tr, kHigh>(r), r, M::source_scales<kHigh>(), 8);
    }
  }
  int gathered_bytes = 0;
  for (int b = lo; b < hi; ++b) gathered_bytes += src_row[b] >= 0;
  const int want_gathered = 64 * (256 + 8 + (kHigh ? 128 : 0));
  if (gathered_bytes != want_gathered && bad++ < 5)
    std::printf("%s: %d bytes gathered, expected %d\n", name, gathered_bytes, want_gathered);
  // The conversion, phase by phase: reads (scales in phase 0, both raw boxes
  // in phase 1), writes (box 0 in phase 1, box 1 in phase 2).
  auto read = [&](int at, int n, int phase, int row, int byte) {
    for (int j = 0; j < n; ++j) {
      last_read[at + j] = std::max(last_read[at + j], phase);
      if ((src_row[at + j] != row || src_byte[at + j] != byte + j) && bad++ < 5)
        std::printf("%s: conversion reads stage byte %d as row %d byte %d, the gather put row %d byte %d there\n", name,
                    at + j, row, byte + j, src_row[at + j], src_byte[at + j]);
    }
  };
  auto write = [&](int at, int phase) {
    for (int j = 0; j < 16; ++j) {
      ++written[at + j];
      first_write[at + j] = std::min(first_write[at + j], phase);
    }
  };
  for (int t = 0; t < 128; ++t) {
    const int r0 = t / 8;
    const int out_even = C::out_ckv<kHigh>(t);
    for (int k = 0; k < 4; ++k) {
      const int r = r0 + 16 * k;
      read(M::scales<Tr, kHigh>(r), 8, 0, r, kDsMlaScaleOffset + 8 * kHigh);
      for (int box = 0; box < 2; ++box) {
        const int byte = M::source_ckv<kHigh>(t, box);
        read(M::raw_ckv<Tr, kHigh>(t, box) + k * M::kRowStride, 16, 1, r, byte);
        // 16 e4m3 values = features [byte, byte + 16): LayoutQK chunks byte / 8 and + 1,
        // scaled by group byte / 128, which is scale .x (box 0) or .y (box 1) of the
        // pair at bytes 2 kHigh, 2 kHigh + 1 of the four.
        if (byte / 128 != 2 * kHigh + box && bad++ < 5)
          std::printf("%s: thread %d box %d converts group %d with scale %d\n", name, t, box, byte / 128, 2 * kHigh + box);
        const int out = out_even + box * M::kOutBoxStride + k * M::kRowStride;
        if (out != qk_chunk_offset(r, byte / 8) && bad++ < 5)
          std::printf("%s: thread %d k %d box %d writes %d, LayoutQK has row %d feature %d at %d\n", name, t, k, box, out,
                      r, byte, qk_chunk_offset(r, byte / 8));
        if ((out ^ 16) != qk_chunk_offset(r, byte / 8 + 1) && bad++ < 5)
          std::printf("%s: thread %d k %d box %d odd chunk at %d\n", name, t, k, box, out ^ 16);
        write(out, box == 0 ? 1 : 2);
        write(out ^ 16, box == 0 ? 1 : 2);
      }
    }
  }
  for (int b = lo; b < hi; ++b) {
    const bool rope = kHigh && b >= 8 * 8192;
    if (written[b] != (rope ? 0 : 1) && bad++ < 5)
      std::printf("%s: stage byte %d written %d times by the conversion\n", name, b, written[b]);
    if (rope && src_row[b] < 0 && bad++ < 5) std::printf("%s: kpe byte %d not gathered\n", name, b);
    if (written[b] > 0 && last_read[b] >= first_write[b] && bad++ < 5)
      std::printf("%s: stage byte %d written in phase %d, read in phase %d\n", name, b, first_write[b], last_read[b]);
  }
  return bad;
}

template <typename Tr>
int check_seesaw_ds(const char* name) {
  using M = mla_jax::sm90::SeesawDsMap;
  using mla_jax::sm90::accumulator_col;
  int bad = check_seesaw_ds_half<Tr, false>(name) + check_seesaw_ds_half<Tr, true>(name);
  for (int t = 0; t < 128; ++t) {
    // The row shuffle: word k / 2 of lane row_lane holds token r0 + 16 k.
    for (int k = 0; k < 4; ++k)
      if ((k >> 1) * 32 + M::row_lane(t, k) != t / 8 + 16 * k && bad++ < 5)
        std::printf("%s: thread %d takes the row of token %d for token %d\n", name, t,
                    (k >> 1) * 32 + M::row_lane(t, k), t / 8 + 16 * k);
    // The mask: element i of the m64n64 S accumulator is token col = accumulator_col(t, i),
    // bit col % 32 of ballot word col / 32; shifted right by mask_shift(t) it must be a
    // bit kMaskKeep keeps, and word 1's bits sit 2 higher. Every kept bit is used once.
    uint32_t used = 0;
    for (int i = 0; i < 32; ++i) {
      const int col = accumulator_col(t, i);
      const int kept = col % 32 - M::mask_shift(t);
      const bool ok = kept >= 0 && ((M::kMaskKeep >> kept) & 1u) && M::mask_bit(i) == kept + 2 * (col / 32);
      if (!ok && bad++ < 5) std::printf("%s: mask of thread %d element %d (token %d) at bit %d\n", name, t, i, col, M::mask_bit(i));
      if (ok) used |= 1u << M::mask_bit(i);
    }
    if (used != (M::kMaskKeep | (M::kMaskKeep << 2)) && bad++ < 5)
      std::printf("%s: thread %d uses mask bits %08x\n", name, t, used);
  }
  if (!bad) std::printf("%s: ok\n", name);
  return bad;
}

int main() {
  int bad = check_traits<mla_jax::sm90::DecodeTraits<__nv_bfloat16>>("bf16");
  bad += check_traits<mla_jax::sm90::DecodeTraits<__half>>("fp16");
  bad += check_swapab<mla_jax::sm90::SwapAbTraits<__nv_bfloat16, 16>>("swapab16");
  bad += check_swapab<mla_jax::sm90::SwapAbTraits<__nv_bfloat16, 32>>("swapab32");
  bad += check_swapab<mla_jax::sm90::SwapAbTraits<__half, 16>>("swapab16 fp16");
  bad += check_swapab<mla_jax::sm90::SwapAbTraits<__half, 32>>("swapab32 fp16");
  bad += check_swapab<mla_jax::sm90::SwapAbTraits<__nv_bfloat16, 16, mla_jax::sm90::kSwapAbWarpgroups,
                                                  mla_jax::sm90::kSwapAbStages, true>>("swapab16 sparse");
  bad += check_swapab<mla_jax::sm90::SwapAbTraits<__nv_bfloat16, 32, mla_jax::sm90::kSwapAbWarpgroups,
                                                  mla_jax::sm90::kSwapAbStages, true>>("swapab32 sparse");
  bad += check_seesaw_convert<mla_jax::sm90::DecodeTraits<__nv_bfloat16, mla_jax::sm90::KvLoad::kFp8>>("seesaw e4m3");
  bad += check_seesaw_convert<mla_jax::sm90::DecodeTraits<__half, mla_jax::sm90::KvLoad::kFp8>>("seesaw e4m3 fp16");
  bad += check_seesaw_ds<mla_jax::sm90::DecodeTraits<__nv_bfloat16, mla_jax::sm90::KvLoad::kDsMla>>("seesaw fp8_ds_mla");
  return bad ? 1 : 0;
}
