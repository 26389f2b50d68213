#include "moe/ep/shared_experts.h"

#include "moe/base/check.h"

namespace moe::ep {

using kernels::Buffer;

SharedExperts::SharedExperts(const MoeLayerConfig& layer, kernels::Backend& be)
    : cfg_(layer.shared_experts()), be_(be), experts_(cfg_, 1, be) {
  MOE_CHECK(cfg_.ffn_hidden > 0, "shared experts: width must be > 0, got ", cfg_.ffn_hidden);
  const size_t T = cfg_.max_tokens, H = cfg_.hidden;
  if (layer.shared_gate) gate_ = std::make_unique<RouterStage>(cfg_, be);
  experts_.reserve(static_cast<int64_t>(T));
  row_expert_ = Buffer(be, 4 * T);
  be.fill_zero(row_expert_.get(), 4 * T);  // every row selects expert 0
  std::vector<float> ones(T, 1.0f);
  ones_ = Buffer(be, 4 * T);
  be.copy_to_device(ones_.get(), ones.data(), 4 * T);
  y_ = Buffer(be, kernels::dtype_size(cfg_.dtype) * T * H);
  if (cfg_.train) {
    grad_rows_ = Buffer(be, 4 * T * H);
    grad_scale_ = Buffer(be, 4 * T);
  }
}

void SharedExperts::set_weights(const model::LayerWeights& w) {
  const size_t H = cfg_.hidden;
  MOE_CHECK(w.shared_w13.size() == w13_size(), "weights: shared experts' gate/up projections have ",
            w.shared_w13.size(), " values, expected ", w13_size());
  MOE_CHECK(w.shared_w2.size() == w2_size(), "weights: shared experts' down projection has ", w.shared_w2.size(),
            " values, expected ", w2_size());
  experts_.set_weights(w.shared_w13.data(), w.shared_w2.data());
  if (!gate_) return;
  MOE_CHECK(w.shared_gate.size() == H, "weights: shared_expert_gate has ", w.shared_gate.size(), " values, expected ",
            H);
  model::LayerWeights g;
  g.gate = w.shared_gate;
  gate_->set_weights(g);
}

void SharedExperts::forward(const void* x, int64_t T, void* out) {
  x_ = x;
  T_ = T;
  const float* scale = ones_.as<float>();
  if (gate_) {
    gate_->forward(x, T);
    scale = gate_->topk_weight();
  }
  experts_.forward(x, T, row_expert_.as<int32_t>(), scale, y_.get());
  be_.add(out, y_.get(), cfg_.dtype, T * cfg_.hidden);
}

void SharedExperts::backward(const void* grad_out, float* grad_x32) {
  MOE_CHECK(cfg_.train, "shared experts: backward on a layer built without train = true");
  experts_.backward(grad_out, grad_rows_.get(), kernels::DType::kF32, grad_scale_.as<float>());
  be_.add(grad_x32, grad_rows_.get(), kernels::DType::kF32, T_ * cfg_.hidden);
  // grad_scale holds <grad_out[t], shared(x_t)>: the gate's routing-weight gradient.
  if (gate_) gate_->backward(x_, grad_scale_.as<float>(), grad_x32);
}

void SharedExperts::apply_update(const kernels::OptimizerConfig& cfg, int64_t step) {
  experts_.apply_update(cfg, step);
  if (gate_) gate_->apply_update(cfg, step);
}

void SharedExperts::copy_weights(model::LayerWeights& w) const {
  w.shared_w13.resize(w13_size());
  w.shared_w2.resize(w2_size());
  experts_.copy_weights(0, w.shared_w13.data(), w.shared_w2.data());
  if (!gate_) return;
  w.shared_gate.resize(cfg_.hidden);
  gate_->copy_gate(w.shared_gate.data());
}

}  // namespace moe::ep
