// Where every logical expert lives (DESIGN 7): an epoch-numbered map from physical
// slots to logical experts, in the shapes of deepseek-ai/EPLB. Physical slot
// rank * slots_per_rank + s is slot s of rank `rank`. An empty slot (-1) is allowed
// in hand-built maps (a rank may host nothing); the solver fills every slot.
#pragma once

#include <cstdint>
#include <vector>

namespace moe::ep {

struct ExpertMap {
  int num_experts = 0;
  int num_ranks = 0;
  int slots_per_rank = 0;
  int64_t epoch = 0;
  std::vector<int32_t> phy2log;  // [R * S], -1 = empty slot
  // Derived by make():
  std::vector<int32_t> logcnt;   // [E] replicas per expert
  int max_replicas = 0;
  std::vector<int32_t> log2phy;  // [E, max_replicas] physical slots in increasing order, -1 padded

  // Validates (every expert placed at least once, ids in range) and derives the
  // rest; throws moe::Error naming the problem.
  static ExpertMap make(int num_experts, int num_ranks, int slots_per_rank, std::vector<int32_t> phy2log,
                        int64_t epoch = 0);
  // Expert e on rank e / (E / R), slot e % (E / R). E must be divisible by R.
  static ExpertMap contiguous(int num_experts, int num_ranks);

  int rank_of_slot(int32_t slot) const { return slot / slots_per_rank; }
  int32_t expert_at(int rank, int local_slot) const { return phy2log[rank * slots_per_rank + local_slot]; }
  // Physical slots of expert e, primary first.
  std::vector<int32_t> replicas(int expert) const;
  // [E]: whether `rank` hosts a replica of each expert.
  std::vector<bool> hosted(int rank) const;
};

}  // namespace moe::ep
