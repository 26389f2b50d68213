// The fp64 reference checked by central finite differences: L = <grad_out, out>,
// dL/dp ~ (L(p + h) - L(p - h)) / 2h for inputs, router weight and expert weights,
// in all four router-backward cases, with capacity dropping, with the balancing
// losses (L gains L_aux + L_z; counts of this batch or a given global batch) and
// with shared experts, gated or not.
#include <gtest/gtest.h>

#include "test_util.h"

namespace moe::test {
namespace {

struct FdCase {
  const char* name;
  ScoreFunc score;
  bool norm;
  double scaling;
  double capacity_factor;
  int num_groups;
  int group_top_k;
  double aux = 0, z = 0;      // balancing coefficients
  int shared = 0;             // shared experts' width
  bool shared_gate = false;
  bool global = false;        // the losses over a given global batch (T_g = 3T)
};

class RefFiniteDifference : public ::testing::TestWithParam<FdCase> {};

double loss(const ref::Config& cfg, const ref::Weights& w, const std::vector<double>& x, int64_t T,
            const std::vector<double>& go, const ref::ForwardOptions& opts) {
  const ref::Forward f = ref::forward(cfg, w, x, T, opts);
  double l = f.aux_loss + f.z_loss;
  for (size_t i = 0; i < go.size(); ++i) l += go[i] * f.out[i];
  return l;
}

TEST_P(RefFiniteDifference, GradientsMatch) {
  const FdCase& c = GetParam();
  ref::Config cfg;
  cfg.hidden = 6;
  cfg.ffn_hidden = 4;
  cfg.num_experts = 8;
  cfg.top_k = 3;
  cfg.score = c.score;
  cfg.norm_topk_prob = c.norm;
  cfg.routed_scaling_factor = c.scaling;
  cfg.capacity_factor = c.capacity_factor;
  cfg.num_groups = c.num_groups;
  cfg.group_top_k = c.group_top_k;
  cfg.aux_loss_coeff = c.aux;
  cfg.z_loss_coeff = c.z;
  cfg.shared_ffn_hidden = c.shared;
  cfg.shared_gate = c.shared_gate;
  const int64_t T = 7;
  const int H = cfg.hidden, I = cfg.ffn_hidden, E = cfg.num_experts;

  ref::Weights w;
  w.gate = to_double(normal_vector(E * H, 11, 0.8));
  w.selection_bias = to_double(normal_vector(E, 12, 0.05));
  w.w13 = to_double(normal_vector(E * 2 * I * H, 13, 0.5));
  w.w2 = to_double(normal_vector(E * H * I, 14, 0.5));
  if (c.shared) {
    w.shared_w13 = to_double(normal_vector(2 * c.shared * H, 17, 0.5));
    w.shared_w2 = to_double(normal_vector(H * c.shared, 18, 0.5));
    if (c.shared_gate) w.shared_gate = to_double(normal_vector(H, 19, 0.5));
  }
  std::vector<double> x = to_double(normal_vector(T * H, 15));
  const std::vector<double> go = to_double(normal_vector(T * H, 16));
  ref::ForwardOptions opts;
  if (c.global) {  // this batch is a third of one whose other tokens chose as here, plus a skew
    const ref::Forward own = ref::forward(cfg, w, x, T);
    for (int e = 0; e < E; ++e) opts.global_counts.push_back(3 * own.counts[e] + (e % 3));
    opts.global_tokens = 3 * T;
    opts.global_counts[0] += cfg.top_k * 3 - 3;  // sum_e c_e = K T_g
  }

  const ref::Forward f = ref::forward(cfg, w, x, T, opts);
  if (c.aux > 0) {
    ASSERT_GT(f.aux_loss, 0);
  }
  if (c.z > 0) {
    ASSERT_GT(f.z_loss, 0);
  }
  const ref::Grads g = ref::backward(cfg, w, x, f, go);
  if (c.capacity_factor > 0) {
    int dropped = 0;
    for (int32_t e : f.kept_idx) dropped += e < 0;
    ASSERT_GT(dropped, 0) << "capacity case must actually drop pairs";
  }

  const double h = 1e-6;
  auto check = [&](const char* what, std::vector<double>& param, const std::vector<double>& analytic) {
    std::vector<double> numeric(param.size());
    for (size_t i = 0; i < param.size(); ++i) {
      const double keep = param[i];
      param[i] = keep + h;
      const double lp = loss(cfg, w, x, T, go, opts);
      param[i] = keep - h;
      const double lm = loss(cfg, w, x, T, go, opts);
      param[i] = keep;
      numeric[i] = (lp - lm) / (2 * h);
    }
    EXPECT_TRUE(close(what, analytic, numeric, 1e-5, 1e-6)) << c.name;
  };
  check("grad_x", x, g.grad_x);
  check("grad_gate", w.gate, g.grad_gate);
  check("grad_w13", w.w13, g.grad_w13);
  check("grad_w2", w.w2, g.grad_w2);
  if (c.shared) {
    check("grad_shared_w13", w.shared_w13, g.grad_shared_w13);
    check("grad_shared_w2", w.shared_w2, g.grad_shared_w2);
  }
  if (c.shared_gate) check("grad_shared_gate", w.shared_gate, g.grad_shared_gate);
}

INSTANTIATE_TEST_SUITE_P(
    RouterCases, RefFiniteDifference,
    ::testing::Values(FdCase{"softmax_norm", ScoreFunc::kSoftmax, true, 1.0, 0, 0, 0},
                      FdCase{"softmax_nonorm", ScoreFunc::kSoftmax, false, 2.5, 0, 0, 0},
                      FdCase{"sigmoid_norm", ScoreFunc::kSigmoid, true, 2.5, 0, 0, 0},
                      FdCase{"sigmoid_nonorm", ScoreFunc::kSigmoid, false, 1.0, 0, 0, 0},
                      FdCase{"softmax_norm_capacity", ScoreFunc::kSoftmax, true, 1.0, 0.6, 0, 0},
                      FdCase{"sigmoid_grouped", ScoreFunc::kSigmoid, true, 1.5, 0, 4, 2},
                      FdCase{"softmax_aux_z", ScoreFunc::kSoftmax, true, 1.0, 0, 0, 0, 0.5, 0.3},
                      FdCase{"softmax_aux_global_capacity", ScoreFunc::kSoftmax, false, 1.0, 0.6, 0, 0, 0.7, 0, 0, false, true},
                      FdCase{"sigmoid_aux_z_global", ScoreFunc::kSigmoid, true, 2.5, 0, 0, 0, 0.5, 0.2, 0, false, true},
                      FdCase{"sigmoid_nonorm_z_shared", ScoreFunc::kSigmoid, false, 1.0, 0, 0, 0, 0, 0.4, 5},
                      FdCase{"softmax_shared_gate", ScoreFunc::kSoftmax, true, 1.0, 0, 0, 0, 0, 0, 3, true},
                      FdCase{"sigmoid_grouped_all", ScoreFunc::kSigmoid, true, 1.5, 0, 4, 2, 0.3, 0.1, 4, true, true}),
    [](const ::testing::TestParamInfo<FdCase>& info) { return std::string(info.param.name); });

TEST(RefCapacity, RoundsUpButNotOnRepresentationNoise) {
  EXPECT_EQ(ref::capacity(1.0, 4096, 8, 64), 512);
  EXPECT_EQ(ref::capacity(1.1, 100, 1, 10), 11);  // 11.000000000000002 in binary
  EXPECT_EQ(ref::capacity(1.25, 10, 1, 4), 4);    // 3.125 -> 4
  EXPECT_EQ(ref::capacity(0.01, 10, 1, 64), 1);
}

TEST(RefDispatchLayout, CountsATokenOncePerRank) {
  // 3 tokens, K = 3, 2 ranks x 2 slots.
  const std::vector<int32_t> slots = {0, 1, 2,   // ranks 0, 0, 1
                                      3, -1, 2,  // rank 1 twice
                                      -1, -1, -1};
  const std::vector<float> w = {0.5f, 0.3f, 0.2f, 0.6f, 0.0f, 0.4f, 0, 0, 0};
  const ref::DispatchLayout d = ref::dispatch_layout(slots, w, 3, 3, 2, 2);
  EXPECT_EQ(d.num_tokens_per_rank, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(d.num_tokens_per_slot, (std::vector<int32_t>{1, 1, 2, 1}));
  // Rank 0's segment: token 0; rank 1's: tokens 0 and 1.
  EXPECT_EQ(d.token_send_row, (std::vector<int32_t>{0, 1, -1, 2, -1, -1}));
  EXPECT_EQ(d.send_src_token, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(d.send_slot, (std::vector<int32_t>{0, 1, -1, -1, -1, 0, 1, -1, 0}));
  EXPECT_EQ(d.send_weight, (std::vector<float>{0.5f, 0.3f, 0, 0, 0, 0.2f, 0.6f, 0, 0.4f}));
}

}  // namespace
}  // namespace moe::test
