// The row-invariant GEMM's driver and register tile, written once over a vector
// type (row_gemm.h states the contract). Included by the file of each ISA, which
// compiles it with that ISA's flags: row_gemm.cc (AVX2), row_gemm_avx512.cc.
//
// Loops (BLIS's, B already in panels or packed per k block):
//   k blocks of kRowGemmKc  >  row blocks of kMc (A packed: MR-row panels [kc][MR])
//     >  panels of NR columns  >  MR rows: the MR x NR tile sums its k block from
//        zero in registers, then adds the old C (from the second block on).
// A panel's k block (kc x NR values, 16 KB on AVX2) stays in L1 while every
// MR-row panel of the row block passes it; the row block's packed A stays in L2.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_ops.h"
#include "moe/base/check.h"
#include "row_gemm.h"

namespace moe::kernels::cpu::row_gemm_impl {

constexpr int64_t kKc = kRowGemmKc;
constexpr int64_t kMc = 96;  // rows per packed A block: a multiple of every MR
constexpr int64_t kMaxNr = 32, kMaxMr = 12;

// Scratch, from its first 64-byte boundary: packed A [kMc][kKc] | an edge tile
// [kMaxMr][kMaxNr] | packed B [n_pad][kKc].
inline float* a_pack(void* scratch) {
  const auto at = reinterpret_cast<uintptr_t>(scratch);
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t{63});
}
inline float* edge_tile(void* scratch) { return a_pack(scratch) + kMc * kKc; }
inline float* b_pack(void* scratch) { return edge_tile(scratch) + kMaxMr * kMaxNr; }

// Rows [0, rows) of A's k block [kc] into mr-row panels [kc][mr]; a last panel
// of fewer rows leaves its other lanes unread (row_gemm.cc: AVX2, shared by every
// kernel).
void pack_a(const float* a, int64_t lda, int64_t rows, int64_t kc, int mr, float* out);

// The k block [pc, pc + kc) of b's weight as fp32 panels [ceil(n / nr)][kc][nr]
// (row_gemm.cc: AVX2, shared by every kernel).
void pack_b_block(const RowGemmB& b, int64_t nr, int64_t pc, int64_t kc, float* out);

template <class V>
struct Kernel {
  using Reg = typename V::Reg;
  static constexpr int L = V::kLanes, NR = 2 * L, MR = V::kMr;
  static_assert(NR <= kMaxNr && MR <= kMaxMr && kMc % MR == 0, "tile sizes fit the scratch");
  static_assert(MR % 8 == 0 || MR % 8 == 4 || MR % 8 == 6, "pack_a stores groups of 8, 6 or 4 rows");

