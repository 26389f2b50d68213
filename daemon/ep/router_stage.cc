#include "moe/ep/router_stage.h"

#include "moe/base/check.h"

namespace moe::ep {

using kernels::Buffer;

RouterStage::RouterStage(const MoeLayerConfig& cfg, kernels::Backend& be) : cfg_(cfg), be_(be) {
  cfg_.validate();
  const size_t T = cfg.max_tokens, H = cfg.hidden, E = cfg.num_experts, K = cfg.top_k;
  gate_ = Buffer(be, 4 * E * H);
  bias_ = Buffer(be, 4 * E);
  logit_bias_ = Buffer(be, 4 * E);
  logits_ = Buffer(be, 4 * T * E);
  scores_ = Buffer(be, 4 * T * E);
  topk_idx_ = Buffer(be, 4 * T * K);
  topk_weight_ = Buffer(be, 4 * T * K);
  kept_idx_ = Buffer(be, 4 * T * K);
  router_ws_ = Buffer(be, be.router_workspace_bytes(cfg.router(cfg.max_tokens)));
  capacity_ws_ = Buffer(be, be.capacity_workspace_bytes(
                                {cfg.max_tokens, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.drop_policy}));
  if (cfg.train) {
    grad_logits_ = Buffer(be, 4 * T * E);
    grad_gate_ = Buffer(be, 4 * E * H);
    // The router reads gate_ as it is: a bf16 layer's holds the rounded copy.
    gate_param_.bind(be, gate_.as<float>(), E * H,
                     cfg.dtype == DType::kBF16 ? ComputeCopy::kRoundedCopy : ComputeCopy::kIsMaster, cfg.moments);
  }
  packed_gate_ = be.make_router_weights(cfg.router(cfg.max_tokens));
}

void RouterStage::copy_gate(float* out) const {
  be_.copy_to_host(out, gate_.get(), 4 * static_cast<size_t>(cfg_.num_experts) * cfg_.hidden);
}

TensorState RouterStage::gate_state(bool moments) const {
  MOE_CHECK(cfg_.train, "router state of a layer built without train = true");
  const size_t n = static_cast<size_t>(cfg_.num_experts) * cfg_.hidden;
  TensorState s;
  s.master.resize(n);
  if (moments) {
    s.m.resize(n);
    s.v.resize(n);
  }
  gate_param_.read(0, n, s.master.data(), moments ? s.m.data() : nullptr, moments ? s.v.data() : nullptr);
  return s;
}

void RouterStage::set_gate_state(const TensorState& s) {
  const size_t n = static_cast<size_t>(cfg_.num_experts) * cfg_.hidden;
  MOE_CHECK(s.master.size() == n, "router state: ", s.master.size(), " values, expected ", n);
  const bool moments = !s.m.empty();
  MOE_CHECK(!moments || (s.m.size() == n && s.v.size() == n), "router state: moments of the wrong size");
  if (cfg_.train)
    gate_param_.write(0, n, s.master.data(), moments ? s.m.data() : nullptr, moments ? s.v.data() : nullptr);
  else  // a layer that only computes (a trained model served): the weights, without the moments
    be_.copy_to_device(gate_.get(), s.master.data(), 4 * n);
  be_.pack_router_weights(*packed_gate_, gate_.as<float>());
  has_weights_ = true;
}

std::vector<float> RouterStage::expert_counts() const {
  const size_t n = static_cast<size_t>(T_) * cfg_.top_k;
  std::vector<int32_t> idx(n);
  be_.copy_to_host(idx.data(), topk_idx_.get(), 4 * n);
  std::vector<float> counts(cfg_.num_experts, 0.0f);
  for (int32_t e : idx) counts[e] += 1.0f;
  return counts;
}

void RouterStage::copy_logits(std::vector<float>& logits, std::vector<float>& scores) const {
  const size_t n = static_cast<size_t>(T_) * cfg_.num_experts;
  logits.resize(n);
  scores.resize(n);
  be_.copy_to_host(logits.data(), logits_.get(), 4 * n);
  be_.copy_to_host(scores.data(), scores_.get(), 4 * n);
}

void RouterStage::set_selection_bias(const std::vector<float>& bias) {
  MOE_CHECK(bias.size() == static_cast<size_t>(cfg_.num_experts), "selection bias has ", bias.size(),
            " values, expected ", cfg_.num_experts);
  be_.copy_to_device(bias_.get(), bias.data(), 4 * bias.size());
  has_bias_ = true;
}

void RouterStage::apply_update(const kernels::OptimizerConfig& cfg, int64_t step) {
  MOE_CHECK(cfg_.train, "apply_update on a layer built without train = true");
  gate_param_.update(cfg, step, grad_gate_.as<float>());
  be_.pack_router_weights(*packed_gate_, gate_.as<float>());
}

void RouterStage::set_weights(const model::LayerWeights& w) {
  const size_t H = cfg_.hidden, E = cfg_.num_experts;
  MOE_CHECK(w.gate.size() == E * H, "weights: gate has ", w.gate.size(), " values, expected ", E * H);
  MOE_CHECK(w.selection_bias.empty() || w.selection_bias.size() == E, "weights: e_score_correction_bias has ",
            w.selection_bias.size(), " values, expected ", E);
  MOE_CHECK(w.logit_bias.empty() || w.logit_bias.size() == E, "weights: logit_bias has ", w.logit_bias.size(),
            " values, expected ", E);
  be_.copy_to_device(gate_.get(), w.gate.data(), 4 * E * H);
  gate_param_.sync_master();
  be_.pack_router_weights(*packed_gate_, gate_.as<float>());
  has_bias_ = !w.selection_bias.empty();
  has_logit_bias_ = !w.logit_bias.empty();
  if (has_bias_) be_.copy_to_device(bias_.get(), w.selection_bias.data(), 4 * E);
  if (has_logit_bias_) be_.copy_to_device(logit_bias_.get(), w.logit_bias.data(), 4 * E);
  has_weights_ = true;
}

void RouterStage::forward(const void* x, int64_t T) {
  MOE_CHECK(T >= 0 && T <= cfg_.max_tokens, "forward: ", T, " tokens exceed max_tokens (", cfg_.max_tokens, ")");
  MOE_CHECK(has_weights_, "forward: set_weights was not called");
  T_ = T;
  kernels::RouterForwardArgs a;
  a.x = x;
  a.weight = gate_.as<float>();
  a.packed_weight = packed_gate_.get();
  a.selection_bias = has_bias_ ? bias_.as<float>() : nullptr;
  a.logit_bias = has_logit_bias_ ? logit_bias_.as<float>() : nullptr;
  a.logits = logits_.as<float>();
  a.scores = scores_.as<float>();
  a.topk_idx = topk_idx_.as<int32_t>();
  a.topk_weight = topk_weight_.as<float>();
  a.workspace = router_ws_.get();
  be_.router_forward(cfg_.router(T), a);
  be_.capacity_drop({T, cfg_.num_experts, cfg_.top_k, cfg_.capacity_factor, cfg_.drop_policy},
                    {topk_idx_.as<int32_t>(), topk_weight_.as<float>(), kept_idx_.as<int32_t>(), capacity_ws_.get()});
}

void RouterStage::backward(const void* x, const float* grad_topk_weight, float* grad_x32, const RouterBalance& balance) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  kernels::RouterBackwardArgs r;
  r.scores = scores_.as<float>();
  r.topk_idx = topk_idx_.as<int32_t>();
  r.topk_weight = topk_weight_.as<float>();
  r.grad_topk_weight = grad_topk_weight;
  r.x = x;
  r.weight = gate_.as<float>();
  r.grad_logits = grad_logits_.as<float>();
  r.grad_weight = grad_gate_.as<float>();
  r.grad_x = grad_x32;
  r.workspace = router_ws_.get();
  r.aux_scale = balance.aux_scale;
  r.balance_counts = balance.counts;
  r.z_scale = balance.z_scale;
  r.logits = logits_.as<float>();
  be_.router_backward(cfg_.router(T_), r);
}

}  // namespace moe::ep
