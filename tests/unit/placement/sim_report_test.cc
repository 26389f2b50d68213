#include "moe/placement/sim_report.h"

#include <gtest/gtest.h>

#include "moe/base/check.h"

namespace moe::placement {
namespace {

std::string error_of(std::string_view text) {
  try {
    parse_loads(text);
  } catch (const moe::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(ParseLoads, ReadsLayersSkippingBlankAndCommentLines) {
  const auto loads = parse_loads("# layer 0\n1 2.5 3e2\n\n  4\t5 6  \n");
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0], (std::vector<double>{1, 2.5, 300}));
  EXPECT_EQ(loads[1], (std::vector<double>{4, 5, 6}));
}

TEST(ParseLoads, NamesTheBadLineAndField) {
  EXPECT_NE(error_of("1 2 3\n1 x 3\n").find("line 2, field 2: 'x'"), std::string::npos);
  EXPECT_NE(error_of("1 2 3\n1 2\n").find("line 2 has 2 loads"), std::string::npos);
  EXPECT_NE(error_of("1 -2 3\n").find("field 2"), std::string::npos);
  EXPECT_NE(error_of("1 nan 3\n").find("field 2"), std::string::npos);
  EXPECT_NE(error_of("1 2.5.1\n").find("'2.5.1'"), std::string::npos);
  EXPECT_NE(error_of("# nothing\n\n").find("no layer"), std::string::npos);
}

SimConfig small_config() {
  SimConfig c;
  c.spec = {32, 8, 2, 8, 4, 4, 2};
  c.num_tokens = 2048;
  c.sample_tokens = 256;
  return c;
}

TEST(Simulation, TraceModeReportsEveryPolicy) {
  const SimReport report = run_simulation(small_config());
  ASSERT_EQ(report.layers.size(), 1u);
  const auto& rows = report.layers[0].policies;
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0].policy, "moed");
  EXPECT_EQ(rows[1].policy, "moed-from-scratch");
  EXPECT_EQ(rows[2].policy, "eplb-hierarchical");
  EXPECT_EQ(rows[3].policy, "eplb-global");
  for (const PolicyResult& r : rows) {
    EXPECT_TRUE(r.available);
    EXPECT_GT(r.balancedness, 0.3);
    EXPECT_LE(r.balancedness, 1.0);
    ASSERT_TRUE(r.fanout.has_value());
    EXPECT_GE(*r.fanout, 1.0);
    EXPECT_LE(*r.fanout, 2.0);  // two nodes
    ASSERT_TRUE(r.copies_moved.has_value());
  }
  const std::string json = format_json(report);
  EXPECT_NE(json.find("\"policy\": \"eplb-global\""), std::string::npos);
  EXPECT_NE(json.find("\"fanout\": "), std::string::npos);
  EXPECT_NE(format_table(report).find("eplb-hierarchical"), std::string::npos);
}

TEST(Simulation, LoadsModeHasNoFanoutAndMarksHierarchicalNotApplicable) {
  SimConfig c = small_config();
  c.spec.num_groups = 0;
  c.spec.group_top_k = 0;
  c.loads = {std::vector<double>(32, 3.0), std::vector<double>(32, 1.0)};
  c.loads[1][5] = 90.0;
  const SimReport report = run_simulation(c);
  ASSERT_EQ(report.layers.size(), 2u);
  for (const LayerResult& layer : report.layers) {
    ASSERT_EQ(layer.policies.size(), 3u);  // no previous loads: no from-scratch row
    EXPECT_FALSE(layer.policies[0].fanout.has_value());
    EXPECT_FALSE(layer.policies[0].copies_moved.has_value());
    EXPECT_FALSE(layer.policies[1].available);
    EXPECT_NE(layer.policies[1].note.find("groups (0)"), std::string::npos);
  }
  EXPECT_NE(format_json(report).find("\"fanout\": null"), std::string::npos);
  c.loads[1].pop_back();
  EXPECT_THROW(run_simulation(c), moe::Error);
}

// Recorded mode (moe-placement-sim --trace): each layer's tokens are its loads
// and the tokens its fan-out is measured on; the balancedness is what the same
// loads give in loads mode.
TEST(SimReport, ARecordedTraceIsItsLayersLoadsAndTokens) {
  SimConfig c;
  c.spec.num_experts = 8;
  c.spec.num_ranks = 4;
  c.spec.num_nodes = 2;
  c.spec.num_redundant = 4;
  c.spec.top_k = 2;
  c.sample_tokens = 64;
  for (int l = 0; l < 2; ++l) {
    Trace t{8, 2, {}};
    for (int tok = 0; tok < 400; ++tok) {  // expert 0 (layer 0) or 7 (layer 1) in most tokens
      const int hot = l == 0 ? 0 : 7;
      const int other = 1 + (tok * 5 + l) % 6;
      t.topk_idx.push_back(tok % 4 ? std::min(hot, other) : std::min(other, (other % 6) + 1));
      t.topk_idx.push_back(tok % 4 ? std::max(hot, other) : std::max(other, (other % 6) + 1));
    }
    c.recorded.push_back(t);
  }
  c.recorded_source = "test";
  const SimReport r = run_simulation(c);
  ASSERT_TRUE(r.recorded_mode);
  ASSERT_EQ(r.layers.size(), 2u);
  EXPECT_EQ(r.recorded_tokens, (std::vector<int64_t>{400, 400}));
  SimConfig as_loads = c;
  as_loads.recorded.clear();
  for (const Trace& t : c.recorded) as_loads.loads.push_back(t.expert_loads());
  const SimReport l = run_simulation(as_loads);
  for (size_t layer = 0; layer < 2; ++layer) {
    const PolicyResult& eplb = r.layers[layer].policies.back();
    EXPECT_EQ(eplb.policy, "eplb-global");
    EXPECT_DOUBLE_EQ(eplb.balancedness, l.layers[layer].policies.back().balancedness);
    ASSERT_TRUE(eplb.fanout.has_value());  // per-token data: the fan-out is measured
    EXPECT_GE(*eplb.fanout, 1.0);
    EXPECT_LE(*eplb.fanout, 2.0);
    EXPECT_GE(r.layers[layer].policies.front().balancedness, eplb.balancedness);
  }
  EXPECT_NE(format_table(r).find("recorded trace: test, 2 layer(s), top-2, tokens per layer: 400 400"),
            std::string::npos)
      << format_table(r);
  c.recorded[1].num_experts = 9;
  EXPECT_THROW(run_simulation(c), Error);
}

}  // namespace
}  // namespace moe::placement
