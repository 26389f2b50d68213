// The single-rank MoE layer (router, capacity, permute, fused experts, combine,
// and the backward through all of it) against the fp64 reference.
#include <gtest/gtest.h>

#include <cstdlib>

#include "moe/ep/moe_layer.h"
#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/ep/reference.h"
#include "test_util.h"

namespace moe::test {
namespace {

using kernels::DType;

enum class Special { kNone, kTies, kZeroTokenExperts, kAllOnOne };
// The GEMM engine of the case's dtype: the table's, oneDNN asked for explicitly,
// or OpenBLAS through the MOE_GEMM_ENGINE override.
enum class Engine { kTable, kOneDnn, kOpenBlasOverride };

struct LayerCase {
  const char* name;
  int64_t T;
  int H, I, E, K;
  ScoreFunc score = ScoreFunc::kSoftmax;
  int groups = 0, group_top_k = 0;
  bool norm = true;
  float scaling = 1.0f;
  double cf = 0.0;
  DropPolicy policy = DropPolicy::kProbs;
  DType dtype = DType::kF32;
  Special special = Special::kNone;
  bool selection_bias = false;
  Engine engine = Engine::kTable;
};

// The backend for a case, or null with the reason in *skip when this CPU cannot
// run the engine the case asks for.
std::unique_ptr<kernels::Backend> make_backend(kernels::ThreadPool& pool, const LayerCase& c, std::string* skip) {
  const std::string dtype = kernels::dtype_name(c.dtype);
  switch (c.engine) {
    case Engine::kTable:
      return kernels::make_cpu_backend(pool);
    case Engine::kOneDnn: {
      if (!kernels::onednn_supports(c.dtype)) {
        *skip = "oneDNN has no " + dtype + " matmul on this CPU (ISA " + kernels::cpu_backend_info().isa + ")";
        return nullptr;
      }
      kernels::CpuEngines e = kernels::cpu_backend_info().engines;
      (c.dtype == DType::kF32 ? e.fp32 : e.bf16) = kernels::GemmEngine::kOneDnn;
      return kernels::make_cpu_backend(pool, e);
    }
    case Engine::kOpenBlasOverride: {
      ::setenv("MOE_GEMM_ENGINE", (dtype + "=openblas").c_str(), 1);
      auto be = kernels::make_cpu_backend(pool);
      ::unsetenv("MOE_GEMM_ENGINE");
      return be;
    }
  }
  return nullptr;
}

// Seeded values rounded to what a tensor of dtype holds.
std::vector<float> rounded_normal(int64_t n, uint64_t seed, DType dtype) {
  std::vector<float> v = normal_vector(n, seed);
  if (dtype == DType::kBF16) model::round_to_bf16(v);
  return v;
}

void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

class LayerVsReference : public ::testing::TestWithParam<LayerCase> {};

TEST_P(LayerVsReference, ForwardAndBackward) {
  const LayerCase& c = GetParam();
  kernels::ThreadPool pool(2);
  std::string skip;
  auto be = make_backend(pool, c, &skip);
  if (!be) GTEST_SKIP() << skip;
  if (c.engine == Engine::kOneDnn) {
    ASSERT_EQ(be->gemm_engine(c.dtype), "onednn");
  } else if (c.engine == Engine::kOpenBlasOverride) {
    ASSERT_EQ(be->gemm_engine(c.dtype), "openblas");
  }

  ep::MoeLayerConfig cfg;
  cfg.hidden = c.H;
  cfg.ffn_hidden = c.I;
  cfg.num_experts = c.E;
  cfg.top_k = c.K;
  cfg.score = c.score;
  cfg.num_groups = c.groups;
  cfg.group_top_k = c.group_top_k;
  cfg.norm_topk_prob = c.norm;
  cfg.routed_scaling_factor = c.scaling;
  cfg.capacity_factor = c.cf;
  cfg.drop_policy = c.policy;
  cfg.dtype = c.dtype;
  cfg.max_tokens = std::max<int64_t>(c.T, 1);
  cfg.train = true;
  ep::MoeLayer layer(cfg, *be);

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
  layer.set_weights(w);
  const model::LayerWeights& used = layer.weights();  // bf16-rounded in a bf16 layer

  const int64_t T = c.T;
  const int H = c.H, K = c.K, E = c.E;
  const std::vector<float> x32 = rounded_normal(T * H, 100, c.dtype), go32 = rounded_normal(T * H, 101, c.dtype);
  const std::vector<uint8_t> x = model::to_storage(x32, c.dtype), go = model::to_storage(go32, c.dtype);
  std::vector<uint8_t> out_buf(x.size()), gx_buf(x.size());
  layer.forward(x.data(), T, out_buf.data());
  layer.backward(go.data(), gx_buf.data());
  const std::vector<double> out = to_double(model::from_storage(out_buf.data(), T * H, c.dtype));
  const std::vector<double> gx = to_double(model::from_storage(gx_buf.data(), T * H, c.dtype));

  const ref::Config rc = ep::reference_config(cfg);
  const ref::Weights rw = ep::reference_weights(used);
  const std::vector<double> xd = to_double(x32);

  // Selection: identical to the reference's own except at near-ties that fp32
  // cannot resolve; the numeric comparison then uses the layer's selection.
  const ref::Forward own = ref::forward(rc, rw, xd, T);
  const std::vector<int32_t> idx(layer.topk_idx(), layer.topk_idx() + T * K);
  int near_ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (own.selection_margin[t] < 1e-5 && c.special != Special::kTies) {
      ++near_ties;
      continue;
    }
    for (int k = 0; k < K; ++k) ASSERT_EQ(idx[t * K + k], own.topk_idx[t * K + k]) << "token " << t;
  }
  EXPECT_LE(near_ties, std::max<int64_t>(1, T / 50));
  const ref::Forward f = ref::forward(rc, rw, xd, T, ref::forced(idx.data()));
  const ref::Grads g = ref::backward(rc, rw, xd, f, to_double(go32));

