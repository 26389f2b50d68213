// What the AVX-512 few-row kernels (small_gemm.h) share: the lane sums and the
// paced weight prefetch. Included only by translation units built with AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moe::kernels::cpu::detail {
namespace {

// Lanes [0, left) of 16 (none when left <= 0).
inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << left) - 1);
}

// The lane sums of eight accumulators, in order, in one ymm: a transposing tree
// (quarters 0+2 and 1+3, then those two, then the four lanes of a quarter as
// (0+2)+(1+3)) of 12 shuffles and 7 adds where eight _mm512_reduce_add_ps take
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

// The weights a block reads next, prefetched into L2 while the rows compute.
// A block of weights is read from memory by the first group of rows and from L1
// by the others, so a call's groups split the prefetch of the block kAhead on
// between them (slice), each spreading its share over its k steps (step): the
// misses stay in flight through the whole block instead of in a burst during
// the first group.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;

  // Group g of `groups`' share of the `bytes` at `ahead` (null: nothing), over
  // `steps` k steps.
  static Prefetch slice(const void* ahead, int64_t bytes, int64_t g, int64_t groups, int64_t steps) {
    if (!ahead) return {};
    const int64_t lines = bytes / 64, b = g * lines / groups, e = (g + 1) * lines / groups;
    const char* base = static_cast<const char*>(ahead);
    return {base + b * 64, base + e * 64, (e - b + steps - 1) / steps};
  }

  void step() {
    for (int64_t l = 0; l < per_step && next < end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

}  // namespace
}  // namespace moe::kernels::cpu::detail
