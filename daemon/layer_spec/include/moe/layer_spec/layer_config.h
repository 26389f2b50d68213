// The spec-to-layer library (docs/jobs.md#spec), proto-free half: a layer as a
// user specifies it (LayerSpec: the layer fields of a job spec in plain types) and
// the configuration the layer runtimes take (MoeLayerConfig: routing, sizes,
// capacity, storage dtype, balancing, shared experts). layer_config() is the one
// place a MoeLayerConfig is built; the job spec's adapter (job_layers.h), the
// benchmarks, the tests and the device checks all come through it.
#pragma once

#include <cstdint>

#include "moe/kernels/api.h"
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
  DType moments = DType::kF32;  // train: how Adam's moments are stored (OptimizerConfig::moments)
  // Balancing (docs/layer.md#balancing; train): coefficients of the aux loss and the z-loss. With
  // global_counts the layer all-reduces c_e (pairs per expert before capacity,
  // over every rank's tokens) each forward: the losses and bias updates need it.
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  bool global_counts = false;
  // Shared experts (docs/layer.md#shared-experts): one SwiGLU of this width on every token (0: none),
  // scaled by sigmoid(x . w_g) with shared_gate.
  int shared_ffn_hidden = 0;
  bool shared_gate = false;

  void validate() const;  // throws moe::Error naming the field
  kernels::RouterConfig router(int64_t T) const;
  // The shared experts as a one-expert, top-1 layer of their width.
  MoeLayerConfig shared_experts() const;
};

// A layer as specified: the job spec's layer fields (docs/jobs.md#spec) in the
// kernels' types. tokens_per_rank sizes the layer (its row capacity per rank);
// the balancing coefficients count only in a train layer.
struct LayerSpec {
  int experts = 0;
  int top_k = 0;
  int hidden = 0;
  int ffn_hidden = 0;
  kernels::ScoreFunc score = kernels::ScoreFunc::kSoftmax;
  int num_groups = 0;
  int group_top_k = 0;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  DType dtype = DType::kF32;
  double capacity_factor = 0.0;
  kernels::DropPolicy drop_policy = kernels::DropPolicy::kProbs;
  int64_t tokens_per_rank = 0;
  bool train = false;
  DType moments = DType::kF32;  // Adam's moments (train)
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  double bias_update_rate = 0.0;
  int shared_experts = 0;
  int shared_ffn_hidden = 0;  // each shared expert's width
  bool shared_expert_gate = false;
};

// The one way to a MoeLayerConfig: derives the balancing switches (global
// counts with any balancing term) and the shared experts' total width.
MoeLayerConfig layer_config(const LayerSpec& spec);
// E, H, I, and the shared experts' total width shared_experts x shared_ffn_hidden.
model::LayerShape layer_shape(const LayerSpec& spec);

// Returns w with its values rounded to what a layer of `dtype` computes with.
model::LayerWeights weights_as_used(model::LayerWeights w, DType dtype);
// Throws unless w holds all cfg.num_experts experts' w13 and w2.
void check_expert_weights(const MoeLayerConfig& cfg, const model::LayerWeights& w);

}  // namespace moe::ep