  // The R x NR tile at c (row stride ldc): sums k in [0, kc) of ap (an MR-row
  // panel) times bp (kc rows of NR values of BT) from zero, then adds the old C
  // when add. Every lane is one C element's chain.
  template <int R, class BT>
  static void tile(int64_t kc, const float* ap, const void* bpv, float* c, int64_t ldc, bool add) {
    const BT* bp = static_cast<const BT*>(bpv);
    Reg acc[R][2];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
    if (add) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + NR - 1), _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
      Reg b0, b1;
      V::load_b(bp + k * NR, b0, b1);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const Reg av = V::bcast(ap + k * MR + r);
        acc[r][0] = V::fma(av, b0, acc[r][0]);
        acc[r][1] = V::fma(av, b1, acc[r][1]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      if (add) {
        acc[r][0] = V::add(V::loadu(c + r * ldc), acc[r][0]);
        acc[r][1] = V::add(V::loadu(c + r * ldc + L), acc[r][1]);
      }
      V::storeu(c + r * ldc, acc[r][0]);
      V::storeu(c + r * ldc + L, acc[r][1]);
    }
  }

  using TileFn = void (*)(int64_t, const float*, const void*, float*, int64_t, bool);

  template <class BT, int... R>
  static TileFn tile_for(int rows, std::integer_sequence<int, R...>) {
    static constexpr TileFn table[] = {&tile<R + 1, BT>...};
    return table[rows - 1];
  }
  template <class BT>
  static TileFn tile_for(int rows) {
    return tile_for<BT>(rows, std::make_integer_sequence<int, MR>{});
  }

  // Rows [0, mc) (packed in ap: MR-row panels of kc values) times one panel's k
  // block bp, into C's columns [j0, j0 + cols) (c: the rows' first C row).
  static void panel_block(const float* ap, int64_t mc, int64_t kc, const void* bp, bool bf16, float* c, int64_t ldc,
                          int64_t j0, int64_t cols, bool add, float* edge) {
    for (int64_t ir = 0; ir < mc; ir += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, mc - ir));
      const TileFn fn = bf16 ? tile_for<bf16_t>(rows) : tile_for<float>(rows);
      float* ct = c + ir * ldc + j0;
      if (cols == NR) {
        fn(kc, ap + ir * kc, bp, ct, ldc, add);
        continue;
      }
      // A last, narrower panel: through a full-width tile.
      for (int r = 0; r < rows; ++r) {
        std::fill(edge + r * NR, edge + (r + 1) * NR, 0.0f);
        if (add) std::copy(ct + r * ldc, ct + r * ldc + cols, edge + r * NR);
      }
      fn(kc, ap + ir * kc, bp, edge, NR, add);
      for (int r = 0; r < rows; ++r) std::copy(edge + r * NR, edge + r * NR + cols, ct + r * ldc);
    }
  }

  static void run(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc, void* scratch,
                  bool accumulate) {
    const int64_t k = b.k, n = b.n;
    if (m == 0 || n == 0 || (k == 0 && accumulate)) return;
    if (k == 0) {
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
      return;
    }
    const int64_t panels = ceil_div(n, NR), blocks = ceil_div(k, kKc);
    float* ap = a_pack(scratch);
    float* edge = edge_tile(scratch);
    auto kc_of = [&](int64_t blk) { return std::min(kKc, k - blk * kKc); };
    if (b.panels && ceil_div(m, MR) * MR * k <= kMc * kKc) {
      // Few rows: all of A packed once (block by block), then each panel's k
      // blocks in turn, so the panels stream as one run of memory.
      const int64_t m_pad = ceil_div(m, MR) * MR;
      for (int64_t blk = 0; blk < blocks; ++blk) pack_a(a + blk * kKc, lda, m, kc_of(blk), MR, ap + blk * kKc * m_pad);
      const bool bf16 = b.panels->dtype == DType::kBF16;
      const auto* base = static_cast<const uint8_t*>(b.panels->data);
      const size_t es = bf16 ? 2 : 4;
      for (int64_t p = 0; p < panels; ++p)
        for (int64_t blk = 0; blk < blocks; ++blk)
          panel_block(ap + blk * kKc * m_pad, m, kc_of(blk), base + (p * k + blk * kKc) * NR * es, bf16, c, ldc,
                      p * NR, std::min<int64_t>(NR, n - p * NR), blk > 0 || accumulate, edge);
      return;
    }
    // BLIS's order: a k block of B (packed here unless in panels), then blocks of
    // kMc rows of A packed for it, each passing every panel.
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t pc = blk * kKc, kc = kc_of(blk);
      const bool add = blk > 0 || accumulate, bf16 = b.panels && b.panels->dtype == DType::kBF16;
      const void* bblock = nullptr;  // panel p's k block at bblock + p * pstride bytes
      size_t pstride = 0;
      if (b.panels) {
        const size_t es = bf16 ? 2 : 4;
        bblock = static_cast<const uint8_t*>(b.panels->data) + pc * NR * es;
        pstride = k * NR * es;
      } else {
        pack_b_block(b, NR, pc, kc, b_pack(scratch));
        bblock = b_pack(scratch);
        pstride = kc * NR * 4;
      }
      for (int64_t i0 = 0; i0 < m; i0 += kMc) {
        const int64_t mc = std::min(kMc, m - i0);
        pack_a(a + i0 * lda + pc, lda, mc, kc, MR, ap);
        for (int64_t p = 0; p < panels; ++p)
          panel_block(ap, mc, kc, static_cast<const uint8_t*>(bblock) + p * pstride, bf16, c + i0 * ldc, ldc, p * NR,
                      std::min<int64_t>(NR, n - p * NR), add, edge);
      }
    }
  }
};

}  // namespace moe::kernels::cpu::row_gemm_impl
