// The AVX-512 BF16 few-row GEMM for bf16 weights (small_gemm.h); this file alone
// is built with AVX512_BF16 and runs only where small_gemm_isa() says so.
//
// VDPBF16PS multiplies 32 bf16 pairs and adds each lane's two products to an
// fp32 accumulator: twice the multiply-adds of an fp32 FMA per instruction, and
// the weights need no widening. Its operands are bf16, so the rows are rounded to
// bf16 (round to nearest even) once per call: exact for a bf16 layer's rows, the
// rounding the engine paths give h. The weights come in the AVX-512 panels
// (pack_small_bf16_weights): a panel step is 8 rows x 32 consecutive values, the
// pairs VDPBF16PS reads. Each product of two bf16 values is exact in fp32; the
// instruction flushes denormal inputs and results to zero.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "small_gemm.h"
#include "small_gemm_avx512_common.h"

namespace moe::kernels::cpu::detail {
namespace {

constexpr int kMr = 3;  // rows of X per block: 24 accumulators, 3 rows and a weight vector in 32 zmm

// c[i, r] for the i < MR rows of xb (bf16, kp values each, zero padded) against
// a panel; pf: this group's share of the prefetch (walk_panels).
template <int MR>
void panel_dot(const bf16_t* xb, int64_t kp, const bf16_t* panel, Prefetch pf, int valid, float* c, int64_t ldc) {
  __m512 acc[MR][kPanelRows];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp; kk += 32) {
    const bf16_t* step = panel + kk * kPanelRows;  // 8 rows x 32 values
    pf.step();
    __m512bh xv[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(xb + i * kp + kk);
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(step + r * 32);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv[i], wv);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) store_reduced8(acc[i], valid, c + i * ldc);
}

// x [m, k] fp32 -> bf16 rows of kp values, zero padded: VCVTNE2PS2BF16 rounds to
// nearest even and flushes denormals to zero, as VDPBF16PS would treat them.
void round_rows(const float* x, int64_t m, int64_t k, int64_t kp, bf16_t* xb) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t v = 0; v < kp; v += 32) {
      const float* row = x + i * k;
      // A load that reads nothing keeps its address inside the row.
      const __m512 lo = _mm512_maskz_loadu_ps(mask16(k - v), row + v);
      const __m512 hi = _mm512_maskz_loadu_ps(mask16(k - v - 16), v + 16 < k ? row + v + 16 : row);
      _mm512_storeu_si512(xb + i * kp + v, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

}  // namespace

void small_rows_gemm_avx512bf16(const float* x, int64_t m, int64_t k, const bf16_t* w, int64_t n, float* c,
                                int64_t ldc) {
  const int64_t kp = (k + 31) / 32 * 32;
  thread_local std::vector<bf16_t> xb;  // grows to the largest call, then stays
  if (xb.size() < static_cast<size_t>(m * kp)) xb.resize(m * kp);
  round_rows(x, m, k, kp, xb.data());
  walk_panels(w, n, kp, m, kMr, 1, kp / 32,
              [&](int64_t j0, int, int64_t i, int64_t rows, const bf16_t* panel, int valid, Prefetch pf) {
                const bf16_t* xi = xb.data() + i * kp;
                float* ci = c + i * ldc + j0;
                if (rows == 3)
                  panel_dot<3>(xi, kp, panel, pf, valid, ci, ldc);
                else if (rows == 2)
                  panel_dot<2>(xi, kp, panel, pf, valid, ci, ldc);
                else
                  panel_dot<1>(xi, kp, panel, pf, valid, ci, ldc);
              });
}

}  // namespace moe::kernels::cpu::detail
