// The AVX2/FMA few-row GEMM (small_gemm.h), the bf16 weight panels and the
// kernel choice.
//
// fp32 weights are read row-major, blocks of W rows against groups of X rows.
// bf16 weights come in the panels the AVX-512 kernels read (a step is 8 rows x 32
// values, 512 contiguous bytes), so the call streams them linearly with the
// panel four on prefetched; a panel is computed in two halves of 4 rows (8
// accumulators and 2 rows of X in 16 ymm), the second from L1. A 16-value load
// holds the even values in its low halves and the odd ones in its high halves:
// a shift and a mask widen it, against rows de-interleaved to match once per call.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <vector>

#include "moe/base/check.h"
#include "small_gemm.h"
#include "small_gemm_shared.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

constexpr int kMr = 4;  // rows of X per block
// Rows of W per block for MR rows of X: MR x NR accumulators, MR rows and one
// weight vector within 16 ymm, and at least 8 independent FMA chains.
constexpr int nr_for(int mr) { return mr == 1 ? 8 : mr == 2 ? 4 : mr == 3 ? 4 : 2; }

// c[i, j0 + r] for i < MR, r < NR. The k tail (k % 8) is summed in scalar after
// the lane reduction, in the same order for every row. pf: the group's prefetch,
// a step of it per k step.
template <int MR, int NR>
void block(const float* x, int64_t k, const float* w, int64_t j0, detail::Prefetch& pf, float* c, int64_t ldc) {
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t k8 = k / 8 * 8;
  for (int64_t kk = 0; kk < k8; kk += 8) {
    pf.step();
    __m256 xv[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * k + kk);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + (j0 + r) * k + kk);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(xv[i], wv, acc[i][r]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      float s = hsum_ps(acc[i][r]);
      for (int64_t kk = k8; kk < k; ++kk) s = std::fma(x[i * k + kk], w[(j0 + r) * k + kk], s);
      c[i * ldc + j0 + r] = s;
    }
}

// Rows [0, n) of the block w against MR rows of X, group g of `groups`; it takes
// its share of the prefetch of the `ahead_bytes` at `ahead` (the block kAhead on,
// or null), spread over every k step it makes.
template <int MR>
void rows_block(const float* x, int64_t k, const float* w, int64_t n, const float* ahead, int64_t ahead_bytes,
                int64_t g, int64_t groups, float* c, int64_t ldc) {
  constexpr int kNr = nr_for(MR);
  detail::Prefetch pf = detail::Prefetch::slice(ahead, ahead_bytes, g, groups, (n / kNr + n % kNr) * (k / 8));
  int64_t j = 0;
  for (; j + kNr <= n; j += kNr) block<MR, kNr>(x, k, w, j, pf, c, ldc);
  for (; j < n; ++j) block<MR, 1>(x, k, w, j, pf, c, ldc);
}

constexpr int64_t kAhead = 4;  // blocks of W rows prefetched ahead of the one computed

// W rows outermost in blocks of about 32 KiB, X row groups inside: a block of W
// is read from memory once and from L1/L2 for the other row groups, which share
// the prefetch of the block kAhead on.
void run_f32(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* c, int64_t ldc) {
  constexpr int64_t kLcm = 8;  // a multiple of every NR, so blocks of W rows split alike for every MR
  const int64_t jb = std::max<int64_t>(kLcm, (32 << 10) / std::max<int64_t>(1, k * 4) / kLcm * kLcm);
  const int64_t groups = (m + kMr - 1) / kMr;
  for (int64_t j0 = 0; j0 < n; j0 += jb) {
    const int64_t nb = std::min(jb, n - j0);
    const float* wb = w + j0 * k;
    const float* ahead = j0 + (kAhead + 1) * jb <= n ? wb + kAhead * jb * k : nullptr;
    const int64_t bytes = jb * k * 4;
    int64_t i = 0;
    for (; i + kMr <= m; i += kMr)
      rows_block<kMr>(x + i * k, k, wb, nb, ahead, bytes, i / kMr, groups, c + i * ldc + j0, ldc);
    switch (m - i) {
      case 3: rows_block<3>(x + i * k, k, wb, nb, ahead, bytes, i / kMr, groups, c + i * ldc + j0, ldc); break;
      case 2: rows_block<2>(x + i * k, k, wb, nb, ahead, bytes, i / kMr, groups, c + i * ldc + j0, ldc); break;
      case 1: rows_block<1>(x + i * k, k, wb, nb, ahead, bytes, i / kMr, groups, c + i * ldc + j0, ldc); break;
      default: break;
    }
  }
}

