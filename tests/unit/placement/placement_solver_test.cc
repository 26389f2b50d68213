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
