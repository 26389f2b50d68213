#include "moe/ep/layer_config.h"

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
  router(max_tokens).validate();
  kernels::CapacityConfig{max_tokens, num_experts, top_k, capacity_factor, drop_policy}.validate();
}

MoeLayerConfig MoeLayerConfig::shared_experts() const {
  MoeLayerConfig c;
  c.hidden = hidden;
  c.ffn_hidden = shared_ffn_hidden;
  c.num_experts = 1;
  c.top_k = 1;
  c.score = kernels::ScoreFunc::kSigmoid;  // the gate's scale, when shared_gate
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 1.0f;
  c.dtype = dtype;
  c.max_tokens = max_tokens;
  c.train = train;
  return c;
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
