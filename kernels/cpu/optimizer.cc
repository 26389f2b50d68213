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
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

// Adam's moments as stored: fp32, or bf16 widened on load and rounded to the
// nearest even on store (NaN stays NaN, as f32_to_bf16 does).
inline float load_moment(const float* p, int64_t i) { return p[i]; }
inline float load_moment(const bf16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store_moment(float* p, int64_t i, float x) { p[i] = x; }
inline void store_moment(bf16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }
inline __m256 load_moments(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_moments(const bf16_t* p) { return load_bf16_ps(p); }
inline void store_moments(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store_moments(bf16_t* p, __m256 x) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps(x)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// One element, the same operations as a vector lane of adam_range. The weight
// moves by the moments as computed (fp32), before bf16 moments are rounded.
template <class M>
inline void adam_element(const AdamConstants& k, const OptimizerArgs& a, M* am, M* av, int64_t i) {
  const float g = a.grad[i];
  const float m = std::fma(k.b1, load_moment(am, i), k.one_b1 * g);
  const float v = std::fma(k.b2, load_moment(av, i), (k.one_b2 * g) * g);
  const float den = std::fma(std::sqrt(v), k.inv_sqrt_c2, k.eps);
  const float w = a.weight[i] - (k.step_size * m) / den;
  store_moment(am, i, m);
  store_moment(av, i, v);
  a.weight[i] = w;
  if (a.rounded) a.rounded[i] = round_to_bf16(w);
}

// Elements [i0, i1): 8 at a time, then the same operations one at a time:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2   (each one fused multiply-add)
//   w -= step_size m / (sqrt(v) inv_sqrt_c2 + eps)  (the denominator one fma)
// (Streaming stores for the write-only bf16 rounding measured slower: 0.89 against
// 0.71 ns a parameter on 100M parameters.)
template <class M>
void adam_range(const AdamConstants& k, const OptimizerArgs& a, int64_t i0, int64_t i1) {
  M* am = static_cast<M*>(a.m);
  M* av = static_cast<M*>(a.v);
  const __m256 b1 = _mm256_set1_ps(k.b1), one_b1 = _mm256_set1_ps(k.one_b1), b2 = _mm256_set1_ps(k.b2);
  const __m256 one_b2 = _mm256_set1_ps(k.one_b2), step_size = _mm256_set1_ps(k.step_size);
  const __m256 inv_sqrt_c2 = _mm256_set1_ps(k.inv_sqrt_c2), eps = _mm256_set1_ps(k.eps);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_loadu_ps(a.grad + i);
    const __m256 m = _mm256_fmadd_ps(b1, load_moments(am + i), _mm256_mul_ps(one_b1, g));
    const __m256 v = _mm256_fmadd_ps(b2, load_moments(av + i), _mm256_mul_ps(_mm256_mul_ps(one_b2, g), g));
    const __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(v), inv_sqrt_c2, eps);
    const __m256 w = _mm256_sub_ps(_mm256_loadu_ps(a.weight + i), _mm256_div_ps(_mm256_mul_ps(step_size, m), den));
    store_moments(am + i, m);
    store_moments(av + i, v);
    _mm256_storeu_ps(a.weight + i, w);
    if (a.rounded) _mm256_storeu_ps(a.rounded + i, round_bf16_ps(w));
  }
  for (; i < i1; ++i) adam_element(k, a, am, av, i);
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

// The step's constants (adam_constants, api.h): with the bias corrections folded
// in, an element takes one square root and one division, where dividing m and v
// by their corrections took three divisions: the pass is bound by memory again,
// not by the divider.
OptimizerPass prepare_optimizer(const OptimizerConfig& cfg, const OptimizerArgs& a) {
  cfg.validate();
  MOE_CHECK(a.step >= 1, "optimizer: step must be >= 1, got ", a.step);
  MOE_CHECK(cfg.kind == OptimizerKind::kSgd || (a.m && a.v), "optimizer: adam needs its moment buffers");
  return {cfg.kind, cfg.moments, cfg.lr, adam_constants(cfg, a.step)};
}

void optimizer_range(const OptimizerPass& pass, const OptimizerArgs& a, int64_t i0, int64_t i1) {
  if (pass.kind == OptimizerKind::kSgd)
    sgd_range(pass.lr, a, i0, i1);
  else if (pass.moments == DType::kBF16)
    adam_range<bf16_t>(pass.adam, a, i0, i1);
  else
    adam_range<float>(pass.adam, a, i0, i1);
}

void optimizer_step(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& a) {
  const OptimizerPass pass = prepare_optimizer(cfg, a);
  parallel_blocks(pool, a.count, 1 << 14, [&](int64_t i0, int64_t i1, int) { optimizer_range(pass, a, i0, i1); });
}

}  // namespace moe::kernels::cpu
