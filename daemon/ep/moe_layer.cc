#include "moe_layer.h"

#include <chrono>

#include "moe/kernels/buffer.h"
#include "moe/kernels/check.h"

namespace moe::ep {

using kernels::Buffer;

void MoeLayerConfig::validate() const {
  MOE_CHECK(max_tokens >= 0, "max_tokens must be >= 0, got ", max_tokens);
  MOE_CHECK(ffn_hidden > 0, "ffn_hidden must be > 0, got ", ffn_hidden);
  router(max_tokens).validate();
  kernels::CapacityConfig{max_tokens, num_experts, top_k, capacity_factor, drop_policy}.validate();
}

kernels::RouterConfig MoeLayerConfig::router(int64_t T) const {
  kernels::RouterConfig r;
  r.num_tokens = T;
  r.hidden = hidden;
  r.num_experts = num_experts;
  r.top_k = top_k;
  r.score = score;
  r.num_groups = num_groups;
  r.group_top_k = group_top_k;
  r.norm_topk_prob = norm_topk_prob;
  r.routed_scaling_factor = routed_scaling_factor;
  r.x_dtype = dtype;
  return r;
}

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Times a phase: synchronises the backend at both ends so the figure is wall time.
template <typename Fn>
double timed(kernels::Backend& be, Fn&& fn) {
  const double t0 = now_seconds();
  fn();
  be.synchronize();
  return now_seconds() - t0;
}

kernels::ExpertMlpConfig mlp_config(const MoeLayerConfig& c) {
  kernels::ExpertMlpConfig m;
  m.num_experts = c.num_experts;
  m.hidden = c.hidden;
  m.ffn_hidden = c.ffn_hidden;
  m.max_rows = c.max_tokens * c.top_k;
  m.max_src_rows = c.max_tokens;
  m.x_dtype = c.dtype;
  m.train = c.train;
  return m;
}

}  // namespace

struct MoeLayer::Buffers {
  // weights (fp32 working copies)
  Buffer gate, selection_bias, logit_bias, w13, w2;
  // forward state [T, E] / [T, K]
  Buffer logits, scores, topk_idx, topk_weight, kept_idx;
  // permute layout
  std::vector<int64_t> expert_offset;  // host, [E + 1]
  Buffer perm_src_row, perm_weight, pair_pos;
  Buffer y, saved_gu;
  // backward
  Buffer grad_perm_x, grad_perm_weight, grad_topk_weight, grad_x32, grad_logits;
  Buffer grad_gate, grad_w13, grad_w2;
  // workspaces
  Buffer router_ws, capacity_ws, layout_ws, mlp_ws;
};

MoeLayer::MoeLayer(const MoeLayerConfig& cfg, kernels::Backend& backend)
    : cfg_(cfg), be_(backend), buf_(std::make_unique<Buffers>()) {
  cfg_.validate();
  const size_t T = cfg.max_tokens, H = cfg.hidden, I = cfg.ffn_hidden, E = cfg.num_experts,
               K = cfg.top_k;
  Buffers& b = *buf_;
  auto make = [&](size_t bytes) { return Buffer(be_, bytes); };
  b.gate = make(4 * E * H);
  b.selection_bias = make(4 * E);
  b.logit_bias = make(4 * E);
  b.w13 = make(4 * E * 2 * I * H);
  b.w2 = make(4 * E * H * I);
  b.logits = make(4 * T * E);
  b.scores = make(4 * T * E);
  b.topk_idx = make(4 * T * K);
  b.topk_weight = make(4 * T * K);
  b.kept_idx = make(4 * T * K);
  b.expert_offset.assign(E + 1, 0);
  b.perm_src_row = make(4 * T * K);
  b.perm_weight = make(4 * T * K);
  b.pair_pos = make(4 * T * K);
  b.y = make(4 * T * K * H);
  if (cfg.train) {
    b.saved_gu = make(4 * T * K * 2 * I);
    b.grad_perm_x = make(4 * T * K * H);
    b.grad_perm_weight = make(4 * T * K);
    b.grad_topk_weight = make(4 * T * K);
    b.grad_x32 = make(4 * T * H);
    b.grad_logits = make(4 * T * E);
    b.grad_gate = make(4 * E * H);
    b.grad_w13 = make(4 * E * 2 * I * H);
    b.grad_w2 = make(4 * E * H * I);
  }
  b.router_ws = make(be_.router_workspace_bytes(cfg.router(cfg.max_tokens)));
  b.capacity_ws = make(be_.capacity_workspace_bytes(
      {cfg.max_tokens, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.drop_policy}));
  b.layout_ws = make(be_.permute_layout_workspace_bytes({cfg.max_tokens, cfg.top_k, cfg.num_experts}));
  b.mlp_ws = make(be_.expert_mlp_workspace_bytes(mlp_config(cfg)));
}

