#include "packing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moe/base/check.h"

namespace moe::placement::detail {

void check_loads(const PlacementSpec& spec, std::span<const double> loads) {
  MOE_CHECK(loads.size() == static_cast<size_t>(spec.num_experts), "loads have ",
                      loads.size(), " entries, expected experts (", spec.num_experts, ")");
  for (size_t e = 0; e < loads.size(); ++e)
    MOE_CHECK(std::isfinite(loads[e]) && loads[e] >= 0.0, "load of expert ", e, " (",
                        loads[e], ") must be finite and non-negative");
}

Packing::Packing(const PlacementSpec& spec, std::span<const double> unit)
    : num_ranks_(spec.num_ranks),
      num_nodes_(spec.num_nodes),
      slots_per_rank_(spec.slots_per_rank()),
      ranks_per_node_(spec.ranks_per_node()),
      unit_(unit),
      phy2log_(static_cast<size_t>(spec.num_slots()), -1),
      load_(spec.num_ranks, 0.0),
      fill_(spec.num_ranks, 0) {}

double Packing::max_load() const { return *std::max_element(load_.begin(), load_.end()); }

int Packing::copies_on(int rank, int expert) const {
  const auto first = phy2log_.begin() + static_cast<size_t>(rank) * slots_per_rank_;
  return static_cast<int>(std::count(first, first + slots_per_rank_, expert));
}

void Packing::place(int rank, int expert) {
  const int base = rank * slots_per_rank_;
  for (int i = 0; i < slots_per_rank_; ++i) {
    if (phy2log_[base + i] == -1) {
      place_at(base + i, expert);
      return;
    }
  }
}

void Packing::place_at(int slot, int expert) {
  const int rank = rank_of_slot(slot);
  phy2log_[slot] = expert;
  load_[rank] += unit_[expert];
  ++fill_[rank];
}

void Packing::swap_slots(int a, int b) {
  const int ra = rank_of_slot(a), rb = rank_of_slot(b);
  const int32_t ea = phy2log_[a], eb = phy2log_[b];
  const double ua = ea < 0 ? 0.0 : unit_[ea], ub = eb < 0 ? 0.0 : unit_[eb];
  load_[ra] += ub - ua;
  load_[rb] += ua - ub;
  fill_[ra] += (eb >= 0) - (ea >= 0);
  fill_[rb] += (ea >= 0) - (eb >= 0);
  std::swap(phy2log_[a], phy2log_[b]);
}

Locality make_locality(const PlacementSpec& spec, std::span<const double> loads) {
  Locality loc;
  const int num_groups = std::max(spec.num_groups, 1);
  const int num_nodes = spec.num_nodes;
  loc.home.assign(static_cast<size_t>(num_groups) * num_nodes, 0);
  if (num_groups < num_nodes) {
    // Group g owns nodes [g*N/G, (g+1)*N/G).
    for (int n = 0; n < num_nodes; ++n) {
      const int g = static_cast<int>(static_cast<int64_t>(n) * num_groups / num_nodes);
      loc.home[static_cast<size_t>(g) * num_nodes + n] = 1;
    }
    return loc;
  }
  // Balanced packing of whole groups: heaviest first onto the lightest node
  // that has fewer than ceil(G/N) groups.
  std::vector<double> group_load(num_groups, 0.0);
  for (int e = 0; e < spec.num_experts; ++e) group_load[spec.group_of(e)] += loads[e];
  std::vector<int> order(num_groups);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return group_load[a] > group_load[b]; });
  const int cap = (num_groups + num_nodes - 1) / num_nodes;
  std::vector<double> node_load(num_nodes, 0.0);
  std::vector<int> node_groups(num_nodes, 0);
  for (int g : order) {
    int best = -1;
    for (int n = 0; n < num_nodes; ++n)
      if (node_groups[n] < cap && (best < 0 || node_load[n] < node_load[best])) best = n;
    loc.home[static_cast<size_t>(g) * num_nodes + best] = 1;
    node_load[best] += group_load[g];
    ++node_groups[best];
  }
  return loc;
}

