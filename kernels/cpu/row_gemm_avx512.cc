// The row-invariant GEMM's AVX-512 kernel (row_gemm.h): 12 rows x 32 columns of
// accumulators (24 zmm), the driver of row_gemm_kernel.h. Built with AVX-512 F,
// run only where the CPU has it; its bits equal the AVX2 kernel's (same chains).
#include <immintrin.h>

#include "row_gemm_kernel.h"

namespace moe::kernels::cpu {
namespace row_gemm_impl {
namespace {

struct Avx512 {
  using Reg = __m512;
  static constexpr int kLanes = 16, kMr = 12;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static void load_b(const float* p, Reg& lo, Reg& hi) {
    lo = _mm512_load_ps(p);
    hi = _mm512_load_ps(p + kLanes);
  }
  // 32 bf16, column c paired with c + 16 in word c.
  static void load_b(const bf16_t* p, Reg& lo, Reg& hi) {
    const __m512i v = _mm512_load_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};

}  // namespace
}  // namespace row_gemm_impl

namespace detail {
void row_gemm_avx512(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc,
                     void* scratch, bool accumulate) {
  row_gemm_impl::Kernel<row_gemm_impl::Avx512>::run(a, m, lda, b, c, ldc, scratch, accumulate);
}
}  // namespace detail

}  // namespace moe::kernels::cpu