MoeLayer::~MoeLayer() = default;

void MoeLayer::set_weights(const model::LayerWeights& w) {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, E = cfg_.num_experts;
  MOE_CHECK(w.gate.size() == E * H, "weights: gate has ", w.gate.size(), " values, expected ", E * H);
  MOE_CHECK(w.w13.size() == E * 2 * I * H, "weights: gate/up projections have ", w.w13.size(),
            " values, expected ", E * 2 * I * H);
  MOE_CHECK(w.w2.size() == E * H * I, "weights: down projections have ", w.w2.size(),
            " values, expected ", E * H * I);
  MOE_CHECK(w.selection_bias.empty() || w.selection_bias.size() == E,
            "weights: e_score_correction_bias has ", w.selection_bias.size(), " values, expected ", E);
  MOE_CHECK(w.logit_bias.empty() || w.logit_bias.size() == E, "weights: logit_bias has ",
            w.logit_bias.size(), " values, expected ", E);
  host_weights_ = w;
  if (cfg_.dtype == DType::kBF16) {
    model::round_to_bf16(host_weights_.gate);
    model::round_to_bf16(host_weights_.w13);
    model::round_to_bf16(host_weights_.w2);
  }
  Buffers& b = *buf_;
  const auto& hw = host_weights_;
  be_.copy_to_device(b.gate.get(), hw.gate.data(), 4 * hw.gate.size());
  be_.copy_to_device(b.w13.get(), hw.w13.data(), 4 * hw.w13.size());
  be_.copy_to_device(b.w2.get(), hw.w2.data(), 4 * hw.w2.size());
  if (!hw.selection_bias.empty()) be_.copy_to_device(b.selection_bias.get(), hw.selection_bias.data(), 4 * E);
  if (!hw.logit_bias.empty()) be_.copy_to_device(b.logit_bias.get(), hw.logit_bias.data(), 4 * E);
}

void MoeLayer::forward(const void* x, int64_t T, void* out) {
  MOE_CHECK(T >= 0 && T <= cfg_.max_tokens, "forward: ", T, " tokens exceed max_tokens (",
            cfg_.max_tokens, ")");
  MOE_CHECK(!host_weights_.gate.empty(), "forward: set_weights was not called");
  Buffers& b = *buf_;
  const int E = cfg_.num_experts, K = cfg_.top_k, H = cfg_.hidden;
  T_ = T;
  x_ = x;
  has_forward_ = true;
  times_ = {};

  times_.router = timed(be_, [&] {
    kernels::RouterForwardArgs a;
    a.x = x;
    a.weight = b.gate.as<float>();
    a.selection_bias = host_weights_.selection_bias.empty() ? nullptr : b.selection_bias.as<float>();
    a.logit_bias = host_weights_.logit_bias.empty() ? nullptr : b.logit_bias.as<float>();
    a.logits = b.logits.as<float>();
    a.scores = b.scores.as<float>();
    a.topk_idx = b.topk_idx.as<int32_t>();
    a.topk_weight = b.topk_weight.as<float>();
    a.workspace = b.router_ws.get();
    be_.router_forward(cfg_.router(T), a);
    be_.capacity_drop({T, E, K, cfg_.capacity_factor, cfg_.drop_policy},
                      {b.topk_idx.as<int32_t>(), b.topk_weight.as<float>(), b.kept_idx.as<int32_t>(),
                       b.capacity_ws.get()});
  });

  times_.permute = timed(be_, [&] {
    kernels::PermuteLayoutArgs a;
    a.row_expert = b.kept_idx.as<int32_t>();
    a.row_weight = b.topk_weight.as<float>();
    a.expert_offset = b.expert_offset.data();
    a.perm_src_row = b.perm_src_row.as<int32_t>();
    a.perm_weight = b.perm_weight.as<float>();
    a.pair_pos = b.pair_pos.as<int32_t>();
    a.workspace = b.layout_ws.get();
    be_.permute_layout({T, K, E}, a);
  });

  kernels::ExpertMlpStats stats;
  const double mlp = timed(be_, [&] {
    kernels::ExpertMlpForwardArgs a;
    a.rows = x;
    a.expert_offset = b.expert_offset.data();
    a.perm_src_row = b.perm_src_row.as<int32_t>();
    a.perm_weight = b.perm_weight.as<float>();
    a.w13 = b.w13.as<float>();
    a.w2 = b.w2.as<float>();
    a.y = b.y.as<float>();
    a.saved_gu = cfg_.train ? b.saved_gu.as<float>() : nullptr;
    a.workspace = b.mlp_ws.get();
    a.stats = &stats;
    be_.expert_mlp_forward(mlp_config(cfg_), a);
  });
  const double busy = stats.gather_seconds + stats.gemm_seconds + stats.swiglu_seconds;
  if (busy > 0) {
    times_.permute += mlp * stats.gather_seconds / busy;
    times_.expert_gemm = mlp * stats.gemm_seconds / busy;
    times_.swiglu = mlp * stats.swiglu_seconds / busy;
  }

  times_.combine = timed(be_, [&] {
    kernels::UnpermuteConfig c{T, K, H, cfg_.dtype, false};
    be_.unpermute(c, {b.y.as<float>(), b.pair_pos.as<int32_t>(), nullptr, out});
  });
}