constexpr int kHalfRows = 4;     // rows of a panel one call of half_panel computes
constexpr int kMrBf16 = 2;       // rows of X per group

// c[i, r] for i < MR, r < 4: rows r0 .. r0 + 3 of a panel against MR rows of xd
// (de-interleaved per 16 values, kp each, zero padded as the panel is); the sums
// of rows at or past `valid` are not stored.
template <int MR>
void half_panel(const float* xd, int64_t kp, const bf16_t* panel, int r0, detail::Prefetch pf, int valid,
                float* c, int64_t ldc) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[MR][kHalfRows];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < kHalfRows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < kp; kk += 16) {
    pf.step();
    const bf16_t* step = panel + kk / 32 * 32 * detail::kPanelRows + kk % 32;  // this 16-value half of the step
    __m256 even[MR], odd[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      even[i] = _mm256_loadu_ps(xd + i * kp + kk);
      odd[i] = _mm256_loadu_ps(xd + i * kp + kk + 8);
    }
#pragma GCC unroll 4
    for (int r = 0; r < kHalfRows; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + (r0 + r) * 32));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        acc[i][r] = _mm256_fmadd_ps(even[i], we, acc[i][r]);
        acc[i][r] = _mm256_fmadd_ps(odd[i], wo, acc[i][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < kHalfRows; ++r)
      if (r0 + r < valid) c[i * ldc + r0 + r] = hsum_ps(acc[i][r]);
}

void run_bf16(const float* x, int64_t m, int64_t k, const bf16_t* w, int64_t n, float* c, int64_t ldc) {
  const int64_t kp = (k + 31) / 32 * 32;
  thread_local std::vector<float> xd;  // grows to the largest call, then stays
  if (xd.size() < static_cast<size_t>(m * kp)) xd.resize(m * kp);
  detail::deinterleave(x, m, k, kp, 16, xd.data());
  // A panel in two halves of 4 rows (the second skipped when the panel has no
  // more rows), each against every group of rows.
  detail::walk_panels(w, n, kp, m, kMrBf16, detail::kPanelRows / kHalfRows, kp / 16,
                      [&](int64_t j0, int part, int64_t i, int64_t rows, const bf16_t* panel, int valid,
                          detail::Prefetch pf) {
                        const int r0 = part * kHalfRows;
                        if (r0 >= valid) return;
                        const float* xi = xd.data() + i * kp;
                        float* ci = c + i * ldc + j0;
                        if (rows == 2)
                          half_panel<2>(xi, kp, panel, r0, pf, valid, ci, ldc);
                        else
                          half_panel<1>(xi, kp, panel, r0, pf, valid, ci, ldc);
                      });
}

}  // namespace

namespace detail {
void small_rows_gemm_avx2(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                          int64_t ldc) {
  if (w_dtype == DType::kBF16)
    run_bf16(x, m, k, static_cast<const bf16_t*>(w), n, c, ldc);
  else
    run_f32(x, m, k, static_cast<const float*>(w), n, c, ldc);
}
}  // namespace detail

namespace {

SmallGemmIsa best_isa_here() {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl"))
    return SmallGemmIsa::kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? SmallGemmIsa::kAvx512Bf16 : SmallGemmIsa::kAvx512;
}

}  // namespace

