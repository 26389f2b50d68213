// A live rebalance of one layer on one rank (docs/placement.md#live-rebalance): the
// slots the rank gains, filled in the background while steps go on, and the
// snapshots it sends to others. EpLayer's stage / staged_ready / switch_to_staged /
// drop_staged (defined in ep_rebalance.cc) drive it; the node's RebalanceSession
// decides when.
//
// At the boundary the ranks agreed to start staging, every copy's holder takes a
// snapshot of its expert (in train jobs the fp32 masters and Adam moments) and
// sends it with a background transfer; the gaining rank receives it into
// staging. In train jobs a gained slot is a shadow replica: from that boundary on
// it receives the same reduced gradient as the expert's replicas
// (replica_grads.h) and applies the same optimizer step, queued until its
// snapshot arrives, so at the switch it is bitwise identical to its holders.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "moe/map/expert_map.h"
#include "moe/ep/expert_stage.h"
#include "moe/transport/communicator.h"

namespace moe::ep {

class StagedExperts {
 public:
  // copies: the layer's copies, in the same order on every rank (tags follow
  // it). adam: train state carries moments.
  StagedExperts(ExpertMap next, std::vector<ExpertCopy> copies, int rank, const MoeLayerConfig& cfg, bool adam,
                uint32_t tag_base);

  // Takes the snapshots this rank sends (from its stage, under `current`) and
  // posts every transfer of this rank.
  void start(const ExpertStage& stage, const ExpertMap& current, transport::Communicator& comm);
  // Progresses the transfers; a snapshot that arrived catches up with the
  // optimizer steps since it was taken. True once every slot this rank gains has.
  bool ready(transport::Communicator& comm, kernels::Backend& be);

  const ExpertMap& next() const { return next_; }
  const std::vector<ExpertCopy>& copies() const { return copies_; }
  // Copy indices (into copies()) of expert e's shadows, in order.
  const std::vector<int>& shadows_of(int expert) const { return shadows_[expert]; }
  int max_shadows() const { return max_shadows_; }
  bool gains(int copy) const { return copies_[copy].to_rank == rank_; }
  // Train, in backward: the reduced gradient [w13 grad | w2 grad] of the expert
  // of copy `copy` (one this rank gains), as its replicas received it.
  float* shadow_gradient(int copy);
  // Train, with the layer's optimizer step: every shadow applies its gradient
  // (queued until its snapshot arrives).
  void optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step, kernels::Backend& be);
  // A serving job's gradients summed over backward calls (GradSums): after each
  // backward, every shadow adds the pass's gradient to its sum; before the
  // optimizer step, the sums become the step's gradients.
  void add_pass_gradients();
  void load_summed_gradients();
  // The state of the slot this rank gains at new local slot `slot` (after ready()).
  const ExpertState& gained_state(int slot) const;
  int64_t bytes_received() const { return bytes_received_; }

 private:
  struct Gained {
    int copy;
    std::shared_ptr<ExpertState> state;  // shared with the transfer that fills it
    std::shared_ptr<std::vector<float>> wire;
    transport::Communicator::TransferId transfer = 0;
    bool arrived = false;
    struct Pending {
      std::vector<float> grad;
      kernels::OptimizerConfig cfg;
      int64_t step;
    };
    std::deque<Pending> pending;  // gradients that came before the snapshot
    std::vector<float> grad;      // this step's, from the replica reduction
    std::vector<float> grad_sum;  // add_pass_gradients' sum since the last step
  };
  struct Sent {
    std::shared_ptr<std::vector<float>> wire;
    transport::Communicator::TransferId transfer = 0;
    bool done = false;
  };
  void apply(Gained& g, const float* grad, const kernels::OptimizerConfig& cfg, int64_t step, kernels::Backend& be);
  void unpack(Gained& g);

  ExpertMap next_;
  std::vector<ExpertCopy> copies_;
  int rank_;
  MoeLayerConfig cfg_;
  bool adam_;
  uint32_t tag_base_;
  std::vector<std::vector<int>> shadows_;  // by expert
  int max_shadows_ = 0;
  std::vector<Gained> gained_;
  std::vector<Sent> sent_;
  int64_t bytes_received_ = 0;
};

}  // namespace moe::ep
