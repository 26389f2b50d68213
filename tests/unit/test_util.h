// Shared helpers of the unit tests: seeded data, fp32 <-> fp64 copies, and a
// closeness check that also refuses trivial (all-zero) data.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Every |got - want| <= rtol * |want| + atol_rel * max|want|. Fails on size
// mismatch, on non-finite values, and when `want` is trivially small (a test on
// all-zero data proves nothing) unless allow_zero.
inline ::testing::AssertionResult close(const std::string& what, const std::vector<double>& got,
                                        const std::vector<double>& want, double rtol, double atol_rel,
                                        bool allow_zero = false) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " != " << want.size();
  const double scale = max_abs(want);
  if (!allow_zero && !(scale > 1e-6))
    return ::testing::AssertionFailure() << what << ": reference is trivially zero (max " << scale << ")";
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << what << "[" << i << "] is not finite: " << got[i];
    // The floor on scale keeps rounding noise of an (allowed) all-zero reference,
    // e.g. 1e-29, from failing an exact zero.
    const double excess =
        std::fabs(got[i] - want[i]) - (rtol * std::fabs(want[i]) + atol_rel * std::max(scale, 1e-6));
    if (excess > worst) {
      worst = excess;
      worst_i = i;
    }
  }
  if (worst > 0)
    return ::testing::AssertionFailure()
           << what << "[" << worst_i << "]: got " << got[worst_i] << ", want " << want[worst_i]
           << " (rtol " << rtol << ", atol " << atol_rel * std::max(scale, 1e-6) << ")";
  return ::testing::AssertionSuccess();
}

// Fraction of entries with |v| > tiny: guards against outputs that are silently zero.
inline double nonzero_fraction(const std::vector<double>& v) {
  if (v.empty()) return 0;
  size_t n = 0;
  for (double x : v) n += std::fabs(x) > 1e-12;
  return static_cast<double>(n) / v.size();
}

}  // namespace moe::test
