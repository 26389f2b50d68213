// The placement problem's sizes and the checks of a layer's map (docs/placement.md#maps;
// the shapes of deepseek-ai/EPLB).
//
// Physical slot p (0 <= p < R*S) lives on rank p / S, local slot p % S; rank r
// lives on node r / (R/N) (global rank = node x ranks_per_node + local device).
// Expert groups, when given, are contiguous: group g holds experts
// [g*E/G, (g+1)*E/G) (DeepSeek-V3 group-limited routing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe/map/expert_map.h"

namespace moe::placement {

// Sizes of one placement request. validate() throws moe::Error naming the
// value that does not fit.
struct PlacementSpec {
  int num_experts = 0;    // E logical experts, >= 1
  int num_ranks = 0;      // R EP ranks, >= 1
  int num_nodes = 1;      // N, R % N == 0
  int num_redundant = 0;  // redundant slots, >= 0; (E + redundant) % R == 0
  int num_groups = 0;     // G; 0 or 1 means no groups; else E % G == 0
  // Routing hints (docs/layer.md#router), optional: the workload's top-k (0: unknown)
  // and group_top_k (0: routing is not group-limited). With top_k the solver
  // models how many nodes a token reaches and keeps that number low.
  int top_k = 0;
  int group_top_k = 0;
  // Every expert's copies span at least this many nodes (docs/placement.md#node-redundancy):
  // with 2, losing any one node leaves a copy of every expert. Needs
  // experts x min_node_replicas <= slots and <= nodes.
  int min_node_replicas = 1;

  void validate() const;
  int num_slots() const { return num_experts + num_redundant; }
  int slots_per_rank() const { return num_slots() / num_ranks; }
  int ranks_per_node() const { return num_ranks / num_nodes; }
  int slots_per_node() const { return num_slots() / num_nodes; }
  bool grouped() const { return num_groups > 1; }
  bool group_limited() const { return grouped() && group_top_k > 0; }
  int group_size() const { return grouped() ? num_experts / num_groups : num_experts; }
  int group_of(int expert) const { return grouped() ? expert / group_size() : 0; }
};

// One layer's map is moe::ExpertMap (moe/map/expert_map.h): the type the agent
// and the daemon share. The solver builds it with ExpertMap::make and fills
// every slot.

// Checks that a map fits spec and is self-consistent (every slot filled with a
// valid expert, every expert at least once, log2phy/logcnt agree with
// phy2log). Throws moe::Error naming the first inconsistency.
void validate_layer_map(const ExpertMap& map, const PlacementSpec& spec);

}  // namespace moe::placement
