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

namespace {

constexpr int kChecked = 4;      // candidates per slot checked with the exact delta
constexpr int kTargetNodes = 8;  // other nodes a slot's replica may go to: the best by delta
constexpr double kMinGain = 1e-12;
constexpr double kMinPassGain = 1e-3;  // relative to the fan-out

// The slot a sweep is at: its replica (expert e on rank ra of node n1) and
// its rank's load la, e's unit load ua.
struct SlotView {
  int a, e, ra, n1;
  double la, ua;
};

// The best swap partner so far: slot b lowers J by -delta (delta < 0);
// b < 0 while none is found.
struct BestSwap {
  double delta = -kMinGain;
  int b = -1;
};

// The kChecked cross-node partners with the lowest approximate delta (the
// sum of the two single-move deltas), ascending.
class Shortlist {
 public:
  struct Candidate {
    double approx;  // d_over + both single-move deltas
    int slot;
  };
  // A partner must be below this to enter.
  double limit() const {
    double limit = -kMinGain;
    if (size_ == kChecked) limit = std::min(limit, top_[kChecked - 1].approx);
    return limit;
  }
  // Inserts in order; the last one falls off a full list.
  void insert(double approx, int slot) {
    int pos = std::min(size_, kChecked - 1);
    while (pos > 0 && top_[pos - 1].approx > approx) {
      top_[pos] = top_[pos - 1];
      --pos;
    }
    top_[pos] = {approx, slot};
    size_ = std::min(size_ + 1, kChecked);
  }
  int size() const { return size_; }
  const Candidate& operator[](int i) const { return top_[i]; }

 private:
  std::array<Candidate, kChecked> top_;
  int size_ = 0;
};

// The swap search of reduce_fanout, sweep by sweep. packing and objective
// (and moves, when given) change only through its swaps.
class FanoutSearch {
 public:
  FanoutSearch(Packing& packing, FanoutObjective& objective, double cap, double penalty,
               bool allow_copies, MoveCount* moves, double move_weight);

  // One sweep over all slots, each taking its best swap. improved: some slot
  // swapped; gain: how much J fell.
  struct Sweep {
    bool improved = false;
    double gain = 0.0;
  };
  Sweep sweep();

 private:
  static int num_experts_of(const Packing& packing);
  double over(double load) const { return load > cap_ ? load - cap_ : 0.0; }
  SlotView view(int a) const;
  BestSwap best_swap(const SlotView& slot);
  void select_target_nodes(int n1);
  void scan_partners(const SlotView& slot, BestSwap* best, Shortlist* shortlist);
  double cached_move_delta(int f, int n2, int n1);
  void check_exact(const SlotView& slot, const Shortlist& shortlist, BestSwap* best) const;
  void apply(const SlotView& slot, int b);

