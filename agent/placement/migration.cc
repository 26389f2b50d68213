#include "migration.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace moe::placement::detail {

namespace {

// Assignment maximising the total weight of a square n x n matrix
// (row-major); returns the column of every row. Hungarian method (potentials,
// O(n^3)) up to kExactLimit rows, greedy by weight above.
constexpr int kExactLimit = 256;

std::vector<int> max_weight_assignment(const std::vector<int64_t>& weight, int n) {
  std::vector<int> col_of_row(n, -1);
  if (n > kExactLimit) {
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
  // Minimise cost = -weight. Rows and columns 1-based; p[c] = row of column c.
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
  for (int j = 1; j <= n; ++j) col_of_row[p[j] - 1] = j - 1;
  return col_of_row;
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

}  // namespace

std::vector<int32_t> align_to_current(const PlacementSpec& spec, std::span<const int32_t> next,
                                      const LayerMap& current) {
  const int num_nodes = spec.num_nodes, per_node = spec.ranks_per_node();
  const int s = spec.slots_per_rank();
  const int num_experts = spec.num_experts;
  // Per rank, its experts sorted.
  auto sorted_ranks = [&](std::span<const int32_t> phy2log) {
    std::vector<int32_t> out(phy2log.begin(), phy2log.end());
    for (int r = 0; r < spec.num_ranks; ++r)
      std::sort(out.begin() + r * s, out.begin() + (r + 1) * s);
    return out;
  };
  const std::vector<int32_t> next_sorted = sorted_ranks(next);
  const std::vector<int32_t> cur_sorted = sorted_ranks(current.phy2log);

  // Nodes: copies in common per (next node, current node).
  std::vector<int> node_match(num_nodes, 0);
  if (num_nodes > 1) {
    std::vector<std::vector<std::pair<int, int>>> cur_nodes(num_experts);  // (node, copies)
    for (int p = 0; p < spec.num_slots(); ++p) {
      auto& list = cur_nodes[current.phy2log[p]];
      const int node = p / s / per_node;
      if (list.empty() || list.back().first != node) list.emplace_back(node, 0);
      ++list.back().second;
    }
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
    node_match = max_weight_assignment(weight, num_nodes);
  }

  std::vector<int32_t> out(next.size(), -1);
  std::vector<int64_t> weight(static_cast<size_t>(per_node) * per_node);
  std::vector<int32_t> items;
  for (int node = 0; node < num_nodes; ++node) {
    const int cn = node_match[node];
    for (int i = 0; i < per_node; ++i)
      for (int j = 0; j < per_node; ++j)
        weight[static_cast<size_t>(i) * per_node + j] =
            common(&next_sorted[static_cast<size_t>(node * per_node + i) * s],
                   &cur_sorted[static_cast<size_t>(cn * per_node + j) * s], s);
    const std::vector<int> rank_match = max_weight_assignment(weight, per_node);
    for (int i = 0; i < per_node; ++i) {
      const int from = node * per_node + i, to = cn * per_node + rank_match[i];
      items.assign(next.begin() + static_cast<size_t>(from) * s,
                   next.begin() + static_cast<size_t>(from + 1) * s);
      // Copies the current map has in this rank keep their slot.
      int32_t* slots = &out[static_cast<size_t>(to) * s];
      for (int k = 0; k < s; ++k) {
        auto it =
            std::find(items.begin(), items.end(), current.phy2log[static_cast<size_t>(to) * s + k]);
        if (it == items.end()) continue;
        slots[k] = *it;
        items.erase(it);
      }
      for (int k = 0, next_item = 0; k < s; ++k)
        if (slots[k] == -1) slots[k] = items[next_item++];
    }
  }
  return out;
}

bool repair_current(const PlacementSpec& spec, std::span<const double> loads,
                    std::span<const int> counts, const LayerMap& current, double cap, int max_swaps,
                    std::vector<int32_t>* phy2log) {
  const int num_experts = spec.num_experts, num_ranks = spec.num_ranks;
  const int s = spec.slots_per_rank();
  std::vector<double> unit(num_experts);
  for (int e = 0; e < num_experts; ++e) unit[e] = loads[e] / counts[e];
  std::vector<int32_t> slots = current.phy2log;
  // copies[e * R + r]: copies of e on rank r, now and in the current map.
  std::vector<int> copies(static_cast<size_t>(num_experts) * num_ranks, 0);
  for (int p = 0; p < spec.num_slots(); ++p)
    ++copies[static_cast<size_t>(slots[p]) * num_ranks + p / s];
  const std::vector<int> original = copies;
  auto at = [&](int e, int r) -> size_t { return static_cast<size_t>(e) * num_ranks + r; };
  std::vector<double> load(num_ranks, 0.0);
  for (int p = 0; p < spec.num_slots(); ++p) load[p / s] += unit[slots[p]];
  std::vector<int> have(num_experts, 0);
  for (int32_t e : slots) ++have[e];

  // Surplus copies leave the most loaded ranks.
  for (int e = 0; e < num_experts; ++e) {
    while (have[e] > counts[e]) {
      int best = -1;
      for (int p = 0; p < spec.num_slots(); ++p)
        if (slots[p] == e && (best < 0 || load[p / s] > load[best / s])) best = p;
      slots[best] = -1;
      load[best / s] -= unit[e];
      --copies[at(e, best / s)];
      --have[e];
    }
  }
  // Missing copies, heaviest first, go to the least loaded rank with a freed
  // slot, one without the expert if there is one.
  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return unit[a] > unit[b]; });
  for (int e : order) {
    while (have[e] < counts[e]) {
      int best = -1;
      for (int p = 0; p < spec.num_slots(); ++p) {
        if (slots[p] != -1) continue;
        if (best < 0) {
          best = p;
          continue;
        }
        const bool dup = copies[at(e, p / s)] > 0, best_dup = copies[at(e, best / s)] > 0;
        if ((best_dup && !dup) || (dup == best_dup && load[p / s] < load[best / s])) best = p;
      }
      slots[best] = e;
      load[best / s] += unit[e];
      ++copies[at(e, best / s)];
      ++have[e];
    }
  }

