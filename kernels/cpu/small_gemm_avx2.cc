// The AVX2/FMA few-row GEMM (small_gemm.h) and the kernel choice.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "moe/base/check.h"
#include "small_gemm.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

constexpr int kMr = 4;  // rows of X per block
// Rows of W per block for MR rows of X: MR x NR accumulators, MR rows and one
// weight vector within 16 ymm, and at least 8 independent FMA chains.
constexpr int nr_for(int mr) { return mr == 1 ? 8 : mr == 2 ? 4 : mr == 3 ? 4 : 2; }

template <bool kBf16>
__m256 load_w(const void* w, int64_t idx) {
  if constexpr (kBf16)
    return load_bf16_ps(static_cast<const bf16_t*>(w) + idx);
  else
    return _mm256_loadu_ps(static_cast<const float*>(w) + idx);
}

template <bool kBf16>
float w_at(const void* w, int64_t idx) {
  if constexpr (kBf16)
    return bf16_to_f32(static_cast<const bf16_t*>(w)[idx]);
  else
    return static_cast<const float*>(w)[idx];
}

// c[i, j0 + r] for i < MR, r < NR. The k tail (k % 8) is summed in scalar after
// the lane reduction, in the same order for every row.
template <int MR, int NR, bool kBf16>
void block(const float* x, int64_t k, const void* w, int64_t j0, float* c, int64_t ldc) {
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t k8 = k / 8 * 8;
  for (int64_t kk = 0; kk < k8; kk += 8) {
    __m256 xv[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * k + kk);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = load_w<kBf16>(w, (j0 + r) * k + kk);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(xv[i], wv, acc[i][r]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      float s = hsum_ps(acc[i][r]);
      for (int64_t kk = k8; kk < k; ++kk) s = std::fma(x[i * k + kk], w_at<kBf16>(w, (j0 + r) * k + kk), s);
      c[i * ldc + j0 + r] = s;
    }
}

template <int MR, bool kBf16>
void rows_block(const float* x, int64_t k, const void* w, int64_t n, float* c, int64_t ldc) {
  constexpr int kNr = nr_for(MR);
  int64_t j = 0;
  for (; j + kNr <= n; j += kNr) block<MR, kNr, kBf16>(x, k, w, j, c, ldc);
  for (; j < n; ++j) block<MR, 1, kBf16>(x, k, w, j, c, ldc);
}

// W rows outermost in blocks of about 32 KiB, X row groups inside: a block of W
// is read from memory once and from L1/L2 for the other row groups.
template <bool kBf16>
void run(const float* x, int64_t m, int64_t k, const void* w, int64_t n, float* c, int64_t ldc) {
  const int64_t es = kBf16 ? 2 : 4;
  constexpr int64_t kLcm = 8;  // a multiple of every NR, so blocks of W rows split alike for every MR
  const int64_t jb = std::max<int64_t>(kLcm, (32 << 10) / std::max<int64_t>(1, k * es) / kLcm * kLcm);
  for (int64_t j0 = 0; j0 < n; j0 += jb) {
    const int64_t nb = std::min(jb, n - j0);
    const void* wb = static_cast<const uint8_t*>(w) + j0 * k * es;
    int64_t i = 0;
    for (; i + kMr <= m; i += kMr) rows_block<kMr, kBf16>(x + i * k, k, wb, nb, c + i * ldc + j0, ldc);
    switch (m - i) {
      case 3: rows_block<3, kBf16>(x + i * k, k, wb, nb, c + i * ldc + j0, ldc); break;
      case 2: rows_block<2, kBf16>(x + i * k, k, wb, nb, c + i * ldc + j0, ldc); break;
      case 1: rows_block<1, kBf16>(x + i * k, k, wb, nb, c + i * ldc + j0, ldc); break;
      default: break;
    }
  }
}

}  // namespace

namespace detail {
void small_rows_gemm_avx2(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                          int64_t ldc) {
  if (w_dtype == DType::kBF16)
    run<true>(x, m, k, w, n, c, ldc);
  else
    run<false>(x, m, k, w, n, c, ldc);
}
}  // namespace detail

namespace {

SmallGemmIsa best_isa_here() {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return SmallGemmIsa::kAvx2;
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

const char* small_gemm_isa_name(SmallGemmIsa isa) {
  switch (isa) {
    case SmallGemmIsa::kAvx512: return "avx512";
    case SmallGemmIsa::kAvx512Bf16: return "avx512-bf16";
    default: return "avx2";
  }
}

bool small_gemm_isa_runs_here(SmallGemmIsa isa) { return isa <= best_isa_here(); }

size_t small_bf16_weight_elems(SmallGemmIsa isa, int64_t n, int64_t k) {
  if (isa == SmallGemmIsa::kAvx2) return static_cast<size_t>(n) * k;
  return static_cast<size_t>((n + 7) / 8 * 8) * ((k + 31) / 32 * 32);
}

void pack_small_bf16_weights(SmallGemmIsa isa, const float* w, int64_t n, int64_t k, bf16_t* out) {
  if (isa == SmallGemmIsa::kAvx2) {
    for (int64_t v = 0; v < n * k; ++v) out[v] = f32_to_bf16(w[v]);
    return;
  }
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
  if (isa == SmallGemmIsa::kAvx512Bf16 && w_dtype == DType::kBF16)
    detail::small_rows_gemm_avx512bf16(x, m, k, static_cast<const bf16_t*>(w), n, c, ldc);
  else if (isa != SmallGemmIsa::kAvx2)
    detail::small_rows_gemm_avx512(x, m, k, w, w_dtype, n, c, ldc);
  else
    detail::small_rows_gemm_avx2(x, m, k, w, w_dtype, n, c, ldc);
}

void small_rows_gemm(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                     int64_t ldc) {
  small_rows_gemm(small_gemm_isa(), x, m, k, w, w_dtype, n, c, ldc);
}

}  // namespace moe::kernels::cpu
