// The two compute stages every MoE layer runtime is built from, on one rank:
//   RouterStage: router + capacity over the rank's own tokens, and its backward.
//   ExpertStage: permute layout -> fused expert MLP -> local combine over the rows
//                the rank holds (its own tokens, or what dispatch brought), and the
//                backward through the same layout.
// MoeLayer (one rank) and EpLayer (expert parallel) differ only in what moves rows
// between the two.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/base/clock.h"
#include "moe/kernels/api.h"
#include "moe/kernels/buffer.h"
#include "moe/model/synthetic.h"

namespace moe::ep {

using kernels::DType;

// One layer: its routing (shared with the router op and the reference), sizes,
// capacity, storage dtype, and whether it keeps what backward needs.
struct MoeLayerConfig : kernels::RoutingParams {
  int hidden = 0;
  int ffn_hidden = 0;
  double capacity_factor = 0.0;
  kernels::DropPolicy drop_policy = kernels::DropPolicy::kProbs;
  DType dtype = DType::kF32;
  int64_t max_tokens = 0;  // per rank
  bool train = false;
  // Balancing (DESIGN 3; train): coefficients of the aux loss and the z-loss. With
  // global_counts the layer all-reduces c_e (pairs per expert before capacity,
  // over every rank's tokens) each forward: the losses and bias updates need it.
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  bool global_counts = false;
  // Shared experts (DESIGN 3): one SwiGLU of this width on every token (0: none),
  // scaled by sigmoid(x . w_g) with shared_gate.
  int shared_ffn_hidden = 0;
  bool shared_gate = false;

  void validate() const;  // throws moe::Error naming the field
  kernels::RouterConfig router(int64_t T) const;
  // The shared experts as a one-expert, top-1 layer of their width.
  MoeLayerConfig shared_experts() const;
};

// Returns w with its values rounded to what a layer of `dtype` computes with.
model::LayerWeights weights_as_used(model::LayerWeights w, DType dtype);
// Throws unless w holds all cfg.num_experts experts' w13 and w2.
void check_expert_weights(const MoeLayerConfig& cfg, const model::LayerWeights& w);

// One expert's state as it moves between ranks (a live rebalance): [gate_up |
// down] = 2IH + HI floats per array. weights: the fp32 masters in a train
// stage, the values it computes with otherwise; m, v: Adam moments (empty for
// forward and SGD).
struct ExpertState {
  std::vector<float> weights, m, v;
  // Resizes for H, I; moments only when `moments`.
  void resize(int hidden, int ffn_hidden, bool moments);
  size_t floats() const { return weights.size() + m.size() + v.size(); }
};

// One trainable tensor of a stage: the values the layer computes with, an fp32
// master copy (its own buffer only in a bf16 layer, where the compute copy holds
// bf16-rounded values) and the optimizer's moments, allocated on first update.
class TrainableTensor {
 public:
  // compute: the stage's buffer of `count` values; sync_master() after loading it.
  void bind(kernels::Backend& be, float* compute, size_t count, DType dtype);
  void sync_master();
  void update(const kernels::OptimizerConfig& cfg, int64_t step, const float* grad);

  // Elements [begin, begin + n) as they cross the wire: the fp32 master values
  // and the Adam moments (zeros before the first update).
  void read(size_t begin, size_t n, float* master, float* m, float* v) const;
  // The inverse: sets master, the compute copy (bf16-rounded in a bf16 layer)
  // and, given m and v, the moments.
  void write(size_t begin, size_t n, const float* master, const float* m, const float* v);
  // Elements [from, from + n) of src (compute, master, moments) into [to, to + n)
  // of this tensor, bit for bit. Both in the same backend and dtype.
  void copy_range(const TrainableTensor& src, size_t from, size_t to, size_t n);
  void ensure_moments();  // allocates zero Adam moments (else on the first update)

 private:
  kernels::Backend* be_ = nullptr;
  float* compute_ = nullptr;
  size_t count_ = 0;
  kernels::Buffer master_, m_, v_;  // master_ empty in an fp32 layer
};

// The balancing terms of a router's backward (DESIGN 3): the losses' scales and
// the global counts [E] in backend memory (null when the aux loss is off).
struct RouterBalance {
  float aux_scale = 0.0f, z_scale = 0.0f;
  const float* counts = nullptr;
};

class RouterStage {
 public:
  RouterStage(const MoeLayerConfig& cfg, kernels::Backend& be);
  void set_weights(const model::LayerWeights& w);  // gate and biases, as used

  // Router then capacity on x [T, H].
  void forward(const void* x, int64_t T);
  // grad_topk_weight [T, K] -> grad_gate (this rank's tokens) and grad_x32 += the
  // router path.
  void backward(const void* x, const float* grad_topk_weight, float* grad_x32, const RouterBalance& balance = {});

