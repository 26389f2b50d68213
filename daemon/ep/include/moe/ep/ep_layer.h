// One MoE layer across R ranks with expert parallelism (docs/layer.md), one instance per
// rank, all ranks calling forward/backward together:
//
//   RouterStage (router + capacity on the local tokens) -> replica choice
//   -> Dispatcher::dispatch -> ExpertStage on the received rows (permute,
//      experts: one weighted row back per (token, expert) pair)
//   -> Dispatcher::combine.
//
// Backward mirrors it through the forward's dispatch handle (combine_backward,
// ExpertStage::backward, dispatch_backward, RouterStage::backward). The router
// weight's gradient is summed over ranks; the gradients of an expert's replicas
// are summed at the primary replica in replica order and sent back, so replicas
// stay bitwise identical.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/ep/balance.h"
#include "moe/ep/dispatcher.h"
#include "moe/ep/ep_rebalance.h"
#include "moe/map/expert_map.h"
#include "moe/ep/expert_stage.h"
#include "moe/ep/grad_sums.h"
#include "moe/ep/replica_grads.h"
#include "moe/ep/router_stage.h"
#include "moe/ep/shared_experts.h"
#include "moe/transport/communicator.h"

namespace moe::ep {

struct EpOptions {
  std::chrono::milliseconds timeout{30000};  // deadline of every transport wait
  uint32_t tag_base = 0;                      // p2p tags of this layer: [tag_base, tag_base + 2^24)
  // Benchmarks: a barrier before each timed all-to-all, so transport times do not
  // include waiting for a slower rank's compute. Off in production.
  bool isolate_transport_timing = false;
  // Chunks of the layer's dispatch/combine pairs (DispatcherOptions): 0 by
  // the rule of docs/layer.md#overlap, n fixed (1: serial).
  int overlap_chunks = 0;
  // A replicated expert's gradient over all its pairs at the primary
  // (ReplicaGradReduction): the bits of one copy, for more work.
  bool exact_replica_grads = false;
  // The forward pair's wire formats (DispatcherConfig; docs/layer.md#wire-formats).
  kernels::WireChoice dispatch_wire, combine_wire;
  // The communicator for the backend's memory: the dispatcher's all-to-alls and
  // the all-reduce of the replicated weights' gradients (NCCL in a CUDA job). Null:
  // the layer's own communicator, which otherwise carries only host memory
  // (counts, the replica gradients and expert copies staged through the host).
  transport::Communicator* data_comm = nullptr;
};

// This rank's weight gradients after a backward, in host memory.
struct EpGrads {
  std::vector<float> gate;                 // [E, H], summed over ranks
  std::vector<float> w13, w2;              // [S, 2I, H], [S, H, I] by local slot, summed over replicas
  std::vector<float> shared_w13, shared_w2, shared_gate;  // empty without shared experts (or gate)
};

// Wall seconds of the last forward/backward by phase, this rank's load, and the
// dispatcher's bytes and transport seconds.
struct EpStats {
  double router = 0, dispatch = 0, expert = 0, combine = 0;  // forward phases
  double backward = 0, expert_backward = 0;                  // the whole backward, and its expert part
  int64_t computed_pairs = 0;  // (token, expert) pairs this rank's experts computed (docs/placement.md#load-and-balancedness)
  DispatchStats transfer;
};

class EpLayer {
 public:
  EpLayer(const MoeLayerConfig& cfg, const ExpertMap& map, transport::Communicator& comm, kernels::Backend& be,
          const EpOptions& options = {});

  // The full logical weights (every rank can build or read them); the layer keeps
  // the router and the experts of its own slots.
  void set_weights(const model::LayerWeights& w);

  // x, out: [T, H] in the layer dtype on this rank; token t has global index
  // token_begin + t (replica choice depends on it). x must stay valid until backward.
  void forward(const void* x, int64_t T, int64_t token_begin, void* out);
  void backward(const void* grad_out, void* grad_x);
  // After backward: one optimizer step (1-based) on the router and the local experts.
  // Every rank and every replica applies it to the same gradient and state, so
  // replicated weights stay bitwise identical.
  void optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step);
  // A serving job's backward calls (docs/serving.md#training): after each
  // backward, accumulate_grads() adds its weight gradients (a staged
  // rebalance's shadows' too) to sums; before an optimizer step,
  // load_accumulated_grads() makes the sums the gradients (false: none since the
  // last). The map must not change between the two.
  void accumulate_grads();
  bool load_accumulated_grads();
  int64_t accumulated_passes() const { return grad_sums_.passes(); }

  // After backward: the router weight's gradient summed over ranks [E, H], and per
  // local slot the expert gradients summed over the expert's replicas (the shared
  // experts' gradients are summed over ranks too).
  const float* grad_gate() const { return router_.grad_gate(); }
  const float* grad_w13(int local_slot) const;  // [2I, H]
  // Local slot s's weights as the layer computes with them, or in a train layer
  // its fp32 masters and optimizer state.
  void export_slot(int local_slot, ExpertState& out) const { experts_->export_slot(local_slot, out); }
  // The weights this layer computes with: the router [E, H], the selection bias,
  // the shared experts and, for each expert this rank is the primary of, its
  // w13/w2; every other expert stays zero.
  // (An all-reduce over the ranks then yields every expert, bit for bit.)
  model::LayerWeights primary_weights() const;
  const float* grad_w2(int local_slot) const;   // [H, I]
  EpGrads copy_grads() const;                  // all of the above, to host memory
  SharedExperts* shared_experts() const { return shared_.get(); }
  kernels::Backend& backend() const { return be_; }

