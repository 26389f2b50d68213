// The synthetic model: counter-based values are pure functions of their keys.
#include <gtest/gtest.h>

#include <cmath>

#include "moe/model/synthetic.h"
#include "moe/base/check.h"

namespace moe::test {
namespace {

TEST(Synthetic, InputsDependOnlyOnGlobalTokenIndex) {
  // One rank with 8 tokens equals two ranks with 4 (global index = rank x T + t).
  std::vector<float> whole(8 * 16), r0(4 * 16), r1(4 * 16);
  model::fill_inputs(7, 3, 0, 8, 16, whole.data());
  model::fill_inputs(7, 3, 0, 4, 16, r0.data());
  model::fill_inputs(7, 3, 4, 4, 16, r1.data());
  EXPECT_TRUE(std::equal(r0.begin(), r0.end(), whole.begin()));
  EXPECT_TRUE(std::equal(r1.begin(), r1.end(), whole.begin() + 64));
  std::vector<float> other_step(8 * 16);
  model::fill_inputs(7, 4, 0, 8, 16, other_step.data());
  EXPECT_NE(other_step, whole);
  double sum = 0, sq = 0;
  std::vector<float> big(4096 * 64);
  model::fill_inputs(1, 0, 0, 4096, 64, big.data());
  for (float v : big) {
    sum += v;
    sq += v * v;
  }
  EXPECT_NEAR(sum / big.size(), 0.0, 0.01);
  EXPECT_NEAR(sq / big.size(), 1.0, 0.02);
  // The two values of a Box-Muller pair are uncorrelated, and so are neighbours
  // across pairs; an odd hidden size still fills its last column.
  double pair = 0, across = 0;
  for (size_t i = 0; i + 2 < big.size(); i += 2) {
    pair += big[i] * big[i + 1];
    across += big[i + 1] * big[i + 2];
  }
  EXPECT_NEAR(pair / (big.size() / 2), 0.0, 0.01);
  EXPECT_NEAR(across / (big.size() / 2), 0.0, 0.01);
  std::vector<float> odd(3 * 5, 0.0f);
  model::fill_inputs(1, 0, 0, 3, 5, odd.data());
  for (int t = 0; t < 3; ++t) EXPECT_NE(odd[t * 5 + 4], 0.0f);
}

TEST(Synthetic, WeightsAreDeterministicAndScaled) {
  const model::LayerShape s{64, 32, 4};
  const auto a = model::make_layer_weights(5, 1, s), b = model::make_layer_weights(5, 1, s);
  const auto c = model::make_layer_weights(5, 2, s);
  EXPECT_EQ(a.w13, b.w13);
  EXPECT_NE(a.w13, c.w13);
  double sq = 0;
  for (float v : a.w2) sq += v * v;
  EXPECT_NEAR(sq / a.w2.size(), 1.0 / 32, 0.1 / 32);  // down_proj ~ N(0, 1/I)
}

TEST(Synthetic, ZipfSkewIsAPermutedLogRamp) {
  EXPECT_TRUE(model::skew_logit_bias("uniform", 1, 8).empty());
  const auto b = model::skew_logit_bias("zipf:1.5", 1, 8);
  ASSERT_EQ(b.size(), 8u);
  std::vector<float> sorted = b;
  std::sort(sorted.rbegin(), sorted.rend());
  for (int r = 0; r < 8; ++r) EXPECT_NEAR(sorted[r], -1.5 * std::log1p(r), 1e-6);
  EXPECT_NE(model::skew_logit_bias("zipf:1.5", 2, 8), b);  // permutation follows the seed
  EXPECT_THROW(model::skew_logit_bias("zipf:", 1, 8), Error);
  EXPECT_THROW(model::skew_logit_bias("zipf:abc", 1, 8), Error);
  EXPECT_THROW(model::skew_logit_bias("pareto:1", 1, 8), Error);
}

}  // namespace
}  // namespace moe::test
