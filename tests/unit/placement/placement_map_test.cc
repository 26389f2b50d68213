#include "moe/placement/placement_map.h"

#include <gtest/gtest.h>

#include <cmath>

#include "moe/base/check.h"
#include "moe/placement/placement_metrics.h"
#include "placement_test_util.h"

namespace moe::placement {
namespace {

using test::map_of;

// Expects fn to throw moe::Error whose message contains every part.
template <typename F>
void expect_error(F&& fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    FAIL() << "no moe::Error";
  } catch (const moe::Error& e) {
    for (const char* part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message '" << e.what() << "' lacks '" << part << "'";
  }
}

TEST(PlacementSpec, RejectsSizesThatDoNotFitNamingTheValue) {
  expect_error([] { PlacementSpec{257, 32, 4, 0, 0}.validate(); }, {"257", "32", "divisible"});
  expect_error([] { PlacementSpec{256, 0, 1, 0, 0}.validate(); }, {"ranks (0)"});
  expect_error([] { PlacementSpec{0, 4, 1, 4, 0}.validate(); }, {"experts (0)"});
  expect_error([] { PlacementSpec{256, 30, 4, 34, 0}.validate(); }, {"ranks (30)", "nodes (4)"});
  expect_error([] { PlacementSpec{256, 32, 0, 32, 0}.validate(); }, {"nodes (0)"});
  expect_error([] { PlacementSpec{256, 32, 4, -1, 0}.validate(); }, {"redundant", "-1"});
  expect_error([] { PlacementSpec{256, 32, 4, 32, 7}.validate(); }, {"groups (7)"});
  expect_error([] { PlacementSpec{256, 32, 4, 32, 8, 257}.validate(); }, {"top_k (257)"});
  expect_error([] { PlacementSpec{256, 32, 4, 32, 8, 8, 9}.validate(); }, {"group_top_k (9)"});
  expect_error([] { PlacementSpec{256, 32, 4, 32, 0, 8, 2}.validate(); }, {"group_top_k (2)"});
  EXPECT_NO_THROW((PlacementSpec{256, 32, 4, 32, 8, 8, 4}.validate()));
  EXPECT_EQ((PlacementSpec{256, 32, 4, 32, 8}.slots_per_rank()), 9);
}

TEST(ExpertMap, BuildsLog2PhyAndLogcnt) {
  const ExpertMap map = map_of(3, 2, {0, 1, 0, 2});
  EXPECT_EQ(map.slots_per_rank, 2);
  EXPECT_EQ(map.logcnt, (std::vector<int32_t>{2, 1, 1}));
  EXPECT_EQ(map.max_replicas, 2);
  EXPECT_EQ(map.log2phy, (std::vector<int32_t>{0, 2, 1, -1, 3, -1}));
  test::expect_valid_map(map, PlacementSpec{3, 2, 2, 1, 0});
  // EPLB-style replica numbering.
  const std::vector<int32_t> rank = {1, 0, 0, 0};
  const ExpertMap ranked = map_of(3, 2, {0, 1, 0, 2}, &rank);
  EXPECT_EQ(ranked.replica_slot(0, 0), 2);
  EXPECT_EQ(ranked.replica_slot(0, 1), 0);
}

TEST(ExpertMap, RejectsUncoveredExpertsAndBadEntries) {
  expect_error([] { map_of(3, 2, {0, 1, 0, 1}); }, {"expert 2 has no slot"});
  expect_error([] { map_of(3, 2, {0, 1, 0, 3}); }, {"slot 3", "expert 3"});
  expect_error([] { map_of(3, 2, {0, 1, 0}); }, {"phy2log size (3)"});
  const std::vector<int32_t> rank = {0, 0, 0, 0};
  expect_error([&] { map_of(3, 2, {0, 1, 0, 2}, &rank); }, {"not a permutation"});
  ExpertMap map = map_of(3, 2, {0, 1, 0, 2});
  map.logcnt[0] = 3;
  expect_error([&] { validate_layer_map(map, PlacementSpec{3, 2, 2, 1, 0}); }, {"logcnt[0] is 3"});
  map = map_of(3, 2, {0, 1, 0, 2});
  map.log2phy[1] = 1;
  expect_error(
      [&] {
        validate_layer_map(map, PlacementSpec{3, 2, 2, 1, 0});
      },
      {"log2phy[0][1] is 1"});
  expect_error(
      [&] {
        validate_layer_map(map_of(3, 2, {0, 1, 0, 2}), PlacementSpec{3, 1, 1, 1, 0});
      },
      {"ranks"});
}

TEST(Metrics, RankLoadsAndBalancedness) {
  // Expert 0 (load 8) has two replicas: 4 on each of its ranks.
  const ExpertMap map = map_of(3, 2, {0, 1, 0, 2});
  const std::vector<double> loads = {8, 2, 6};
  EXPECT_EQ(rank_loads(map, loads), (std::vector<double>{6, 10}));
  EXPECT_DOUBLE_EQ(balancedness(map, loads), 8.0 / 10.0);
  EXPECT_DOUBLE_EQ(balancedness(map, std::vector<double>{0, 0, 0}), 1.0);
  EXPECT_THROW(balancedness(map, std::vector<double>{1, 2}), moe::Error);
}

TEST(Metrics, ExpectedFanoutIsExact) {
  // Node 0 = rank 0 = {0, 1}, node 1 = rank 1 = {0, 2}: expert 0 is on both.
  const ExpertMap map = map_of(3, 2, {0, 1, 0, 2});
  Trace trace;
  trace.num_experts = 3;
  trace.top_k = 2;
  trace.topk_idx = {0, 1, 1, 2, 0, 2};
  // {0,1}: node 0 surely, node 1 half the time; {1,2}: both; {0,2}: 1.5.
  EXPECT_DOUBLE_EQ(expected_fanout(map, 2, trace), (1.5 + 2.0 + 1.5) / 3.0);
  EXPECT_DOUBLE_EQ(expected_fanout(map, 1, trace), 1.0);
}

TEST(Metrics, CopiesMovedCountsCopiesARankMustFetch) {
  const ExpertMap before = map_of(3, 2, {0, 1, 2, 0});
  EXPECT_EQ(copies_moved(before, before), 0);
  EXPECT_EQ(copies_moved(before, map_of(3, 2, {1, 0, 0, 2})), 0);  // slots reordered
  EXPECT_EQ(copies_moved(before, map_of(3, 2, {2, 1, 0, 0})), 2);
  EXPECT_EQ(copies_moved(before, map_of(3, 2, {2, 0, 1, 0})), 2);
  EXPECT_THROW(copies_moved(before, map_of(3, 1, {0, 1, 2, 0})), moe::Error);
}

}  // namespace
}  // namespace moe::placement