  Packing& packing_;
  FanoutObjective& objective_;
  const double cap_, scale_;
  const bool allow_copies_;
  MoveCount* const moves_;
  const double move_weight_;
  const int num_slots_, num_nodes_;
  std::vector<double> gains_;  // [N] move_deltas of the current slot's replica
  // move_delta(f, node, target) per (f, node): valid while nothing is
  // swapped and the target node stays the same.
  std::vector<double> cached_;
  std::vector<int64_t> cached_at_;
  int64_t version_ = 0;
  int cached_target_ = -1;
  std::vector<int> node_order_;  // [N] scratch
  std::vector<uint8_t> target_;  // [N] 1: a partner may sit on the node
};

FanoutSearch::FanoutSearch(Packing& packing, FanoutObjective& objective, double cap,
                           double penalty, bool allow_copies, MoveCount* moves, double move_weight)
    : packing_(packing),
      objective_(objective),
      cap_(cap),
      scale_(penalty / cap),
      allow_copies_(allow_copies),
      moves_(moves),
      move_weight_(move_weight),
      num_slots_(packing.num_ranks() * packing.slots_per_rank()),
      num_nodes_(packing.num_nodes()),
      gains_(num_nodes_),
      cached_(static_cast<size_t>(num_experts_of(packing)) * num_nodes_),
      cached_at_(cached_.size(), -1),
      node_order_(num_nodes_),
      target_(num_nodes_) {}

int FanoutSearch::num_experts_of(const Packing& packing) {
  int num_experts = 0;
  const int num_slots = packing.num_ranks() * packing.slots_per_rank();
  for (int slot = 0; slot < num_slots; ++slot)
    num_experts = std::max(num_experts, packing.expert_at(slot) + 1);
  return num_experts;
}

FanoutSearch::Sweep FanoutSearch::sweep() {
  Sweep result;
  for (int a = 0; a < num_slots_; ++a) {
    const SlotView slot = view(a);
    const BestSwap best = best_swap(slot);
    if (best.b < 0) continue;
    apply(slot, best.b);
    result.improved = true;
    result.gain -= best.delta;
  }
  return result;
}

SlotView FanoutSearch::view(int a) const {
  const int e = packing_.expert_at(a);
  const int ra = packing_.rank_of_slot(a);
  return {a, e, ra, packing_.node_of_rank(ra), packing_.rank_load(ra), packing_.unit(e)};
}

// The swap of the slot that lowers J most: same-node partners by their exact
// (load and move) delta, cross-node ones shortlisted by the approximate
// delta and then checked exactly.
BestSwap FanoutSearch::best_swap(const SlotView& slot) {
  objective_.move_deltas(slot.e, slot.n1, gains_);
  if (slot.n1 != cached_target_) {
    cached_target_ = slot.n1;
    ++version_;
  }
  select_target_nodes(slot.n1);
  BestSwap best;
  Shortlist shortlist;
  scan_partners(slot, &best, &shortlist);
  check_exact(slot, shortlist, &best);
  return best;
}

// target_: every node, or with more than kTargetNodes + 1 nodes only n1 and
// the kTargetNodes nodes with the lowest gains_ (ties: lower node).
void FanoutSearch::select_target_nodes(int n1) {
  for (int n = 0; n < num_nodes_; ++n) node_order_[n] = n;
  std::fill(target_.begin(), target_.end(), 1);
  if (num_nodes_ <= kTargetNodes + 1) return;
  std::nth_element(
      node_order_.begin(), node_order_.begin() + kTargetNodes, node_order_.end(),
      [&](int x, int y) { return gains_[x] < gains_[y] || (gains_[x] == gains_[y] && x < y); });
  std::fill(target_.begin(), target_.end(), 0);
  for (int i = 0; i < kTargetNodes; ++i) target_[node_order_[i]] = 1;
  target_[n1] = 1;
}

// Every slot b of another rank on a target node, in slot order: a same-node
// partner updates best directly, a cross-node one may enter the shortlist.
void FanoutSearch::scan_partners(const SlotView& slot, BestSwap* best, Shortlist* shortlist) {
  const int a = slot.a, e = slot.e, ra = slot.ra, n1 = slot.n1;
  for (int b = 0; b < num_slots_; ++b) {
    const int rb = packing_.rank_of_slot(b);
    if (!target_[packing_.node_of_rank(rb)]) {
      b = (rb + 1) * packing_.slots_per_rank() - 1;  // skip the rest of the rank
      continue;
    }
    const int f = packing_.expert_at(b);
    if (f == e || rb == ra) continue;
    const double lb = packing_.rank_load(rb), ub = packing_.unit(f);
    double d_over = scale_ * (over(slot.la - slot.ua + ub) + over(lb - ub + slot.ua) -
                              over(slot.la) - over(lb));
    if (moves_) d_over += move_weight_ * moves_->swap_delta(a, b);
    const int n2 = packing_.node_of_rank(rb);
    if (n2 == n1) {
      if (d_over < best->delta &&
          (allow_copies_ || (packing_.copies_on(rb, e) == 0 && packing_.copies_on(ra, f) == 0))) {
        best->delta = d_over;
        best->b = b;
      }
      continue;
    }
    const double limit = shortlist->limit();
    const double partial = d_over + gains_[n2];
    if (partial - objective_.move_bound(f) >= limit) continue;
    const double approx = partial + cached_move_delta(f, n2, n1);
    if (approx >= limit) continue;
    shortlist->insert(approx, b);
  }
}

// objective_.move_delta(f, n2, n1), from the cache while it is valid.
double FanoutSearch::cached_move_delta(int f, int n2, int n1) {
  const size_t key = static_cast<size_t>(f) * num_nodes_ + n2;
  if (cached_at_[key] != version_) {
    cached_[key] = objective_.move_delta(f, n2, n1);
    cached_at_[key] = version_;
  }
  return cached_[key];
}

// The shortlist's exact deltas (approximate + joint); best takes the lowest
// one below it that keeps copies apart unless allow_copies_.
void FanoutSearch::check_exact(const SlotView& slot, const Shortlist& shortlist,
                               BestSwap* best) const {
  for (int i = 0; i < shortlist.size(); ++i) {
    const int b = shortlist[i].slot;
    const double exact = shortlist[i].approx + objective_.joint_delta(slot.a, b);
    if (exact >= best->delta) continue;
    const int rb = packing_.rank_of_slot(b);
    if (!allow_copies_ && (packing_.copies_on(rb, slot.e) > 0 ||
                           packing_.copies_on(slot.ra, packing_.expert_at(b)) > 0))
      continue;
    best->delta = exact;
    best->b = b;
  }
}

// Swaps the slot with slot b in the objective (a cross-node swap, which
// also invalidates the cache), the move count and the packing.
void FanoutSearch::apply(const SlotView& slot, int b) {
  if (packing_.node_of_rank(packing_.rank_of_slot(b)) != slot.n1) {
    objective_.apply_swap(slot.a, b);
    ++version_;
  }
  if (moves_) moves_->apply_swap(slot.a, b);
  packing_.swap_slots(slot.a, b);
}

}  // namespace

void reduce_fanout(Packing& packing, FanoutObjective& objective, double cap, double penalty,
                   int max_passes, bool allow_copies, MoveCount* moves, double move_weight) {
  FanoutSearch search(packing, objective, cap, penalty, allow_copies, moves, move_weight);
  for (int pass = 0; pass < max_passes; ++pass) {
    const FanoutSearch::Sweep sweep = search.sweep();
    // A sweep that moved J by less than kMinPassGain is the last one.
    if (!sweep.improved || sweep.gain < kMinPassGain * objective.fanout()) break;
  }
}

}  // namespace moe::placement::detail
