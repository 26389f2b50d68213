#include "moe/placement/placement_solver.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "moe/placement/eplb.h"
#include "moe/base/check.h"
#include "moe/placement/placement_metrics.h"
#include "placement_test_util.h"

namespace moe::placement {
namespace {

struct Case {
  PlacementSpec spec;
  double alpha;
  int group_top_k;  // of the trace
};

// Shapes from 4 to 1024 ranks and 8 to 1024 experts, with and without groups.
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {{8, 4, 2, 0, 0, 2}, 1.0, 0},
      {{8, 4, 4, 8, 2, 2, 1}, 1.4, 1},
      {{64, 8, 2, 8, 4, 4, 2}, 0.8, 2},
      {{256, 32, 4, 32, 8, 8, 4}, 1.2, 4},
      {{160, 16, 4, 16, 0, 6}, 1.1, 0},
      {{1024, 4, 2, 0, 16, 8, 4}, 0.6, 4},
      {{128, 1024, 128, 896, 8, 8, 0}, 1.0, 0},
  };
  return all;
}

Trace trace_for(const Case& c, uint64_t window, int64_t tokens) {
  TraceConfig t;
  t.num_experts = c.spec.num_experts;
  t.top_k = c.spec.top_k;
  t.num_tokens = tokens;
  t.zipf_alpha = c.alpha;
  t.window = window;
  t.num_groups = c.spec.num_groups;
  t.group_top_k = c.group_top_k;
  return generate_trace(t);
}

TEST(Solver, MapsAreValidDeterministicAndNoWorseThanEplbGlobalWithoutObjective) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(testing::Message()
                 << c.spec.num_experts << " experts, " << c.spec.num_ranks << " ranks");
    const std::vector<double> loads = trace_for(c, 0, 2048).expert_loads();
    const Trace sample = trace_for(c, 1, 512);
    const ExpertMap a = solve_layer(c.spec, loads, {nullptr, &sample});
    test::expect_valid_map(a, c.spec);
    const ExpertMap b = solve_layer(c.spec, loads, {nullptr, &sample});
    EXPECT_EQ(a.phy2log, b.phy2log);
    EXPECT_EQ(a.log2phy, b.log2phy);
    // Balance only (no sample, no top_k hint): never below EPLB global.
    PlacementSpec plain = c.spec;
    plain.top_k = 0;
    plain.group_top_k = 0;
    const ExpertMap m = solve_layer(plain, loads);
    test::expect_valid_map(m, plain);
    EXPECT_GE(balancedness(m, loads),
              balancedness(eplb_rebalance(plain, loads, EplbPolicy::kGlobal), loads) - 1e-12);
  }
}

TEST(Solver, HandlesDegenerateLoads) {
  const PlacementSpec spec{16, 4, 2, 4, 4, 2, 1};
  for (const std::vector<double>& loads :
       {std::vector<double>(16, 0.0), std::vector<double>(16, 5.0), [] {
          std::vector<double> v(16, 0.0);
          v[7] = 1000.0;  // every token on one expert
          return v;
        }()}) {
    SolveInfo info;
    const ExpertMap map = solve_layer(spec, loads, {}, {}, &info);
    test::expect_valid_map(map, spec);
    EXPECT_LE(info.max_load, info.pure_max_load * 1.01 + 1e-9);
  }
  // A routing sample with no load to balance.
  Trace sample;
  sample.num_experts = 16;
  sample.top_k = 2;
  sample.topk_idx = {0, 1, 2, 5, 7, 3};
  test::expect_valid_map(solve_layer(spec, std::vector<double>(16, 0.0), {nullptr, &sample}), spec);
  std::vector<double> one_hot(16, 0.0);
  one_hot[7] = 1000.0;
  test::expect_valid_map(solve_layer(spec, one_hot, {nullptr, &sample}), spec);
  const ExpertMap map = solve_layer(spec, one_hot);
  EXPECT_EQ(map.logcnt[7], 5);  // all four redundant slots go to the only loaded expert
}

TEST(Solver, RejectsBadInputNamingIt) {
  const PlacementSpec spec = test::reference_spec(4);
  auto message = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const moe::Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message([&] { solve_layer(spec, std::vector<double>(255, 1.0)); }).find("255"),
            std::string::npos);
  std::vector<double> loads(256, 1.0);
  loads[17] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(message([&] { solve_layer(spec, loads); }).find("expert 17"), std::string::npos);
  loads[17] = -3;
  EXPECT_NE(message([&] { solve_layer(spec, loads); }).find("expert 17"), std::string::npos);
  PlacementSpec bad = spec;
  bad.num_experts = 257;
  EXPECT_NE(message([&] { solve_layer(bad, std::vector<double>(257, 1.0)); }).find("257"),
            std::string::npos);
  // A current map of another shape.
  const ExpertMap other =
      solve_layer(PlacementSpec{256, 16, 4, 32, 8}, std::vector<double>(256, 1.0));
  EXPECT_NE(
      message([&] { solve_layer(spec, std::vector<double>(256, 1.0), {&other}); }).find("ranks"),
      std::string::npos);
  // A routing sample with an unknown or repeated expert.
  Trace sample;
  sample.num_experts = 256;
  sample.top_k = 2;
  sample.topk_idx = {3, 300};
  EXPECT_NE(message([&] {
              solve_layer(spec, std::vector<double>(256, 1.0), {nullptr, &sample});
            }).find("300"),
            std::string::npos);
  sample.topk_idx = {3, 3};
  EXPECT_NE(message([&] {
              solve_layer(spec, std::vector<double>(256, 1.0), {nullptr, &sample});
            }).find("twice"),
            std::string::npos);
}

