// Where every logical expert lives (docs/placement.md#maps): the one map type of
// the agent (its solver and state) and the daemon (its layers), in the shapes of
// deepseek-ai/EPLB, with the epoch it is in force under.
//
//   phy2log [R*S]   logical expert held by each physical slot (-1: empty)
//   logcnt  [E]     replicas of each expert (>= 1)
//   log2phy [E, X]  replica j of expert e sits in slot log2phy[e*X + j]; entries
//                   j >= logcnt[e] are -1; X = max_replicas
//
// Physical slot p (0 <= p < R*S) is local slot p % S of rank p / S. Replica 0 of
// an expert is its primary. A (token, expert) pair goes to replica
// hash(token, expert) % logcnt[e] (docs/layer.md#replica-choice). The solver fills
// every slot (full()); a hand-built map may leave slots empty (a rank that hosts
// nothing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe {

struct ExpertMap {
  int num_experts = 0;
  int num_ranks = 0;
  int slots_per_rank = 0;
  int64_t epoch = 0;
  std::vector<int32_t> phy2log;  // [R * S]
  // Derived from phy2log by make(), the one place that does it:
  std::vector<int32_t> logcnt;   // [E]
  int max_replicas = 0;
  std::vector<int32_t> log2phy;  // [E, max_replicas], -1 padded

  // Validates (every expert placed at least once, ids in range) and derives
  // logcnt and log2phy. Replicas are numbered by ascending slot, unless
  // replica_order [R*S] gives each slot's replica number (EPLB keeps the order
  // in which it created replicas; -1 for an empty slot). Throws moe::Error naming
  // the problem.
  static ExpertMap make(int num_experts, int num_ranks, int slots_per_rank, std::vector<int32_t> phy2log,
                        int64_t epoch = 0, const std::vector<int32_t>* replica_order = nullptr);
  // Expert e on rank e / (E / R), slot e % (E / R). E must be divisible by R.
  static ExpertMap contiguous(int num_experts, int num_ranks);

  int num_slots() const { return num_ranks * slots_per_rank; }
  bool full() const;  // no empty slot
  int rank_of_slot(int32_t slot) const { return slot / slots_per_rank; }
  int32_t expert_at(int rank, int local_slot) const { return phy2log[rank * slots_per_rank + local_slot]; }
  int32_t replica_slot(int expert, int replica) const {
    return log2phy[static_cast<std::size_t>(expert) * max_replicas + replica];
  }
  // Physical slots of expert e, primary first.
  std::vector<int32_t> replicas(int expert) const;
  // [E]: whether `rank` hosts a replica of each expert.
  std::vector<bool> hosted(int rank) const;
};

// One copy of a live rebalance in one layer (docs/placement.md#live-rebalance):
// rank to_rank gains local slot to_slot of `expert` from from_rank, which holds
// it in the map in force.
struct ExpertCopy {
  int expert = 0, from_rank = 0, to_rank = 0, to_slot = 0;
};

}  // namespace moe
