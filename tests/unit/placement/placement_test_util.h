// Shared helpers of the placement tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"

namespace moe::placement::test {

// A map of E experts on R ranks from phy2log alone (slots per rank from its size),
// optionally with EPLB's replica order.
inline ExpertMap map_of(int num_experts, int num_ranks, std::vector<int32_t> phy2log,
                        const std::vector<int32_t>* replica_order = nullptr) {
  const int S = num_ranks > 0 ? std::max<int>(1, static_cast<int>(phy2log.size()) / num_ranks) : 1;
  return ExpertMap::make(num_experts, num_ranks, S, std::move(phy2log), 0, replica_order);
}

// The pinned reference setting (agent/placement/README.md): 256 experts, top-8, 65,536 tokens,
// seed 0, alpha 1.2, 32 ranks on 4 nodes, 8 groups, 32 redundant slots.
inline PlacementSpec reference_spec(int group_top_k) {
  return PlacementSpec{256, 32, 4, 32, 8, 8, group_top_k};
}

inline TraceConfig reference_trace(int group_top_k, uint64_t seed = 0, uint64_t window = 0,
                                   int64_t tokens = 65536) {
  TraceConfig t;
  t.num_groups = 8;
  t.group_top_k = group_top_k;
  t.seed = seed;
  t.window = window;
  t.num_tokens = tokens;
  return t;
}

// Every property a map must have: sizes, every slot a valid expert, every
// expert at least once, log2phy/logcnt consistent (validate_layer_map), and
// log2phy listing each of the expert's slots exactly once.
inline void expect_valid_map(const ExpertMap& map, const PlacementSpec& spec) {
  ASSERT_NO_THROW(validate_layer_map(map, spec));
  ASSERT_EQ(map.phy2log.size(), static_cast<size_t>(spec.num_slots()));
  std::vector<std::set<int>> slots(spec.num_experts);
  for (int p = 0; p < spec.num_slots(); ++p) slots[map.phy2log[p]].insert(p);
  for (int e = 0; e < spec.num_experts; ++e) {
    ASSERT_GE(map.logcnt[e], 1) << "expert " << e;
    std::set<int> listed;
    for (int j = 0; j < map.logcnt[e]; ++j) listed.insert(map.replica_slot(e, j));
    EXPECT_EQ(listed, slots[e]) << "expert " << e;
  }
}

}  // namespace moe::placement::test
