// Node redundancy (docs/placement.md#node-redundancy): every expert's copies on
// at least spec.min_node_replicas distinct nodes, so that losing any
// min_node_replicas - 1 nodes leaves a copy of every expert.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe/placement/placement_map.h"

namespace moe::placement::detail {

// Swaps copies between nodes until every expert spans min_node_replicas nodes:
// a copy from a node where its expert has another, with a copy of an expert
// that keeps its own span, the pair whose two ranks end up least loaded
// (unit: load of one copy of each expert). Replica counts do not change; each
// expert must already have min_node_replicas copies. Throws moe::Error naming
// an expert it cannot spread.
void spread_over_nodes(const PlacementSpec& spec, std::span<const double> unit, std::vector<int32_t>& phy2log);

}  // namespace moe::placement::detail
