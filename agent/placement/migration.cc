#include "migration.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>

#include "moe/base/check.h"
#include "moe/placement/copy_plan.h"

namespace moe::placement::detail {

namespace {

// Rows up to which max_weight_assignment is exact.
constexpr int kExactLimit = 256;

// The assignments below take a square n x n weight matrix (row-major) and
// return the column of every row.

// Greedy by weight (ties: lower cell): each row takes the heaviest cell
// whose row and column are both still free.
std::vector<int> greedy_assignment(const std::vector<int64_t>& weight, int n) {
  std::vector<int> col_of_row(n, -1);
  std::vector<int> order(static_cast<size_t>(n) * n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return weight[a] > weight[b]; });
  std::vector<uint8_t> col_used(n, 0);
  for (int cell : order) {
    const int r = cell / n, c = cell % n;
    if (col_of_row[r] < 0 && !col_used[c]) {
      col_of_row[r] = c;
      col_used[c] = 1;
    }
  }
  return col_of_row;
}

// Hungarian method with potentials, O(n^3): minimises cost = -weight.
// Rows and columns 1-based; p[c] = row of column c.
std::vector<int> hungarian_assignment(const std::vector<int64_t>& weight, int n) {
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> u(n + 1, 0), v(n + 1, 0);
  std::vector<int> p(n + 1, 0), way(n + 1, 0);
  for (int i = 1; i <= n; ++i) {
    p[0] = i;
    int j0 = 0;
    std::vector<int64_t> minv(n + 1, kInf);
    std::vector<uint8_t> used(n + 1, 0);
    do {
      used[j0] = 1;
      const int i0 = p[j0];
      int64_t delta = kInf;
      int j1 = 0;
      for (int j = 1; j <= n; ++j) {
        if (used[j]) continue;
        const int64_t cur = -weight[static_cast<size_t>(i0 - 1) * n + (j - 1)] - u[i0] - v[j];
        if (cur < minv[j]) {
          minv[j] = cur;
          way[j] = j0;
        }
        if (minv[j] < delta) {
          delta = minv[j];
          j1 = j;
        }
      }
      for (int j = 0; j <= n; ++j) {
        if (used[j]) {
          u[p[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
    } while (p[j0] != 0);
    do {
      const int j1 = way[j0];
      p[j0] = p[j1];
      j0 = j1;
    } while (j0);
  }
  std::vector<int> col_of_row(n, -1);
  for (int j = 1; j <= n; ++j) col_of_row[p[j] - 1] = j - 1;
  return col_of_row;
}

// Assignment maximising the total weight: Hungarian method up to kExactLimit
// rows, greedy by weight above.
std::vector<int> max_weight_assignment(const std::vector<int64_t>& weight, int n) {
  return n > kExactLimit ? greedy_assignment(weight, n) : hungarian_assignment(weight, n);
}

// Copies two sorted multisets have in common.
int64_t common(const int32_t* a, const int32_t* b, int n) {
  int64_t same = 0;
  for (int i = 0, j = 0; i < n && j < n;) {
    if (a[i] == b[j]) {
      ++same;
      ++i;
      ++j;
    } else if (a[i] < b[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return same;
}

// Per rank, its experts sorted (s slots per rank).
std::vector<int32_t> sorted_ranks(const PlacementSpec& spec, std::span<const int32_t> phy2log) {
  const int s = spec.slots_per_rank();
  std::vector<int32_t> out(phy2log.begin(), phy2log.end());
  for (int r = 0; r < spec.num_ranks; ++r)
    std::sort(out.begin() + r * s, out.begin() + (r + 1) * s);
  return out;
}

// Per expert, the nodes that hold it in phy2log with their copies, in node
// order: (node, copies).
std::vector<std::vector<std::pair<int, int>>> copies_per_node(const PlacementSpec& spec,
                                                               std::span<const int32_t> phy2log) {
  const int s = spec.slots_per_rank(), per_node = spec.ranks_per_node();
  std::vector<std::vector<std::pair<int, int>>> out(spec.num_experts);
  for (int p = 0; p < spec.num_slots(); ++p) {
    auto& list = out[phy2log[p]];
    const int node = p / s / per_node;
    if (list.empty() || list.back().first != node) list.emplace_back(node, 0);
    ++list.back().second;
  }
  return out;
}

// The current node of every next node: the assignment with the most copies
// in common per (next node, current node). next_sorted: the next map's
// ranks sorted (sorted_ranks).
std::vector<int> match_nodes(const PlacementSpec& spec, const std::vector<int32_t>& next_sorted,
                             const ExpertMap& current) {
  const int num_nodes = spec.num_nodes, per_node = spec.ranks_per_node();
  const int s = spec.slots_per_rank();
  if (num_nodes <= 1) return std::vector<int>(num_nodes, 0);
  const auto cur_nodes = copies_per_node(spec, current.phy2log);
  std::vector<int64_t> weight(static_cast<size_t>(num_nodes) * num_nodes, 0);
  for (int node = 0; node < num_nodes; ++node) {
    const int32_t* first = &next_sorted[static_cast<size_t>(node) * per_node * s];
    std::vector<int32_t> items(first, first + per_node * s);
    std::sort(items.begin(), items.end());
    for (size_t i = 0; i < items.size();) {
      size_t j = i;
      while (j < items.size() && items[j] == items[i]) ++j;
      for (const auto& [cn, copies] : cur_nodes[items[i]])
        weight[static_cast<size_t>(node) * num_nodes + cn] +=
            std::min<int64_t>(copies, static_cast<int64_t>(j - i));
      i = j;
    }
  }
  return max_weight_assignment(weight, num_nodes);
}

// The rank of current node cn for every rank of next node `node` (indices
// inside the node): the assignment with the most copies in common.
std::vector<int> match_ranks(const PlacementSpec& spec, const std::vector<int32_t>& next_sorted,
                             const std::vector<int32_t>& cur_sorted, int node, int cn) {
  const int per_node = spec.ranks_per_node(), s = spec.slots_per_rank();
  std::vector<int64_t> weight(static_cast<size_t>(per_node) * per_node);
  for (int i = 0; i < per_node; ++i)
    for (int j = 0; j < per_node; ++j)
      weight[static_cast<size_t>(i) * per_node + j] =
          common(&next_sorted[static_cast<size_t>(node * per_node + i) * s],
                 &cur_sorted[static_cast<size_t>(cn * per_node + j) * s], s);
  return max_weight_assignment(weight, per_node);
}

// Writes next's rank `from` into rank `to` of out (s slots per rank): copies
// the current map has in that rank keep their slot, the rest fill the other
// slots in next's order.
void place_rank(std::span<const int32_t> next, const std::vector<int32_t>& current, int from,
                int to, int s, std::vector<int32_t>* out) {
  std::vector<int32_t> items(next.begin() + static_cast<size_t>(from) * s,
                             next.begin() + static_cast<size_t>(from + 1) * s);
  int32_t* slots = &(*out)[static_cast<size_t>(to) * s];
  for (int k = 0; k < s; ++k) {
    auto it = std::find(items.begin(), items.end(), current[static_cast<size_t>(to) * s + k]);
    if (it == items.end()) continue;
    slots[k] = *it;
    items.erase(it);
  }
  for (int k = 0, next_item = 0; k < s; ++k)
    if (slots[k] == -1) slots[k] = items[next_item++];
}

// repair_current's state: the slots of the map under repair (-1: freed)
// with their rank loads and the copies of every expert on every rank, now
// and in the current map. unit [E] is the load of one replica.
class Repair {
 public:
  Repair(const PlacementSpec& spec, std::span<const double> unit, const ExpertMap& current);

  // Surplus copies leave the most loaded ranks.
  void drop_surplus(std::span<const int> counts);
  // Missing copies, heaviest first, go to the least loaded rank with a freed
  // slot, one without the expert if there is one.
  void add_missing(std::span<const int> counts);
  // Swaps off the most loaded rank, fewest copies moved first, until every
  // rank is at or under cap (true); false when no swap helps before that or
  // after max_swaps swaps.
  bool swap_to_cap(double cap, int max_swaps);
  // The repaired slots; once, after swap_to_cap returned true.
  std::vector<int32_t> take_slots() { return std::move(slots_); }

 private:
  size_t at(int e, int r) const { return static_cast<size_t>(e) * num_ranks_ + r; }
  // Copies the rank must fetch change by this when it loses x and gains y.
  int fetch_delta(int r, int x, int y) const {
    return (copies_[at(y, r)] >= original_[at(y, r)] ? 1 : 0) -
           (copies_[at(x, r)] > original_[at(x, r)] ? 1 : 0);
  }
  // The swap of a slot of rank rmax (load lmax) with a slot of another rank
  // that moves fewest copies, then lowers the pair's larger load most; a < 0
  // when none lowers it below lmax - eps without a second copy on a rank.
  struct Swap {
    int a = -1, b = -1;
  };
  Swap find_swap(int rmax, double lmax, double eps) const;
  void apply(const Swap& swap);

  const int num_experts_, num_ranks_, num_slots_, s_;
  std::span<const double> unit_;
  std::vector<int32_t> slots_;
  std::vector<int> copies_;    // [E, R] copies of e on rank r, now
  std::vector<int> original_;  // [E, R] ... and in the current map
  std::vector<double> load_;   // [R]
  std::vector<int> have_;      // [E] copies of e
};

Repair::Repair(const PlacementSpec& spec, std::span<const double> unit, const ExpertMap& current)
    : num_experts_(spec.num_experts),
      num_ranks_(spec.num_ranks),
      num_slots_(spec.num_slots()),
      s_(spec.slots_per_rank()),
      unit_(unit),
      slots_(current.phy2log),
      copies_(static_cast<size_t>(num_experts_) * num_ranks_, 0),
      load_(num_ranks_, 0.0),
      have_(num_experts_, 0) {
  for (int p = 0; p < num_slots_; ++p) ++copies_[at(slots_[p], p / s_)];
  original_ = copies_;
  for (int p = 0; p < num_slots_; ++p) load_[p / s_] += unit_[slots_[p]];
  for (int32_t e : slots_) ++have_[e];
}

void Repair::drop_surplus(std::span<const int> counts) {
  for (int e = 0; e < num_experts_; ++e) {
    while (have_[e] > counts[e]) {
      int best = -1;
      for (int p = 0; p < num_slots_; ++p)
        if (slots_[p] == e && (best < 0 || load_[p / s_] > load_[best / s_])) best = p;
      slots_[best] = -1;
      load_[best / s_] -= unit_[e];
      --copies_[at(e, best / s_)];
      --have_[e];
    }
  }
}

void Repair::add_missing(std::span<const int> counts) {
  std::vector<int> order(num_experts_);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return unit_[a] > unit_[b]; });
  for (int e : order) {
    while (have_[e] < counts[e]) {
      int best = -1;
      for (int p = 0; p < num_slots_; ++p) {
        if (slots_[p] != -1) continue;
        if (best < 0) {
          best = p;
          continue;
        }
        const bool dup = copies_[at(e, p / s_)] > 0, best_dup = copies_[at(e, best / s_)] > 0;
        if ((best_dup && !dup) || (dup == best_dup && load_[p / s_] < load_[best / s_])) best = p;
      }
      slots_[best] = e;
      load_[best / s_] += unit_[e];
      ++copies_[at(e, best / s_)];
      ++have_[e];
    }
  }
}

bool Repair::swap_to_cap(double cap, int max_swaps) {
  for (int iter = 0; iter < max_swaps; ++iter) {
    const int rmax =
        static_cast<int>(std::max_element(load_.begin(), load_.end()) - load_.begin());
    const double lmax = load_[rmax];
    if (lmax <= cap) return true;
    const double eps = 1e-12 * std::max(lmax, 1.0);
    const Swap swap = find_swap(rmax, lmax, eps);
    if (swap.a < 0) return false;
    apply(swap);
  }
  return false;
}

Repair::Swap Repair::find_swap(int rmax, double lmax, double eps) const {
  Swap best;
  int best_moves = std::numeric_limits<int>::max();
  double best_val = lmax - eps;
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rmax || load_[r] >= lmax - eps) continue;
    for (int i = 0; i < s_; ++i) {
      const int a = rmax * s_ + i, ea = slots_[a];
      for (int j = 0; j < s_; ++j) {
        const int b = r * s_ + j, eb = slots_[b];
        const double d = unit_[ea] - unit_[eb];
        if (d <= 0.0 || ea == eb) continue;
        const double val = std::max(lmax - d, load_[r] + d);
        if (val >= lmax - eps) continue;
        if (copies_[at(ea, r)] > 0 || copies_[at(eb, rmax)] > 0) continue;
        const int moves = fetch_delta(rmax, ea, eb) + fetch_delta(r, eb, ea);
        if (moves > best_moves || (moves == best_moves && val >= best_val)) continue;
        best_moves = moves;
        best_val = val;
        best = {a, b};
      }
    }
  }
  return best;
}

// Exchanges the slots (a on the most loaded rank).
void Repair::apply(const Swap& swap) {
  const int ea = slots_[swap.a], eb = slots_[swap.b];
  const int rmax = swap.a / s_, rb = swap.b / s_;
  --copies_[at(ea, rmax)];
  ++copies_[at(ea, rb)];
  --copies_[at(eb, rb)];
  ++copies_[at(eb, rmax)];
  load_[rmax] += unit_[eb] - unit_[ea];
  load_[rb] += unit_[ea] - unit_[eb];
  std::swap(slots_[swap.a], slots_[swap.b]);
}

}  // namespace

std::vector<int32_t> align_to_current(const PlacementSpec& spec, std::span<const int32_t> next,
                                      const ExpertMap& current) {
  const int per_node = spec.ranks_per_node();
  const std::vector<int32_t> next_sorted = sorted_ranks(spec, next);
  const std::vector<int32_t> cur_sorted = sorted_ranks(spec, current.phy2log);
  const std::vector<int> node_match = match_nodes(spec, next_sorted, current);
  std::vector<int32_t> out(next.size(), -1);
  for (int node = 0; node < spec.num_nodes; ++node) {
    const int cn = node_match[node];
    const std::vector<int> rank_match = match_ranks(spec, next_sorted, cur_sorted, node, cn);
    for (int i = 0; i < per_node; ++i)
      place_rank(next, current.phy2log, node * per_node + i, cn * per_node + rank_match[i],
                 spec.slots_per_rank(), &out);
  }
  return out;
}

bool repair_current(const PlacementSpec& spec, std::span<const double> loads,
                    std::span<const int> counts, const ExpertMap& current, double cap, int max_swaps,
                    std::vector<int32_t>* phy2log) {
  std::vector<double> unit(spec.num_experts);
  for (int e = 0; e < spec.num_experts; ++e) unit[e] = loads[e] / counts[e];
  Repair repair(spec, unit, current);
  repair.drop_surplus(counts);
  repair.add_missing(counts);
  if (!repair.swap_to_cap(cap, max_swaps)) return false;
  *phy2log = repair.take_slots();
  return true;
}

}  // namespace moe::placement::detail

namespace moe::placement {

ExpertMap keep_local_slots(const ExpertMap& current, const ExpertMap& next) {
  const int S0 = current.slots_per_rank, S1 = next.slots_per_rank;
  std::vector<int32_t> phy2log(next.phy2log.size());
  for (int r = 0; r < next.num_ranks; ++r) {
    std::vector<int32_t> left(next.phy2log.begin() + r * S1, next.phy2log.begin() + (r + 1) * S1);
    std::vector<int32_t> slots(S1, -1);
    for (int s = 0; s < std::min(S0, S1); ++s) {  // an expert that stays keeps its slot
      const auto it = std::find(left.begin(), left.end(), current.expert_at(r, s));
      if (it == left.end()) continue;
      slots[s] = *it;
      left.erase(it);
    }
    auto rest = left.begin();
    for (int s = 0; s < S1; ++s) phy2log[r * S1 + s] = slots[s] >= 0 ? slots[s] : *rest++;
  }
  return ExpertMap::make(next.num_experts, next.num_ranks, S1, std::move(phy2log), next.epoch);
}

std::vector<ExpertCopy> copies_between(const ExpertMap& current, const ExpertMap& next, int devices_per_node) {
  std::vector<ExpertCopy> copies;
  const int S0 = current.slots_per_rank, S1 = next.slots_per_rank;
  auto holders = [&](int e) {  // in slot order
    std::vector<int> ranks;
    for (int p = 0; p < current.num_slots(); ++p)
      if (current.phy2log[p] == e) ranks.push_back(current.rank_of_slot(p));
    return ranks;
  };
  for (int r = 0; r < next.num_ranks; ++r) {
    std::set<int> had;  // a rank fills every slot of an expert it hosts from its own copy
    for (int s = 0; s < S0; ++s) had.insert(current.expert_at(r, s));
    for (int s = 0; s < S1; ++s) {
      const int e = next.expert_at(r, s);
      if (e < 0 || had.count(e)) continue;
      const std::vector<int> from = holders(e);
      MOE_CHECK(!from.empty(), "placement: expert ", e, " has no holder in the map in force");
      const auto same_node = std::find_if(from.begin(), from.end(), [&](int h) {
        return devices_per_node > 0 && h / devices_per_node == r / devices_per_node;
      });
      copies.push_back({.expert = e, .from_rank = same_node != from.end() ? *same_node : from.front(), .to_rank = r,
                        .to_slot = s});
    }
  }
  return copies;
}

}  // namespace moe::placement
