// moed's expert placement solver (docs/placement.md#solver): replicate hot experts and pack
// the replicas onto ranks so that rank loads are balanced, keeping each
// expert group on few nodes (fewer nodes per token under group-limited
// routing) and, given the current map, keeping expert copies where they are;
// with spec.min_node_replicas > 1, every expert's copies span that many nodes.
//
// Pure computation: no I/O, no clocks, deterministic for the same input.
#pragma once

#include <span>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"

namespace moe::placement {

struct SolverOptions {
  // With a fan-out objective (a routing sample, or the top_k hint), the map
  // may give up this fraction of the best max rank load the solver finds for
  // fewer nodes per token. Without one the solver only balances, and its max
  // rank load is never above that of EPLB's global policy on the same loads.
  double locality_slack = 0.01;
  // With a current map: the result's max rank load may be up to
  // (1 + migration_slack) x that of the map solved without it, if that keeps
  // more copies in place.
  double migration_slack = 0.0;
  // ... and up to (1 + migration_fanout_slack) x its fan-out (measured on the
  // routing sample the from-scratch map was fitted to, which favours that
  // map by about a percent).
  double migration_fanout_slack = 0.03;
  // Fan-out (as a fraction of itself) that one more expert copy to fetch
  // must buy while the current map is repaired.
  double move_weight = 3e-4;
  // Bounds on the local searches (guard the run time): swaps per
  // load-balancing phase, sweeps over all slots per fan-out phase.
  int max_swaps = 200000;
  int max_passes = 50;
  // Perturb-and-search rounds of the node-level fan-out search (iterated
  // local search; only on problems with node slots x nodes <= 8192).
  int restarts = 8;
};

// Optional inputs of one layer besides its loads.
struct LayerContext {
  // The map in force: the new one keeps expert copies where they are.
  const ExpertMap* current = nullptr;
  // Expert sets of a sample of routed tokens. With it the solver lowers the
  // cross-node fan-out of exactly these tokens; without it, that of a model
  // of the loads (which needs the spec's top_k hint). A few thousand tokens
  // are plenty; the solver uses at most the first 131072 / nodes.
  const Trace* routing_sample = nullptr;
};

// What the solver did, for reports.
struct SolveInfo {
  const char* fanout_objective = "none";  // "sample", "model" or "none" (balance only)
  const char* migration = "none";         // "repaired" current map, "aligned" new one, "none"
  double pure_max_load = 0.0;             // best max rank load found without regard to nodes
  double max_load = 0.0;                  // max rank load of the returned map
};

// One layer. loads [E] (tokens per expert, finite, >= 0). context.current,
// when given, must be a valid map for spec (validate_layer_map); the routing
// sample must have spec's experts and distinct experts per token. Throws
// moe::Error.
ExpertMap solve_layer(const PlacementSpec& spec, std::span<const double> loads,
                     const LayerContext& context = {}, const SolverOptions& options = {},
                     SolveInfo* info = nullptr);

// Every layer: loads[l] is layer l's [E]; current, when given, has one map per layer.
std::vector<ExpertMap> solve(const PlacementSpec& spec,
                            const std::vector<std::vector<double>>& loads,
                            const std::vector<ExpertMap>* current = nullptr,
                            const SolverOptions& options = {});

}  // namespace moe::placement
