// One MoE layer's configuration (docs/layer.md): routing, sizes, capacity, storage
// dtype, balancing and shared experts; and the weights as such a layer computes
// with them.
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

// Returns w with its values rounded to what a layer of `dtype` computes with.
model::LayerWeights weights_as_used(model::LayerWeights w, DType dtype);
// Throws unless w holds all cfg.num_experts experts' w13 and w2.
void check_expert_weights(const MoeLayerConfig& cfg, const model::LayerWeights& w);

}  // namespace moe::ep
