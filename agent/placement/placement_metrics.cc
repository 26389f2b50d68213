#include "moe/placement/placement_metrics.h"

#include <algorithm>
#include <unordered_map>

#include "moe/base/check.h"

namespace moe::placement {

std::vector<double> rank_loads(const ExpertMap& map, std::span<const double> loads) {
  MOE_CHECK(loads.size() == static_cast<size_t>(map.num_experts), "loads have ",
                      loads.size(), " entries, the map ", map.num_experts, " experts");
  std::vector<double> out(map.num_ranks, 0.0);
  for (int p = 0; p < map.num_slots(); ++p) {
    const int e = map.phy2log[p];
    out[map.rank_of_slot(p)] += loads[e] / map.logcnt[e];
  }
  return out;
}

double balancedness(const ExpertMap& map, std::span<const double> loads) {
  const std::vector<double> per_rank = rank_loads(map, loads);
  double sum = 0.0, max = 0.0;
  for (double l : per_rank) {
    sum += l;
    max = std::max(max, l);
  }
  return max > 0.0 ? sum / per_rank.size() / max : 1.0;
}

double expected_fanout(const ExpertMap& map, int num_nodes, const Trace& trace) {
  MOE_CHECK(num_nodes >= 1 && map.num_ranks % num_nodes == 0, "ranks (", map.num_ranks,
                      ") must be divisible by nodes (", num_nodes, ")");
  MOE_CHECK(trace.num_experts == map.num_experts, "trace has ", trace.num_experts,
                      " experts, the map ", map.num_experts);
  const int ranks_per_node = map.num_ranks / num_nodes;
  // Per expert: (node, fraction of its replicas there), each node once.
  std::vector<std::vector<std::pair<int, double>>> spread(map.num_experts);
  for (int e = 0; e < map.num_experts; ++e) {
    auto& s = spread[e];
    for (int j = 0; j < map.logcnt[e]; ++j) {
      const int node = map.rank_of_slot(map.replica_slot(e, j)) / ranks_per_node;
      auto it = std::find_if(s.begin(), s.end(), [&](const auto& x) { return x.first == node; });
      if (it == s.end())
        s.emplace_back(node, 1.0 / map.logcnt[e]);
      else
        it->second += 1.0 / map.logcnt[e];
    }
  }
  const int64_t num_tokens = trace.num_tokens();
  if (num_tokens == 0) return 0.0;
  std::vector<double> miss(num_nodes, 1.0);  // prod (1 - q) per node for the current token
  std::vector<int64_t> seen(num_nodes, -1);  // token that last touched the node
  std::vector<int> touched;
  double total = 0.0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    touched.clear();
    for (int i = 0; i < trace.top_k; ++i) {
      const int e = trace.topk_idx[t * trace.top_k + i];
      for (const auto& [node, q] : spread[e]) {
        if (seen[node] != t) {
          seen[node] = t;
          touched.push_back(node);
        }
        miss[node] *= 1.0 - q;
      }
    }
    double nodes = 0.0;
    for (int node : touched) {
      nodes += 1.0 - miss[node];
      miss[node] = 1.0;
    }
    total += nodes;
  }
  return total / num_tokens;
}

int64_t copies_moved(const ExpertMap& before, const ExpertMap& after) {
  MOE_CHECK(before.num_experts == after.num_experts &&
                          before.num_ranks == after.num_ranks &&
                          before.slots_per_rank == after.slots_per_rank,
                      "maps differ in size: ", before.num_experts, " experts x ", before.num_ranks,
                      " ranks x ", before.slots_per_rank, " slots vs ", after.num_experts, " x ",
                      after.num_ranks, " x ", after.slots_per_rank);
  int64_t moved = 0;
  const int s = after.slots_per_rank;
  std::unordered_map<int32_t, int> have;
  for (int r = 0; r < after.num_ranks; ++r) {
    have.clear();
    for (int i = 0; i < s; ++i) ++have[before.phy2log[r * s + i]];
    for (int i = 0; i < s; ++i) {
      auto it = have.find(after.phy2log[r * s + i]);
      if (it != have.end() && it->second > 0)
        --it->second;
      else
        ++moved;
    }
  }
  return moved;
}

std::vector<int> experts_lost_per_node(const ExpertMap& map, int num_nodes) {
  const int slots = static_cast<int>(map.phy2log.size());
  const int per_node = slots / num_nodes;
  std::vector<int> home(map.num_experts, -1);  // the one node holding every copy; -2: several
  for (int p = 0; p < slots; ++p) {
    int& h = home[map.phy2log[p]];
    const int node = p / per_node;
    h = h == -1 ? node : (h == node ? h : -2);
  }
  std::vector<int> lost(num_nodes, 0);
  for (int h : home)
    if (h >= 0) ++lost[h];
  return lost;
}

int min_nodes_spanned(const ExpertMap& map, int num_nodes) {
  const size_t per_node = map.phy2log.size() / num_nodes;
  std::vector<std::vector<char>> on(map.num_experts, std::vector<char>(num_nodes, 0));
  for (size_t p = 0; p < map.phy2log.size(); ++p) on[map.phy2log[p]][p / per_node] = 1;
  int fewest = num_nodes;
  for (const auto& nodes : on) fewest = std::min(fewest, static_cast<int>(std::count(nodes.begin(), nodes.end(), 1)));
  return fewest;
}

}  // namespace moe::placement
