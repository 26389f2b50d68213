// Internal to the solver: keeping expert copies where the current map has
// them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe/placement/placement_map.h"
#include "packing.h"

namespace moe::placement::detail {

// Renumbers the nodes of `next`, and the ranks inside each node, and orders
// each rank's slots, so that as many expert copies as possible sit where
// `current` has them. Rank loads and fan-out stay as they are (a node is
// matched to a node, a rank to a rank of the matched node; Hungarian
// assignment on the copies in common, greedy above 256 candidates).
std::vector<int32_t> align_to_current(const PlacementSpec& spec, std::span<const int32_t> next,
                                      const ExpertMap& current);

// The current map changed as little as it can: replica counts set to
// `counts` (surplus copies leave the most loaded ranks, new ones go to the
// least loaded ranks' freed slots), then swaps off the most loaded rank,
// fewest copies moved first, until every rank is at or under cap. False when
// no swap helps before that.
bool repair_current(const PlacementSpec& spec, std::span<const double> loads,
                    std::span<const int> counts, const ExpertMap& current, double cap, int max_swaps,
                    std::vector<int32_t>* phy2log);

}  // namespace moe::placement::detail
