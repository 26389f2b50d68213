// Row and element work of the CUDA kernels (permute.cu, swiglu.cu,
// elementwise.cu), as __host__ __device__ functions over one vector of a row or
// one element, so tests/gpu/cuda_logic_test.cu can run them on the host: the
// bf16 storage type and its conversions, the gather and the weighted per-row sum,
// the SwiGLU element math and the optimizer's element steps.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moe/kernels/types.h"

namespace moe::kernels::cuda {

struct bf16s {  // bf16 storage: the upper half of an IEEE fp32
  uint16_t bits;
};

MOE_HOST_DEVICE inline float to_f32(float v) { return v; }
MOE_HOST_DEVICE inline float to_f32(bf16s v) {
  const uint32_t b = static_cast<uint32_t>(v.bits) << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// Round to nearest even, NaN kept quiet: the same bits as kernels::f32_to_bf16.
MOE_HOST_DEVICE inline bf16s bf16_from_f32(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0) return {static_cast<uint16_t>((b >> 16) | 0x40u)};
  b += 0x7fffu + ((b >> 16) & 1u);
  return {static_cast<uint16_t>(b >> 16)};
}

template <typename T>
MOE_HOST_DEVICE inline T from_f32(float v);
template <>
MOE_HOST_DEVICE inline float from_f32<float>(float v) { return v; }
template <>
MOE_HOST_DEVICE inline bf16s from_f32<bf16s>(float v) { return bf16_from_f32(v); }

// Accurate single-precision sigmoid (no fast-math intrinsics).
MOE_HOST_DEVICE inline float sigmoidf_acc(float x) { return 1.0f / (1.0f + expf(-x)); }

namespace row_logic {

// V consecutive elements, moved as one access.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Vector j of out row m = vector j of source row s, converted.
template <typename In, typename Out, int V>
MOE_HOST_DEVICE inline void gather_vec(const In* rows, int H, int32_t s, int64_t m, int j, Out* out) {
  const Vec<In, V> x = reinterpret_cast<const Vec<In, V>*>(rows + int64_t{s} * H)[j];
  Vec<Out, V> y;
  for (int i = 0; i < V; ++i) y.v[i] = from_f32<Out>(to_f32(x.v[i]));
  reinterpret_cast<Vec<Out, V>*>(out + m * H)[j] = y;
}

// The rows of an unpermute's perm: what its pair_pos may index.
MOE_HOST_DEVICE inline int64_t perm_rows(const UnpermuteConfig& c) {
  return c.num_perm_rows >= 0 ? c.num_perm_rows : c.num_rows * c.top_k;
}

// Vector j of out row n (+)= sum_k w[n, k] perm[pos[n, k]], in k order, fp32.
// Returns the first pair whose position is outside [-1, M), or -1.
template <typename In, typename Out, int V>
MOE_HOST_DEVICE inline int64_t unpermute_vec(const In* perm, const int32_t* pos, const float* w, int64_t n, int K,
                                             int H, int64_t M, bool accumulate, int j, Out* out) {
  int64_t bad = -1;
  float acc[V] = {};
  for (int k = 0; k < K; ++k) {
    const int32_t m = pos[n * K + k];
    if (m < 0) continue;
    if (m >= M) {
      bad = n * K + k;
      continue;
    }
    const float wk = w ? w[n * K + k] : 1.0f;
    const Vec<In, V> x = reinterpret_cast<const Vec<In, V>*>(perm + int64_t{m} * H)[j];
    for (int i = 0; i < V; ++i) acc[i] += wk * to_f32(x.v[i]);
  }
  auto* o = reinterpret_cast<Vec<Out, V>*>(out + n * H) + j;
  Vec<Out, V> y;
  if (accumulate) y = *o;
  for (int i = 0; i < V; ++i) y.v[i] = from_f32<Out>(accumulate ? to_f32(y.v[i]) + acc[i] : acc[i]);
  *o = y;
  return bad;
}

// SwiGLU of one element: h = scale * silu(g) * u.
MOE_HOST_DEVICE inline float swiglu(float g, float u, float scale) { return scale * (g * sigmoidf_acc(g) * u); }

// Its backward for one element given dh: dg, du, and the unscaled h (the
// routing-weight gradient's term dh * h).
struct SwigluGrad {
  float dg, du, h;
};
MOE_HOST_DEVICE inline SwigluGrad swiglu_grad(float g, float u, float dh, float scale) {
  const float sig = sigmoidf_acc(g);
  const float silu = g * sig;
  const float dhs = dh * scale;
  return {dhs * u * (sig * (1.0f + g * (1.0f - sig))), dhs * silu, silu * u};
}

// Each operation rounded on its own (no FMA contraction): on the device by the
// _rn intrinsics; on the host (emulation) by plain float arithmetic.
#if defined(__CUDA_ARCH__)
#define MOE_RN(device, host) return device
#else
#define MOE_RN(device, host) return host
#endif
MOE_HOST_DEVICE inline float sub_rn(float a, float b) { MOE_RN(__fsub_rn(a, b), a - b); }
MOE_HOST_DEVICE inline float mul_rn(float a, float b) { MOE_RN(__fmul_rn(a, b), a * b); }
MOE_HOST_DEVICE inline float div_rn(float a, float b) { MOE_RN(__fdiv_rn(a, b), a / b); }
MOE_HOST_DEVICE inline float sqrt_rn(float a) { MOE_RN(__fsqrt_rn(a), std::sqrt(a)); }
MOE_HOST_DEVICE inline float fma_rn(float a, float b, float c) { MOE_RN(__fmaf_rn(a, b, c), std::fma(a, b, c)); }
#undef MOE_RN

// One Adam element step: AdamConstants' operations (kernels/api.h), the CPU
// backend's one for one, so both give the same bits.
MOE_HOST_DEVICE inline void adam_step(const AdamConstants& p, float& w, float g, float& m, float& v) {
  m = fma_rn(p.b1, m, mul_rn(p.one_b1, g));
  v = fma_rn(p.b2, v, mul_rn(mul_rn(p.one_b2, g), g));
  const float den = fma_rn(sqrt_rn(v), p.inv_sqrt_c2, p.eps);
  w = sub_rn(w, div_rn(mul_rn(p.step_size, m), den));
}

// SGD: w = fma(-lr, g, w), as the CPU backend.
MOE_HOST_DEVICE inline void sgd_step(float lr, float& w, float g) { w = fma_rn(-lr, g, w); }

}  // namespace row_logic
}  // namespace moe::kernels::cuda
