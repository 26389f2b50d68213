#include "moe/placement/eplb.h"

#include <algorithm>
#include <numeric>

#include "moe/base/check.h"
#include "packing.h"

namespace moe::placement {

const char* eplb_policy_name(EplbPolicy policy) {
  return policy == EplbPolicy::kHierarchical ? "eplb-hierarchical" : "eplb-global";
}

bool eplb_hierarchical_applicable(const PlacementSpec& spec) {
  return spec.num_groups >= 1 && spec.num_experts % spec.num_groups == 0 &&
         spec.num_groups % spec.num_nodes == 0;
}

std::vector<int> eplb_balanced_packing(std::span<const double> weight, int num_packs,
                                       std::vector<int>* rank_in_pack) {
  const int n = static_cast<int>(weight.size());
  MOE_CHECK(num_packs >= 1 && n % num_packs == 0, "balanced packing: items (", n,
                      ") must be divisible by packs (", num_packs, ")");
  const int per_pack = n / num_packs;
  std::vector<int> pack(n), rank(n);
  if (per_pack == 1) {
    std::iota(pack.begin(), pack.end(), 0);
    std::fill(rank.begin(), rank.end(), 0);
  } else {
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return weight[a] > weight[b]; });
    std::vector<double> pack_weight(num_packs, 0.0);
    std::vector<int> pack_items(num_packs, 0);
    for (int item : order) {
      int best = -1;
      for (int p = 0; p < num_packs; ++p)
        if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
      pack[item] = best;
      rank[item] = pack_items[best]++;
      pack_weight[best] += weight[item];
    }
  }
  if (rank_in_pack) *rank_in_pack = std::move(rank);
  return pack;
}

std::vector<int> eplb_replicate_experts(std::span<const double> weight, int num_phy,
                                        std::vector<int>* replica_rank, std::vector<int>* logcnt,
                                        int min_count) {
  const int n = static_cast<int>(weight.size());
  MOE_CHECK(min_count >= 1 && static_cast<int64_t>(num_phy) >= static_cast<int64_t>(n) * min_count,
            "replicate: physical experts (", num_phy, ") fewer than logical (", n, ") x ", min_count);
  std::vector<int> phy2log(num_phy), rank(num_phy, 0), count(n, min_count);
  for (int i = 0; i < n * min_count; ++i) {
    phy2log[i] = i % n;
    rank[i] = i / n;
  }
  for (int i = n * min_count; i < num_phy; ++i) {
    int best = 0;
    for (int e = 1; e < n; ++e)
      if (weight[e] / count[e] > weight[best] / count[best]) best = e;
    phy2log[i] = best;
    rank[i] = count[best]++;
  }
  if (replica_rank) *replica_rank = std::move(rank);
  if (logcnt) *logcnt = std::move(count);
  return phy2log;
}

ExpertMap eplb_rebalance(const PlacementSpec& spec_in, std::span<const double> loads,
                        EplbPolicy policy) {
  spec_in.validate();
  detail::check_loads(spec_in, loads);
  PlacementSpec spec = spec_in;
  // Global: every expert gets at least min_node_replicas copies (spreading them
  // over nodes is the solver's); hierarchical keeps an expert on one node.
  const int min_count = policy == EplbPolicy::kGlobal ? spec_in.min_node_replicas : 1;
  if (policy == EplbPolicy::kGlobal) {
    spec.num_groups = 1;
    spec.num_nodes = 1;
  } else {
    MOE_CHECK(eplb_hierarchical_applicable(spec), "EPLB hierarchical needs groups (",
                        spec.num_groups, ") divisible by nodes (", spec.num_nodes, ")");
  }
  spec.min_node_replicas = 1;
  const int num_log = spec.num_experts;
  const int num_phy = spec.num_slots();
  const int num_groups = std::max(spec.num_groups, 1);
  const int group_size = num_log / num_groups;
  const int num_nodes = spec.num_nodes;
  const int groups_per_node = num_groups / num_nodes;
  const int log_per_node = num_log / num_nodes;
  const int phy_per_node = num_phy / num_nodes;
  const int slots_per_rank = spec.slots_per_rank();

  // Step 1: pack groups to nodes. mlog ("middle" logical id) numbers the
  // experts node by node, a node's groups in pack order.
  std::vector<double> group_load(num_groups, 0.0);
  for (int e = 0; e < num_log; ++e) group_load[e / group_size] += loads[e];
  std::vector<int> group_rank;
  const std::vector<int> group_pack = eplb_balanced_packing(group_load, num_nodes, &group_rank);
  std::vector<int> log2mlog(num_log), mlog2log(num_log);
  for (int e = 0; e < num_log; ++e) {
    const int g = e / group_size;
    log2mlog[e] = (group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size;
    mlog2log[log2mlog[e]] = e;
  }

  std::vector<int32_t> phy2log(num_phy), replica_rank(num_phy);
  for (int node = 0; node < num_nodes; ++node) {
    // Step 2: replicate inside the node.
    std::vector<double> mlog_load(log_per_node);
    for (int i = 0; i < log_per_node; ++i) mlog_load[i] = loads[mlog2log[node * log_per_node + i]];
    std::vector<int> phy_rank, mlog_count;
    const std::vector<int> phy2mlog =
        eplb_replicate_experts(mlog_load, phy_per_node, &phy_rank, &mlog_count, min_count);
    // Step 3: pack the node's physical experts to its ranks.
    std::vector<double> phy_load(phy_per_node);
    for (int j = 0; j < phy_per_node; ++j)
      phy_load[j] = mlog_load[phy2mlog[j]] / mlog_count[phy2mlog[j]];
    std::vector<int> rank_in_pack;
    const std::vector<int> pack =
        eplb_balanced_packing(phy_load, spec.ranks_per_node(), &rank_in_pack);
    for (int j = 0; j < phy_per_node; ++j) {
      const int slot = node * phy_per_node + pack[j] * slots_per_rank + rank_in_pack[j];
      phy2log[slot] = mlog2log[node * log_per_node + phy2mlog[j]];
      replica_rank[slot] = phy_rank[j];
    }
  }
  return ExpertMap::make(num_log, spec.num_ranks, spec.slots_per_rank(), std::move(phy2log), 0, &replica_rank);
}

}  // namespace moe::placement
