// The expert map (docs/placement.md#maps) on the wire, v1::PlacementMap, and
// back: the one codec the agent, moed and moectl use.
#pragma once

#include "moe/map/expert_map.h"
#include "moe/v1/placement.pb.h"

namespace moe::spec {

// The map of job layer `layer`, with the map's epoch.
v1::PlacementMap to_proto(const ExpertMap& map, int layer);
// Validates as ExpertMap::make does (empty slots allowed: check full() where a
// map must come from the solver); throws moe::Error naming the layer.
ExpertMap from_proto(const v1::PlacementMap& map);

}  // namespace moe::spec
