// The lane sums the AVX-512 few-row kernels (small_gemm.h) share. Included only
// by translation units built with AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "small_gemm_shared.h"

namespace moe::kernels::cpu::detail {
namespace {

// Lanes [0, left) of 16 (none when left <= 0).
inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << left) - 1);
}

// The lane sums of eight accumulators, in order, in one ymm: a transposing tree
// (quarters 0+2 and 1+3, then those two, then the four lanes of a quarter as
// (0+2)+(1+3)) of 16 shuffles and 8 adds where eight _mm512_reduce_add_ps take
// about 64 instructions. Each sum's order is fixed and involves its own
// accumulator only, whatever the other seven hold.
inline __m256 reduce8(const __m512 (&a)[8]) {
  __m512 pair[4];
  for (int p = 0; p < 4; ++p)  // quarters [a0+a2, a1+a3, b0+b2, b1+b3] of a = a[2p], b = a[2p + 1]
    pair[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                            _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
  // quarter q: accumulator q's (resp. 4 + q's) four partial sums
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(pair[0], pair[1], 0x88),
                                  _mm512_shuffle_f32x4(pair[0], pair[1], 0xdd));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(pair[2], pair[3], 0x88),
                                  _mm512_shuffle_f32x4(pair[2], pair[3], 0xdd));
  // per quarter [l0+l2, h0+h2, l1+l3, h1+h3], then (0+2)+(1+3) in elements 0 and 1
  const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(lo, hi), _mm512_unpackhi_ps(lo, hi));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4e));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, v));
}

// c[0, r) = the first `valid` of reduce8(a).
inline void store_reduced8(const __m512 (&a)[8], int valid, float* c) {
  _mm256_mask_storeu_ps(c, static_cast<__mmask8>((1u << valid) - 1), reduce8(a));
}

}  // namespace
}  // namespace moe::kernels::cpu::detail