  // Copies the rank must fetch change by this when it loses x and gains y.
  auto fetch_delta = [&](int r, int x, int y) {
    return (copies[at(y, r)] >= original[at(y, r)] ? 1 : 0) -
           (copies[at(x, r)] > original[at(x, r)] ? 1 : 0);
  };
  for (int iter = 0; iter < max_swaps; ++iter) {
    const int rmax = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    const double lmax = load[rmax];
    if (lmax <= cap) {
      *phy2log = std::move(slots);
      return true;
    }
    const double eps = 1e-12 * std::max(lmax, 1.0);
    int best_a = -1, best_b = -1, best_moves = std::numeric_limits<int>::max();
    double best_val = lmax - eps;
    for (int r = 0; r < num_ranks; ++r) {
      if (r == rmax || load[r] >= lmax - eps) continue;
      for (int i = 0; i < s; ++i) {
        const int a = rmax * s + i, ea = slots[a];
        for (int j = 0; j < s; ++j) {
          const int b = r * s + j, eb = slots[b];
          const double d = unit[ea] - unit[eb];
          if (d <= 0.0 || ea == eb) continue;
          const double val = std::max(lmax - d, load[r] + d);
          if (val >= lmax - eps) continue;
          if (copies[at(ea, r)] > 0 || copies[at(eb, rmax)] > 0) continue;
          const int moves = fetch_delta(rmax, ea, eb) + fetch_delta(r, eb, ea);
          if (moves > best_moves || (moves == best_moves && val >= best_val)) continue;
          best_moves = moves;
          best_val = val;
          best_a = a;
          best_b = b;
        }
      }
    }
    if (best_a < 0) return false;
    const int ea = slots[best_a], eb = slots[best_b], rb = best_b / s;
    --copies[at(ea, rmax)];
    ++copies[at(ea, rb)];
    --copies[at(eb, rb)];
    ++copies[at(eb, rmax)];
    load[rmax] += unit[eb] - unit[ea];
    load[rb] += unit[ea] - unit[eb];
    std::swap(slots[best_a], slots[best_b]);
  }
  return false;
}

}  // namespace moe::placement::detail
