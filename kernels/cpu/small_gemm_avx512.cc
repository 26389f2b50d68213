// The AVX-512 few-row GEMM (small_gemm.h); this file alone is built with AVX-512
// enabled and runs only where small_gemm_isa() says so.
//
// fp32 weights are read row-major, blocks of 4 rows at a time, 4 rows of X each. bf16 weights come
// in panels (pack_small_bf16_weights): a panel step is 8 rows x 32 values, 512
// contiguous bytes, so a call streams the weights linearly (rows of 2 KiB read side
// by side defeat the hardware prefetchers). A 32-value bf16 load holds the even
// values in its low halves and the odd ones in its high halves: a shift and a mask
// widen it without a shuffle, and the rows are de-interleaved to match once per
// call (evens then odds per 32 values). Every value is summed in the same place
// whatever m is.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "small_gemm.h"
#include "small_gemm_avx512_common.h"

namespace moe::kernels::cpu::detail {
namespace {

// fp32: rows of W per block and of X per group, MR x NR accumulators. 4 x 4 (8
// loads a 16 FMAs) ran 1.19-1.23x the 3 x 8 it replaced at 4-32 rows from memory
// on Zen 4: fewer groups read each block again from L1.
constexpr int kNr = 4, kMrF32 = 4;
constexpr int kMrBf16 = 2;      // bf16 panels: MR x 8 accumulators
constexpr int64_t kAhead = 8;  // fp32 blocks prefetched ahead of the one computed (128 KiB at k = 1024)

// One k step of 16 values (the lanes of m) of an fp32 block into acc.
template <int MR, int NR>
inline void k_step_f32(const float* x, int64_t k, const float* w, int64_t j0, int64_t kk, __mmask16 m,
                       __m512 (&acc)[MR][NR]) {
  __m512 xv[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) xv[i] = _mm512_maskz_loadu_ps(m, x + i * k + kk);
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const __m512 wv = _mm512_maskz_loadu_ps(m, w + (j0 + r) * k + kk);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_fmadd_ps(xv[i], wv, acc[i][r]);
  }
}

// fp32 weights: c[i, j0 + r] for i < MR, r < NR; whole steps with a constant
// mask (plain loads: 5% faster than a mask per step), then the k tail's masked one.
// pf: this group's share of the rows kAhead blocks on.
template <int MR, int NR>
void block_f32(const float* x, int64_t k, const float* w, int64_t j0, Prefetch pf, float* c, int64_t ldc) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t whole = k / 16 * 16;
  for (int64_t kk = 0; kk < whole; kk += 16) {
    pf.step();
    k_step_f32(x, k, w, j0, kk, __mmask16(0xffff), acc);
  }
  if (whole < k) {
    pf.step();
    k_step_f32(x, k, w, j0, whole, mask16(k - whole), acc);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
    if constexpr (NR == 1) {
      c[i * ldc + j0] = _mm512_reduce_add_ps(acc[i][0]);
    } else {  // the sums of NR accumulators, by the tree of eight (unused ones zero)
      __m512 a8[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) a8[r] = r < NR ? acc[i][r] : _mm512_setzero_ps();
      store_reduced8(a8, NR, c + i * ldc + j0);
    }
}

// Row group g of `groups`: rows [j0, j_end) of W in blocks of kNr.
template <int MR>
void rows_f32(const float* x, int64_t k, const float* w, int64_t n, int64_t j0, int64_t j_end, int64_t g,
              int64_t groups, float* c, int64_t ldc) {
  int64_t j = j0;
  for (; j + kNr <= j_end; j += kNr) {
    const float* ahead = j + (kAhead + 1) * kNr <= n ? w + (j + kAhead * kNr) * k : nullptr;
    block_f32<MR, kNr>(x, k, w, j, Prefetch::slice(ahead, kNr * k * 4, g, groups, (k + 15) / 16), c, ldc);
  }
  for (; j < j_end; ++j) block_f32<MR, 1>(x, k, w, j, Prefetch{}, c, ldc);
}

// W rows outermost in blocks of about 32 KiB, row groups of X inside: a block of W
// comes from memory once and from L1/L2 for the other groups.
void run_f32(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* c, int64_t ldc) {
  const int64_t jb = std::max<int64_t>(kNr, (32 << 10) / std::max<int64_t>(1, k * 4) / kNr * kNr);
  for (int64_t j0 = 0; j0 < n; j0 += jb) {
    const int64_t j_end = std::min(n, j0 + jb);
    // The row groups share the prefetch of the rows kAhead blocks on.
    const int64_t groups = (m + kMrF32 - 1) / kMrF32;
    int64_t i = 0;
    for (; i + kMrF32 <= m; i += kMrF32)
      rows_f32<kMrF32>(x + i * k, k, w, n, j0, j_end, i / kMrF32, groups, c + i * ldc, ldc);
    if (m - i == 3) rows_f32<3>(x + i * k, k, w, n, j0, j_end, i / kMrF32, groups, c + i * ldc, ldc);
    if (m - i == 2) rows_f32<2>(x + i * k, k, w, n, j0, j_end, i / kMrF32, groups, c + i * ldc, ldc);
    if (m - i == 1) rows_f32<1>(x + i * k, k, w, n, j0, j_end, i / kMrF32, groups, c + i * ldc, ldc);
  }
}

// bf16 panel p (8 rows from j0 = 8p, `valid` of them real); xd: MR rows
// de-interleaved, kp values each (zero padded, as the panel is).
template <int MR>
void panel_bf16(const float* xd, int64_t kp, const bf16_t* panel, Prefetch pf, int valid, float* c, int64_t ldc) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 acc[MR][kPanelRows];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp; kk += 32) {
    const bf16_t* step = panel + kk * kPanelRows;  // 8 rows x 32 values
    pf.step();
    __m512 even[MR], odd[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      even[i] = _mm512_loadu_ps(xd + i * kp + kk);
      odd[i] = _mm512_loadu_ps(xd + i * kp + kk + 16);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) {
      const __m512i v = _mm512_loadu_si512(step + r * 32);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        acc[i][r] = _mm512_fmadd_ps(even[i], we, acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(odd[i], wo, acc[i][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) store_reduced8(acc[i], valid, c + i * ldc);
}

void run_bf16(const float* x, int64_t m, int64_t k, const bf16_t* w, int64_t n, float* c, int64_t ldc) {
  const int64_t kp = (k + 31) / 32 * 32;
  thread_local std::vector<float> xd;  // grows to the largest call, then stays
  if (xd.size() < static_cast<size_t>(m * kp)) xd.resize(m * kp);
  deinterleave(x, m, k, kp, 32, xd.data());
  walk_panels(w, n, kp, m, kMrBf16, 1, kp / 32,
              [&](int64_t j0, int, int64_t i, int64_t rows, const bf16_t* panel, int valid, Prefetch pf) {
                const float* xi = xd.data() + i * kp;
                float* ci = c + i * ldc + j0;
                if (rows == 2)
                  panel_bf16<2>(xi, kp, panel, pf, valid, ci, ldc);
                else
                  panel_bf16<1>(xi, kp, panel, pf, valid, ci, ldc);
              });
}

}  // namespace

void small_rows_gemm_avx512(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                            int64_t ldc) {
  if (w_dtype == DType::kBF16)
    run_bf16(x, m, k, static_cast<const bf16_t*>(w), n, c, ldc);
  else
    run_f32(x, m, k, static_cast<const float*>(w), n, c, ldc);
}

}  // namespace moe::kernels::cpu::detail
