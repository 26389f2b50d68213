// RouterStage: router + capacity over a rank's own tokens, and its backward
// (docs/layer.md#router). One of the two compute stages every MoE layer runtime is
// built from; MoeLayer (one rank) and EpLayer (expert parallel) differ only in
// what moves rows between it and the ExpertStage.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/layer_spec/layer_config.h"
#include "moe/ep/trainable_tensor.h"
#include "moe/kernels/api.h"
#include "moe/kernels/buffer.h"
#include "moe/model/synthetic.h"

namespace moe::ep {

using kernels::DType;

// The balancing terms of a router's backward (docs/layer.md#balancing): the losses' scales and
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
  // Train: the router weight's master and (with `moments`) Adam state, and back
  // (a layer that does not train takes the master alone: a trained model served).
  TensorState gate_state(bool moments) const;
  void set_gate_state(const TensorState& s);
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

}  // namespace moe::ep
