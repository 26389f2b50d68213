// Shared helpers of the placement tests.
#pragma once

#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"

namespace moe::placement::test {

// The pinned reference setting of issue 3: 256 experts, top-8, 65,536 tokens,
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
inline void expect_valid_map(const LayerMap& map, const PlacementSpec& spec) {
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
