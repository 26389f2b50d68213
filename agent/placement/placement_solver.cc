#include "moe/placement/placement_solver.h"

#include <algorithm>

#include "fanout_objective.h"
#include "migration.h"
#include "moe/placement/eplb.h"
#include "moe/base/check.h"
#include "moe/placement/placement_metrics.h"
#include "moe/placement/rng.h"
#include "packing.h"

namespace moe::placement {

namespace {

using detail::Packing;

// Weight of overload against modelled fan-out in the local search: 1% of a
// rank's cap over costs as much as 0.1 nodes per token.
constexpr double kOverloadPenalty = 10.0;
// Then overload only moves to cut overload.
constexpr double kHardPenalty = 1e6;
// Perturbation rounds run where node slots x nodes is at most this.
constexpr int64_t kRestartLimit = 8192;
constexpr uint64_t kRestartSeed = 0x5EED;
// Routing-sample tokens x nodes the fan-out search works with.
constexpr int64_t kSampleBudget = int64_t{1} << 17;

// The packing of spec whose slots hold phy2log (every slot filled).
Packing packing_of(const PlacementSpec& spec, std::span<const double> unit,
                   std::span<const int32_t> phy2log) {
  Packing packing(spec, unit);
  for (int p = 0; p < spec.num_slots(); ++p) packing.place_at(p, phy2log[p]);
  return packing;
}

void check_sample(const PlacementSpec& spec, const Trace& sample) {
  MOE_CHECK(sample.num_experts == spec.num_experts, "routing sample has ",
                      sample.num_experts, " experts, the request ", spec.num_experts);
  MOE_CHECK(sample.top_k >= 1 && sample.topk_idx.size() % sample.top_k == 0,
                      "routing sample: ", sample.topk_idx.size(),
                      " entries is not a multiple of top_k (", sample.top_k, ")");
  std::vector<int64_t> seen(spec.num_experts, -1);  // token that last picked the expert
  for (int64_t t = 0; t < sample.num_tokens(); ++t) {
    const int32_t* row = &sample.topk_idx[t * sample.top_k];
    for (int i = 0; i < sample.top_k; ++i) {
      MOE_CHECK(row[i] >= 0 && row[i] < spec.num_experts, "routing sample token ", t,
                          " picks expert ", row[i], ", outside [0, ", spec.num_experts, ")");
      MOE_CHECK(seen[row[i]] != t, "routing sample token ", t, " picks expert ", row[i],
                          " twice");
      seen[row[i]] = t;
    }
  }
}

// Packs for few nodes per token: every group on its home nodes, swaps
// between nodes that even out node loads (to node_cap) where that costs the
// least fan-out, then each node spread over its ranks and the same search on
// ranks (to cap). False if it cannot get every rank under cap.
template <typename MakeObjective>
bool pack_for_locality(const PlacementSpec& spec, std::span<const double> loads,
                       std::span<const double> unit, std::span<const int> counts, double node_cap,
                       double cap, const SolverOptions& options, MakeObjective make_objective,
                       std::vector<int32_t>* phy2log) {
  const PlacementSpec node_spec = detail::node_level_spec(spec);
  const detail::Locality locality = detail::make_locality(spec, loads);
  Packing nodes = detail::greedy_pack(node_spec, unit, counts, locality, node_cap, true);
  {
    auto objective = make_objective(nodes);
    detail::reduce_fanout(nodes, *objective, node_cap, kOverloadPenalty, options.max_passes, true);
  }
  // Iterated local search: perturb the best node packing with a few random
  // swaps and search again, keeping the result if J fell. Only on small
  // problems, where a search is cheap.
  const int node_slots = node_spec.num_slots();
  const int rounds =
      static_cast<int64_t>(node_slots) * spec.num_nodes <= kRestartLimit ? options.restarts : 0;
  if (rounds > 0) {
    auto node_j = [&](const Packing& p, detail::FanoutObjective& objective) {
      double over = 0.0;
      for (int n = 0; n < spec.num_nodes; ++n)
        over += std::max(0.0, p.rank_load(n) - node_cap) / node_cap;
      return objective.fanout() + kOverloadPenalty * over;
    };
    double best_j = node_j(nodes, *make_objective(nodes));
    SplitMix64 rng(kRestartSeed);
    const int kick = std::max(4, node_slots / 32);
    for (int round = 0; round < rounds; ++round) {
      Packing trial = nodes;
      for (int i = 0; i < kick; ++i) {
        const int a = static_cast<int>(rng.next_below(node_slots));
        const int b = static_cast<int>(rng.next_below(node_slots));
        if (trial.rank_of_slot(a) != trial.rank_of_slot(b)) trial.swap_slots(a, b);
      }
      auto objective = make_objective(trial);
      detail::reduce_fanout(trial, *objective, node_cap, kOverloadPenalty, options.max_passes,
                            true);
      const double j = node_j(trial, *objective);
      if (j < best_j) {
        best_j = j;
        nodes = std::move(trial);
      }
    }
  }
  Packing ranks = detail::unfold_nodes(spec, nodes, unit);
  detail::reduce_max_load(ranks, true, options.max_swaps);
  {
    auto objective = make_objective(ranks);
    detail::reduce_fanout(ranks, *objective, cap, kOverloadPenalty, options.max_passes, false);
    if (ranks.max_load() > cap)
      detail::reduce_fanout(ranks, *objective, cap, kHardPenalty, options.max_passes, false);
  }
  detail::reduce_max_load(ranks, true, options.max_swaps);
  if (ranks.max_load() > cap) return false;
  *phy2log = ranks.phy2log();
  return true;
}

}  // namespace

LayerMap solve_layer(const PlacementSpec& spec, std::span<const double> loads,
                     const LayerContext& context, const SolverOptions& options, SolveInfo* info) {
  spec.validate();
  detail::check_loads(spec, loads);
  if (context.current) validate_layer_map(*context.current, spec);
  const Trace* sample = context.routing_sample;
  if (sample) check_sample(spec, *sample);
  // The sample objective's work grows with tokens x nodes: use at most
  // kSampleBudget / nodes tokens of the sample (the first ones).
  Trace trimmed;
  if (sample && sample->num_tokens() * spec.num_nodes > kSampleBudget) {
    trimmed.num_experts = sample->num_experts;
    trimmed.top_k = sample->top_k;
    const int64_t keep = std::max<int64_t>(1, kSampleBudget / spec.num_nodes);
    trimmed.topk_idx.assign(sample->topk_idx.begin(),
                            sample->topk_idx.begin() + keep * sample->top_k);
    sample = &trimmed;
  }

  // Replica counts and the balance-only candidate: EPLB's global map, then
  // local search, so the result can only improve on EPLB global.
  const LayerMap global = eplb_rebalance(spec, loads, EplbPolicy::kGlobal);
  const std::vector<int> counts(global.logcnt.begin(), global.logcnt.end());
  std::vector<double> unit(loads.size());
  for (size_t e = 0; e < loads.size(); ++e) unit[e] = loads[e] / counts[e];
  Packing pure = packing_of(spec, unit, global.phy2log);
  detail::reduce_max_load(pure, false, options.max_swaps);
  const double pure_max = pure.max_load();
  std::vector<int32_t> phy2log = pure.phy2log();
  double max_load = pure_max;
  const char* objective_name = "none";
  const char* migration = "none";

  // Fewer nodes per token, measured on the routing sample when there is one,
  // else on the model of the loads and routing hints.
  // (Nothing to do on one node or without load.)
  detail::RoutingModel model;
  const bool use_sample =
      sample && sample->num_tokens() > 0 && spec.num_nodes > 1 && pure_max > 0.0;
  const bool use_model = !use_sample && detail::make_routing_model(spec, loads, &model);
  // The fan-out objective over packing (when use_sample or use_model).
  auto make_objective = [&](const Packing& packing) {
    return use_sample ? detail::make_sample_objective(packing, counts, *sample)
                      : detail::make_model_objective(packing, counts, model);
  };
  if (use_sample || use_model) {
    const double cap = pure_max * (1.0 + options.locality_slack);
    double total = 0.0;
    for (double l : loads) total += l;
    // Node loads get half the ranks' slack over their mean, which leaves the
    // ranks room for coarse replicas; where the ranks still cannot all get
    // under cap, none.
    std::vector<int32_t> local;
    bool packed = false;
    for (double share : {0.5, 0.0}) {
      const double node_cap =
          total / spec.num_nodes * (1.0 + (cap / (total / spec.num_ranks) - 1.0) * share);
      packed = pack_for_locality(spec, loads, unit, counts, node_cap, cap, options, make_objective,
                                 &local);
      if (packed) break;
    }
    if (packed) {
      const Packing candidate = packing_of(spec, unit, local);
      if (make_objective(candidate)->fanout() < make_objective(pure)->fanout()) {
        phy2log = std::move(local);
        max_load = candidate.max_load();
        objective_name = use_sample ? "sample" : "model";
      }
    }
  }
  if (context.current) {
    // Keep copies in place: the map above with nodes and ranks renumbered to
    // match the current one, or the current map repaired, whichever moves
    // fewer copies without a higher max rank load (and, with a fan-out
    // objective, without more than migration_fanout_slack more fan-out).
    const LayerMap& current = *context.current;
    std::vector<int32_t> aligned = detail::align_to_current(spec, phy2log, current);
    const int64_t aligned_moves =
        copies_moved(current, make_layer_map(spec.num_experts, spec.num_ranks, aligned));
    std::vector<int32_t> repaired;
    const double cap = max_load * (1.0 + options.migration_slack);
    bool use_repaired = false;
    if (detail::repair_current(spec, loads, counts, current, cap, options.max_swaps, &repaired)) {
      if (use_sample || use_model) {
        // Win back fan-out, a copy to fetch costing move_weight of it.
        Packing packing = packing_of(spec, unit, repaired);
        auto objective = make_objective(packing);
        detail::MoveCount moves(packing, current.phy2log, spec.num_experts);
        const double weight = options.move_weight * objective->fanout();
        detail::reduce_fanout(packing, *objective, cap, kHardPenalty, options.max_passes, false,
                              &moves, weight);
        repaired = packing.phy2log();
      }
      const int64_t repaired_moves =
          copies_moved(current, make_layer_map(spec.num_experts, spec.num_ranks, repaired));
      use_repaired = repaired_moves < aligned_moves;
      if (use_repaired && (use_sample || use_model)) {
        auto fanout_of = [&](const std::vector<int32_t>& map) {
          const Packing packing = packing_of(spec, unit, map);
          return make_objective(packing)->fanout();
        };
        use_repaired =
            fanout_of(repaired) <= fanout_of(aligned) * (1.0 + options.migration_fanout_slack);
      }
    }
    phy2log = use_repaired ? std::move(repaired) : std::move(aligned);
    migration = use_repaired ? "repaired" : "aligned";
  }
  LayerMap map = make_layer_map(spec.num_experts, spec.num_ranks, std::move(phy2log));
  if (info) {
    info->fanout_objective = objective_name;
    info->migration = migration;
    info->pure_max_load = pure_max;
    // Every candidate map keeps the replica counts `counts`, so these are the
    // loads the search worked with (unit = loads / counts, summed slot by slot).
    const std::vector<double> per_rank = rank_loads(map, loads);
    info->max_load = *std::max_element(per_rank.begin(), per_rank.end());
  }
  return map;
}

std::vector<LayerMap> solve(const PlacementSpec& spec,
                            const std::vector<std::vector<double>>& loads,
                            const std::vector<LayerMap>* current, const SolverOptions& options) {
  MOE_CHECK(!current || current->size() == loads.size(), "current map has ",
                      current ? current->size() : 0, " layers, loads have ", loads.size());
  std::vector<LayerMap> maps;
  maps.reserve(loads.size());
  for (size_t l = 0; l < loads.size(); ++l)
    maps.push_back(
        solve_layer(spec, loads[l], {current ? &(*current)[l] : nullptr, nullptr}, options));
  return maps;
}

}  // namespace moe::placement
