#include "moe/layer_spec/layer_config.h"

#include <cmath>

#include "moe/base/check.h"

namespace moe::ep {

void MoeLayerConfig::validate() const {
  MOE_CHECK(max_tokens >= 0, "max_tokens must be >= 0, got ", max_tokens);
  MOE_CHECK(ffn_hidden > 0, "ffn_hidden must be > 0, got ", ffn_hidden);
  MOE_CHECK(aux_loss_coeff >= 0 && std::isfinite(aux_loss_coeff), "aux_loss_coeff must be >= 0, got ", aux_loss_coeff);
  MOE_CHECK(z_loss_coeff >= 0 && std::isfinite(z_loss_coeff), "z_loss_coeff must be >= 0, got ", z_loss_coeff);
  MOE_CHECK(aux_loss_coeff == 0 || global_counts, "aux_loss_coeff needs global_counts");
  MOE_CHECK(shared_ffn_hidden >= 0, "shared_ffn_hidden must be >= 0, got ", shared_ffn_hidden);
  MOE_CHECK(moments == DType::kF32 || moments == DType::kBF16, "moments_dtype must be fp32 or bf16");
  router(max_tokens).validate();
  kernels::CapacityConfig{max_tokens, num_experts, top_k, capacity_factor, drop_policy}.validate();
}

MoeLayerConfig layer_config(const LayerSpec& s) {
  MoeLayerConfig c;
  c.hidden = s.hidden;
  c.ffn_hidden = s.ffn_hidden;
  c.num_experts = s.experts;
  c.top_k = s.top_k;
  c.score = s.score;
  c.num_groups = s.num_groups;
  c.group_top_k = s.group_top_k;
  c.norm_topk_prob = s.norm_topk_prob;
  c.routed_scaling_factor = static_cast<float>(s.routed_scaling_factor);
  c.capacity_factor = s.capacity_factor;
  c.drop_policy = s.drop_policy;
  c.dtype = s.dtype;
  c.max_tokens = s.tokens_per_rank;
  c.train = s.train;
  c.moments = s.moments;
  c.aux_loss_coeff = s.train ? s.aux_loss_coeff : 0.0;
  c.z_loss_coeff = s.train ? s.z_loss_coeff : 0.0;
  c.global_counts = c.aux_loss_coeff > 0 || c.z_loss_coeff > 0 || s.bias_update_rate > 0;
  c.shared_ffn_hidden = s.shared_experts * s.shared_ffn_hidden;
  c.shared_gate = s.shared_expert_gate;
  return c;
}

model::LayerShape layer_shape(const LayerSpec& s) {
  return {.hidden = s.hidden,
          .ffn_hidden = s.ffn_hidden,
          .num_experts = s.experts,
          .shared_ffn_hidden = s.shared_experts * s.shared_ffn_hidden,
          .shared_gate = s.shared_expert_gate};
}

// The shared experts as a one-expert, top-1 layer of their total width whose
// router is the gate: sigmoid, unnormalised.
MoeLayerConfig MoeLayerConfig::shared_experts() const {
  return layer_config({.experts = 1,
                       .top_k = 1,
                       .hidden = hidden,
                       .ffn_hidden = shared_ffn_hidden,
                       .score = kernels::ScoreFunc::kSigmoid,
                       .norm_topk_prob = false,
                       .routed_scaling_factor = 1.0,
                       .dtype = dtype,
                       .tokens_per_rank = max_tokens,
                       .train = train,
                       .moments = moments});
}

kernels::RouterConfig MoeLayerConfig::router(int64_t T) const {
  kernels::RouterConfig r;
  static_cast<kernels::RoutingParams&>(r) = routing();
  r.num_tokens = T;
  r.hidden = hidden;
  r.x_dtype = dtype;
  return r;
}

model::LayerWeights weights_as_used(model::LayerWeights w, DType dtype) {
  if (dtype == DType::kBF16) {
    for (std::vector<float>* v : {&w.gate, &w.w13, &w.w2, &w.shared_w13, &w.shared_w2, &w.shared_gate})
      model::round_to_bf16(*v);
  }
  return w;
}

void check_expert_weights(const MoeLayerConfig& cfg, const model::LayerWeights& w) {
  const size_t H = cfg.hidden, I = cfg.ffn_hidden, E = cfg.num_experts;
  MOE_CHECK(w.w13.size() == E * 2 * I * H, "weights: gate/up projections have ", w.w13.size(), " values, expected ",
            E * 2 * I * H);
  MOE_CHECK(w.w2.size() == E * H * I, "weights: down projections have ", w.w2.size(), " values, expected ", E * H * I);
}

}  // namespace moe::ep
