#include "moe/placement/eplb.h"

#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "moe/base/check.h"
#include "moe/placement/placement_metrics.h"
#include "placement_test_util.h"

namespace moe::placement {
namespace {

TEST(EplbBalancedPacking, HeaviestFirstIntoLightestPackWithRoom) {
  std::vector<int> rank;
  const std::vector<int> pack = eplb_balanced_packing(std::vector<double>{10, 9, 8, 1}, 2, &rank);
  // 10 -> pack 0; 9 -> pack 1; 8 -> pack 1 (9 < 10); 1 -> pack 0 (pack 1 full).
  EXPECT_EQ(pack, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(rank, (std::vector<int>{0, 0, 1, 1}));
  // One item per pack: identity, as in EPLB.
  EXPECT_EQ(eplb_balanced_packing(std::vector<double>{1, 5, 3}, 3), (std::vector<int>{0, 1, 2}));
  EXPECT_THROW(eplb_balanced_packing(std::vector<double>{1, 2, 3}, 2), moe::Error);
}

TEST(EplbReplicateExperts, EachExtraSlotToTheLargestLoadPerReplica) {
  std::vector<int> rank, count;
  const std::vector<int> phy2log =
      eplb_replicate_experts(std::vector<double>{6, 3, 2}, 5, &rank, &count);
  // Slot 3: 6/1 is largest. Slot 4: 6/2 ties 3/1, the lower index wins.
  EXPECT_EQ(phy2log, (std::vector<int>{0, 1, 2, 0, 0}));
  EXPECT_EQ(rank, (std::vector<int>{0, 0, 0, 1, 2}));
  EXPECT_EQ(count, (std::vector<int>{3, 1, 1}));
}

TEST(EplbRebalance, HierarchicalByHand) {
  // 4 experts in 2 groups, 2 nodes of 1 rank, 2 redundant slots.
  const PlacementSpec spec{4, 2, 2, 2, 2};
  const ExpertMap map =
      eplb_rebalance(spec, std::vector<double>{8, 1, 4, 3}, EplbPolicy::kHierarchical);
  // Node 0 holds group 0 and replicates expert 0; node 1 group 1, expert 2.
  EXPECT_EQ(map.phy2log, (std::vector<int32_t>{0, 0, 1, 3, 2, 2}));
  EXPECT_EQ(map.logcnt, (std::vector<int32_t>{2, 1, 2, 1}));
  EXPECT_DOUBLE_EQ(balancedness(map, std::vector<double>{8, 1, 4, 3}), 8.0 / 9.0);
}

TEST(EplbRebalance, MapsAreValidAndHierarchicalKeepsGroupsOnTheirNode) {
  const PlacementSpec spec = test::reference_spec(0);
  const std::vector<double> loads =
      generate_trace(test::reference_trace(0, 1, 0, 4096)).expert_loads();
  for (EplbPolicy policy : {EplbPolicy::kHierarchical, EplbPolicy::kGlobal}) {
    const ExpertMap map = eplb_rebalance(spec, loads, policy);
    test::expect_valid_map(map, spec);
  }
  const ExpertMap h = eplb_rebalance(spec, loads, EplbPolicy::kHierarchical);
  std::vector<std::set<int>> nodes_of_group(8);
  for (int p = 0; p < spec.num_slots(); ++p) nodes_of_group[h.phy2log[p] / 32].insert(p / 72);
  for (int g = 0; g < 8; ++g) EXPECT_EQ(nodes_of_group[g].size(), 1u) << "group " << g;
}

TEST(EplbRebalance, RejectsBadInput) {
  const PlacementSpec spec = test::reference_spec(0);
  EXPECT_THROW(eplb_rebalance(spec, std::vector<double>(255, 1.0), EplbPolicy::kGlobal),
               moe::Error);
  std::vector<double> loads(256, 1.0);
  loads[3] = -1;
  EXPECT_THROW(eplb_rebalance(spec, loads, EplbPolicy::kGlobal), moe::Error);
  PlacementSpec ungrouped = spec;
  ungrouped.num_groups = 0;
  EXPECT_FALSE(eplb_hierarchical_applicable(ungrouped));
  EXPECT_THROW(eplb_rebalance(ungrouped, std::vector<double>(256, 1.0), EplbPolicy::kHierarchical),
               moe::Error);
}

// EPLB's own figures on the pinned trace: hierarchical about 0.823, global
// about 0.989. Global does not depend on which experts share a group and is
// reproduced on seed 0. Hierarchical does: the seed's shuffle decides which
// groups the hot experts land in, and across seeds it spans 0.63 to 0.97
// (seed 0 of this generator: 0.649). Its mean over seeds is the figure to
// reproduce; 16 seeds of 16,384 tokens measure 0.822.
TEST(EplbReproduction, GlobalOnThePinnedTrace) {
  const std::vector<double> loads = generate_trace(test::reference_trace(0)).expert_loads();
  const PlacementSpec spec = test::reference_spec(0);
  const double global = balancedness(eplb_rebalance(spec, loads, EplbPolicy::kGlobal), loads);
  EXPECT_NEAR(global, 0.989, 0.004);
  // Pinned values of seed 0 (regression guard for the generator and EPLB).
  EXPECT_NEAR(global, 0.9901, 1e-4);
  EXPECT_NEAR(balancedness(eplb_rebalance(spec, loads, EplbPolicy::kHierarchical), loads), 0.6493,
              1e-4);
}

TEST(EplbReproduction, HierarchicalAcrossSeeds) {
  const PlacementSpec spec = test::reference_spec(0);
  double hierarchical = 0.0, global = 0.0;
  constexpr int kSeeds = 16;
  for (int seed = 0; seed < kSeeds; ++seed) {
    const std::vector<double> loads =
        generate_trace(test::reference_trace(0, seed, 0, 16384)).expert_loads();
    hierarchical += balancedness(eplb_rebalance(spec, loads, EplbPolicy::kHierarchical), loads);
    global += balancedness(eplb_rebalance(spec, loads, EplbPolicy::kGlobal), loads);
  }
  EXPECT_NEAR(hierarchical / kSeeds, 0.823, 0.03);
  EXPECT_NEAR(global / kSeeds, 0.989, 0.004);
}

}  // namespace
}  // namespace moe::placement
