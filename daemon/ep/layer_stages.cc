#include "moe/ep/layer_stages.h"

#include <chrono>
#include <cmath>

#include "moe/base/check.h"

namespace moe::ep {

using kernels::Buffer;

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

// ---------------------------------------------------------------------------

void TrainableTensor::bind(kernels::Backend& be, float* compute, size_t count, DType dtype) {
  be_ = &be;
  compute_ = compute;
  count_ = count;
  if (dtype == DType::kBF16) master_ = Buffer(be, 4 * count);
}

void TrainableTensor::sync_master() {
  if (master_.get()) be_->copy(master_.get(), compute_, 4 * count_);
}

void TrainableTensor::ensure_moments() {
  if (m_.get() || !count_) return;
  m_ = Buffer(*be_, 4 * count_);
  v_ = Buffer(*be_, 4 * count_);
  be_->fill_zero(m_.get(), 4 * count_);
  be_->fill_zero(v_.get(), 4 * count_);
}

void TrainableTensor::read(size_t begin, size_t n, float* master, float* m, float* v) const {
  const float* src = master_.get() ? master_.as<float>() : compute_;
  be_->copy_to_host(master, src + begin, 4 * n);
  if (m && m_.get()) be_->copy_to_host(m, m_.as<float>() + begin, 4 * n);
  else if (m) std::fill_n(m, n, 0.0f);
  if (v && v_.get()) be_->copy_to_host(v, v_.as<float>() + begin, 4 * n);
  else if (v) std::fill_n(v, n, 0.0f);
}

void TrainableTensor::write(size_t begin, size_t n, const float* master, const float* m, const float* v) {
  if (master_.get()) {
    be_->copy_to_device(master_.as<float>() + begin, master, 4 * n);
    std::vector<float> rounded(master, master + n);
    model::round_to_bf16(rounded);
    be_->copy_to_device(compute_ + begin, rounded.data(), 4 * n);
  } else {
    be_->copy_to_device(compute_ + begin, master, 4 * n);
  }
  if (!m || !v) return;
  ensure_moments();
  be_->copy_to_device(m_.as<float>() + begin, m, 4 * n);
  be_->copy_to_device(v_.as<float>() + begin, v, 4 * n);
}

void TrainableTensor::copy_range(const TrainableTensor& src, size_t from, size_t to, size_t n) {
  be_->copy(compute_ + to, src.compute_ + from, 4 * n);
  if (master_.get()) be_->copy(master_.as<float>() + to, src.master_.as<float>() + from, 4 * n);
  if (!src.m_.get()) {
    if (m_.get()) {  // the source has taken no Adam step yet: zero moments
      be_->fill_zero(m_.as<float>() + to, 4 * n);
      be_->fill_zero(v_.as<float>() + to, 4 * n);
    }
    return;
  }
  ensure_moments();
  be_->copy(m_.as<float>() + to, src.m_.as<float>() + from, 4 * n);
  be_->copy(v_.as<float>() + to, src.v_.as<float>() + from, 4 * n);
}

void TrainableTensor::update(const kernels::OptimizerConfig& cfg, int64_t step, const float* grad) {
  if (cfg.kind == kernels::OptimizerKind::kAdam) ensure_moments();
  kernels::OptimizerArgs a;
  a.count = static_cast<int64_t>(count_);
  a.step = step;
  a.weight = master_.get() ? master_.as<float>() : compute_;
  a.grad = grad;
  a.m = m_.as<float>();
  a.v = v_.as<float>();
  a.rounded = master_.get() ? compute_ : nullptr;
  be_->optimizer_step(cfg, a);
}

// ---------------------------------------------------------------------------

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
    gate_param_.bind(be, gate_.as<float>(), E * H, cfg.dtype);
  }
  packed_gate_ = be.make_router_weights(cfg.router(cfg.max_tokens));
}

