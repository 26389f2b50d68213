// Internal to the solver: how many nodes a token reaches (its cross-node
// fan-out), as an objective the local search can update swap by swap.
//
// Two implementations:
// - sample: the exact expectation over a sample of routed tokens (their
//   expert sets). Each (token, expert) pair picks a replica uniformly
//   (docs/layer.md#replica-choice), so token t misses node n with probability
//   M(t, n) = prod_{e in t} (1 - k(e, n) / c(e)), k(e, n) = replicas of e on
//   n, c(e) = replicas of e; fan-out = mean over t of sum_n (1 - M(t, n)).
// - model: no sample, only loads and the routing hints. A token activates
//   each expert group g independently with probability alpha_g (one group of
//   every expert, always active, when routing is not group-limited) and picks
//   expert e of an active group independently with probability beta_e, so it
//   misses node n with probability prod_g (1 - alpha_g + alpha_g W(g, n)),
//   W(g, n) = prod_{e in g} (1 - beta_e k(e, n) / c(e)). alpha and beta are
//   fitted to the loads: sum_g alpha_g = group_top_k with alpha_g
//   proportional to the group's load (capped at 1), alpha_g beta_e =
//   load_e / tokens, tokens = total load / top_k.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"
#include "packing.h"

namespace moe::placement::detail {

class FanoutObjective {
 public:
  virtual ~FanoutObjective() = default;
  // Expected nodes per token for the current packing.
  virtual double fanout() const = 0;
  // Change of fan-out if one replica of e moved from node `from` to node n,
  // for every n (delta[from] = 0). delta has num_nodes entries.
  virtual void move_deltas(int e, int from, std::span<double> delta) const = 0;
  // The same for one target node.
  virtual double move_delta(int e, int from, int to) const = 0;
  // A bound on |move_delta(e, ., .)|.
  virtual double move_bound(int e) const = 0;
  // The exact change if the replicas in slots a and b (on different nodes, of
  // different experts) traded places, minus the two single-move deltas: what
  // the tokens that picked both experts add.
  virtual double joint_delta(int a, int b) const = 0;
  // Records that swap; call before Packing::swap_slots(a, b).
  virtual void apply_swap(int a, int b) = 0;
};

struct RoutingModel {
  int num_groups = 1;         // model groups
  int group_size = 1;         // experts per model group
  std::vector<double> alpha;  // [num_groups]
  std::vector<double> beta;   // [E]
};

// False when there is nothing to model (no top_k hint, one node, zero load).
bool make_routing_model(const PlacementSpec& spec, std::span<const double> loads,
                        RoutingModel* model);

// Objectives over packing (which must outlive them and change only through
// apply_swap + swap_slots). replicas [E] are the replica counts.
std::unique_ptr<FanoutObjective> make_model_objective(const Packing& packing,
                                                      std::span<const int> replicas,
                                                      const RoutingModel& model);
std::unique_ptr<FanoutObjective> make_sample_objective(const Packing& packing,
                                                       std::span<const int> replicas,
                                                       const Trace& sample);

// Local search on J = fan-out + penalty x sum over ranks of
// max(0, load - cap) / cap. For each slot in turn it takes the swap with a
// slot of another rank that lowers J most (a swap inside a node changes loads
// only); candidates are ranked by the sum of the two single-move deltas and
// the best few are checked exactly. Stops after a sweep that lowers J by
// less than 0.1% of the fan-out, or after max_passes sweeps. A large penalty makes cap a hard limit
// for a packing that starts under it; a smaller one lets an over-full start shed load where that
// costs the least fan-out. Unless allow_copies, no swap puts a second copy of an expert on a rank.
//
// With moves, J also counts move_weight per expert copy a rank holds beyond
// what it holds in moves' original map (copies a daemon would fetch).
class MoveCount {
 public:
  MoveCount(const Packing& packing, std::span<const int32_t> original, int num_experts);
  // Change of the copies to fetch if slots a and b traded places.
  int swap_delta(int a, int b) const;
  // Records that swap; call before Packing::swap_slots(a, b).
  void apply_swap(int a, int b);

 private:
  size_t at(int e, int r) const { return static_cast<size_t>(e) * num_ranks_ + r; }
  int fetch_delta(int r, int lose, int gain) const;
  const Packing& packing_;
  int num_ranks_;
  std::vector<int> now_, original_;  // [E, R] copies of e on rank r
};

void reduce_fanout(Packing& packing, FanoutObjective& objective, double cap, double penalty,
                   int max_passes, bool allow_copies, MoveCount* moves = nullptr,
                   double move_weight = 0.0);

}  // namespace moe::placement::detail
