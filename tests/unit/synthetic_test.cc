// The synthetic model: counter-based values are pure functions of their keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "moe/model/counter_rng.h"
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

TEST(Synthetic, AKeyPrefixHashesAsTheWholeKey) {
  const model::KeyPrefix key({3, 1, 4});
  for (uint64_t last : {0ull, 1ull, 15ull, ~0ull}) EXPECT_EQ(key.hash(last), model::key_hash({3, 1, 4, last}));
  EXPECT_NE(model::KeyPrefix({3, 1}).hash(4), model::key_hash({3, 1, 4, 0}));
}

// The fp32 Box-Muller against the same draw in double: its log, sin and cos are
// polynomials, within 5e-7 x (1 + r) of the exact values (r = sqrt(-2 ln u1) <= 5.77).
TEST(Synthetic, TheFloatBoxMullerIsTheDoubleOneToWithinItsBound) {
  double worst = 0, biggest = 0;
  int64_t beyond3 = 0;
  constexpr int64_t kDraws = 1 << 20;
  for (int64_t i = 0; i < kDraws; ++i) {
    const uint64_t h = model::key_hash({12345, static_cast<uint64_t>(i)});
    const uint32_t hi = static_cast<uint32_t>(h >> 32), lo = static_cast<uint32_t>(h);
    float a, b;
    model::box_muller_f32(hi, lo, &a, &b);
    const double u1 = ((hi >> 8) + 1.0) / 16777216.0, half_pi = 1.5707963267948966;
    const double theta = (hi & 3) * half_pi + (lo >> 10) / 4194304.0 * half_pi;
    const double r = std::sqrt(-2.0 * std::log(u1));
    worst = std::max(worst, std::max(std::fabs(a - r * std::cos(theta)), std::fabs(b - r * std::sin(theta))) / (1 + r));
    biggest = std::max(biggest, static_cast<double>(std::max(std::fabs(a), std::fabs(b))));
    beyond3 += (std::fabs(a) > 3) + (std::fabs(b) > 3);
  }
  EXPECT_LE(worst, 5e-7);
  EXPECT_LE(biggest, std::sqrt(2.0 * 24 * std::log(2.0)));
  EXPECT_NEAR(static_cast<double>(beyond3) / (2 * kDraws), 0.0027, 0.0002);  // P(|N(0,1)| > 3)
}

// A value depends on its key alone, not on the length of the call that drew it
// (the library's vector loop, its tails, and this file's scalar calls agree bit
// for bit).
TEST(Synthetic, AValueIsTheSameWhateverCallDrewIt) {
  std::vector<float> row(1000), shorter(37), scalar(1000);
  model::fill_inputs(9, 2, 5, 1, 1000, row.data());
  model::fill_inputs(9, 2, 5, 1, 37, shorter.data());
  EXPECT_TRUE(std::equal(shorter.begin(), shorter.end(), row.begin()));
  const model::KeyPrefix key({0x1e9, 9, 2, 5});
  for (int j = 0; j < 500; ++j) {
    const uint64_t h = key.hash(j);
    model::box_muller_f32(static_cast<uint32_t>(h >> 32), static_cast<uint32_t>(h), &scalar[2 * j], &scalar[2 * j + 1]);
  }
  EXPECT_EQ(scalar, row);
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
  // A rank that builds only expert 2 gets its values, and the others stay zero.
  const auto only2 = model::make_layer_weights(5, 1, s, {false, false, true, false});
  const int64_t n13 = 2 * 32 * 64, n2 = 64 * 32;
  EXPECT_TRUE(std::equal(only2.w13.begin() + 2 * n13, only2.w13.begin() + 3 * n13, a.w13.begin() + 2 * n13));
  EXPECT_TRUE(std::all_of(only2.w13.begin(), only2.w13.begin() + 2 * n13, [](float v) { return v == 0; }));
  std::vector<float> w13(n13), w2(n2);
  model::fill_expert_weights(5, 1, s, 2, w13.data(), w2.data());
  EXPECT_TRUE(std::equal(w2.begin(), w2.end(), a.w2.begin() + 2 * n2));
  EXPECT_EQ(only2.gate, a.gate);
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
