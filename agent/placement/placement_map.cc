#include "moe/placement/placement_map.h"

#include <algorithm>
#include <string>

#include "moe/base/check.h"

namespace moe::placement {

namespace {
constexpr int kMaxSize = 1 << 20;  // keeps every product of sizes inside int64
}  // namespace

void PlacementSpec::validate() const {
  MOE_CHECK(num_experts >= 1 && num_experts <= kMaxSize, "experts (", num_experts,
                      ") must be in [1, ", kMaxSize, "]");
  MOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxSize, "ranks (", num_ranks,
                      ") must be in [1, ", kMaxSize, "]");
  MOE_CHECK(num_nodes >= 1, "nodes (", num_nodes, ") must be at least 1");
  MOE_CHECK(num_ranks % num_nodes == 0, "ranks (", num_ranks,
                      ") must be divisible by nodes (", num_nodes, ")");
  MOE_CHECK(num_redundant >= 0 && num_redundant <= kMaxSize, "redundant experts (",
                      num_redundant, ") must be in [0, ", kMaxSize, "]");
  MOE_CHECK(num_slots() % num_ranks == 0, "experts + redundant (", num_experts, " + ",
                      num_redundant, " = ", num_slots(), ") must be divisible by ranks (",
                      num_ranks, ")");
  MOE_CHECK(num_groups >= 0, "groups (", num_groups, ") must not be negative");
  MOE_CHECK(num_groups <= 1 || num_experts % num_groups == 0, "experts (", num_experts,
                      ") must be divisible by groups (", num_groups, ")");
  MOE_CHECK(top_k >= 0 && top_k <= num_experts, "top_k (", top_k,
                      ") must be in [0, experts (", num_experts, ")]");
  MOE_CHECK(group_top_k >= 0 && group_top_k <= std::max(num_groups, 0), "group_top_k (",
                      group_top_k, ") must be in [0, groups (", num_groups, ")]");
  MOE_CHECK(group_top_k == 0 || num_groups > 1, "group_top_k (", group_top_k,
                      ") needs more than one group (groups = ", num_groups, ")");
  MOE_CHECK(min_node_replicas >= 1 && min_node_replicas <= num_nodes, "min_node_replicas (", min_node_replicas,
            ") must be in [1, nodes (", num_nodes, ")]");
  MOE_CHECK(static_cast<int64_t>(num_experts) * min_node_replicas <= num_slots(), "min_node_replicas (",
            min_node_replicas, ") needs experts x ", min_node_replicas, " = ",
            static_cast<int64_t>(num_experts) * min_node_replicas, " slots, there are ", num_slots(),
            " (experts + redundant)");
}

void validate_layer_map(const ExpertMap& map, const PlacementSpec& spec) {
  spec.validate();
  MOE_CHECK(map.num_experts == spec.num_experts, "map has ", map.num_experts,
                      " experts, the request ", spec.num_experts);
  MOE_CHECK(map.num_ranks == spec.num_ranks, "map has ", map.num_ranks,
                      " ranks, the request ", spec.num_ranks);
  MOE_CHECK(map.slots_per_rank == spec.slots_per_rank(), "map has ", map.slots_per_rank,
                      " slots per rank, the request ", spec.slots_per_rank());
  MOE_CHECK(map.phy2log.size() == static_cast<size_t>(spec.num_slots()), "phy2log has ",
                      map.phy2log.size(), " slots, the request ", spec.num_slots());
  MOE_CHECK(map.logcnt.size() == static_cast<size_t>(spec.num_experts), "logcnt has ",
                      map.logcnt.size(), " entries, the request ", spec.num_experts, " experts");
  MOE_CHECK(
      map.max_replicas >= 1 &&
          map.log2phy.size() == static_cast<size_t>(spec.num_experts) * map.max_replicas,
      "log2phy has ", map.log2phy.size(), " entries, expected experts (", spec.num_experts,
      ") x max_replicas (", map.max_replicas, ")");
  std::vector<int32_t> count(spec.num_experts, 0);
  for (size_t p = 0; p < map.phy2log.size(); ++p) {
    const int32_t e = map.phy2log[p];
    MOE_CHECK(e >= 0 && e < spec.num_experts, "slot ", p, " holds expert ", e,
                        ", outside [0, ", spec.num_experts, ")");
    ++count[e];
  }
  int max_count = 0;
  for (int e = 0; e < spec.num_experts; ++e) {
    MOE_CHECK(count[e] >= 1, "expert ", e, " has no slot");
    MOE_CHECK(map.logcnt[e] == count[e], "logcnt[", e, "] is ", map.logcnt[e], " but ",
                        count[e], " slots hold expert ", e);
    max_count = std::max(max_count, count[e]);
  }
  MOE_CHECK(map.max_replicas == max_count, "max_replicas is ", map.max_replicas,
                      ", the largest logcnt ", max_count);
  for (int e = 0; e < spec.num_experts; ++e) {
    for (int j = 0; j < map.max_replicas; ++j) {
      const int32_t p = map.replica_slot(e, j);
      if (j >= map.logcnt[e]) {
        MOE_CHECK(p == -1, "log2phy[", e, "][", j, "] is ", p, ", expected -1 padding");
        continue;
      }
      MOE_CHECK(p >= 0 && p < spec.num_slots() && map.phy2log[p] == e, "log2phy[", e,
                          "][", j, "] is ", p, ", which does not hold expert ", e);
      for (int i = 0; i < j; ++i)
        MOE_CHECK(map.replica_slot(e, i) != p, "log2phy[", e, "] lists slot ", p,
                            " twice");
    }
  }
}

}  // namespace moe::placement
