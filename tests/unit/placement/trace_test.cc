#include "moe/placement/trace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "moe/base/check.h"
#include "placement_test_util.h"

namespace moe::placement {
namespace {

TEST(Trace, IsDeterministicAndDistinctPerToken) {
  TraceConfig config = test::reference_trace(0, 7, 0, 2048);
  const Trace a = generate_trace(config), b = generate_trace(config);
  ASSERT_EQ(a.num_tokens(), 2048);
  EXPECT_EQ(a.topk_idx, b.topk_idx);
  for (int64_t t = 0; t < a.num_tokens(); ++t) {
    std::set<int> picked(a.topk_idx.begin() + t * 8, a.topk_idx.begin() + (t + 1) * 8);
    ASSERT_EQ(picked.size(), 8u) << "token " << t;
    for (int e : picked) ASSERT_TRUE(e >= 0 && e < 256);
  }
  const std::vector<double> loads = a.expert_loads();
  EXPECT_DOUBLE_EQ(std::accumulate(loads.begin(), loads.end(), 0.0), 2048.0 * 8);
}

TEST(Trace, PinnedBits) {
  // The generator is pinned: these ids come from SplitMix64 and must not
  // change on any machine, or every figure in the README changes with them.
  const Trace trace = generate_trace(test::reference_trace(0, 0, 0, 2));
  EXPECT_EQ(trace.topk_idx, (std::vector<int32_t>{1, 130, 154, 157, 180, 190, 225, 228, 19, 129,
                                                  130, 157, 180, 223, 228, 239}));
}

TEST(Trace, LoadsFollowPopularity) {
  const TraceConfig config = test::reference_trace(0, 3, 0, 16384);
  const std::vector<double> weight = expert_popularity(config);
  const std::vector<double> loads = generate_trace(config).expert_loads();
  const int hottest =
      static_cast<int>(std::max_element(weight.begin(), weight.end()) - weight.begin());
  const int coldest =
      static_cast<int>(std::min_element(weight.begin(), weight.end()) - weight.begin());
  EXPECT_EQ(std::max_element(loads.begin(), loads.end()) - loads.begin(), hottest);
  EXPECT_GT(loads[hottest], 20 * std::max(loads[coldest], 1.0));
  // The popularity order is a permutation of 1/rank^alpha, shuffled by seed.
  std::vector<double> sorted = weight;
  std::sort(sorted.rbegin(), sorted.rend());
  EXPECT_DOUBLE_EQ(sorted[0], 1.0);
  EXPECT_NEAR(sorted[9], std::pow(10.0, -1.2), 1e-12);
  EXPECT_NE(expert_popularity(test::reference_trace(0, 4)), weight);
}

TEST(Trace, WindowResamplesTokensOfTheSameWorkload) {
  const TraceConfig w0 = test::reference_trace(0, 0, 0, 4096),
                    w1 = test::reference_trace(0, 0, 1, 4096);
  EXPECT_EQ(expert_popularity(w0), expert_popularity(w1));
  EXPECT_NE(generate_trace(w0).topk_idx, generate_trace(w1).topk_idx);
}

TEST(Trace, GroupLimitedTokensStayInTheirGroups) {
  const Trace trace = generate_trace(test::reference_trace(4, 0, 0, 4096));
  std::vector<int> groups_used(9, 0);
  for (int64_t t = 0; t < trace.num_tokens(); ++t) {
    std::set<int> groups;
    for (int i = 0; i < 8; ++i) groups.insert(trace.topk_idx[t * 8 + i] / 32);
    ASSERT_LE(groups.size(), 4u) << "token " << t;
    ++groups_used[groups.size()];
  }
  // Most tokens use more than two groups (the limit is not trivially met).
  EXPECT_GT(groups_used[3] + groups_used[4], trace.num_tokens() / 2);
}

TEST(Trace, RejectsBadConfigNamingTheField) {
  TraceConfig c = test::reference_trace(0);
  c.top_k = 0;
  EXPECT_THROW(c.validate(), moe::Error);
  c = test::reference_trace(0);
  c.zipf_alpha = -1;
  EXPECT_THROW(generate_trace(c), moe::Error);
  c = test::reference_trace(9);
  try {
    c.validate();
    FAIL();
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("group_top_k (9)"), std::string::npos) << e.what();
  }
  c = test::reference_trace(1);
  c.top_k = 40;  // more than one group of 32 holds
  EXPECT_THROW(c.validate(), moe::Error);
}

}  // namespace
}  // namespace moe::placement
