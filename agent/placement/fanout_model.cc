// The model objective of fanout_objective.h.
#include <algorithm>
#include <cmath>

#include "fanout_objective.h"

namespace moe::placement::detail {

namespace {

// A product of factors in [0, 1] from which a factor can be taken out again:
// the sum of logs of the non-zero factors and the number of zero ones.
struct LogProduct {
  double log_sum = 0.0;
  int zeros = 0;

  static bool is_zero(double f) { return f <= 1e-300; }
  void add(double f) {
    if (is_zero(f))
      ++zeros;
    else
      log_sum += std::log(f);
  }
  void remove(double f) {
    if (is_zero(f))
      --zeros;
    else
      log_sum -= std::log(f);
  }
  double value() const { return zeros > 0 ? 0.0 : std::exp(log_sum); }
};

class ModelObjective final : public FanoutObjective {
 public:
  ModelObjective(const Packing& packing, std::span<const int> replicas, const RoutingModel& model)
      : packing_(packing), replicas_(replicas), model_(model), num_nodes_(packing.num_nodes()) {
    const int num_experts = static_cast<int>(replicas.size());
    count_.assign(static_cast<size_t>(num_experts) * num_nodes_, 0);
    for (int slot = 0; slot < packing.num_ranks() * packing.slots_per_rank(); ++slot)
      ++count_[idx(packing.expert_at(slot), node_of_slot(slot))];
    w_.assign(static_cast<size_t>(model.num_groups) * num_nodes_, LogProduct{});
    for (int e = 0; e < num_experts; ++e)
      for (int n = 0; n < num_nodes_; ++n) w_[gidx(group(e), n)].add(factor(e, count_[idx(e, n)]));
    u_.assign(num_nodes_, LogProduct{});
    for (int g = 0; g < model.num_groups; ++g)
      for (int n = 0; n < num_nodes_; ++n) u_[n].add(v(g, w_[gidx(g, n)]));
  }

  double fanout() const override {
    double f = 0.0;
    for (const LogProduct& u : u_) f += 1.0 - u.value();
    return f;
  }

  double move_delta(int e, int from, int to) const override {
    if (from == to) return 0.0;
    const int g = group(e);
    LogProduct wf = w_[gidx(g, from)], wt = w_[gidx(g, to)];
    move(wf, wt, e, from, to);
    LogProduct uf = u_[from], ut = u_[to];
    replace(uf, g, w_[gidx(g, from)], wf);
    replace(ut, g, w_[gidx(g, to)], wt);
    return (u_[from].value() - uf.value()) + (u_[to].value() - ut.value());
  }

  void move_deltas(int e, int from, std::span<double> delta) const override {
    for (int n = 0; n < num_nodes_; ++n) delta[n] = move_delta(e, from, n);
  }

  double move_bound(int e) const override {
    // One replica changes W(g, n) of two nodes by at most beta / c.
    return 2.0 * model_.alpha[group(e)] * model_.beta[e] / replicas_[e];
  }

  double joint_delta(int a, int b) const override {
    const int e = packing_.expert_at(a), f = packing_.expert_at(b);
    const int n1 = node_of_slot(a), n2 = node_of_slot(b);
    return swap_delta(a, b) - move_delta(e, n1, n2) - move_delta(f, n2, n1);
  }

  void apply_swap(int a, int b) override {
    const int e = packing_.expert_at(a), f = packing_.expert_at(b);
    const int n1 = node_of_slot(a), n2 = node_of_slot(b);
    const int g = group(e), h = group(f);
    for (int n : {n1, n2}) {
      u_[n].remove(v(g, w_[gidx(g, n)]));
      if (h != g) u_[n].remove(v(h, w_[gidx(h, n)]));
    }
    move(w_[gidx(g, n1)], w_[gidx(g, n2)], e, n1, n2);
    --count_[idx(e, n1)];
    ++count_[idx(e, n2)];
    move(w_[gidx(h, n2)], w_[gidx(h, n1)], f, n2, n1);
    --count_[idx(f, n2)];
    ++count_[idx(f, n1)];
    for (int n : {n1, n2}) {
      u_[n].add(v(g, w_[gidx(g, n)]));
      if (h != g) u_[n].add(v(h, w_[gidx(h, n)]));
    }
  }