TEST(Solver, KeepsACurrentMapThatIsStillGood) {
  // Solving again for the same loads with the map as current moves nothing.
  const PlacementSpec spec = test::reference_spec(0);
  const std::vector<double> loads =
      generate_trace(test::reference_trace(0, 0, 0, 8192)).expert_loads();
  const ExpertMap first = solve_layer(spec, loads);
  SolveInfo info;
  const ExpertMap again = solve_layer(spec, loads, {&first}, {}, &info);
  test::expect_valid_map(again, spec);
  EXPECT_EQ(copies_moved(first, again), 0);
  EXPECT_GE(balancedness(again, loads), balancedness(first, loads) - 1e-12);
}

TEST(Solver, MultiLayerSolveMatchesPerLayer) {
  const PlacementSpec spec{64, 8, 2, 8, 4};
  std::vector<std::vector<double>> loads;
  for (int l = 0; l < 3; ++l) {
    TraceConfig t;
    t.num_experts = 64;
    t.num_tokens = 1024;
    t.seed = l;
    loads.push_back(generate_trace(t).expert_loads());
  }
  const std::vector<ExpertMap> maps = solve(spec, loads);
  ASSERT_EQ(maps.size(), 3u);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(maps[l].phy2log, solve_layer(spec, loads[l]).phy2log);
  std::vector<ExpertMap> wrong(2, maps[0]);
  EXPECT_THROW(solve(spec, loads, &wrong), moe::Error);
}

}  // namespace
}  // namespace moe::placement

namespace moe::placement {
namespace {

// docs/placement.md#node-redundancy: with min_node_replicas m, no expert has all
// its copies on fewer than m nodes, on every shape and skew, with or without a
// current map (a rebalance keeps the rule), and where the slots leave room for
// hot replicas beyond the m copies of every expert, the balance stays close to
// the unconstrained map's (with exactly E x m slots no hot expert can get a
// third copy: that balance is the capacity's, whatever the placement).
TEST(NodeRedundancy, EveryExpertSpansMinNodeReplicasNodes) {
  struct Shape {
    int experts, ranks, nodes, redundant, groups, top_k, m;
  };
  for (const Shape& s : {Shape{16, 4, 2, 24, 0, 4, 2}, Shape{16, 3, 3, 38, 0, 4, 3}, Shape{64, 8, 4, 96, 8, 4, 2},
                         Shape{256, 64, 8, 384, 8, 8, 2}, Shape{32, 8, 4, 48, 0, 0, 2}, Shape{16, 4, 2, 16, 0, 4, 2}}) {
    const bool room = s.redundant > s.experts * (s.m - 1);
    for (double alpha : {0.0, 1.2, 2.0}) {
      SCOPED_TRACE(testing::Message() << s.experts << " experts on " << s.ranks << " ranks, " << s.nodes
                                      << " nodes, m " << s.m << ", zipf " << alpha);
      PlacementSpec spec{s.experts, s.ranks, s.nodes, s.redundant, s.groups, s.top_k};
      spec.min_node_replicas = s.m;
      PlacementSpec routed = spec;  // the trace's routing (top-4 when the spec gives no hint)
      routed.top_k = std::max(4, spec.top_k);
      const Case c{routed, alpha, 0};
      const std::vector<double> loads = trace_for(c, 0, 4096).expert_loads();
      const ExpertMap map = solve_layer(spec, loads);
      test::expect_valid_map(map, spec);
      const std::vector<int> lost = experts_lost_per_node(map, s.nodes);
      for (int n = 0; n < s.nodes; ++n) EXPECT_EQ(lost[n], 0) << "node " << n;
      for (int e = 0; e < s.experts; ++e) EXPECT_GE(map.logcnt[e], s.m) << "expert " << e;
      PlacementSpec free = spec;
      free.min_node_replicas = 1;
      if (room) EXPECT_GE(balancedness(map, loads), 0.95 * balancedness(solve_layer(free, loads), loads));
      // A rebalance from it under other loads keeps the rule.
      const std::vector<double> later = trace_for(Case{routed, alpha + 0.3, 0}, 2, 4096).expert_loads();
      const ExpertMap next = solve_layer(spec, later, {&map, nullptr});
      for (int lost_here : experts_lost_per_node(next, s.nodes)) EXPECT_EQ(lost_here, 0);
    }
  }
}

TEST(NodeRedundancy, ImpossibleRequestsAreRefusedNamingTheRule) {
  PlacementSpec spec{16, 4, 2, 0, 0, 0};
  spec.min_node_replicas = 2;  // 16 slots cannot hold two copies of 16 experts
  try {
    spec.validate();
    ADD_FAILURE() << "accepted";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("min_node_replicas (2) needs experts x 2 = 32 slots, there are 16"),
              std::string::npos)
        << e.what();
  }
  spec.num_redundant = 48;
  spec.min_node_replicas = 3;  // more than the 2 nodes
  EXPECT_THROW(spec.validate(), moe::Error);
}

TEST(NodeRedundancy, LostExpertsPerNodeCountsExpertsHeldByOneNodeOnly) {
  // 4 ranks x 2 slots on 2 nodes: node 0 = slots 0-3, node 1 = slots 4-7.
  const ExpertMap map = ExpertMap::make(4, 4, 2, {0, 1, 0, 2, 3, 3, 1, 2});
  EXPECT_EQ(experts_lost_per_node(map, 2), (std::vector<int>{1, 1}));  // expert 0 on node 0, 3 on node 1
}

}  // namespace
}  // namespace moe::placement
