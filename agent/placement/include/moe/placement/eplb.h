// A C++ rendering of deepseek-ai/EPLB's greedy policy (eplb.py,
// rebalance_experts), the baseline moed's solver is measured against.
//
// Hierarchical: pack expert groups to nodes (balanced_packing), replicate
// experts inside each node (replicate_experts: each redundant slot goes to the
// expert with the largest load per replica), pack the node's physical experts
// to its ranks (balanced_packing). Global: the same with one group and one
// node. Ties go to the lower index (EPLB relies on torch's sort and argmax);
// loads are doubles where EPLB uses float32.
#pragma once

#include <span>
#include <vector>

#include "moe/placement/placement_map.h"

namespace moe::placement {

enum class EplbPolicy { kHierarchical, kGlobal };

const char* eplb_policy_name(EplbPolicy policy);

// Whether EPLB would use its hierarchical policy: groups given and divisible by
// nodes (EPLB's rebalance_experts falls back to global otherwise).
bool eplb_hierarchical_applicable(const PlacementSpec& spec);

// One layer. Throws moe::Error for an invalid spec, loads of the wrong size
// or negative/non-finite loads, and kHierarchical where it is not applicable.
ExpertMap eplb_rebalance(const PlacementSpec& spec, std::span<const double> loads,
                        EplbPolicy policy);

// balanced_packing: packs n items into num_packs packs of exactly n/num_packs
// items each, heaviest item first into the lightest pack that has room.
// Returns pack index per item; rank_in_pack (if given) gets the item's position.
std::vector<int> eplb_balanced_packing(std::span<const double> weight, int num_packs,
                                       std::vector<int>* rank_in_pack = nullptr);

// replicate_experts: num_phy >= n x min_count physical experts; the first n x
// min_count are the logical ones min_count times over (EPLB's min_count is 1),
// each further one replicates the expert with the largest weight / count.
// Returns phy2log [num_phy]; replica_rank and logcnt outputs.
std::vector<int> eplb_replicate_experts(std::span<const double> weight, int num_phy,
                                        std::vector<int>* replica_rank, std::vector<int>* logcnt,
                                        int min_count = 1);

}  // namespace moe::placement