Packing greedy_pack(const PlacementSpec& spec, std::span<const double> unit,
                    std::span<const int> replicas, const Locality& locality, double cap,
                    bool allow_copies) {
  Packing packing(spec, unit);
  std::vector<int> order(spec.num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return unit[a] > unit[b]; });
  const int num_nodes = spec.num_nodes;
  const int ranks_per_node = spec.ranks_per_node();
  std::vector<uint8_t> used = locality.home;
  // Least-loaded rank with a free slot in the marked nodes (all when nodes is
  // null), preferring ranks without a copy of expert; -1 if none has room.
  auto best_rank = [&](int expert, const uint8_t* nodes) {
    int best = -1;
    bool best_dup = true;
    for (int node = 0; node < num_nodes; ++node) {
      if (nodes && !nodes[node]) continue;
      for (int r = node * ranks_per_node; r < (node + 1) * ranks_per_node; ++r) {
        if (packing.free_slots(r) == 0) continue;
        const bool dup = !allow_copies && packing.copies_on(r, expert) > 0;
        if (best < 0 || (best_dup && !dup) ||
            (dup == best_dup && packing.rank_load(r) < packing.rank_load(best))) {
          best = r;
          best_dup = dup;
        }
      }
    }
    return best;
  };
  for (int e : order) {
    uint8_t* group_nodes = &used[static_cast<size_t>(spec.group_of(e)) * num_nodes];
    for (int i = 0; i < replicas[e]; ++i) {
      int r = best_rank(e, group_nodes);
      if (r < 0 || packing.rank_load(r) + unit[e] > cap) {
        r = best_rank(e, nullptr);
        group_nodes[packing.node_of_rank(r)] = 1;
      }
      packing.place(r, e);
    }
  }
  return packing;
}

PlacementSpec node_level_spec(const PlacementSpec& spec) {
  PlacementSpec node_spec = spec;
  node_spec.num_ranks = spec.num_nodes;
  return node_spec;
}

Packing unfold_nodes(const PlacementSpec& spec, const Packing& node_packing,
                     std::span<const double> unit) {
  Packing packing(spec, unit);
  const int per_node = spec.slots_per_node();
  const int ranks_per_node = spec.ranks_per_node();
  std::vector<int> items(per_node);
  for (int node = 0; node < spec.num_nodes; ++node) {
    for (int i = 0; i < per_node; ++i) items[i] = node_packing.expert_at(node * per_node + i);
    std::stable_sort(items.begin(), items.end(), [&](int a, int b) {
      return unit[a] > unit[b] || (unit[a] == unit[b] && a < b);
    });
    for (int e : items) {
      int best = -1;
      bool best_dup = true;
      for (int r = node * ranks_per_node; r < (node + 1) * ranks_per_node; ++r) {
        if (packing.free_slots(r) == 0) continue;
        const bool dup = packing.copies_on(r, e) > 0;
        if (best < 0 || (best_dup && !dup) ||
            (dup == best_dup && packing.rank_load(r) < packing.rank_load(best))) {
          best = r;
          best_dup = dup;
        }
      }
      packing.place(best, e);
    }
  }
  return packing;
}

namespace {

// Lowers the largest load among ranks [first, last) by swaps inside that range.
void reduce_range_max(Packing& packing, int first, int last, int max_swaps) {
  const int s = packing.slots_per_rank();
  for (int iter = 0; iter < max_swaps; ++iter) {
    int rmax = first;
    for (int r = first + 1; r < last; ++r)
      if (packing.rank_load(r) > packing.rank_load(rmax)) rmax = r;
    const double lmax = packing.rank_load(rmax);
    const double eps = 1e-12 * std::max(lmax, 1.0);
    double best_val = lmax - eps;
    int best_a = -1, best_b = -1;
    for (int r = first; r < last; ++r) {
      const double lr = packing.rank_load(r);
      if (r == rmax || lr >= best_val) continue;
      for (int i = 0; i < s; ++i) {
        const int a = rmax * s + i;
        const int ea = packing.expert_at(a);
        const double ua = packing.unit(ea);
        for (int j = 0; j < s; ++j) {
          const int b = r * s + j;
          const int eb = packing.expert_at(b);
          const double d = ua - packing.unit(eb);
          if (d <= 0.0 || ea == eb) continue;
          const double val = std::max(lmax - d, lr + d);
          if (val >= best_val) continue;
          // Do not create a second copy of an expert on one rank.
          if (packing.copies_on(r, ea) > 0 || packing.copies_on(rmax, eb) > 0) continue;
          best_val = val;
          best_a = a;
          best_b = b;
        }
      }
    }
    if (best_a < 0) return;
    packing.swap_slots(best_a, best_b);
  }
}

}  // namespace

void reduce_max_load(Packing& packing, bool same_node_only, int max_swaps) {
  if (!same_node_only) {
    reduce_range_max(packing, 0, packing.num_ranks(), max_swaps);
    return;
  }
  const int per_node = packing.num_ranks() / packing.num_nodes();
  for (int node = 0; node < packing.num_nodes(); ++node)
    reduce_range_max(packing, node * per_node, (node + 1) * per_node, max_swaps);
}

}  // namespace moe::placement::detail
