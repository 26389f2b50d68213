#include "layer_cases.h"

#include <algorithm>
#include <sstream>

#include "moe/ep/moe_layer.h"
#include "moe/ep/reference.h"
#include "moe/kernels/buffer.h"
#include "numeric.h"

namespace moe::test {
namespace {

using kernels::DType;

// Seeded values rounded to what a tensor of dtype holds.
std::vector<float> rounded_normal(int64_t n, uint64_t seed, DType dtype) {
  std::vector<float> v = normal_vector(n, seed);
  if (dtype == DType::kBF16) model::round_to_bf16(v);
  return v;
}

// Collects failures: EXPECT-style, one line each.
class Failures {
 public:
  void expect(const std::string& failure) {
    if (!failure.empty()) os_ << failure << "\n";
  }
  void expect(bool ok, const std::string& what) {
    if (!ok) os_ << what << "\n";
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

std::string close(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                  double rtol, double atol_rel, bool allow_zero = false) {
  return compare_within(what, got, want, nullptr, 0.0, rtol, atol_rel, allow_zero);
}
std::string close_bounded(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                          const std::vector<double>& bound, double coef, double rtol, double atol_rel,
                          bool allow_zero = false) {
  return compare_within(what, got, want, &bound, coef, rtol, atol_rel, allow_zero);
}

// The case's layer config: a train layer with room for T tokens.
ep::MoeLayerConfig layer_config(const LayerCase& c) {
  return ep::layer_config({.experts = c.E,
                           .top_k = c.K,
                           .hidden = c.H,
                           .ffn_hidden = c.I,
                           .score = c.score,
                           .num_groups = c.groups,
                           .group_top_k = c.group_top_k,
                           .norm_topk_prob = c.norm,
                           .routed_scaling_factor = c.scaling,
                           .dtype = c.dtype,
                           .capacity_factor = c.cf,
                           .drop_policy = c.policy,
                           .tokens_per_rank = std::max<int64_t>(c.T, 1),
                           .train = true});
}

// Seeded weights, bent by the case's special routing.
model::LayerWeights case_weights(const LayerCase& c) {
  model::LayerWeights w = model::make_layer_weights(42, 0, {c.H, c.I, c.E});
  if (c.selection_bias) w.selection_bias = normal_vector(c.E, 8, 0.02);
  switch (c.special) {
    case Special::kNone:
      break;
    case Special::kTies:  // equal scores; selection bias ties in pairs
      std::fill(w.gate.begin(), w.gate.end(), 0.0f);
      w.selection_bias.assign(c.E, 0.0f);
      for (int e = 0; e < c.E; ++e) w.selection_bias[e] = 0.01f * static_cast<float>((c.E - e) / 2);
      break;
    case Special::kZeroTokenExperts:  // upper half of the experts never chosen
      w.logit_bias.assign(c.E, 0.0f);
      for (int e = c.E / 2; e < c.E; ++e) w.logit_bias[e] = -40.0f;
      break;
    case Special::kAllOnOne:
      w.logit_bias.assign(c.E, 0.0f);
      w.logit_bias[c.E / 2] = 40.0f;
      break;
  }
  return w;
}

// What one forward and backward of the layer produced, in host memory.
struct LayerRun {
  std::vector<double> out, gx, topk_weight, grad_topk_weight;
  std::vector<int32_t> topk_idx, kept_idx;
  std::vector<int64_t> expert_tokens;
  ep::LayerGrads grads;
};

LayerRun run_layer(kernels::Backend& be, ep::MoeLayer& layer, const LayerCase& c, const std::vector<float>& x32,
                   const std::vector<float>& go32) {
  const int64_t T = c.T, n = T * c.H, pairs = T * c.K;
  const kernels::Buffer x = kernels::to_backend(be, model::to_storage(x32, c.dtype));
  const kernels::Buffer go = kernels::to_backend(be, model::to_storage(go32, c.dtype));
  kernels::Buffer out(be, x.bytes()), gx(be, x.bytes());
  layer.forward(x.get(), T, out.get());
  layer.backward(go.get(), gx.get());
  const size_t bytes = kernels::dtype_size(c.dtype) * n;
  LayerRun r;
  r.out = to_double(model::from_storage(kernels::to_host<uint8_t>(be, out.get(), bytes).data(), n, c.dtype));
  r.gx = to_double(model::from_storage(kernels::to_host<uint8_t>(be, gx.get(), bytes).data(), n, c.dtype));
  r.topk_idx = kernels::to_host<int32_t>(be, layer.topk_idx(), pairs);
  r.kept_idx = kernels::to_host<int32_t>(be, layer.kept_idx(), pairs);
  r.topk_weight = to_double(kernels::to_host<float>(be, layer.topk_weight(), pairs));
  r.grad_topk_weight = to_double(kernels::to_host<float>(be, layer.grad_topk_weight(), pairs));
  r.expert_tokens = layer.expert_tokens();
  r.grads = layer.copy_grads();
  return r;
}

// The counts the layer reports agree with its selection and the case's routing.
void check_counts(const LayerCase& c, const LayerRun& r, Failures& fail) {
  int64_t total = 0, kept_pairs = 0;
  for (int64_t n : r.expert_tokens) total += n;
  for (int32_t e : r.kept_idx) kept_pairs += e >= 0;
  fail.expect(total == kept_pairs, "expert_tokens sum " + std::to_string(total) + " != kept pairs " +
                                       std::to_string(kept_pairs));
  if (c.special == Special::kZeroTokenExperts)
    for (int e = c.E / 2; e < c.E; ++e)
      fail.expect(r.expert_tokens[e] == 0, "expert " + std::to_string(e) + " should get no tokens");
  if (c.special == Special::kAllOnOne)
    fail.expect(r.expert_tokens[c.E / 2] == c.T, "every token should go to expert " + std::to_string(c.E / 2));
  if (c.cf > 0) fail.expect(kept_pairs < c.T * c.K, "capacity case must drop");
}

// The run's selection against the reference's own, except at near-ties that fp32
// cannot resolve (the numeric comparison then uses the run's selection). False
// when a token's selection differs.
bool check_selection(const LayerCase& c, const LayerRun& r, const ref::Forward& own, Failures& fail) {
  int near_ties = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    if (own.selection_margin[t] < 1e-5 && c.special != Special::kTies) {
      ++near_ties;
      continue;
    }
    for (int k = 0; k < c.K; ++k)
      if (r.topk_idx[t * c.K + k] != own.topk_idx[t * c.K + k]) {
        fail.expect(false, "selection of token " + std::to_string(t) + " differs from the reference");
        return false;
      }
  }
  fail.expect(near_ties <= std::max<int64_t>(1, c.T / 50), std::to_string(near_ties) + " near-ties");
  return true;
}

// Every value of the run against the reference's forward f and backward g.
// fp32: accumulation-order noise only. bf16: out and grad_x are rounded once to
// bf16 at the end (at most 2^-8 of the value: bf16 keeps 8 significant bits),
// with fp32 noise left to the 1e-5 of scale; the rest is fp32 on the same exact
// bf16 inputs and weights. Engines with bf16 GEMM operands (oneDNN, cuBLAS) also
// round h and dgu to bf16 before the GEMMs that read them: an element moves by at
// most 2^-8 of its sum of |terms| (RoundingSums); 2^-7 leaves as much again for
// the fp32 accumulation and the exp approximation behind those operands (each
// well under 1e-4 relative). Router, grad_topk_weight and grad_gate read no
// rounded operand and keep their fp32 tolerances.
void check_values(const LayerCase& c, const LayerRun& r, const ref::Forward& f, const ref::Grads& g,
                  const RoundingSums& sums, bool rounds_operands, Failures& fail) {
  const bool empty = c.T == 0;
  const double rt = c.dtype == DType::kF32 ? 1e-4 : kBf16Roundoff;
  const double coef = rounds_operands ? 2 * kBf16Roundoff : 0.0;
  fail.expect(r.kept_idx == f.kept_idx, "kept_idx differs from the reference's capacity drop");
  fail.expect(close_bounded("out", r.out, f.out, sums.out, coef, rt, 1e-5, empty));
  fail.expect(close("topk_weight", r.topk_weight, f.topk_weight, 1e-5, 1e-6, empty));
  fail.expect(close_bounded("grad_x", r.gx, g.grad_x, sums.grad_x, coef, rt, 1e-5, empty));
  fail.expect(close("grad_topk_weight", r.grad_topk_weight, g.grad_topk_weight, 1e-4, 1e-5, empty));
  const ep::LayerGrads& lg = r.grads;
  // With top-1 and normalisation the weight is always c: no router gradient exists.
  const bool no_router_grad = empty || c.special == Special::kTies || (c.K == 1 && c.norm);
  fail.expect(close("grad_gate", to_double(lg.gate), g.grad_gate, 1e-4, 1e-5, no_router_grad));
  fail.expect(close_bounded("grad_w13", to_double(lg.w13), g.grad_w13, sums.grad_w13, coef, 1e-4, 1e-5, empty));
  fail.expect(close_bounded("grad_w2", to_double(lg.w2), g.grad_w2, sums.grad_w2, coef, 1e-4, 1e-5, empty));
  if (!empty) {
    fail.expect(nonzero_fraction(r.out) > 0.5, "out is mostly zero");
    fail.expect(nonzero_fraction(r.gx) > 0.5, "grad_x is mostly zero");
  } else {
    fail.expect(max_abs(to_double(lg.w13)) == 0.0 && max_abs(to_double(lg.gate)) == 0.0,
                "no tokens must give zero weight gradients");
  }
}

}  // namespace

std::string check_layer(kernels::Backend& be, const LayerCase& c) {
  Failures fail;
  const ep::MoeLayerConfig cfg = layer_config(c);
  ep::MoeLayer layer(cfg, be);
  layer.set_weights(case_weights(c));
  const model::LayerWeights& used = layer.weights();  // bf16-rounded in a bf16 layer
  const std::vector<float> x32 = rounded_normal(c.T * c.H, 100, c.dtype),
                           go32 = rounded_normal(c.T * c.H, 101, c.dtype);
  const LayerRun r = run_layer(be, layer, c, x32, go32);

  const ref::Config rc = ep::reference_config(cfg);
  const ref::Weights rw = ep::reference_weights(used);
  const std::vector<double> xd = to_double(x32);
  if (!check_selection(c, r, ref::forward(rc, rw, xd, c.T), fail)) return fail.str();
  const ref::Forward f = ref::forward(rc, rw, xd, c.T, ref::forced(r.topk_idx.data()));
  const ref::Grads g = ref::backward(rc, rw, xd, f, to_double(go32));
  const bool rounds_operands = c.dtype == DType::kBF16 && be.gemm_engine(DType::kBF16) != "openblas";
  check_values(c, r, f, g, rounding_sums(rc, rw, xd, f, g, to_double(go32)), rounds_operands, fail);
  check_counts(c, r, fail);
  return fail.str();
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> v;
  auto add = [&](LayerCase c) { v.push_back(c); };
  LayerCase base{"softmax", 200, 48, 24, 16, 4};
  add(base);
  {
    LayerCase c = base;
    c.name = "softmax_bf16";
    c.dtype = DType::kBF16;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "T0";
    c.T = 0;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "T1";
    c.T = 1;
    add(c);
  }
  add(LayerCase{"E1", 50, 32, 16, 1, 1});
  add(LayerCase{"K_equals_E", 60, 32, 16, 4, 4});
  {
    LayerCase c = base;
    c.name = "ties";
    c.special = Special::kTies;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "zero_token_experts";
    c.special = Special::kZeroTokenExperts;
    add(c);
  }
  {
    LayerCase c{"all_on_one", 1100, 32, 16, 8, 1};  // one expert, several fused tiles
    c.special = Special::kAllOnOne;
    add(c);
  }
  {
    LayerCase c{"grouped_sigmoid", 200, 48, 24, 32, 4};
    c.score = ScoreFunc::kSigmoid;
    c.groups = 8;
    c.group_top_k = 3;
    c.scaling = 2.5f;
    c.selection_bias = true;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "softmax_nonorm";
    c.norm = false;
    c.scaling = 2.5f;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "sigmoid_norm";
    c.score = ScoreFunc::kSigmoid;
    c.scaling = 2.5f;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "sigmoid_nonorm";
    c.score = ScoreFunc::kSigmoid;
    c.norm = false;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "capacity_probs";
    c.cf = 0.8;
    add(c);
  }
  {
    LayerCase c = base;
    c.name = "capacity_position";
    c.cf = 0.5;
    c.policy = DropPolicy::kPosition;
    add(c);
  }
  {
    LayerCase c{"grouped_capacity_bf16", 200, 48, 24, 32, 4};
    c.groups = 4;
    c.group_top_k = 2;
    c.cf = 0.9;
    c.dtype = DType::kBF16;
    add(c);
  }
  // Each engine explicitly, whatever the table picks on this CPU: oneDNN (bf16 dot
  // products where the CPU has them), and OpenBLAS through MOE_GEMM_ENGINE.
  auto with_engine = [](LayerCase c, const char* name, DType dtype, Engine engine) {
    c.name = name;
    c.dtype = dtype;
    c.engine = engine;
    return c;
  };
  add(with_engine(base, "softmax_bf16_onednn", DType::kBF16, Engine::kOneDnn));
  add(with_engine(base, "softmax_bf16_openblas", DType::kBF16, Engine::kOpenBlasOverride));
  add(with_engine(base, "softmax_fp32_onednn", DType::kF32, Engine::kOneDnn));
  add(with_engine(base, "softmax_fp32_openblas", DType::kF32, Engine::kOpenBlasOverride));
  {
    LayerCase c = with_engine(base, "zero_token_experts_bf16_onednn", DType::kBF16, Engine::kOneDnn);
    c.special = Special::kZeroTokenExperts;
    add(c);
  }
  {
    LayerCase c = with_engine(base, "T0_bf16_onednn", DType::kBF16, Engine::kOneDnn);
    c.T = 0;
    add(c);
  }
  {
    LayerCase c = with_engine(base, "T0_bf16_openblas", DType::kBF16, Engine::kOpenBlasOverride);
    c.T = 0;
    add(c);
  }
  {
    LayerCase c{"all_on_one_bf16_onednn", 1100, 32, 16, 8, 1};  // one expert, several fused tiles
    c.special = Special::kAllOnOne;
    add(with_engine(c, c.name, DType::kBF16, Engine::kOneDnn));
  }
  {
    LayerCase c{"grouped_sigmoid_bf16_onednn", 200, 48, 24, 32, 4};
    c.score = ScoreFunc::kSigmoid;
    c.groups = 8;
    c.group_top_k = 3;
    c.scaling = 2.5f;
    c.selection_bias = true;
    c.norm = false;
    add(with_engine(c, c.name, DType::kBF16, Engine::kOneDnn));
  }
  return v;
}

}  // namespace moe::test