void RouterStage::copy_gate(float* out) const {
  be_.copy_to_host(out, gate_.get(), 4 * static_cast<size_t>(cfg_.num_experts) * cfg_.hidden);
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

// ---------------------------------------------------------------------------

ExpertStage::ExpertStage(const MoeLayerConfig& cfg, int num_local_experts, kernels::Backend& be)
    : cfg_(cfg), L_(num_local_experts), be_(be) {
  MOE_CHECK(L_ >= 0, "expert stage: negative expert count ", L_);
  const size_t H = cfg.hidden, I = cfg.ffn_hidden, L = L_;
  expert_offset_.assign(L + 1, 0);
  w13_ = Buffer(be, 4 * L * 2 * I * H);
  w2_ = Buffer(be, 4 * L * H * I);
  if (cfg.train) {
    grad_w13_ = Buffer(be, 4 * L * 2 * I * H);
    grad_w2_ = Buffer(be, 4 * L * H * I);
    w13_param_.bind(be, w13_.as<float>(), L * 2 * I * H, cfg.dtype);
    w2_param_.bind(be, w2_.as<float>(), L * H * I, cfg.dtype);
  }
  kernels::ExpertMlpConfig shape = mlp_config();  // only the weights' shape matters here
  shape.max_rows = shape.max_src_rows = 0;
  packed_ = be.make_expert_weights(shape);
}

void ExpertStage::pack_weights(int first, int count) {
  be_.pack_expert_weights(*packed_, w13_.as<float>(), w2_.as<float>(), first, count);
}

void ExpertStage::set_weights(const float* w13, const float* w2) {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, L = L_;
  be_.copy_to_device(w13_.get(), w13, 4 * L * 2 * I * H);
  be_.copy_to_device(w2_.get(), w2, 4 * L * H * I);
  w13_param_.sync_master();
  w2_param_.sync_master();
  pack_weights(0, L_);
}

void ExpertStage::apply_update(const kernels::OptimizerConfig& cfg, int64_t step) {
  MOE_CHECK(cfg_.train, "apply_update on a layer built without train = true");
  w13_param_.update(cfg, step, grad_w13_.as<float>());
  w2_param_.update(cfg, step, grad_w2_.as<float>());
  pack_weights(0, L_);
}

void ExpertState::resize(int hidden, int ffn_hidden, bool moments) {
  const size_t n = 3 * static_cast<size_t>(hidden) * ffn_hidden;
  weights.assign(n, 0.0f);
  m.assign(moments ? n : 0, 0.0f);
  v.assign(moments ? n : 0, 0.0f);
}

void ExpertStage::copy_slot(const ExpertStage& src, int from, int to) {
  MOE_CHECK(from >= 0 && from < src.L_ && to >= 0 && to < L_, "expert stage: copy of slot ", from, " to slot ", to);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  if (!cfg_.train) {
    be_.copy(w13_.as<float>() + to * n13, src.w13_.as<float>() + from * n13, 4 * n13);
    be_.copy(w2_.as<float>() + to * n2, src.w2_.as<float>() + from * n2, 4 * n2);
  } else {
    w13_param_.copy_range(src.w13_param_, from * n13, to * n13, n13);
    w2_param_.copy_range(src.w2_param_, from * n2, to * n2, n2);
  }
  pack_weights(to, 1);
}

void ExpertStage::touch(bool moments) {
  for (kernels::Buffer* b : {&w13_, &w2_, &grad_w13_, &grad_w2_, &y_, &saved_gu_, &grad_perm_x_, &mlp_ws_})
    if (b->get()) be_.fill_zero(b->get(), b->bytes());
  if (moments && cfg_.train) {
    w13_param_.ensure_moments();
    w2_param_.ensure_moments();
  }
}

void ExpertStage::copy_weights(int s, float* w13, float* w2) const {
  MOE_CHECK(s >= 0 && s < L_, "expert stage: no local slot ", s);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  be_.copy_to_host(w13, w13_.as<float>() + s * n13, 4 * n13);
  be_.copy_to_host(w2, w2_.as<float>() + s * n2, 4 * n2);
}

void ExpertStage::export_slot(int s, ExpertState& out) const {
  MOE_CHECK(s >= 0 && s < L_, "expert stage: no local slot ", s);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  float* m = out.m.empty() ? nullptr : out.m.data();
  float* v = out.v.empty() ? nullptr : out.v.data();
  if (!cfg_.train) {  // the weights it computes with
    be_.copy_to_host(out.weights.data(), w13_.as<float>() + s * n13, 4 * n13);
    be_.copy_to_host(out.weights.data() + n13, w2_.as<float>() + s * n2, 4 * n2);
    return;
  }
  w13_param_.read(s * n13, n13, out.weights.data(), m, v);
  w2_param_.read(s * n2, n2, out.weights.data() + n13, m ? m + n13 : nullptr, v ? v + n13 : nullptr);
}

void ExpertStage::import_slot(int s, const ExpertState& in) {
  MOE_CHECK(s >= 0 && s < L_, "expert stage: no local slot ", s);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  MOE_CHECK(in.weights.size() == n13 + n2, "expert stage: an expert state of ", in.weights.size(), " values, expected ",
            n13 + n2);
  if (!cfg_.train) {
    be_.copy_to_device(w13_.as<float>() + s * n13, in.weights.data(), 4 * n13);
    be_.copy_to_device(w2_.as<float>() + s * n2, in.weights.data() + n13, 4 * n2);
  } else {
    const float* m = in.m.empty() ? nullptr : in.m.data();
    const float* v = in.v.empty() ? nullptr : in.v.data();
    w13_param_.write(s * n13, n13, in.weights.data(), m, v);
    w2_param_.write(s * n2, n2, in.weights.data() + n13, m ? m + n13 : nullptr, v ? v + n13 : nullptr);
  }
  pack_weights(s, 1);
}

kernels::ExpertMlpConfig ExpertStage::mlp_config() const {
  kernels::ExpertMlpConfig m;
  m.num_experts = L_;
  m.hidden = cfg_.hidden;
  m.ffn_hidden = cfg_.ffn_hidden;
  m.max_rows = capacity_rows_ * std::min(cfg_.top_k, std::max(L_, 1));
  m.max_src_rows = capacity_rows_;
  m.x_dtype = cfg_.dtype;
  m.train = cfg_.train;
  return m;
}

void ExpertStage::reserve(int64_t rows) {
  if (rows <= capacity_rows_) return;
  capacity_rows_ = rows;
  const size_t N = rows, K = cfg_.top_k, H = cfg_.hidden, I = cfg_.ffn_hidden;
  const size_t M = N * std::min<size_t>(K, std::max(L_, 1));  // a row has at most min(K, L) local pairs
  perm_src_row_ = Buffer(be_, 4 * N * K);
  perm_weight_ = Buffer(be_, 4 * N * K);
  pair_pos_ = Buffer(be_, 4 * N * K);
  y_ = Buffer(be_, 4 * M * H);
  if (cfg_.train) {
    saved_gu_ = Buffer(be_, 4 * M * 2 * I);
    grad_perm_x_ = Buffer(be_, 4 * M * H);
    grad_perm_weight_ = Buffer(be_, 4 * M);
  }
  layout_ws_ = Buffer(be_, be_.permute_layout_workspace_bytes({rows, cfg_.top_k, L_}));
  mlp_ws_ = Buffer(be_, be_.expert_mlp_workspace_bytes(mlp_config()));
}

void ExpertStage::forward(const void* rows, int64_t N, const int32_t* row_expert, const float* row_weight,
                          void* combined) {
  reserve(N);
  N_ = N;
  rows_ = rows;
  has_forward_ = true;
  times_ = {};
  const int K = cfg_.top_k, H = cfg_.hidden;
  double t0 = now_seconds();
  kernels::PermuteLayoutArgs pl;
  pl.row_expert = row_expert;
  pl.row_weight = row_weight;
  pl.expert_offset = expert_offset_.data();
  pl.perm_src_row = perm_src_row_.as<int32_t>();
  pl.perm_weight = perm_weight_.as<float>();
  pl.pair_pos = pair_pos_.as<int32_t>();
  pl.workspace = layout_ws_.get();
  be_.permute_layout({N, K, L_}, pl);
  MOE_CHECK(expert_offset_[L_] <= mlp_config().max_rows, "expert stage: ", expert_offset_[L_],
            " pairs exceed the reserved ", mlp_config().max_rows);
  be_.synchronize();
  double t1 = now_seconds();
  times_.layout = t1 - t0;

  kernels::ExpertMlpForwardArgs a;
  a.rows = rows;
  a.expert_offset = expert_offset_.data();
  a.perm_src_row = perm_src_row_.as<int32_t>();
  a.perm_weight = perm_weight_.as<float>();
  a.w13 = w13_.as<float>();
  a.w2 = w2_.as<float>();
  a.packed = packed_.get();
  a.y = y_.as<float>();
  a.saved_gu = cfg_.train ? saved_gu_.as<float>() : nullptr;
  a.workspace = mlp_ws_.get();
  a.stats = &times_.mlp_stats;
  be_.expert_mlp_forward(mlp_config(), a);
  be_.synchronize();
  t0 = now_seconds();
  times_.mlp = t0 - t1;

  // y is already weighted: the local combine is a plain per-row sum.
  be_.unpermute({N, K, H, cfg_.dtype, false, DType::kF32}, {y_.get(), pair_pos_.as<int32_t>(), nullptr, combined});
  be_.synchronize();
  times_.combine = now_seconds() - t0;
}

void ExpertStage::backward(const void* grad_combined, void* grad_rows, DType grad_rows_dtype,
                           float* grad_pair_weight) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  MOE_CHECK(has_forward_, "backward called before forward");
  const int K = cfg_.top_k, H = cfg_.hidden;
  kernels::ExpertMlpBackwardArgs m;
  m.grad_rows = grad_combined;
  m.rows = rows_;
  m.expert_offset = expert_offset_.data();
  m.perm_src_row = perm_src_row_.as<int32_t>();
  m.perm_weight = perm_weight_.as<float>();
  m.w13 = w13_.as<float>();
  m.w2 = w2_.as<float>();
  m.packed = packed_.get();
  m.saved_gu = saved_gu_.as<float>();
  m.grad_perm_x = grad_perm_x_.as<float>();
  m.grad_perm_weight = grad_perm_weight_.as<float>();
  m.grad_w13 = grad_w13_.as<float>();
  m.grad_w2 = grad_w2_.as<float>();
  m.workspace = mlp_ws_.get();
  be_.expert_mlp_backward(mlp_config(), m);
  be_.unpermute({N_, K, H, grad_rows_dtype, false, DType::kF32},
                {grad_perm_x_.get(), pair_pos_.as<int32_t>(), nullptr, grad_rows});
  be_.unpermute_scalars(pair_pos_.as<int32_t>(), N_, K, grad_perm_weight_.as<float>(), grad_pair_weight);
}

std::vector<int64_t> ExpertStage::expert_rows() const {
  std::vector<int64_t> counts(L_);
  for (int e = 0; e < L_; ++e) counts[e] = expert_offset_[e + 1] - expert_offset_[e];
  return counts;
}

}  // namespace moe::ep