  const std::vector<int32_t> kept(layer.kept_idx(), layer.kept_idx() + T * K);
  EXPECT_EQ(kept, f.kept_idx);
  const bool empty = T == 0;
  // fp32: accumulation-order noise only. bf16: out and grad_x are rounded once to
  // bf16 at the end (at most 2^-8 of the value: bf16 keeps 8 significant bits),
  // with fp32 noise left to the 1e-5 of scale; the rest is fp32 on the same exact
  // bf16 inputs and weights. The oneDNN engine also rounds h and dgu to bf16
  // before the GEMMs that read them (expert_mlp_onednn.cc): an element moves by at
  // most 2^-8 of its sum of |terms| (RoundingSums); 2^-7 leaves as much again for
  // the fp32 accumulation and the exp approximation behind those operands (each
  // well under 1e-4 relative). Router, grad_topk_weight and grad_gate read no
  // rounded operand and keep their fp32 tolerances.
  const double rt = c.dtype == DType::kF32 ? 1e-4 : kBf16Roundoff;
  const bool rounds_operands = c.dtype == DType::kBF16 && be->gemm_engine(DType::kBF16) == "onednn";
  const double coef = rounds_operands ? 2 * kBf16Roundoff : 0.0;
  const RoundingSums sums = rounding_sums(rc, rw, xd, f, g, to_double(go32));
  EXPECT_TRUE(close_bounded("out", out, f.out, sums.out, coef, rt, 1e-5, empty));
  EXPECT_TRUE(close("topk_weight", to_double(layer.topk_weight(), T * K), f.topk_weight, 1e-5, 1e-6, empty));
  EXPECT_TRUE(close_bounded("grad_x", gx, g.grad_x, sums.grad_x, coef, rt, 1e-5, empty));
  EXPECT_TRUE(close("grad_topk_weight", to_double(layer.grad_topk_weight(), T * K), g.grad_topk_weight, 1e-4,
                    1e-5, empty));
  const ep::LayerGrads lg = layer.copy_grads();
  // With top-1 and normalisation the weight is always c: no router gradient exists.
  const bool no_router_grad = empty || c.special == Special::kTies || (c.K == 1 && c.norm);
  EXPECT_TRUE(close("grad_gate", to_double(lg.gate), g.grad_gate, 1e-4, 1e-5, no_router_grad));
  EXPECT_TRUE(close_bounded("grad_w13", to_double(lg.w13), g.grad_w13, sums.grad_w13, coef, 1e-4, 1e-5, empty));
  EXPECT_TRUE(close_bounded("grad_w2", to_double(lg.w2), g.grad_w2, sums.grad_w2, coef, 1e-4, 1e-5, empty));
  if (!empty) {
    EXPECT_GT(nonzero_fraction(out), 0.5);
    EXPECT_GT(nonzero_fraction(gx), 0.5);
  } else {
    EXPECT_EQ(max_abs(to_double(lg.w13)), 0.0);
    EXPECT_EQ(max_abs(to_double(lg.gate)), 0.0);
  }

  const std::vector<int64_t> counts = layer.expert_tokens();
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  int64_t kept_pairs = 0;
  for (int32_t e : kept) kept_pairs += e >= 0;
  EXPECT_EQ(total, kept_pairs);
  if (c.special == Special::kZeroTokenExperts) {
    for (int e = E / 2; e < E; ++e) EXPECT_EQ(counts[e], 0) << "expert " << e;
  }
  if (c.special == Special::kAllOnOne) {
    EXPECT_EQ(counts[E / 2], T);
  }
  if (c.cf > 0) {
    EXPECT_LT(kept_pairs, T * K) << "capacity case must drop";
  }
}

std::vector<LayerCase> cases() {
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

INSTANTIATE_TEST_SUITE_P(Cases, LayerVsReference, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return std::string(info.param.name); });

TEST(MoeLayer, RejectsBadUse) {
  kernels::ThreadPool pool(1);
  auto be = kernels::make_cpu_backend(pool);
  ep::MoeLayerConfig cfg;
  cfg.hidden = 8;
  cfg.ffn_hidden = 4;
  cfg.num_experts = 4;
  cfg.top_k = 5;
  cfg.max_tokens = 4;
  EXPECT_THROW(ep::MoeLayer(cfg, *be), Error);  // top_k > experts
  cfg.top_k = 2;
  ep::MoeLayer layer(cfg, *be);
  std::vector<float> x(8 * 8), out(8 * 8);
  EXPECT_THROW(layer.forward(x.data(), 2, out.data()), Error);  // no weights yet
  model::LayerWeights w = model::make_layer_weights(1, 0, {8, 4, 4});
  w.w2.pop_back();
  EXPECT_THROW(layer.set_weights(w), Error);  // wrong size names the tensor
  layer.set_weights(model::make_layer_weights(1, 0, {8, 4, 4}));
  EXPECT_THROW(layer.forward(x.data(), 5, out.data()), Error);  // T > max_tokens
  EXPECT_THROW(layer.backward(x.data(), out.data()), Error);    // not a train layer
}

}  // namespace
}  // namespace moe::test