SmallGemmIsa small_gemm_isa_for(const char* requested, SmallGemmIsa best) {
  if (!requested || !*requested) return best;
  for (const SmallGemmIsa isa : {SmallGemmIsa::kAvx2, SmallGemmIsa::kAvx512, SmallGemmIsa::kAvx512Bf16})
    if (std::strcmp(requested, small_gemm_isa_name(isa)) == 0) {
      MOE_CHECK(isa <= best, "MOE_SMALL_GEMM_ISA='", requested, "': this CPU runs at most ",
                small_gemm_isa_name(best));
      return isa;
    }
  MOE_CHECK(false, "MOE_SMALL_GEMM_ISA='", requested, "': expected avx2, avx512 or avx512-bf16");
  return best;
}

SmallGemmIsa small_gemm_isa() {
  static const SmallGemmIsa isa = small_gemm_isa_for(std::getenv("MOE_SMALL_GEMM_ISA"), best_isa_here());
  return isa;
}

SmallGemmIsa small_gemm_kernel_for(SmallGemmIsa isa, DType w_dtype) {
  return isa == SmallGemmIsa::kAvx512Bf16 && w_dtype != DType::kBF16 ? SmallGemmIsa::kAvx512 : isa;
}

const char* small_gemm_isa_name(SmallGemmIsa isa) {
  switch (isa) {
    case SmallGemmIsa::kAvx512: return "avx512";
    case SmallGemmIsa::kAvx512Bf16: return "avx512-bf16";
    default: return "avx2";
  }
}

bool small_gemm_isa_runs_here(SmallGemmIsa isa) { return isa <= best_isa_here(); }

size_t small_bf16_weight_elems(int64_t n, int64_t k) {
  return static_cast<size_t>((n + 7) / 8 * 8) * ((k + 31) / 32 * 32);
}

void pack_small_bf16_weights(const float* w, int64_t n, int64_t k, bf16_t* out) {
  const int64_t kp = (k + 31) / 32 * 32;
  for (int64_t j = 0; j < (n + 7) / 8 * 8; ++j)
    for (int64_t v = 0; v < kp; ++v) {
      // panel j / 8, chunk v / 32, row j % 8 of the panel, value v % 32
      const int64_t at = (j / 8) * 8 * kp + (v / 32) * 256 + (j % 8) * 32 + v % 32;
      out[at] = j < n && v < k ? f32_to_bf16(w[j * k + v]) : bf16_t{0};
    }
}

void small_rows_gemm(SmallGemmIsa isa, const float* x, int64_t m, int64_t k, const void* w, DType w_dtype,
                     int64_t n, float* c, int64_t ldc) {
  MOE_CHECK(m >= 0 && k >= 0 && n >= 0 && ldc >= n, "small_rows_gemm: bad shape m=", m, " k=", k, " n=", n,
            " ldc=", ldc);
  MOE_CHECK(w_dtype == DType::kF32 || w_dtype == DType::kBF16, "small_rows_gemm: weights must be fp32 or bf16");
  if (m == 0 || n == 0) return;
  MOE_CHECK(small_gemm_isa_runs_here(isa), "small_rows_gemm: this CPU cannot run the ", small_gemm_isa_name(isa),
            " kernel");
  switch (small_gemm_kernel_for(isa, w_dtype)) {
    case SmallGemmIsa::kAvx512Bf16:
      detail::small_rows_gemm_avx512bf16(x, m, k, static_cast<const bf16_t*>(w), n, c, ldc);
      break;
    case SmallGemmIsa::kAvx512: detail::small_rows_gemm_avx512(x, m, k, w, w_dtype, n, c, ldc); break;
    case SmallGemmIsa::kAvx2: detail::small_rows_gemm_avx2(x, m, k, w, w_dtype, n, c, ldc); break;
  }
}

void small_rows_gemm(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                     int64_t ldc) {
  small_rows_gemm(small_gemm_isa(), x, m, k, w, w_dtype, n, c, ldc);
}

}  // namespace moe::kernels::cpu
