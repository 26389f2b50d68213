// Shared helpers of the unit tests: numeric.h's helpers, and its closeness
// comparison as GoogleTest assertion results.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "numeric.h"

namespace moe::test {

inline ::testing::AssertionResult close_within(const std::string& what, const std::vector<double>& got,
                                               const std::vector<double>& want, const std::vector<double>* bound,
                                               double coef, double rtol, double atol_rel, bool allow_zero) {
  const std::string failure = compare_within(what, got, want, bound, coef, rtol, atol_rel, allow_zero);
  if (failure.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failure;
}

inline ::testing::AssertionResult close(const std::string& what, const std::vector<double>& got,
                                        const std::vector<double>& want, double rtol, double atol_rel,
                                        bool allow_zero = false) {
  return close_within(what, got, want, nullptr, 0.0, rtol, atol_rel, allow_zero);
}

// close() plus coef * bound[i] per element.
inline ::testing::AssertionResult close_bounded(const std::string& what, const std::vector<double>& got,
                                                const std::vector<double>& want, const std::vector<double>& bound,
                                                double coef, double rtol, double atol_rel, bool allow_zero = false) {
  return close_within(what, got, want, &bound, coef, rtol, atol_rel, allow_zero);
}

}  // namespace moe::test
