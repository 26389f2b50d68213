// ExpertStage: permute layout -> fused expert MLP -> local combine over the rows a
// rank holds (its own tokens, or what dispatch brought), and the backward through
// the same layout (docs/layer.md#experts). ExpertState is one expert's state as it
// moves between ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/layer_spec/layer_config.h"
#include "moe/ep/trainable_tensor.h"
#include "moe/kernels/api.h"
#include "moe/kernels/buffer.h"

namespace moe::ep {

using kernels::DType;

// One expert's state as it moves between ranks (a live rebalance): [gate_up |
// down] = 2IH + HI floats per array. weights: the fp32 masters in a train
// stage, the values it computes with otherwise; m, v: Adam moments (empty for
// forward and SGD).
// One expert's state: weights [gate (I x H) | up (I x H) | down (H x I)], fp32
// (the masters of a train job), and Adam's moments m and v in the same layout
// (empty without them). The one layout of a live rebalance's copies, an elastic
// world's moves and a checkpoint's tensors (docs/formats.md#expert-state).
struct ExpertState {
  std::vector<float> weights, m, v;
  // Resizes for H, I; moments only when `moments`.
  void resize(int hidden, int ffn_hidden, bool moments);
  size_t floats() const { return weights.size() + m.size() + v.size(); }
  // On the wire: [weights | m | v], floats() values.
  std::vector<float> to_wire() const;
  // From a wire of floats() values (the sizes set by resize); throws on another size.
  void from_wire(const std::vector<float>& wire);
};

// Wall seconds of the last ExpertStage::forward, and the fused MLP's split.
struct ExpertStageTimes {
  double layout = 0;
  double mlp = 0;
  double combine = 0;
  kernels::ExpertMlpStats mlp_stats;
};

// How an EP layer's received rows are laid out; every member may be null (a
// local layer: rows in their own order, results summed per row).
struct RowLayout {
  // The order that cuts into the chunks of an overlapped layer (layout()).
  const int32_t* row_order = nullptr;
  // Results as pair rows: row n's weighted outputs (and backward, its input
  // gradients) are rows [pair_row_offset[n], pair_row_offset[n + 1]) in k order
  // (the EP combine's return rows, docs/layer.md#dispatch-and-combine). Host, [N + 1].
  const int64_t* pair_row_offset = nullptr;
  // Each row's source key (host, [N], DispatchHandle::source_key): the weight
  // gradients sum every expert's pairs in source order, which does not depend on
  // row_order's, which depends on what else the rank hosts (docs/layer.md#determinism).
  const int64_t* source_key = nullptr;
};

class ExpertStage {
 public:
  ExpertStage(const MoeLayerConfig& cfg, int num_local_experts, kernels::Backend& be);
  // Host weights of the local experts: w13 [L, 2I, H], w2 [L, H, I] (as used).
  void set_weights(const float* w13, const float* w2);
  // Makes room for `rows` rows; allocates only when the high-water mark rises.
  void reserve(int64_t rows);

  // rows [N, H] (dtype), row_expert / row_weight [N, K] (local expert or -1) ->
  // combined in dtype: [N, H], each row's local pairs weighted and summed in k
  // order; or, with rl.pair_row_offset, a row per pair (RowLayout).
  void forward(const void* rows, int64_t N, const int32_t* row_expert, const float* row_weight, void* combined,
               const RowLayout& rl = {});
  // grad_combined [N, H] (dtype) -> grad_rows in grad_rows_dtype, laid out as the
  // forward's combined ([N, H] summed, or a row per pair), the routing-weight
  // gradient per (row, k) [N, K] (0 where no pair), and the weight gradients of
  // the local experts (overwritten).
  void backward(const void* grad_combined, void* grad_rows, DType grad_rows_dtype, float* grad_pair_weight);

  // The same in parts, to overlap a chunked dispatch (docs/layer.md#overlap):
  //   layout(row_expert, row_weight, N, rl)            // all rows' pairs, once
  //   forward_rows(rows, first, n, combined)           // part by part, in row_order's order
  //   backward_rows(grad_combined, first, n, ...)      // the forward's parts: the dgrad chain
  //   weight_grads()                                   // after every part's backward
  // A part is a range of rows that is also a range of rl.row_order (null: the rows'
  // own order), so each expert's pairs of a part are contiguous in the layout; a
  // part that is not throws. Every pair is computed as in the whole call, and the
  // weight gradients sum the pairs in the same order, so the results do not
  // depend on the parts.
  void layout(const int32_t* row_expert, const float* row_weight, int64_t N, const RowLayout& rl = {});
  void forward_rows(const void* rows, int64_t first, int64_t n, void* combined);
  void backward_rows(const void* grad_combined, int64_t first, int64_t n, void* grad_rows, DType grad_rows_dtype,
                     float* grad_pair_weight);
  void weight_grads();