 private:
  // Exact change of fan-out if the replicas in slots a and b (on different
  // nodes, of different experts) traded places.
  double swap_delta(int a, int b) const {
    const int e = packing_.expert_at(a), f = packing_.expert_at(b);
    const int n1 = node_of_slot(a), n2 = node_of_slot(b);
    const int g = group(e), h = group(f);
    LogProduct wg1 = w_[gidx(g, n1)], wg2 = w_[gidx(g, n2)];
    move(wg1, wg2, e, n1, n2);
    LogProduct u1 = u_[n1], u2 = u_[n2];
    if (g == h) {
      move(wg2, wg1, f, n2, n1);
      replace(u1, g, w_[gidx(g, n1)], wg1);
      replace(u2, g, w_[gidx(g, n2)], wg2);
    } else {
      LogProduct wh1 = w_[gidx(h, n1)], wh2 = w_[gidx(h, n2)];
      move(wh2, wh1, f, n2, n1);
      replace(u1, g, w_[gidx(g, n1)], wg1);
      replace(u1, h, w_[gidx(h, n1)], wh1);
      replace(u2, g, w_[gidx(g, n2)], wg2);
      replace(u2, h, w_[gidx(h, n2)], wh2);
    }
    return (u_[n1].value() - u1.value()) + (u_[n2].value() - u2.value());
  }

  size_t idx(int e, int n) const { return static_cast<size_t>(e) * num_nodes_ + n; }
  size_t gidx(int g, int n) const { return static_cast<size_t>(g) * num_nodes_ + n; }
  int group(int e) const { return e / model_.group_size; }
  int node_of_slot(int slot) const { return packing_.node_of_rank(packing_.rank_of_slot(slot)); }
  double factor(int e, int k) const { return 1.0 - model_.beta[e] * k / replicas_[e]; }
  double v(int g, const LogProduct& w) const {
    return 1.0 - model_.alpha[g] + model_.alpha[g] * w.value();
  }
  // One replica of e goes from node `from` (group product wf) to `to` (wt).
  void move(LogProduct& wf, LogProduct& wt, int e, int from, int to) const {
    const int kf = count_[idx(e, from)], kt = count_[idx(e, to)];
    wf.remove(factor(e, kf));
    wf.add(factor(e, kf - 1));
    wt.remove(factor(e, kt));
    wt.add(factor(e, kt + 1));
  }
  void replace(LogProduct& u, int g, const LogProduct& w_old, const LogProduct& w_new) const {
    u.remove(v(g, w_old));
    u.add(v(g, w_new));
  }

  const Packing& packing_;
  std::span<const int> replicas_;
  const RoutingModel& model_;
  int num_nodes_;
  std::vector<int> count_;     // [E, N] replicas of e on node n
  std::vector<LogProduct> w_;  // [G, N]
  std::vector<LogProduct> u_;  // [N]
};

}  // namespace

bool make_routing_model(const PlacementSpec& spec, std::span<const double> loads,
                        RoutingModel* model) {
  if (spec.top_k <= 0 || spec.num_nodes <= 1) return false;
  double total = 0.0;
  for (double l : loads) total += l;
  if (!(total > 0.0)) return false;
  const double tokens = total / spec.top_k;
  const int num_experts = spec.num_experts;
  RoutingModel m;
  if (spec.group_limited()) {
    m.num_groups = spec.num_groups;
    m.group_size = spec.group_size();
    std::vector<double> group_load(m.num_groups, 0.0);
    for (int e = 0; e < num_experts; ++e) group_load[e / m.group_size] += loads[e];
    // alpha_g = min(1, s x load_g) with s such that sum alpha = group_top_k.
    m.alpha.assign(m.num_groups, 0.0);
    std::vector<uint8_t> capped(m.num_groups, 0);
    for (int round = 0; round <= m.num_groups; ++round) {
      double free_load = 0.0;
      int num_capped = 0;
      for (int g = 0; g < m.num_groups; ++g) {
        if (capped[g])
          ++num_capped;
        else
          free_load += group_load[g];
      }
      const double s = free_load > 0.0 ? (spec.group_top_k - num_capped) / free_load : 0.0;
      bool changed = false;
      for (int g = 0; g < m.num_groups; ++g) {
        if (capped[g]) continue;
        m.alpha[g] = s * group_load[g];
        if (m.alpha[g] >= 1.0) {
          m.alpha[g] = 1.0;
          capped[g] = 1;
          changed = true;
        }
      }
      if (!changed) break;
    }
  } else {
    m.num_groups = 1;
    m.group_size = num_experts;
    m.alpha.assign(1, 1.0);
  }
  m.beta.resize(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    const double a = m.alpha[e / m.group_size];
    m.beta[e] = a > 0.0 ? std::min(1.0, loads[e] / tokens / a) : 0.0;
  }
  *model = std::move(m);
  return true;
}

std::unique_ptr<FanoutObjective> make_model_objective(const Packing& packing,
                                                      std::span<const int> replicas,
                                                      const RoutingModel& model) {
  return std::make_unique<ModelObjective>(packing, replicas, model);
}

}  // namespace moe::placement::detail