  // Checkpoints (train): what every rank holds alike (router, selection bias,
  // shared experts; masters and, with `moments`, Adam state), and back; a local
  // slot's state goes through export_slot / import_slot.
  struct ReplicatedState {
    TensorState gate;
    std::vector<float> selection_bias;  // empty without one
    ExpertState shared;                 // empty without shared experts
    TensorState shared_gate;            // empty without the gate
    // The arrays it is made of, in the one order it travels in (an elastic
    // world's joining rank gets them this way).
    std::vector<std::vector<float>*> arrays() {
      return {&gate.master, &gate.m, &gate.v, &selection_bias, &shared.weights,
              &shared.m,    &shared.v, &shared_gate.master, &shared_gate.m, &shared_gate.v};
    }
  };
  ReplicatedState replicated_state(bool moments) const;
  void set_replicated_state(const ReplicatedState& s);
  void import_slot(int local_slot, const ExpertState& in) { experts_->import_slot(local_slot, in); }

  // Live rebalance (docs/placement.md#live-rebalance; defined in ep_rebalance.cc),
  // called by every rank at the same step boundaries:
  // stage() starts filling the slots `next` gives this rank (copies: the layer's,
  // in the same order everywhere; the optimizer's Adam state travels when adam);
  // staged_ready() progresses them; switch_to_staged() moves the layer onto
  // `next` (every rank's copies must be ready); drop_staged() abandons it.
  void stage(const ExpertMap& next, std::vector<ExpertCopy> copies, bool adam);
  bool staged_ready();
  void switch_to_staged();
  void drop_staged();
  bool staging() const { return next_.staged != nullptr; }
  int64_t staged_bytes_received() const { return next_.staged ? next_.staged->bytes_received() : 0; }
  const ExpertMap& map() const { return map_; }

  // Balancing (docs/layer.md#balancing). After forward with cfg.global_counts: c_e of the step
  // over every rank [E], and (train) this rank's shares of the aux and z losses.
  const std::vector<float>& global_counts() const { return balance_.counts; }
  double global_tokens() const { return balance_.global_tokens; }
  const BalanceLosses& balance_losses() const { return balance_.losses; }
  // After the step: the aux-loss-free bias update from global_counts() (every
  // rank applies the same counts, so the bias stays identical everywhere).
  void update_selection_bias(double rate);
  // The selection bias in use (empty without one), and a replacement for it
  // (an elastic world change; empty: none).
  const std::vector<float>& selection_bias() const { return balance_.selection_bias; }
  void set_selection_bias(std::vector<float> bias);

  const int32_t* topk_idx() const { return router_.topk_idx(); }
  const int32_t* kept_idx() const { return router_.kept_idx(); }
  const float* topk_weight() const { return router_.topk_weight(); }
  const EpStats& stats() const { return stats_; }

 private:
  transport::Deadline deadline() const { return transport::deadline_in(opts_.timeout); }
  void reserve_rows(int64_t recv_rows);
  static RowLayout row_layout(const DispatchHandle& h);
  void reserve_pairs(int64_t recv_pairs);
  void gather_counts();
  RouterBalance balance_terms() const;
  void forward_chunks(const DispatchHandle& h, void* out);
  void experts_backward(const void* grad_out);
  void all_reduce_replicated_grads();
  std::vector<GradSums::Tensor> grad_tensors();  // every weight gradient this rank holds
  std::unique_ptr<Dispatcher> make_dispatcher(const ExpertMap& map) const;
  void install_map(const ExpertMap& map);
  int old_slot_of(int expert) const;  // this rank's first slot of expert, or -1
  void switch_in_place(const ExpertMap& next);
  void switch_to_new_stage(const ExpertMap& next);

  MoeLayerConfig cfg_;
  ExpertMap map_;
  transport::Communicator& comm_;
  transport::Communicator& data_;  // opts.data_comm, or comm_
  kernels::Backend& be_;
  EpOptions opts_;
  RouterStage router_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<ExpertStage> experts_;
  struct Staging {  // a live rebalance's next placement (docs/placement.md#live-rebalance)
    std::unique_ptr<StagedExperts> staged;
    // Built at staging when the slot count changes, so the switch only copies.
    std::unique_ptr<ExpertStage> experts;
    std::unique_ptr<Dispatcher> dispatcher;
    bool adam = false;  // staged copies carry Adam moments
  } next_;
  struct LastPass {  // what the backward needs of the last forward (and backward)
    const DispatchHandle* handle = nullptr;
    const void* x = nullptr;
    const void* grad_rows = nullptr;  // the last backward's grad rows, for the replica reduction
  } last_;
  struct Scratch {  // per-pass buffers, grown to the most rows and pairs seen
    kernels::Buffer topk_slot, combined, grad_pair_weight, grad_topk_weight, grad_x32;
    int64_t recv_capacity = -1, pair_capacity = -1;
  } scratch_;
  kernels::Buffer log2phy_, logcnt_;  // the map's tables on the backend
  ReplicaGradReduction replica_grads_;
  EpStats stats_;
  std::unique_ptr<SharedExperts> shared_;  // with cfg.shared_ffn_hidden > 0
  struct Balance {  // the last step's global counts, the selection bias, the balancing losses
    std::vector<float> counts, selection_bias;
    double global_tokens = 0;
    kernels::Buffer counts_dev;  // counts for the router's backward
    BalanceLosses losses;
  } balance_;
  GradSums grad_sums_;  // serving: the gradients of the backward calls since the last step
};

}  // namespace moe::ep
