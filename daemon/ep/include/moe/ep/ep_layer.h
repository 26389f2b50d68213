// One MoE layer across R ranks with expert parallelism (DESIGN 3), one instance per
// rank, all ranks calling forward/backward together:
//
//   router + capacity (local tokens) -> replica choice -> dispatch layout
//   -> dispatch: counts, then one all-to-all of token rows + metadata (local slots,
//      weights); a token goes to a rank once however many of its experts live there
//   -> ExpertStage on the received rows (permute, experts, weighted local combine:
//      one row back per (source rank, token))
//   -> combine: the reverse all-to-all, then a per-token sum in rank order.
//
// Backward mirrors it through the same layout (combine^T = dispatch): grad_out goes
// out like x, grad rows and per-pair routing-weight gradients come back like the
// combine. The router weight's gradient is summed over ranks; the gradients of an
// expert's replicas are summed at the primary replica in replica order and sent
// back, so replicas stay bitwise identical.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/ep/expert_map.h"
#include "moe/ep/layer_stages.h"
#include "moe/transport/communicator.h"

namespace moe::ep {

struct EpOptions {
  std::chrono::milliseconds timeout{30000};  // deadline of every transport wait
  uint32_t tag_base = 0;                      // p2p tags of this layer: [tag_base, tag_base + 2^24)
  // Benchmarks: a barrier before each timed all-to-all, so transport times do not
  // include waiting for a slower rank's compute. Off in production.
  bool isolate_transport_timing = false;
};

// Per-step accounting (DESIGN 4) and wall seconds of the last forward/backward.
struct EpStats {
  int64_t dispatch_bytes = 0;        // bytes handed to the transport for OTHER ranks
  int64_t combine_bytes = 0;
  int64_t naive_dispatch_bytes = 0;  // one row + one slot + one weight per remote pair
  int64_t received_rows = 0;         // rows this rank's experts processed (N)
  double router = 0, dispatch = 0, expert = 0, combine = 0, backward = 0;
  // The all-to-all calls alone (counts excluded), inside dispatch / combine / backward.
  double dispatch_transport = 0, combine_transport = 0;
  double backward_dispatch = 0, backward_combine = 0;
  // Backward: grad_out rows out like x; grad rows + per-pair weight gradients back.
  int64_t backward_dispatch_bytes = 0, backward_combine_bytes = 0;
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

  // After backward: the router weight's gradient summed over ranks [E, H], and per
  // local slot the expert gradients summed over the expert's replicas.
  const float* grad_gate() const { return router_.grad_gate(); }
  const float* grad_w13(int local_slot) const;  // [2I, H]
  const float* grad_w2(int local_slot) const;   // [H, I]

  const int32_t* topk_idx() const { return router_.topk_idx(); }
  const int32_t* kept_idx() const { return router_.kept_idx(); }
  const float* topk_weight() const { return router_.topk_weight(); }
  const EpStats& stats() const { return stats_; }

 private:
  transport::Deadline deadline() const { return transport::deadline_in(opts_.timeout); }
  void reserve_rows(int64_t recv_rows);
  void reduce_replica_grads();

  MoeLayerConfig cfg_;
  ExpertMap map_;
  transport::Communicator& comm_;
  kernels::Backend& be_;
  EpOptions opts_;
  RouterStage router_;
  ExpertStage experts_;
  size_t row_bytes_;

  // Forward state kept for backward.
  const void* x_ = nullptr;
  bool has_forward_ = false;
  std::vector<int64_t> send_counts_, recv_counts_;  // rows per peer
  std::vector<int64_t> rank_offset_;                // host [R + 1]
  transport::Segments send_rows_segs_, recv_rows_segs_, send_meta_segs_, recv_meta_segs_;
  int64_t recv_capacity_ = -1;

  kernels::Buffer log2phy_, logcnt_;
  kernels::Buffer topk_slot_, num_tokens_per_rank_, num_tokens_per_slot_, in_rank_, token_send_row_;
  kernels::Buffer send_src_token_, send_slot_, send_weight_, send_rows_, back_rows_, back_gw_, layout_ws_;
  kernels::Buffer recv_rows_, recv_slot_, recv_weight_, combined_, grad_recv_rows_, grad_pair_weight_;
  kernels::Buffer grad_topk_weight_, grad_x32_;
  std::vector<float> reduce_tmp_;
  std::vector<int32_t> per_slot_host_;  // pairs per physical slot, for the accounting
  EpStats stats_;
};

}  // namespace moe::ep
