#include "moe/placement/placement_solver.h"

#include <algorithm>
#include <memory>

#include "fanout_objective.h"
#include "migration.h"
#include "node_spread.h"
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

// The fan-out objective of a layer over a packing: on the routing sample when
// there is one (and more than one node and some load), else on the model of
// the loads and routing hints where there is one (docs/placement.md#solver);
// inactive when neither. counts [E] (replica counts) and sample must outlive it.
class ObjectiveMaker {
 public:
  ObjectiveMaker(const PlacementSpec& spec, std::span<const double> loads,
                 std::span<const int> counts, const Trace* sample, double pure_max)
      : counts_(counts),
        sample_(sample),
        use_sample_(sample && sample->num_tokens() > 0 && spec.num_nodes > 1 && pure_max > 0.0),
        use_model_(!use_sample_ && detail::make_routing_model(spec, loads, &model_)) {}

  bool active() const { return use_sample_ || use_model_; }
  // SolveInfo::fanout_objective of an active objective.
  const char* name() const { return use_sample_ ? "sample" : "model"; }
  // Only when active().
  std::unique_ptr<detail::FanoutObjective> operator()(const Packing& packing) const {
    return use_sample_ ? detail::make_sample_objective(packing, counts_, *sample_)
                       : detail::make_model_objective(packing, counts_, model_);
  }

 private:
  std::span<const int> counts_;
  const Trace* sample_;
  detail::RoutingModel model_;
  bool use_sample_, use_model_;
};

// Iterated local search on a node packing: `rounds` times, perturb the best
// packing with a few random swaps and search again, keeping the result if J
// (fan-out plus the overload penalty over node_cap) fell.
void perturb_and_search(const PlacementSpec& spec, double node_cap, int rounds, int max_passes,
                        const ObjectiveMaker& make_objective, Packing* nodes) {
  const int node_slots = static_cast<int>(nodes->phy2log().size());
  auto node_j = [&](const Packing& p, detail::FanoutObjective& objective) {
    double over = 0.0;
    for (int n = 0; n < spec.num_nodes; ++n)
      over += std::max(0.0, p.rank_load(n) - node_cap) / node_cap;
    return objective.fanout() + kOverloadPenalty * over;
  };
  double best_j = node_j(*nodes, *make_objective(*nodes));
  SplitMix64 rng(kRestartSeed);
  const int kick = std::max(4, node_slots / 32);
  for (int round = 0; round < rounds; ++round) {
    Packing trial = *nodes;
    for (int i = 0; i < kick; ++i) {
      const int a = static_cast<int>(rng.next_below(node_slots));
      const int b = static_cast<int>(rng.next_below(node_slots));
      if (trial.rank_of_slot(a) != trial.rank_of_slot(b)) trial.swap_slots(a, b);
    }
    auto objective = make_objective(trial);
    detail::reduce_fanout(trial, *objective, node_cap, kOverloadPenalty, max_passes, true);
    const double j = node_j(trial, *objective);
    if (j < best_j) {
      best_j = j;
      *nodes = std::move(trial);
    }
  }
}

