// Figures of merit of a map: rank loads, balancedness, cross-node fan-out and
// the copies a migration moves.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"

namespace moe::placement {

// Load of each rank: sum over its slots of load[e] / logcnt[e] (the replica
// rule of docs/layer.md#replica-choice makes that exact). loads has E entries,
// in tokens.
std::vector<double> rank_loads(const ExpertMap& map, std::span<const double> loads);

// Mean rank load / max rank load, in (0, 1]; 1 when every load is zero.
double balancedness(const ExpertMap& map, std::span<const double> loads);

// Expected number of distinct nodes that serve a token's experts, averaged over
// the trace's tokens: each (token, expert) pair picks one of the expert's
// replicas uniformly and independently (docs/layer.md#replica-choice), so for a
// token with expert set K the expectation is sum over nodes n of
// 1 - prod_{e in K} (1 - q(e, n)), q(e, n) = the fraction of e's replicas on
// node n. Exact, not sampled.
double expected_fanout(const ExpertMap& map, int num_nodes, const Trace& trace);

// Per node: the experts that have every copy on that node, which a job loses
// when the node dies (docs/placement.md#node-redundancy). Slot p lives on node
// p / (slots / num_nodes).
std::vector<int> experts_lost_per_node(const ExpertMap& map, int num_nodes);
// The fewest distinct nodes any expert's copies span (the map's node redundancy).
int min_nodes_spanned(const ExpertMap& map, int num_nodes);

// Expert copies a daemon must fetch to go from `before` to `after`: over all
// ranks, the copies of an expert that `after` puts on the rank beyond those
// `before` already had there (a multiset difference per rank). Moving a copy
// between slots of one rank is free. Both maps must have the same sizes.
int64_t copies_moved(const ExpertMap& before, const ExpertMap& after);

}  // namespace moe::placement