  // One optimizer step on the router weight from grad_gate().
  void apply_update(const kernels::OptimizerConfig& cfg, int64_t step);

  int64_t num_tokens() const { return T_; }
  const int32_t* topk_idx() const { return topk_idx_.as<int32_t>(); }
  const int32_t* kept_idx() const { return kept_idx_.as<int32_t>(); }
  const float* topk_weight() const { return topk_weight_.as<float>(); }
  float* grad_gate() const { return grad_gate_.as<float>(); }
  // The router weight [E, H] as the layer computes with it, to host memory.
  void copy_gate(float* out) const;
  // Pairs per expert that top-k selected in the last forward, before capacity [E].
  std::vector<float> expert_counts() const;
  // The last forward's logits and scores [T, E], to host memory.
  void copy_logits(std::vector<float>& logits, std::vector<float>& scores) const;
  // Replaces the selection bias (e_score_correction_bias) [E].
  void set_selection_bias(const std::vector<float>& bias);

 private:
  MoeLayerConfig cfg_;
  kernels::Backend& be_;
  bool has_weights_ = false, has_bias_ = false, has_logit_bias_ = false;
  int64_t T_ = 0;
  kernels::Buffer gate_, bias_, logit_bias_, logits_, scores_, topk_idx_, topk_weight_, kept_idx_;
  kernels::Buffer grad_logits_, grad_gate_, router_ws_, capacity_ws_;
  TrainableTensor gate_param_;
  std::unique_ptr<kernels::PackedWeights> packed_gate_;  // gate_ as the GEMM engine reads it
};

// Wall seconds of the last ExpertStage::forward, and the fused MLP's split.
struct ExpertStageTimes {
  double layout = 0;
  double mlp = 0;
  double combine = 0;
  kernels::ExpertMlpStats mlp_stats;
};

class ExpertStage {
 public:
  ExpertStage(const MoeLayerConfig& cfg, int num_local_experts, kernels::Backend& be);
  // Host weights of the local experts: w13 [L, 2I, H], w2 [L, H, I] (as used).
  void set_weights(const float* w13, const float* w2);
  // Makes room for `rows` rows; allocates only when the high-water mark rises.
  void reserve(int64_t rows);

  // rows [N, H] (dtype), row_expert / row_weight [N, K] (local expert or -1) ->
  // combined [N, H] in dtype: each row's local pairs, weighted and summed.
  void forward(const void* rows, int64_t N, const int32_t* row_expert, const float* row_weight, void* combined);
  // grad_combined [N, H] (dtype) -> grad_rows [N, H] in grad_rows_dtype, the
  // routing-weight gradient per (row, k) [N, K] (0 where no pair), and the weight
  // gradients of the local experts (overwritten).
  void backward(const void* grad_combined, void* grad_rows, DType grad_rows_dtype, float* grad_pair_weight);

  // One optimizer step on the local experts' weights from grad_w13()/grad_w2().
  void apply_update(const kernels::OptimizerConfig& cfg, int64_t step);

  // One local expert's state, packed [w13 | w2] per array (ExpertState): in a
  // train stage the fp32 masters and Adam moments, in a forward stage the
  // weights it computes with.
  void export_slot(int slot, struct ExpertState& out) const;
  // Slot s's weights as the stage computes with them: w13 [2I, H], w2 [H, I].
  void copy_weights(int slot, float* w13, float* w2) const;
  void import_slot(int slot, const struct ExpertState& in);
  // Slot `from` of src (weights, and in a train stage masters and moments) into
  // slot `to` of this stage, bit for bit.
  void copy_slot(const ExpertStage& src, int from, int to);
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
  kernels::ExpertMlpConfig mlp_config() const;
  void pack_weights(int first, int count);  // experts' w13_, w2_ -> packed_, after every change
  MoeLayerConfig cfg_;
  int L_;
  kernels::Backend& be_;
  int64_t capacity_rows_ = -1;
  int64_t N_ = 0;
  const void* rows_ = nullptr;
  bool has_forward_ = false;
  std::vector<int64_t> expert_offset_;  // host, [L + 1]
  kernels::Buffer w13_, w2_, grad_w13_, grad_w2_;
  kernels::Buffer perm_src_row_, perm_weight_, pair_pos_, y_, saved_gu_, grad_perm_x_, grad_perm_weight_;
  kernels::Buffer layout_ws_, mlp_ws_;
  TrainableTensor w13_param_, w2_param_;
  std::unique_ptr<kernels::PackedWeights> packed_;  // w13_, w2_ as the GEMM engine reads them
  ExpertStageTimes times_;
};

}  // namespace moe::ep