// Packs for few nodes per token: every group on its home nodes, swaps
// between nodes that even out node loads (to node_cap) where that costs the
// least fan-out, then each node spread over its ranks and the same search on
// ranks (to cap). False if it cannot get every rank under cap.
bool pack_for_locality(const PlacementSpec& spec, std::span<const double> loads,
                       std::span<const double> unit, std::span<const int> counts, double node_cap,
                       double cap, const SolverOptions& options,
                       const ObjectiveMaker& make_objective, std::vector<int32_t>* phy2log) {
  const PlacementSpec node_spec = detail::node_level_spec(spec);
  const detail::Locality locality = detail::make_locality(spec, loads);
  Packing nodes = detail::greedy_pack(node_spec, unit, counts, locality, node_cap, true);
  {
    auto objective = make_objective(nodes);
    detail::reduce_fanout(nodes, *objective, node_cap, kOverloadPenalty, options.max_passes, true);
  }
  // Perturbation rounds only on small problems, where a search is cheap.
  const int rounds =
      static_cast<int64_t>(node_spec.num_slots()) * spec.num_nodes <= kRestartLimit
          ? options.restarts
          : 0;
  if (rounds > 0)
    perturb_and_search(spec, node_cap, rounds, options.max_passes, make_objective, &nodes);
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

// The routing sample the search works with: the sample objective's work
// grows with tokens x nodes, so at most kSampleBudget / nodes tokens of it
// (the first ones, copied into *trimmed). sample may be null.
const Trace* trim_sample(const Trace* sample, int num_nodes, Trace* trimmed) {
  if (!sample || sample->num_tokens() * num_nodes <= kSampleBudget) return sample;
  trimmed->num_experts = sample->num_experts;
  trimmed->top_k = sample->top_k;
  const int64_t keep = std::max<int64_t>(1, kSampleBudget / num_nodes);
  trimmed->topk_idx.assign(sample->topk_idx.begin(),
                           sample->topk_idx.begin() + keep * sample->top_k);
  return trimmed;
}

// One layer's solve, step by step: the balance-only map (constructor), then
// fewer nodes per token (lower_fanout, when make_objective is active), then
// copies kept where the current map has them (keep_copies), then the map
// (finish, once). Every candidate keeps the replica counts of EPLB's global
// map. spec, loads, sample and options must outlive it.
class LayerSolver {
 public:
  LayerSolver(const PlacementSpec& spec, std::span<const double> loads, const Trace* sample,
              const SolverOptions& options);

  bool has_objective() const { return make_objective_.active(); }
  void lower_fanout();
  void keep_copies(const ExpertMap& current);
  ExpertMap finish(SolveInfo* info);

 private:
  static std::vector<double> unit_loads(std::span<const double> loads,
                                        const std::vector<int>& counts);
  static Packing balance_only(const PlacementSpec& spec, std::span<const double> unit,
                              const ExpertMap& global, int max_swaps);
  void win_back_fanout(const ExpertMap& current, double cap, std::vector<int32_t>* repaired) const;
  int64_t moves_from(const ExpertMap& current, const std::vector<int32_t>& phy2log) const;
  double fanout_of(const std::vector<int32_t>& phy2log) const;

  const PlacementSpec& spec_;
  const std::span<const double> loads_;
  const SolverOptions& options_;
  const ExpertMap global_;           // EPLB's global map of loads_
  const std::vector<int> counts_;   // [E] replica counts (global_'s)
  const std::vector<double> unit_;  // [E] load of one replica: loads / counts
  // Balance-only candidate: EPLB's global map, then local search, so the
  // result can only improve on EPLB global.
  const Packing pure_;
  const double pure_max_;
  const ObjectiveMaker make_objective_;
  std::vector<int32_t> phy2log_;  // the map so far
  double max_load_;               // its max rank load
  const char* objective_name_ = "none";
  const char* migration_ = "none";
};

LayerSolver::LayerSolver(const PlacementSpec& spec, std::span<const double> loads,
                         const Trace* sample, const SolverOptions& options)
    : spec_(spec),
      loads_(loads),
      options_(options),
      global_(eplb_rebalance(spec, loads, EplbPolicy::kGlobal)),
      counts_(global_.logcnt.begin(), global_.logcnt.end()),
      unit_(unit_loads(loads, counts_)),
      pure_(balance_only(spec, unit_, global_, options.max_swaps)),
      pure_max_(pure_.max_load()),
      make_objective_(spec, loads, counts_, sample, pure_max_),
      phy2log_(pure_.phy2log()),
      max_load_(pure_max_) {}

std::vector<double> LayerSolver::unit_loads(std::span<const double> loads,
                                            const std::vector<int>& counts) {
  std::vector<double> unit(loads.size());
  for (size_t e = 0; e < loads.size(); ++e) unit[e] = loads[e] / counts[e];
  return unit;
}

Packing LayerSolver::balance_only(const PlacementSpec& spec, std::span<const double> unit,
                                  const ExpertMap& global, int max_swaps) {
  Packing pure = packing_of(spec, unit, global.phy2log);
  detail::reduce_max_load(pure, false, max_swaps);
  return pure;
}

// Fewer nodes per token, measured by make_objective_ (nothing to do on one
// node or without load): the locality packing replaces the map if it has a
// lower fan-out than the balance-only one.
void LayerSolver::lower_fanout() {
  const double cap = pure_max_ * (1.0 + options_.locality_slack);
  double total = 0.0;
  for (double l : loads_) total += l;
  // Node loads get half the ranks' slack over their mean, which leaves the
  // ranks room for coarse replicas; where the ranks still cannot all get
  // under cap, none.
  std::vector<int32_t> local;
  bool packed = false;
  for (double share : {0.5, 0.0}) {
    const double node_cap =
        total / spec_.num_nodes * (1.0 + (cap / (total / spec_.num_ranks) - 1.0) * share);
    packed = pack_for_locality(spec_, loads_, unit_, counts_, node_cap, cap, options_,
                               make_objective_, &local);
    if (packed) break;
  }
  if (!packed) return;
  const Packing candidate = packing_of(spec_, unit_, local);
  if (make_objective_(candidate)->fanout() < make_objective_(pure_)->fanout()) {
    phy2log_ = std::move(local);
    max_load_ = candidate.max_load();
    objective_name_ = make_objective_.name();
  }
}

// Keep copies in place: the map so far with nodes and ranks renumbered to
// match the current one, or the current map repaired, whichever moves fewer
// copies without a higher max rank load (and, with a fan-out objective,
// without more than migration_fanout_slack more fan-out).
void LayerSolver::keep_copies(const ExpertMap& current) {
  std::vector<int32_t> aligned = detail::align_to_current(spec_, phy2log_, current);
  const int64_t aligned_moves = moves_from(current, aligned);
  std::vector<int32_t> repaired;
  const double cap = max_load_ * (1.0 + options_.migration_slack);
  bool use_repaired = false;
  if (detail::repair_current(spec_, loads_, counts_, current, cap, options_.max_swaps,
                             &repaired)) {
    if (has_objective()) win_back_fanout(current, cap, &repaired);
    use_repaired = moves_from(current, repaired) < aligned_moves;
    if (use_repaired && has_objective())
      use_repaired =
          fanout_of(repaired) <= fanout_of(aligned) * (1.0 + options_.migration_fanout_slack);
  }
  phy2log_ = use_repaired ? std::move(repaired) : std::move(aligned);
  migration_ = use_repaired ? "repaired" : "aligned";
}

// Win back fan-out on the repaired map, under cap, a copy to fetch costing
// move_weight of it.
void LayerSolver::win_back_fanout(const ExpertMap& current, double cap,
                                  std::vector<int32_t>* repaired) const {
  Packing packing = packing_of(spec_, unit_, *repaired);
  auto objective = make_objective_(packing);
  detail::MoveCount moves(packing, current.phy2log, spec_.num_experts);
  const double weight = options_.move_weight * objective->fanout();
  detail::reduce_fanout(packing, *objective, cap, kHardPenalty, options_.max_passes, false,
                        &moves, weight);
  *repaired = packing.phy2log();
}

int64_t LayerSolver::moves_from(const ExpertMap& current,
                                const std::vector<int32_t>& phy2log) const {
  return copies_moved(current, ExpertMap::make(spec_.num_experts, spec_.num_ranks, spec_.slots_per_rank(), phy2log));
}

double LayerSolver::fanout_of(const std::vector<int32_t>& phy2log) const {
  const Packing packing = packing_of(spec_, unit_, phy2log);
  return make_objective_(packing)->fanout();
}

ExpertMap LayerSolver::finish(SolveInfo* info) {
  detail::spread_over_nodes(spec_, unit_, phy2log_);  // min_node_replicas: last, so no search undoes it
  ExpertMap map = ExpertMap::make(spec_.num_experts, spec_.num_ranks, spec_.slots_per_rank(), std::move(phy2log_));
  if (info) {
    info->fanout_objective = objective_name_;
    info->migration = migration_;
    info->pure_max_load = pure_max_;
    // Every candidate map keeps the replica counts `counts_`, so these are the
    // loads the search worked with (unit = loads / counts, summed slot by slot).
    const std::vector<double> per_rank = rank_loads(map, loads_);
    info->max_load = *std::max_element(per_rank.begin(), per_rank.end());
  }
  return map;
}

}  // namespace

