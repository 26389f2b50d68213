// reduce_fanout (fanout_objective.h).
#include <algorithm>
#include <array>
#include <limits>

#include "fanout_objective.h"

namespace moe::placement::detail {

MoveCount::MoveCount(const Packing& packing, std::span<const int32_t> original, int num_experts)
    : packing_(packing), num_ranks_(packing.num_ranks()) {
  now_.assign(static_cast<size_t>(num_experts) * num_ranks_, 0);
  original_ = now_;
  const int s = packing.slots_per_rank();
  for (int p = 0; p < num_ranks_ * s; ++p) {
    ++now_[at(packing.expert_at(p), p / s)];
    ++original_[at(original[p], p / s)];
  }
}

int MoveCount::fetch_delta(int r, int lose, int gain) const {
  return (now_[at(gain, r)] >= original_[at(gain, r)] ? 1 : 0) -
         (now_[at(lose, r)] > original_[at(lose, r)] ? 1 : 0);
}

int MoveCount::swap_delta(int a, int b) const {
  const int ra = packing_.rank_of_slot(a), rb = packing_.rank_of_slot(b);
  const int e = packing_.expert_at(a), f = packing_.expert_at(b);
  return fetch_delta(ra, e, f) + fetch_delta(rb, f, e);
}

void MoveCount::apply_swap(int a, int b) {
  const int ra = packing_.rank_of_slot(a), rb = packing_.rank_of_slot(b);
  const int e = packing_.expert_at(a), f = packing_.expert_at(b);
  --now_[at(e, ra)];
  ++now_[at(e, rb)];
  --now_[at(f, rb)];
  ++now_[at(f, ra)];
}

void reduce_fanout(Packing& packing, FanoutObjective& objective, double cap, double penalty,
                   int max_passes, bool allow_copies, MoveCount* moves, double move_weight) {
  constexpr int kChecked = 4;      // candidates per slot checked with the exact delta
  constexpr int kTargetNodes = 8;  // other nodes a slot's replica may go to: the best by delta
  constexpr double kMinGain = 1e-12;
  constexpr double kMinPassGain = 1e-3;  // relative to the fan-out
  const int num_slots = packing.num_ranks() * packing.slots_per_rank();
  const int num_nodes = packing.num_nodes();
  const double scale = penalty / cap;
  auto over = [&](double load) { return load > cap ? load - cap : 0.0; };
  std::vector<double> gains(num_nodes);
  int num_experts = 0;
  for (int slot = 0; slot < num_slots; ++slot)
    num_experts = std::max(num_experts, packing.expert_at(slot) + 1);
  // move_delta(f, node, target) per (f, node): valid while nothing is
  // swapped and the target node stays the same.
  std::vector<double> cached(static_cast<size_t>(num_experts) * num_nodes);
  std::vector<int64_t> cached_at(cached.size(), -1);
  int64_t version = 0;
  int cached_target = -1;
  std::vector<int> node_order(num_nodes);
  std::vector<uint8_t> target(num_nodes);
  struct Candidate {
    double approx;  // d_over + both single-move deltas
    int slot;
  };
  for (int pass = 0; pass < max_passes; ++pass) {
    bool improved = false;
    double pass_gain = 0.0;
    for (int a = 0; a < num_slots; ++a) {
      const int e = packing.expert_at(a);
      const int ra = packing.rank_of_slot(a);
      const int n1 = packing.node_of_rank(ra);
      const double la = packing.rank_load(ra), ua = packing.unit(e);
      objective.move_deltas(e, n1, gains);
      if (n1 != cached_target) {
        cached_target = n1;
        ++version;
      }
      for (int n = 0; n < num_nodes; ++n) node_order[n] = n;
      std::fill(target.begin(), target.end(), 1);
      if (num_nodes > kTargetNodes + 1) {
        std::nth_element(
            node_order.begin(), node_order.begin() + kTargetNodes, node_order.end(),
            [&](int x, int y) { return gains[x] < gains[y] || (gains[x] == gains[y] && x < y); });
        std::fill(target.begin(), target.end(), 0);
        for (int i = 0; i < kTargetNodes; ++i) target[node_order[i]] = 1;
        target[n1] = 1;
      }
      double best = -kMinGain;
      int best_b = -1;
      std::array<Candidate, kChecked> top;
      int num_top = 0;
      for (int b = 0; b < num_slots; ++b) {
        const int rb = packing.rank_of_slot(b);
        if (!target[packing.node_of_rank(rb)]) {
          b = (rb + 1) * packing.slots_per_rank() - 1;  // skip the rest of the rank
          continue;
        }
        const int f = packing.expert_at(b);
        if (f == e || rb == ra) continue;
        const double lb = packing.rank_load(rb), ub = packing.unit(f);
        double d_over = scale * (over(la - ua + ub) + over(lb - ub + ua) - over(la) - over(lb));
        if (moves) d_over += move_weight * moves->swap_delta(a, b);
        const int n2 = packing.node_of_rank(rb);
        if (n2 == n1) {
          if (d_over < best &&
              (allow_copies || (packing.copies_on(rb, e) == 0 && packing.copies_on(ra, f) == 0))) {
            best = d_over;
            best_b = b;
          }
          continue;
        }
        double limit = -kMinGain;
        if (num_top == kChecked) limit = std::min(limit, top[kChecked - 1].approx);
        const double partial = d_over + gains[n2];
        if (partial - objective.move_bound(f) >= limit) continue;
        const size_t key = static_cast<size_t>(f) * num_nodes + n2;
        if (cached_at[key] != version) {
          cached[key] = objective.move_delta(f, n2, n1);
          cached_at[key] = version;
        }
        const double approx = partial + cached[key];
        if (approx >= limit) continue;
        int pos = std::min(num_top, kChecked - 1);
        while (pos > 0 && top[pos - 1].approx > approx) {
          top[pos] = top[pos - 1];
          --pos;
        }
        top[pos] = {approx, b};
        num_top = std::min(num_top + 1, kChecked);
      }
      for (int i = 0; i < num_top; ++i) {
        const int b = top[i].slot;
        const double exact = top[i].approx + objective.joint_delta(a, b);
        if (exact >= best) continue;
        const int rb = packing.rank_of_slot(b);
        if (!allow_copies &&
            (packing.copies_on(rb, e) > 0 || packing.copies_on(ra, packing.expert_at(b)) > 0))
          continue;
        best = exact;
        best_b = b;
      }
      if (best_b < 0) continue;
      if (packing.node_of_rank(packing.rank_of_slot(best_b)) != n1) {
        objective.apply_swap(a, best_b);
        ++version;
      }
      if (moves) moves->apply_swap(a, best_b);
      packing.swap_slots(a, best_b);
      improved = true;
      pass_gain -= best;
    }
    // A sweep that moved J by less than kMinPassGain is the last one.
    if (!improved || pass_gain < kMinPassGain * objective.fanout()) break;
  }
}

}  // namespace moe::placement::detail
