// Numeric helpers the tests share, with no test framework (the device machine's
// moe-gpu-check uses them too): seeded data, fp32 <-> fp64 copies, the bf16
// rounding bounds of the layer, and a closeness comparison that also refuses
// trivial (all-zero) data.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "moe/model/counter_rng.h"
#include "moe/model/synthetic.h"
#include "moe/kernels/types.h"
#include "moe/ref/moe_ref.h"

namespace moe::test {


using kernels::DropPolicy;
using kernels::ScoreFunc;

// N(0, stddev) values keyed by (seed, index).
inline std::vector<float> normal_vector(size_t n, uint64_t seed, double stddev = 1.0) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(stddev * model::normal(model::key_hash({seed, i})));
  return v;
}

// K distinct values of [0, E) per row (a top-k selection), about drop_percent of
// them set to -1, keyed by (seed, row, k).
inline std::vector<int32_t> random_selection(int64_t T, int K, int E, uint64_t seed, int drop_percent) {
  std::vector<int32_t> v(T * K);
  std::vector<int32_t> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int k = 0; k < K; ++k) {  // partial Fisher-Yates
      const uint64_t h = model::key_hash({seed, static_cast<uint64_t>(t), static_cast<uint64_t>(k)});
      std::swap(perm[k], perm[k + static_cast<int>(h % static_cast<uint64_t>(E - k))]);
      v[t * K + k] = (h >> 32) % 100 < static_cast<uint64_t>(drop_percent) ? -1 : perm[k];
    }
  }
  return v;
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

template <typename T>
std::vector<double> to_double(const T* p, size_t n) {
  return std::vector<double>(p, p + n);
}

inline std::vector<kernels::bf16_t> float_to_bf16(const std::vector<float>& v) {
  std::vector<kernels::bf16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = kernels::f32_to_bf16(v[i]);
  return out;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// bf16 unit roundoff: rounding to nearest bf16 (8 significant bits) moves a value
// by at most 2^-8 of itself.
constexpr double kBf16Roundoff = 0x1.0p-8;

// For the operands the bf16 oneDNN path rounds to bf16 before a GEMM (the scaled
// h = w silu(g) u, and dgu), the sums of |terms| of every element that reads one:
// such an element moves by at most kBf16Roundoff times its sum. Computed from the
// reference's own values, in the layouts of ref::Forward and ref::Grads.
struct RoundingSums {
  std::vector<double> out;       // [T, H]: sum_k,i |w_k h_ki w2_e[j, i]|
  std::vector<double> grad_x;    // [T, H]: sum_k,i |dgu_ki w13_e[i, j]|
  std::vector<double> grad_w13;  // [E, 2I, H]: sum over pairs |dgu_i x_j|
  std::vector<double> grad_w2;   // [E, H, I]: sum over pairs |w_k go_j h_i|
};

inline double silu_of(double g) { return g / (1.0 + std::exp(-g)); }

inline RoundingSums rounding_sums(const ref::Config& c, const ref::Weights& w, const std::vector<double>& x,
                                  const ref::Forward& f, const ref::Grads& g, const std::vector<double>& grad_out) {
  const int64_t T = f.num_tokens;
  const int H = c.hidden, I = c.ffn_hidden, E = c.num_experts, K = c.top_k;
  RoundingSums s;
  s.out.assign(T * H, 0.0);
  s.grad_x.assign(T * H, 0.0);
  s.grad_w13.assign(static_cast<size_t>(E) * 2 * I * H, 0.0);
  s.grad_w2.assign(static_cast<size_t>(E) * H * I, 0.0);
  std::vector<double> h(I);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = f.kept_idx[t * K + k];
      if (e < 0) continue;
      const double wk = f.topk_weight[t * K + k];
      const double* gu = &f.gu[(t * K + k) * 2 * I];
      const double* dgu = &g.grad_gu[(t * K + k) * 2 * I];
      for (int i = 0; i < I; ++i) h[i] = wk * silu_of(gu[i]) * gu[I + i];
      for (int j = 0; j < H; ++j) {
        const double* w2row = &w.w2[(static_cast<size_t>(e) * H + j) * I];
        double* w2sum = &s.grad_w2[(static_cast<size_t>(e) * H + j) * I];
        for (int i = 0; i < I; ++i) {
          s.out[t * H + j] += std::fabs(h[i] * w2row[i]);
          w2sum[i] += std::fabs(grad_out[t * H + j] * h[i]);
        }
      }
      for (int i = 0; i < 2 * I; ++i) {
        const double* w13row = &w.w13[(static_cast<size_t>(e) * 2 * I + i) * H];
        double* w13sum = &s.grad_w13[(static_cast<size_t>(e) * 2 * I + i) * H];
        for (int j = 0; j < H; ++j) {
          s.grad_x[t * H + j] += std::fabs(dgu[i] * w13row[j]);
          w13sum[j] += std::fabs(dgu[i] * x[t * H + j]);
        }
      }
    }
  return s;
}

// Fraction of entries with |v| > tiny: guards against outputs that are silently zero.
inline double nonzero_fraction(const std::vector<double>& v) {
  if (v.empty()) return 0;
  size_t n = 0;
  for (double x : v) n += std::fabs(x) > 1e-12;
  return static_cast<double>(n) / v.size();
}

// Every |got - want| <= coef * bound[i] + rtol * |want| + atol_rel * max|want|
// (bound null: no per-element term). Fails on size mismatch, on non-finite values,
// and when `want` is trivially small (a test on all-zero data proves nothing)
// unless allow_zero. Returns "" when close, else what failed.
inline std::string compare_within(const std::string& what, const std::vector<double>& got,
                                  const std::vector<double>& want, const std::vector<double>* bound, double coef,
                                  double rtol, double atol_rel, bool allow_zero) {
  std::ostringstream os;
  if (got.size() != want.size()) {
    os << what << ": size " << got.size() << " != " << want.size();
    return os.str();
  }
  if (bound && bound->size() != want.size()) {
    os << what << ": bound size " << bound->size() << " != " << want.size();
    return os.str();
  }
  const double scale = max_abs(want);
  if (!allow_zero && !(scale > 1e-6)) {
    os << what << ": reference is trivially zero (max " << scale << ")";
    return os.str();
  }
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      os << what << "[" << i << "] is not finite: " << got[i];
      return os.str();
    }
    // The floor on scale keeps rounding noise of an (allowed) all-zero reference,
    // e.g. 1e-29, from failing an exact zero.
    const double allowed = rtol * std::fabs(want[i]) + atol_rel * std::max(scale, 1e-6) + (bound ? coef * (*bound)[i] : 0.0);
    const double excess = std::fabs(got[i] - want[i]) - allowed;
    if (excess > worst) {
      worst = excess;
      worst_i = i;
    }
  }
  if (worst > 0)
    os << what << "[" << worst_i << "]: got " << got[worst_i] << ", want " << want[worst_i] << " (rtol " << rtol
       << ", atol " << atol_rel * std::max(scale, 1e-6) << ", bound " << (bound ? coef * (*bound)[worst_i] : 0.0)
       << ")";
  return os.str();
}

}  // namespace moe::test