ExpertMap solve_layer(const PlacementSpec& spec, std::span<const double> loads,
                     const LayerContext& context, const SolverOptions& options, SolveInfo* info) {
  spec.validate();
  detail::check_loads(spec, loads);
  if (context.current) validate_layer_map(*context.current, spec);
  if (context.routing_sample) check_sample(spec, *context.routing_sample);
  Trace trimmed;
  const Trace* sample = trim_sample(context.routing_sample, spec.num_nodes, &trimmed);
  LayerSolver solver(spec, loads, sample, options);
  if (solver.has_objective()) solver.lower_fanout();
  if (context.current) solver.keep_copies(*context.current);
  return solver.finish(info);
}

std::vector<ExpertMap> solve(const PlacementSpec& spec,
                            const std::vector<std::vector<double>>& loads,
                            const std::vector<ExpertMap>* current, const SolverOptions& options) {
  MOE_CHECK(!current || current->size() == loads.size(), "current map has ",
                      current ? current->size() : 0, " layers, loads have ", loads.size());
  std::vector<ExpertMap> maps;
  maps.reserve(loads.size());
  for (size_t l = 0; l < loads.size(); ++l)
    maps.push_back(
        solve_layer(spec, loads[l], {current ? &(*current)[l] : nullptr, nullptr}, options));
  return maps;
}

}  // namespace moe::placement
