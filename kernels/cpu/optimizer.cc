// Adam and SGD steps on fp32 master weights (kernels/api.h), one pass over the
// streams with AVX2. Each element runs the same operations in the same order in
// the vector body and the scalar tail (fma, mul, div, sqrt and add are correctly
// rounded either way), so the result does not depend on the thread split or on
// where an element falls in a block: replicas with the same inputs get the same bits.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "cpu_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cpu {
namespace {

// The step's constants (bias corrections folded in per step, as the formula has).
struct Adam {
  float lr, b1, one_b1, b2, one_b2, c1, c2, eps;
};

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

// Elements [i0, i1): 8 at a time, then the same operations one at a time.
void adam_range(const Adam& k, const OptimizerArgs& a, int64_t i0, int64_t i1) {
  const __m256 lr = _mm256_set1_ps(k.lr), b1 = _mm256_set1_ps(k.b1), one_b1 = _mm256_set1_ps(k.one_b1);
  const __m256 b2 = _mm256_set1_ps(k.b2), one_b2 = _mm256_set1_ps(k.one_b2), c1 = _mm256_set1_ps(k.c1);
  const __m256 c2 = _mm256_set1_ps(k.c2), eps = _mm256_set1_ps(k.eps);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_loadu_ps(a.grad + i);
    const __m256 m = _mm256_fmadd_ps(b1, _mm256_loadu_ps(a.m + i), _mm256_mul_ps(one_b1, g));
    const __m256 v = _mm256_fmadd_ps(b2, _mm256_loadu_ps(a.v + i), _mm256_mul_ps(_mm256_mul_ps(one_b2, g), g));
    const __m256 den = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(v, c2)), eps);
    const __m256 w = _mm256_sub_ps(_mm256_loadu_ps(a.weight + i), _mm256_div_ps(_mm256_mul_ps(lr, _mm256_div_ps(m, c1)), den));
    _mm256_storeu_ps(a.m + i, m);
    _mm256_storeu_ps(a.v + i, v);
    _mm256_storeu_ps(a.weight + i, w);
    if (a.rounded) _mm256_storeu_ps(a.rounded + i, round_bf16_ps(w));
  }
  for (; i < i1; ++i) {
    const float g = a.grad[i];
    const float m = std::fma(k.b1, a.m[i], k.one_b1 * g);
    const float v = std::fma(k.b2, a.v[i], (k.one_b2 * g) * g);
    const float den = std::sqrt(v / k.c2) + k.eps;
    const float w = a.weight[i] - (k.lr * (m / k.c1)) / den;
    a.m[i] = m;
    a.v[i] = v;
    a.weight[i] = w;
    if (a.rounded) a.rounded[i] = round_to_bf16(w);
  }
}

void sgd_range(float lr, const OptimizerArgs& a, int64_t i0, int64_t i1) {
  const __m256 vlr = _mm256_set1_ps(lr);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 w = _mm256_fnmadd_ps(vlr, _mm256_loadu_ps(a.grad + i), _mm256_loadu_ps(a.weight + i));
    _mm256_storeu_ps(a.weight + i, w);
    if (a.rounded) _mm256_storeu_ps(a.rounded + i, round_bf16_ps(w));
  }
  for (; i < i1; ++i) {
    const float w = std::fma(-lr, a.grad[i], a.weight[i]);
    a.weight[i] = w;
    if (a.rounded) a.rounded[i] = round_to_bf16(w);
  }
}

}  // namespace

void optimizer_step(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& a) {
  cfg.validate();
  MOE_CHECK(a.step >= 1, "optimizer: step must be >= 1, got ", a.step);
  MOE_CHECK(cfg.kind == OptimizerKind::kSgd || (a.m && a.v), "optimizer: adam needs its moment buffers");
  const Adam k{cfg.lr,
               cfg.beta1,
               1.0f - cfg.beta1,
               cfg.beta2,
               1.0f - cfg.beta2,
               1.0f - static_cast<float>(std::pow(static_cast<double>(cfg.beta1), static_cast<double>(a.step))),
               1.0f - static_cast<float>(std::pow(static_cast<double>(cfg.beta2), static_cast<double>(a.step))),
               cfg.eps};
  parallel_blocks(pool, a.count, 1 << 14, [&](int64_t i0, int64_t i1, int) {
    if (cfg.kind == OptimizerKind::kSgd)
      sgd_range(cfg.lr, a, i0, i1);
    else
      adam_range(k, a, i0, i1);
  });
}

}  // namespace moe::kernels::cpu