  // One optimizer step on the local experts' weights from grad_w13()/grad_w2().
  void apply_update(const kernels::OptimizerConfig& cfg, int64_t step);

  // One local expert's state, packed [w13 | w2] per array (ExpertState): in a
  // train stage the fp32 masters and Adam moments, in a forward stage the
  // weights it computes with.
  void export_slot(int slot, ExpertState& out) const;
  // Slot s's weights as the stage computes with them: w13 [2I, H], w2 [H, I].
  void copy_weights(int slot, float* w13, float* w2) const;
  void import_slot(int slot, const ExpertState& in);
  // Slot `from` of src (weights, and in a train stage masters and moments) into
  // slot `to` of this stage, bit for bit.
  void copy_slot(const ExpertStage& src, int from, int to);
  // Slot `from` of src's weights, as src computes with them, into slot `to` (no
  // optimizer state): for a stage that only computes with them.
  void copy_compute_weights(const ExpertStage& src, int from, int to);
  // Touches every buffer once (with `moments`, the Adam moments too), so a stage
  // built ahead of use faults its pages in then rather than in its first step.
  void touch(bool moments);
  int num_local_experts() const { return L_; }

  const float* grad_w13() const { return grad_w13_.as<float>(); }
  float* grad_w13() { return grad_w13_.as<float>(); }
  float* grad_w2() { return grad_w2_.as<float>(); }
  const float* grad_w2() const { return grad_w2_.as<float>(); }
  std::vector<int64_t> expert_rows() const;  // pairs per local expert, last forward
  const ExpertStageTimes& times() const { return times_; }

 private:
  // Pairs [begin[e], end[e]) of each expert: the part of rows [first, first + n).
  struct Part {
    int64_t first = 0, n = 0;
    std::vector<int64_t> begin, end;
  };
  kernels::ExpertMlpConfig mlp_config() const;
  const Part& add_part(int64_t first, int64_t n);
  const Part* part_of(int64_t first, int64_t n) const;
  void copy_layout_to_host();
  void lay_out_pair_rows(const int64_t* pair_row_offset);
  void order_weight_grads(const int64_t* source_key);
  void write_rows(int64_t first, int64_t n, void* out, DType dtype);
  void run_forward(const void* rows, int64_t first, int64_t n, void* combined, const kernels::ExpertMlpPart& part);
  void run_dgrad(const void* grad_combined, int64_t first, int64_t n, void* grad_rows, DType grad_rows_dtype,
                 float* grad_pair_weight, const kernels::ExpertMlpPart& part, kernels::MlpBackwardPhase phase);
  kernels::ExpertMlpBackwardArgs backward_args(const void* grad_combined, kernels::MlpBackwardPhase phase) const;
  void pack_weights(int first, int count);  // experts' w13_, w2_ -> packed_, after every change
  MoeLayerConfig cfg_;
  int L_;
  kernels::Backend& be_;
  int64_t capacity_rows_ = -1;
  int64_t N_ = 0;
  const void* rows_ = nullptr;
  const void* grad_combined_ = nullptr;  // the dgrad's input, read again by weight_grads
  bool has_layout_ = false, has_forward_ = false;
  std::vector<Part> parts_;          // of the last forward, when it ran in parts
  int64_t dgrad_rows_ = 0;           // rows whose dgrad ran since the forward
  struct HostLayout {  // the layout on the host
    std::vector<int32_t> src_row, pair_pos;  // read to find parts
    bool valid = false;                      // ... and copied since the last layout()
    // Pair rows out (a pair_row_offset given): the offsets, and pair_src [M], the
    // pair (pairs_.pair_y row) each output row takes; empty offsets: rows summed.
    std::vector<int64_t> pair_row_offset;
    std::vector<int32_t> pair_src;
    // The weight gradients' pair order (order_weight_grads), or none: the layout's.
    bool wgrad_ordered = false;
    std::vector<int32_t> wgrad_order;
    std::vector<int64_t> expert_offset;  // [L + 1]
  } host_;
  kernels::Buffer w13_, w2_, grad_w13_, grad_w2_;
  struct PairBuffers {  // on the backend, per pass
    // pair_y: the weighted expert outputs per pair [M, H] fp32 in forward (read by
    // the combine), then the input gradients per pair in backward (the dgrad writes
    // them after the forward's combine has read every y; no pass reads y again).
    kernels::Buffer perm_src_row, perm_weight, pair_pos, pair_src, wgrad_order, pair_y, saved_gu, grad_perm_weight;
    kernels::Buffer layout_ws, mlp_ws;
  } pairs_;
  TrainableTensor w13_param_, w2_param_;
  // w13_, w2_ as the GEMM engine reads them (rounded to bf16 in a bf16 layer: in a
  // train stage w13_ and w2_ are the fp32 masters, kernels/api.h).
  std::unique_ptr<kernels::PackedWeights> packed_;
  ExpertStageTimes times_;
};

}  // namespace moe::ep
