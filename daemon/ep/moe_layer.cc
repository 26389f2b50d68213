#include "moe/ep/moe_layer.h"

#include "moe/base/check.h"
#include "moe/base/clock.h"

namespace moe::ep {

MoeLayer::MoeLayer(const MoeLayerConfig& cfg, kernels::Backend& backend)
    : cfg_(cfg), be_(backend), router_(cfg, backend), experts_(cfg, cfg.num_experts, backend) {
  experts_.reserve(cfg.max_tokens);
  if (cfg.train) {
    grad_topk_weight_ = kernels::Buffer(be_, 4 * static_cast<size_t>(cfg.max_tokens) * cfg.top_k);
    grad_x32_ = kernels::Buffer(be_, 4 * static_cast<size_t>(cfg.max_tokens) * cfg.hidden);
  }
}

void MoeLayer::set_weights(model::LayerWeights w) {
  check_expert_weights(cfg_, w);
  model::LayerWeights used = weights_as_used(std::move(w), cfg_.dtype);
  router_.set_weights(used);
  experts_.set_weights(used.w13.data(), used.w2.data());
  // The experts' values live in the stage alone (weights() reads them back): the
  // host vectors are released, not just emptied (clear() keeps the capacity).
  used.w13 = std::vector<float>();
  used.w2 = std::vector<float>();
  used_ = std::move(used);
}

model::LayerWeights MoeLayer::weights() const {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  model::LayerWeights w = used_;
  router_.copy_gate(w.gate.data());  // as trained
  w.w13.resize(cfg_.num_experts * n13);
  w.w2.resize(cfg_.num_experts * n2);
  for (int e = 0; e < cfg_.num_experts; ++e) experts_.copy_weights(e, w.w13.data() + e * n13, w.w2.data() + e * n2);
  return w;
}

void MoeLayer::forward(const void* x, int64_t T, void* out) {
  x_ = x;
  times_ = {};
  double t0 = now_seconds();
  router_.forward(x, T);
  be_.synchronize();
  times_.router = now_seconds() - t0;
  experts_.forward(x, T, router_.kept_idx(), router_.topk_weight(), out);
  const ExpertStageTimes& et = experts_.times();
  const kernels::ExpertMlpStats& s = et.mlp_stats;
  const double busy = s.gather_seconds + s.gemm_seconds + s.swiglu_seconds;
  times_.permute = et.layout + (busy > 0 ? et.mlp * s.gather_seconds / busy : 0);
  times_.expert_gemm = busy > 0 ? et.mlp * s.gemm_seconds / busy : 0;
  times_.swiglu = busy > 0 ? et.mlp * s.swiglu_seconds / busy : 0;
  times_.combine = et.combine;
}

void MoeLayer::backward(const void* grad_out, void* grad_x) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  const int64_t T = router_.num_tokens();
  const double t0 = now_seconds();
  experts_.backward(grad_out, grad_x32_.get(), DType::kF32, grad_topk_weight_.as<float>());
  router_.backward(x_, grad_topk_weight_.as<float>(), grad_x32_.as<float>());
  be_.convert(grad_x32_.get(), DType::kF32, grad_x, cfg_.dtype, T * cfg_.hidden);
  be_.synchronize();
  times_.backward = now_seconds() - t0;
}

void MoeLayer::optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step) {
  const double t0 = now_seconds();
  router_.apply_update(cfg, step);
  experts_.apply_update(cfg, step);
  be_.synchronize();
  times_.optimizer = now_seconds() - t0;
}

LayerGrads MoeLayer::copy_grads() const {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, E = cfg_.num_experts;
  LayerGrads g;
  g.gate.resize(E * H);
  g.w13.resize(E * 2 * I * H);
  g.w2.resize(E * H * I);
  be_.copy_to_host(g.gate.data(), grad_gate(), 4 * g.gate.size());
  be_.copy_to_host(g.w13.data(), grad_w13(), 4 * g.w13.size());
  be_.copy_to_host(g.w2.data(), grad_w2(), 4 * g.w2.size());
  return g;
}

}  // namespace moe::ep
