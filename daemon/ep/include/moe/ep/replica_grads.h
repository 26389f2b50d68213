// The reduction that keeps an expert's replicas bitwise identical
// (docs/layer.md#backward): after the experts' backward, the primary replica (the
// expert's first slot) takes the expert's gradient and sends it back to every
// replica and, while a rebalance is staged, to the expert's shadows
// (ep_rebalance.h), so every copy applies the same optimizer step to the same bits.
// Two ways to take it:
//   split (default): the replicas' partial gradients g_0 + g_1 + ... in replica
//     order; the last bits differ from one copy's.
//   exact: the other replicas ship their pairs of the expert (source key, routing
//     weight, input row, grad row); the primary runs the expert over all of them
//     in source order on a stage of its own (forward, dgrad, weight gradients, as
//     a rank hosting the only copy would): the bits of a job without the replicas
//     (row-invariant GEMMs on the CPU, docs/layer.md#determinism), for the
//     primary's computing the replicas' share of the expert again.
//
// Experts are handled in increasing id on every rank, and within an expert all
// traffic is between the primary and its replicas and shadows, so the blocking
// sends and receives cannot wait on each other in a cycle. Everything crosses
// the host communicator (staged through host memory). In exact mode a holder
// waits while its primary computes every earlier expert it is primary of: each
// wait has the layer's transport deadline, which a very large expert on a slow
// CPU could pass (docs/layer.md#backward).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe/ep/expert_stage.h"
#include "moe/map/expert_map.h"
#include "moe/transport/communicator.h"

namespace moe::ep {

class StagedExperts;

// The step's received rows as the experts saw them: backend memory but for
// source_key (host).
struct ReceivedRows {
  const void* x = nullptr;              // [N, H] layer dtype
  const void* grad = nullptr;           // [N, H] layer dtype: the backward's grad rows
  const int32_t* slot = nullptr;        // [N, K] local slot or -1
  const float* weight = nullptr;        // [N, K]
  const int64_t* source_key = nullptr;  // [N], DispatchHandle::source_key
  int64_t num_rows = 0;
};

class ReplicaGradReduction {
 public:
  // tag_base: the layer's point-to-point tags; timeout: the deadline of each wait.
  ReplicaGradReduction(const MoeLayerConfig& cfg, transport::Communicator& comm, kernels::Backend& be,
                       uint32_t tag_base, std::chrono::milliseconds timeout, bool exact);
  ~ReplicaGradReduction();

  // Collective over the ranks of `map`: every expert with two or more replicas
  // (or a shadow in `staged`, which may be null) ends with its gradient over all
  // of its pairs in each of its slots of `experts` and in each shadow's gradient.
  void run(const ExpertMap& map, ExpertStage& experts, StagedExperts* staged, const ReceivedRows& rows);

 private:
  // One expert's pairs on the host: keys, weights, and rows (row_bytes each).
  struct Pairs {
    std::vector<int64_t> key;
    std::vector<float> weight;
    std::vector<uint8_t> x, grad;
  };
  void reduce_expert(int expert, const ExpertMap& map, ExpertStage& experts, StagedExperts* staged);
  // The primary's and a holder's part of taking the gradient (into acc_ at the primary).
  void take_gradient(int expert, const ExpertMap& map, ExpertStage& experts, const std::vector<int>& holders);
  void give_share(int expert, const ExpertMap& map, ExpertStage& experts, int primary, size_t holder);
  uint32_t tag(int expert, size_t k, uint32_t phase) const;
  Pairs local_pairs(int expert, const ExpertMap& map);
  void send_pairs(int to, const Pairs& p, uint32_t count_tag, uint32_t pairs_tag);
  void receive_pairs(int from, Pairs& into, uint32_t count_tag, uint32_t pairs_tag);
  void gradient_of(Pairs& p, const ExpertStage& experts, int local_slot, float* acc);

  const MoeLayerConfig cfg_;
  const size_t n13_, n2_, row_bytes_;  // floats of one expert's w13 and w2 gradients; bytes of a row
  transport::Communicator& comm_;
  kernels::Backend& be_;
  const uint32_t tag_base_;
  const std::chrono::milliseconds timeout_;
  const bool exact_;
  int recipients_ = 0;  // tags: per expert, the holders, then the shadows
  ReceivedRows rows_;
  struct HostRows {  // this step's received rows on the host, copied once a step
    bool valid = false;
    std::vector<int32_t> slot;
    std::vector<float> weight;
    std::vector<uint8_t> x, grad;
  } host_;
  std::vector<float> acc_, msg_;
  struct Merge {  // exact mode: one expert, top-1: the primary's run over every pair
    std::unique_ptr<ExpertStage> stage;
    kernels::Buffer x, grad, expert, weight, out, gx, gw;
    int64_t capacity = -1;
  } merge_;
};

}  // namespace moe::ep