void MoeLayer::backward(const void* grad_out, void* grad_x) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  MOE_CHECK(has_forward_, "backward called before forward");
  Buffers& b = *buf_;
  const int64_t T = T_;
  const int K = cfg_.top_k, H = cfg_.hidden;
  times_.backward = timed(be_, [&] {
    kernels::ExpertMlpBackwardArgs m;
    m.grad_rows = grad_out;
    m.rows = x_;
    m.expert_offset = b.expert_offset.data();
    m.perm_src_row = b.perm_src_row.as<int32_t>();
    m.perm_weight = b.perm_weight.as<float>();
    m.w13 = b.w13.as<float>();
    m.w2 = b.w2.as<float>();
    m.saved_gu = b.saved_gu.as<float>();
    m.grad_perm_x = b.grad_perm_x.as<float>();
    m.grad_perm_weight = b.grad_perm_weight.as<float>();
    m.grad_w13 = b.grad_w13.as<float>();
    m.grad_w2 = b.grad_w2.as<float>();
    m.workspace = b.mlp_ws.get();
    be_.expert_mlp_backward(mlp_config(cfg_), m);

    be_.unpermute({T, K, H, DType::kF32, false},
                  {b.grad_perm_x.as<float>(), b.pair_pos.as<int32_t>(), nullptr, b.grad_x32.get()});
    be_.unpermute_scalars(b.pair_pos.as<int32_t>(), T, K, b.grad_perm_weight.as<float>(),
                          b.grad_topk_weight.as<float>());

    kernels::RouterBackwardArgs r;
    r.scores = b.scores.as<float>();
    r.topk_idx = b.topk_idx.as<int32_t>();
    r.topk_weight = b.topk_weight.as<float>();
    r.grad_topk_weight = b.grad_topk_weight.as<float>();
    r.x = x_;
    r.weight = b.gate.as<float>();
    r.grad_logits = b.grad_logits.as<float>();
    r.grad_weight = b.grad_gate.as<float>();
    r.grad_x = b.grad_x32.as<float>();
    r.workspace = b.router_ws.get();
    be_.router_backward(cfg_.router(T), r);
    be_.convert(b.grad_x32.get(), DType::kF32, grad_x, cfg_.dtype, T * H);
  });
}

const int32_t* MoeLayer::topk_idx() const { return buf_->topk_idx.as<int32_t>(); }
const int32_t* MoeLayer::kept_idx() const { return buf_->kept_idx.as<int32_t>(); }
const float* MoeLayer::topk_weight() const { return buf_->topk_weight.as<float>(); }
const float* MoeLayer::grad_topk_weight() const { return buf_->grad_topk_weight.as<float>(); }
const float* MoeLayer::grad_gate() const { return buf_->grad_gate.as<float>(); }
const float* MoeLayer::grad_w13() const { return buf_->grad_w13.as<float>(); }
const float* MoeLayer::grad_w2() const { return buf_->grad_w2.as<float>(); }

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

std::vector<int64_t> MoeLayer::expert_tokens() const {
  const auto& off = buf_->expert_offset;
  std::vector<int64_t> counts(cfg_.num_experts);
  for (int e = 0; e < cfg_.num_experts; ++e) counts[e] = off[e + 1] - off[e];
  return counts;
}

}  // namespace moe::ep
