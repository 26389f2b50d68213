// Shared experts (docs/layer.md#shared-experts): one SwiGLU of width Is (all shared experts
// together, as DeepSeek stores them) on every token of the rank, optionally
// scaled by a sigmoid gate (Qwen2-MoE): out += sigmoid(x . w_g) x shared(x).
// Built from the layer's own stages: the experts are a one-expert ExpertStage
// every row selects with weight 1 or the gate's value, and the gate is a
// one-expert sigmoid RouterStage without normalisation, whose weight is exactly
// sigmoid(x . w_g) and whose backward is exactly the gate's gradient. Weights are
// replicated on every rank; their gradients are this rank's until all-reduced.
#pragma once

#include <memory>

#include "moe/ep/expert_stage.h"
#include "moe/ep/router_stage.h"

namespace moe::ep {

class SharedExperts {
 public:
  // layer: the MoE layer's config, shared_ffn_hidden > 0.
  SharedExperts(const MoeLayerConfig& layer, kernels::Backend& be);
  // w.shared_w13 [2Is, H], w.shared_w2 [H, Is], w.shared_gate [H] (with the gate),
  // as the layer computes with them.
  void set_weights(const model::LayerWeights& w);

  // out [T, H] (layer dtype) += the shared path of x. x stays valid until backward.
  void forward(const void* x, int64_t T, void* out);
  // grad_out [T, H] (layer dtype): the weight gradients (overwritten) and
  // grad_x32 += the shared path's input gradient, gate included.
  void backward(const void* grad_out, float* grad_x32);
  void apply_update(const kernels::OptimizerConfig& cfg, int64_t step);

  // The gradients as flat tensors, for the all-reduce over ranks.
  float* grad_w13() { return experts_.grad_w13(); }
  float* grad_w2() { return experts_.grad_w2(); }
  float* grad_gate() { return gate_ ? gate_->grad_gate() : nullptr; }
  size_t w13_size() const { return 2 * static_cast<size_t>(cfg_.ffn_hidden) * cfg_.hidden; }
  size_t w2_size() const { return static_cast<size_t>(cfg_.hidden) * cfg_.ffn_hidden; }
  size_t gate_size() const { return gate_ ? cfg_.hidden : 0; }
  // Adds the weights in use (fp32 values) to w's shared fields.
  void copy_weights(model::LayerWeights& w) const;
  // Train: masters and (with `moments`) Adam state, as checkpoints hold them, and back.
  ExpertState state(bool moments) const;
  TensorState gate_state(bool moments) const;  // empty without the gate
  void set_state(const ExpertState& experts, const TensorState& gate);

 private:
  MoeLayerConfig cfg_;
  kernels::Backend& be_;
  ExpertStage experts_;
  std::unique_ptr<RouterStage> gate_;  // with shared_gate
  const void* x_ = nullptr;
  int64_t T_ = 0;
  kernels::Buffer row_expert_, ones_, y_, grad_rows_, grad_scale_;
};

}  // namespace moe::ep
