// The placement problem's sizes and the per-layer map (DESIGN 7; the shapes of
// deepseek-ai/EPLB).
//
// Physical slot p (0 <= p < R*S) lives on rank p / S, local slot p % S; rank r
// lives on node r / (R/N) (global rank = node x ranks_per_node + local device).
// Expert groups, when given, are contiguous: group g holds experts
// [g*E/G, (g+1)*E/G) (DeepSeek-V3 group-limited routing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::placement {

// Sizes of one placement request. validate() throws moe::Error naming the
// value that does not fit.
struct PlacementSpec {
  int num_experts = 0;    // E logical experts, >= 1
  int num_ranks = 0;      // R EP ranks, >= 1
  int num_nodes = 1;      // N, R % N == 0
  int num_redundant = 0;  // redundant slots, >= 0; (E + redundant) % R == 0
  int num_groups = 0;     // G; 0 or 1 means no groups; else E % G == 0
  // Routing hints (DESIGN 3.1), optional: the workload's top-k (0: unknown)
  // and group_top_k (0: routing is not group-limited). With top_k the solver
  // models how many nodes a token reaches and keeps that number low.
  int top_k = 0;
  int group_top_k = 0;

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

// One layer's map.
//   phy2log [R*S]      logical expert held by each physical slot
//   logcnt  [E]        replicas of each expert (>= 1)
//   log2phy [E, X]     replica j of expert e sits in slot log2phy[e*X + j];
//                      entries j >= logcnt[e] are -1; X = max_replicas
// A (token, expert) pair goes to replica hash(token, expert) % logcnt[e]
// (DESIGN 3), so each replica takes an equal share of its expert's load.
struct LayerMap {
  int num_experts = 0;
  int num_ranks = 0;
  int slots_per_rank = 0;
  int max_replicas = 0;
  std::vector<int32_t> phy2log;
  std::vector<int32_t> logcnt;
  std::vector<int32_t> log2phy;

  int num_slots() const { return num_ranks * slots_per_rank; }
  int rank_of_slot(int slot) const { return slot / slots_per_rank; }
  int32_t replica_slot(int expert, int replica) const {
    return log2phy[static_cast<std::size_t>(expert) * max_replicas + replica];
  }
};

// Builds logcnt and log2phy from phy2log. Replicas are numbered by ascending
// slot unless replica_rank [R*S] gives each slot's replica number (EPLB keeps
// the order in which it created replicas). Throws moe::Error when a slot
// holds an expert outside [0, E), an expert has no slot, or replica_rank is
// not a permutation of 0..logcnt-1 per expert.
LayerMap make_layer_map(int num_experts, int num_ranks, std::vector<int32_t> phy2log,
                        const std::vector<int32_t>* replica_rank = nullptr);

// Checks that a map fits spec and is self-consistent (every slot filled with a
// valid expert, every expert at least once, log2phy/logcnt agree with
// phy2log). Throws moe::Error naming the first inconsistency.
void validate_layer_map(const LayerMap& map, const PlacementSpec& spec);

}  // namespace moe::placement
