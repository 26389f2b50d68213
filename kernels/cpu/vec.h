// AVX2/FMA row primitives of the CPU backend. Every function takes a length and
// handles the tail with scalar code; pointers need no alignment.
//
// exp: range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial;
// max relative error about 2e-7 over [-87, 88]; inputs are clamped to that range (checked in kernels_cpu_test).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "moe/kernels/types.h"

namespace moe::kernels::cpu {

inline __m256 exp_ps(__m256 x) {
  const __m256 max_x = _mm256_set1_ps(88.0f);  // keeps n <= 127
  const __m256 min_x = _mm256_set1_ps(-87.3365447504f);
  x = _mm256_min_ps(_mm256_max_ps(x, min_x), max_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 in two steps (Cody-Waite) to keep the low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // Scale by 2^n through the exponent bits; n is in [-126, 127] after clamping.
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Scalar twin of exp_ps for tails, so a row gives the same bits whatever its length.
inline float exp_scalar(float x) {
  alignas(32) float buf[8] = {x, 0, 0, 0, 0, 0, 0, 0};
  _mm256_store_ps(buf, exp_ps(_mm256_load_ps(buf)));
  return buf[0];
}

inline __m256 sigmoid_ps(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline float sigmoid_scalar(float x) { return 1.0f / (1.0f + exp_scalar(-x)); }

// 8 bf16 -> 8 fp32.
inline __m256 load_bf16_ps(const bf16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// 8 fp32 -> 8 bf16, round to nearest even (NaN inputs are not expected on this path).
inline void store_bf16_ps(bf16_t* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  bits = _mm256_srli_epi32(bits, 16);
  // Pack 8 x u32 (each < 65536) to 8 x u16 in order.
  const __m128i lo = _mm256_castsi256_si128(bits);
  const __m128i hi = _mm256_extracti128_si256(bits, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}

// w rounded to the nearest bf16 value (ties to even), as fp32; NaN stays NaN
// (quieted), as f32_to_bf16 does.
inline __m256 round_bf16_ps(__m256 w) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
  const __m256 nan = _mm256_cmp_ps(w, w, _CMP_UNORD_Q);
  const __m256i pick = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
  return _mm256_castsi256_ps(_mm256_and_si256(pick, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// dst[i] = src[i] rounded to the nearest bf16 value, as fp32 (round_to_bf16's bits;
// dst may be src).
inline void round_rows_to_bf16(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, round_bf16_ps(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = round_to_bf16(src[i]);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// dst[i] = src[i] (fp32 or bf16 source) as fp32.
inline void load_row_f32(const void* src, DType dtype, float* dst, int64_t n) {
  if (dtype == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
    return;
  }
  const bf16_t* s = static_cast<const bf16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16_ps(s + i));
  for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
}

// dst[i] = src[i] as fp32 or bf16.
inline void store_row_f32(const float* src, void* dst, DType dtype, int64_t n) {
  if (dtype == DType::kF32) {
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = src[i];
    return;
  }
  bf16_t* d = static_cast<bf16_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16_ps(d + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) d[i] = f32_to_bf16(src[i]);
}

}  // namespace moe::kernels::cpu
