// SwiGLU on [g | u] rows: h = scale * silu(g) * u, silu(g) = g * sigmoid(g).
#include "cpu_ops.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

// Stores 8 lanes, or one value, as fp32 or as bf16 (round to nearest even).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16_t* p, __m256 v) { store_bf16_ps(p, v); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16_t* p, float v) { *p = f32_to_bf16(v); }

}  // namespace

template <typename Out>
void swiglu_forward_rows(const float* gu, const float* row_scale, Out* h, int64_t rows, int I) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    Out* out = h + r * I;
    const float scale = row_scale ? row_scale[r] : 1.0f;
    const __m256 vs = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 vg = _mm256_loadu_ps(g + i);
      const __m256 silu = _mm256_mul_ps(vg, sigmoid_ps(vg));
      store8(out + i, _mm256_mul_ps(vs, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i))));
    }
    for (; i < I; ++i) store1(out + i, scale * (g[i] * sigmoid_scalar(g[i]) * u[i]));
  }
}

template <typename Out>
void swiglu_backward_rows(const float* gu, const float* grad_h, const float* row_scale, Out* grad_gu,
                          float* grad_row_scale, Out* h, int64_t rows, int I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    const float* dh = grad_h + r * I;
    Out* dg = grad_gu + r * 2 * I;
    Out* du = dg + I;
    const float scale = row_scale ? row_scale[r] : 1.0f;
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vdot = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 vg = _mm256_loadu_ps(g + i), vu = _mm256_loadu_ps(u + i);
      const __m256 vdh = _mm256_loadu_ps(dh + i);
      const __m256 sig = sigmoid_ps(vg);
      const __m256 silu = _mm256_mul_ps(vg, sig);
      const __m256 p = _mm256_mul_ps(silu, vu);  // unscaled h
      vdot = _mm256_fmadd_ps(vdh, p, vdot);
      const __m256 dhs = _mm256_mul_ps(vdh, vs);
      store8(du + i, _mm256_mul_ps(dhs, silu));
      // d silu / dg = sig * (1 + g * (1 - sig))
      const __m256 dsilu = _mm256_mul_ps(sig, _mm256_fmadd_ps(vg, _mm256_sub_ps(one, sig), one));
      store8(dg + i, _mm256_mul_ps(_mm256_mul_ps(dhs, vu), dsilu));
      if (h) store8(h + r * I + i, _mm256_mul_ps(vs, p));
    }
    float dot = hsum_ps(vdot);
    for (; i < I; ++i) {
      const float gi = g[i], ui = u[i];  // read before dg/du may overwrite them (in place)
      const float sig = sigmoid_scalar(gi);
      const float silu = gi * sig;
      const float p = silu * ui;
      dot += dh[i] * p;
      const float dhs = dh[i] * scale;
      store1(du + i, dhs * silu);
      store1(dg + i, dhs * ui * (sig * (1.0f + gi * (1.0f - sig))));
      if (h) store1(h + r * I + i, scale * p);
    }
    if (grad_row_scale) grad_row_scale[r] = dot;
  }
}

template void swiglu_forward_rows<float>(const float*, const float*, float*, int64_t, int);
template void swiglu_forward_rows<bf16_t>(const float*, const float*, bf16_t*, int64_t, int);
template void swiglu_backward_rows<float>(const float*, const float*, const float*, float*, float*, float*,
                                          int64_t, int);
template void swiglu_backward_rows<bf16_t>(const float*, const float*, const float*, bf16_t*, float*, bf16_t*,
                                           int64_t, int);

void swiglu_forward(ThreadPool& pool, const SwigluConfig& cfg, const SwigluForwardArgs& a) {
  cfg.validate();
  const int I = cfg.ffn_hidden;
  parallel_blocks(pool, cfg.num_rows, 32, [&](int64_t r0, int64_t r1, int) {
    swiglu_forward_rows(a.gu + r0 * 2 * I, a.row_scale ? a.row_scale + r0 : nullptr,
                        a.h + r0 * I, r1 - r0, I);
  });
}

void swiglu_backward(ThreadPool& pool, const SwigluConfig& cfg, const SwigluBackwardArgs& a) {
  cfg.validate();
  const int I = cfg.ffn_hidden;
  parallel_blocks(pool, cfg.num_rows, 32, [&](int64_t r0, int64_t r1, int) {
    swiglu_backward_rows(a.gu + r0 * 2 * I, a.grad_h + r0 * I,
                         a.row_scale ? a.row_scale + r0 : nullptr, a.grad_gu + r0 * 2 * I,
                         a.grad_row_scale ? a.grad_row_scale + r0 : nullptr,
                         a.h ? a.h + r0 * I : nullptr, r1 - r0, I);
  });
}

}  // namespace moe::kernels::cpu
