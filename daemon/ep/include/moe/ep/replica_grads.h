// The reduction that keeps an expert's replicas bitwise identical
// (docs/layer.md#backward): after the experts' backward, the primary replica (the
// expert's first slot) sums the w13/w2 gradients g_0 + g_1 + ... in replica order
// and sends the sum back to every replica, and, while a rebalance is staged, to
// the expert's shadows (ep_rebalance.h), so every copy applies the same optimizer
// step to the same bits.
//
// Experts are handled in increasing id on every rank, and within an expert all
// traffic is between the primary and its replicas and shadows, so the blocking
// sends and receives cannot wait on each other in a cycle. Gradients cross the
// host communicator (staged through host memory).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "moe/map/expert_map.h"
#include "moe/ep/expert_stage.h"
#include "moe/transport/communicator.h"

namespace moe::ep {

class StagedExperts;

class ReplicaGradReduction {
 public:
  // tag_base: the layer's point-to-point tags; timeout: the deadline of each wait.
  ReplicaGradReduction(const MoeLayerConfig& cfg, transport::Communicator& comm, kernels::Backend& be,
                       uint32_t tag_base, std::chrono::milliseconds timeout);

  // Collective over the ranks of `map`: every expert with two or more replicas
  // (or a shadow in `staged`, which may be null) ends with the replica sum in
  // each of its slots of `experts` and in each shadow's gradient.
  void run(const ExpertMap& map, ExpertStage& experts, StagedExperts* staged);

 private:
  // One expert: acc and msg hold [w13 grad | w2 grad] of one replica each.
  void reduce_expert(int expert, const ExpertMap& map, ExpertStage& experts, StagedExperts* staged, float* acc,
                     float* msg);

  const size_t n13_, n2_;  // floats of one expert's w13 and w2 gradients
  transport::Communicator& comm_;
  kernels::Backend& be_;
  const uint32_t tag_base_;
  const std::chrono::milliseconds timeout_;
  std::vector<float> scratch_;
};

}  // namespace moe::ep
