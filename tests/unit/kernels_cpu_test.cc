// Every CPU-backend op against the fp64 reference or a plain double loop.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>

#include "moe/kernels/api.h"
#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/kernels/thread_pool.h"
#include "cpu_ops.h"
#include "packed_weights.h"
#include "test_util.h"
#include "vec.h"

namespace moe::test {
namespace {

using namespace moe::kernels;

class CpuOps : public ::testing::Test {
 protected:
  // Three threads: an odd count shakes out block and tile arithmetic.
  ThreadPool pool{3};
  std::unique_ptr<Backend> be = make_cpu_backend(pool);
  std::vector<uint8_t> ws;
  void* workspace(size_t bytes) {
    ws.assign(bytes + 64, 0);
    return ws.data();
  }
};

TEST(ThreadPool, RunsEveryTaskOnceAndPropagatesErrors) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, [&](int64_t t, int thread) {
    ASSERT_GE(thread, 0);
    ASSERT_LT(thread, 4);
    hits[t].fetch_add(1);
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_THROW(pool.parallel_for(100, [](int64_t t, int) {
    if (t == 37) throw Error("task 37 failed");
  }), Error);
  // The pool still works after an error.
  std::atomic<int> n{0};
  pool.parallel_for(10, [&](int64_t, int) { n.fetch_add(1); });
  EXPECT_EQ(n.load(), 10);
}

TEST(Vec, ExpIsAccurate) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.01337f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(cpu::exp_scalar(x) - want) / want);
  }
  EXPECT_LT(worst, 4e-7);
  EXPECT_EQ(cpu::exp_scalar(-1000.0f), cpu::exp_scalar(-87.3365447504f));  // clamped, not NaN
  EXPECT_TRUE(std::isfinite(cpu::exp_scalar(1000.0f)));
}

TEST(Bf16, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1.0p-8f), 0x3f80);             // tie -> even
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1.8p-7f), 0x3f82);             // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1.0p-8f + 0x1.0p-20f), 0x3f81);  // above tie -> up
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // The vector conversion agrees with the scalar one.
  const std::vector<float> v = normal_vector(1003, 5, 100.0);
  std::vector<bf16_t> vec(v.size());
  cpu::store_row_f32(v.data(), vec.data(), DType::kBF16, static_cast<int64_t>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(vec[i], f32_to_bf16(v[i])) << i;
}

// FP8 wire rows (kernels/types.h, docs/layer.md#wire-formats) against ref::round_e4m3
// and ref::through_fp8_wire.
TEST(Fp8, EveryCodeRoundTripsAndRoundingMatchesTheReference) {
  for (int q = 0; q < 256; ++q) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(q));
    if ((q & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << q;
      continue;
    }
    EXPECT_EQ(f32_to_e4m3(v), q == 0x80 ? 0x80 : q) << q;  // -0 keeps its sign
    EXPECT_EQ(ref::round_e4m3(v), v) << q;
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(1.0f + 1.0f / 16)), 1.0f);      // tie -> even (down)
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(1.0f + 3.0f / 16)), 1.25f);     // tie -> even (up)
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(0x1.8p-9f)), 0x1p-8f);          // subnormal tie -> even
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(470.0f)), 448.0f);              // saturates
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(-1e30f)), -448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()))));
  const std::vector<float> v = normal_vector(20000, 9, 60.0);
  for (float x : v)
    for (float s : {1.0f, 0x1p-7f, 0x1p-12f}) ASSERT_EQ(e4m3_to_f32(f32_to_e4m3(x * s)), ref::round_e4m3(x * s)) << x * s;
}

TEST_F(CpuOps, Fp8WireRowsMatchTheReference) {
  const int H = 300;  // groups of 128, 128 and 44
  const int64_t n = 37;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<float> x = normal_vector(n * H, 11, 3.0);
    for (int i = 0; i < 128; ++i) x[5 * H + i] = 0;       // an all-zero group: scale 1
    x[7 * H + 3] = 5000.0f;                                 // one large value in a group
    x[9 * H + 200] = std::numeric_limits<float>::quiet_NaN();
    std::vector<uint8_t> rows(n * H * dtype_size(dtype));
    cpu::store_row_f32(x.data(), rows.data(), dtype, n * H);
    if (dtype == DType::kBF16)
      for (float& v : x) v = bf16_to_f32(f32_to_bf16(v));
    std::vector<uint8_t> wire(n * fp8_row_bytes(H));
    be->pack_rows(WireFormat::kFP8, rows.data(), dtype, n, H, wire.data());
    std::vector<float> back(n * H);
    be->unpack_rows(WireFormat::kFP8, wire.data(), n, H, back.data(), DType::kF32);
    const std::vector<double> want = ref::through_fp8_wire(x, n, H);
    for (int64_t i = 0; i < n * H; ++i) {
      if (std::isnan(x[i])) {
        EXPECT_TRUE(std::isnan(back[i])) << i;
        continue;
      }
      ASSERT_EQ(back[i], want[i]) << "element " << i;
      const int64_t g0 = i / H * H + i % H / 128 * 128, g1 = std::min<int64_t>(g0 + 128, (i / H + 1) * H);
      double amax = 0;
      for (int64_t j = g0; j < g1; ++j)
        if (!std::isnan(x[j])) amax = std::max(amax, std::fabs(static_cast<double>(x[j])));
      // The documented bound: 2^-4 of the value plus half a subnormal step
      // (2^-10 of the scale), and the scale's own fp32 rounding.
      ASSERT_LE(std::fabs(back[i] - x[i]), (0x1p-4 * std::fabs(x[i]) + 0x1p-10 * amax / 448) * (1 + 0x1p-20))
          << "element " << i;
    }
    EXPECT_EQ(back[5 * H + 1], 0.0f);
  }
}

// Every row of the wire-format table (kernels/wire_format.h): the backend's packed
// rows are row_bytes long and unpack to what the reference says the format keeps.
TEST_F(CpuOps, EveryWireFormatPacksAsTheReferenceSays) {
  const int H = 300;
  const int64_t n = 9;
  const std::vector<float> x = normal_vector(n * H, 12, 3.0);
  for (const WireFormatInfo& f : kWireFormats) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(wire_by_name(f.name), f.format);
    const size_t bytes = f.row_bytes(H);
    std::vector<uint8_t> wire(n * bytes + 16, 0xAB);  // a guard past the rows
    be->pack_rows(f.format, x.data(), DType::kF32, n, H, wire.data());
    for (size_t i = n * bytes; i < wire.size(); ++i) ASSERT_EQ(wire[i], 0xAB) << "written past the rows: " << i;
    std::vector<float> back(n * H);
    be->unpack_rows(f.format, wire.data(), n, H, back.data(), DType::kF32);
    const std::vector<double> want = ref::through_wire(f.format, x, n, H);
    for (int64_t i = 0; i < n * H; ++i) ASSERT_EQ(back[i], want[i]) << "element " << i;
  }
  EXPECT_FALSE(wire_by_name("int4"));
}

// ---------------------------------------------------------------------------
// Router

struct RouterCase {
  const char* name;
  ScoreFunc score;
  bool norm;
  float scaling;
  int num_groups;
  int group_top_k;
  bool selection_bias;
  bool logit_bias;
  DType dtype;
};

void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }

// A backend running `engine` for `dtype` (the table's choice for the other), or
// null with the reason in *skip when this CPU cannot run it.
std::unique_ptr<Backend> backend_with(ThreadPool& pool, DType dtype, GemmEngine engine, std::string* skip) {
  if (engine == GemmEngine::kOneDnn && !onednn_supports(dtype)) {
    *skip = std::string("oneDNN has no ") + dtype_name(dtype) + " matmul on this CPU (ISA " + cpu_backend_info().isa + ")";
    return nullptr;
  }
  CpuEngines e = cpu_backend_info().engines;
  (dtype == DType::kF32 ? e.fp32 : e.bf16) = engine;
  return make_cpu_backend(pool, e);
}

std::string engine_suffix(GemmEngine e) { return std::string("_") + gemm_engine_name(e); }

class RouterOp : public CpuOps, public ::testing::WithParamInterface<std::tuple<RouterCase, GemmEngine>> {};

TEST_P(RouterOp, ForwardAndBackwardMatchReference) {
  const RouterCase& c = std::get<0>(GetParam());
  std::string skip;
  std::unique_ptr<Backend> be = backend_with(pool, c.dtype, std::get<1>(GetParam()), &skip);
  if (!be) GTEST_SKIP() << skip;
  RouterConfig cfg;
  cfg.num_tokens = 300;
  cfg.hidden = 48;
  cfg.num_experts = 32;
  cfg.top_k = 6;
  cfg.score = c.score;
  cfg.num_groups = c.num_groups;
  cfg.group_top_k = c.group_top_k;
  cfg.norm_topk_prob = c.norm;
  cfg.routed_scaling_factor = c.scaling;
  cfg.x_dtype = c.dtype;
  const int64_t T = cfg.num_tokens;
  const int H = cfg.hidden, E = cfg.num_experts, K = cfg.top_k;

  std::vector<float> x = normal_vector(T * H, 1);
  if (c.dtype == DType::kBF16) model::round_to_bf16(x);
  const std::vector<bf16_t> x16 = float_to_bf16(x);
  const void* xp = c.dtype == DType::kF32 ? static_cast<const void*>(x.data()) : x16.data();
  model::LayerWeights w;
  w.gate = normal_vector(E * H, 2, 1.0 / std::sqrt(H));
  if (c.dtype == DType::kBF16) model::round_to_bf16(w.gate);  // a bf16 router's weight holds bf16 values
  if (c.selection_bias) w.selection_bias = normal_vector(E, 3, 0.05);
  if (c.logit_bias) w.logit_bias = normal_vector(E, 4, 1.0);

  std::vector<float> logits(T * E), scores(T * E), weight(T * K);
  std::vector<int32_t> idx(T * K);
  const std::unique_ptr<PackedWeights> packed = be->make_router_weights(cfg);
  be->pack_router_weights(*packed, w.gate.data());
  RouterForwardArgs a;
  a.x = xp;
  a.weight = w.gate.data();
  a.packed_weight = packed.get();
  a.selection_bias = c.selection_bias ? w.selection_bias.data() : nullptr;
  a.logit_bias = c.logit_bias ? w.logit_bias.data() : nullptr;
  a.logits = logits.data();
  a.scores = scores.data();
  a.topk_idx = idx.data();
  a.topk_weight = weight.data();
  a.workspace = workspace(be->router_workspace_bytes(cfg));
  be->router_forward(cfg, a);

  ref::Config rc;
  rc.hidden = H;
  rc.ffn_hidden = 1;
  rc.num_experts = E;
  rc.top_k = K;
  rc.score = c.score;
  rc.num_groups = c.num_groups;
  rc.group_top_k = c.group_top_k;
  rc.norm_topk_prob = c.norm;
  rc.routed_scaling_factor = c.scaling;
  ref::Weights rw;
  rw.gate = to_double(w.gate);
  rw.selection_bias = to_double(w.selection_bias);
  rw.logit_bias = to_double(w.logit_bias);
  rw.w13.assign(E * 2 * H, 0.0);
  rw.w2.assign(E * H, 0.0);
  const ref::Forward own = ref::forward(rc, rw, to_double(x), T);
  int near_ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (own.selection_margin[t] < 1e-5) {
      ++near_ties;
      continue;
    }
    for (int k = 0; k < K; ++k) ASSERT_EQ(idx[t * K + k], own.topk_idx[t * K + k]) << "token " << t << " k " << k;
  }
  EXPECT_LT(near_ties, T / 20);
  const ref::Forward f = ref::forward(rc, rw, to_double(x), T, ref::forced(idx.data()));
  EXPECT_TRUE(close("logits", to_double(logits), f.logits, 1e-5, 1e-6));
  EXPECT_TRUE(close("scores", to_double(scores), f.scores, 1e-5, 1e-6));
  EXPECT_TRUE(close("topk_weight", to_double(weight), f.topk_weight, 1e-5, 1e-6));

  // Backward from a given grad_topk_weight.
  const std::vector<float> gw = normal_vector(T * K, 7);
  std::vector<float> grad_logits(T * E), grad_w(E * H), grad_x(T * H, 0.0f);
  RouterBackwardArgs b;
  b.scores = scores.data();
  b.topk_idx = idx.data();
  b.topk_weight = weight.data();
  b.grad_topk_weight = gw.data();
  b.x = xp;
  b.weight = w.gate.data();
  b.grad_logits = grad_logits.data();
  b.grad_weight = grad_w.data();
  b.grad_x = grad_x.data();
  b.workspace = a.workspace;
  be->router_backward(cfg, b);

  // Reference: the generic chain rule of ref::backward, driven through zero expert
  // weights so that only the given routing-weight gradient reaches the logits.
  ref::Forward fg = f;
  ref::Grads want_grads;
  {
    // ref::backward derives grad_topk_weight from expert outputs; emulate the given
    // one with y_k(t) = e_0 * gw and grad_out = e_0.
    const int Hr = H;
    fg.expert_out.assign(T * K * Hr, 0.0);
    fg.gu.assign(T * K * 2, 0.0);
    for (int64_t p = 0; p < T * K; ++p) fg.expert_out[p * Hr] = gw[p];
    std::vector<double> go(T * Hr, 0.0);
    for (int64_t t = 0; t < T; ++t) go[t * Hr] = 1.0;
    want_grads = ref::backward(rc, rw, to_double(x), fg, go);
  }
  EXPECT_TRUE(close("grad_topk_weight(ref setup)", want_grads.grad_topk_weight, to_double(gw), 0, 0));
  EXPECT_TRUE(close("grad_logits", to_double(grad_logits), want_grads.grad_logits, 1e-4, 1e-5));
  EXPECT_TRUE(close("grad_gate", to_double(grad_w), want_grads.grad_gate, 1e-4, 1e-5));
  EXPECT_TRUE(close("grad_x", to_double(grad_x), want_grads.grad_x, 1e-4, 1e-5));
  if (!c.norm && c.score == ScoreFunc::kSoftmax) {
    // Unselected logits get gradient too in this case.
    int unselected_nonzero = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        bool sel = false;
        for (int k = 0; k < K; ++k) sel |= idx[t * K + k] == e;
        unselected_nonzero += !sel && grad_logits[t * E + e] != 0.0f;
      }
    EXPECT_GT(unselected_nonzero, T * (E - K) / 2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RouterOp,
    ::testing::Combine(::testing::Values(
        RouterCase{"softmax_norm", ScoreFunc::kSoftmax, true, 1.0f, 0, 0, false, false, DType::kF32},
        RouterCase{"softmax_nonorm", ScoreFunc::kSoftmax, false, 2.5f, 0, 0, false, true, DType::kF32},
        RouterCase{"sigmoid_norm_bias", ScoreFunc::kSigmoid, true, 2.5f, 0, 0, true, false, DType::kF32},
        RouterCase{"sigmoid_nonorm", ScoreFunc::kSigmoid, false, 1.0f, 0, 0, false, false, DType::kF32},
        RouterCase{"sigmoid_grouped", ScoreFunc::kSigmoid, true, 2.5f, 8, 3, true, false, DType::kF32},
        RouterCase{"softmax_grouped_bf16", ScoreFunc::kSoftmax, true, 1.0f, 4, 2, false, true, DType::kBF16}),
        ::testing::Values(GemmEngine::kOpenBlas, GemmEngine::kOneDnn)),
    [](const ::testing::TestParamInfo<std::tuple<RouterCase, GemmEngine>>& info) {
      return std::string(std::get<0>(info.param).name) + engine_suffix(std::get<1>(info.param));
    });

TEST_F(CpuOps, RouterTiesGoToTheLowerIndex) {
  RouterConfig cfg;
  cfg.num_tokens = 3;
  cfg.hidden = 8;
  cfg.num_experts = 8;
  cfg.top_k = 3;
  const std::vector<float> x = normal_vector(3 * 8, 1);
  const std::vector<float> zero_gate(8 * 8, 0.0f);  // every score equal
  // Biased scores tie in pairs: experts {1, 6} best, then {3, 4}.
  const std::vector<float> bias = {0.0f, 0.2f, 0.0f, 0.1f, 0.1f, 0.0f, 0.2f, 0.0f};
  std::vector<float> logits(24), scores(24), weight(9);
  std::vector<int32_t> idx(9);
  const std::unique_ptr<PackedWeights> packed = be->make_router_weights(cfg);
  be->pack_router_weights(*packed, zero_gate.data());
  RouterForwardArgs a{x.data(), zero_gate.data(), packed.get(), nullptr, nullptr, logits.data(), scores.data(),
                      idx.data(), weight.data(), workspace(be->router_workspace_bytes(cfg))};
  be->router_forward(cfg, a);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(std::vector<int32_t>(idx.begin() + 3 * t, idx.begin() + 3 * t + 3),
                                        (std::vector<int32_t>{0, 1, 2}));
  a.selection_bias = bias.data();
  be->router_forward(cfg, a);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(std::vector<int32_t>(idx.begin() + 3 * t, idx.begin() + 3 * t + 3),
                                        (std::vector<int32_t>{1, 6, 3}));
  for (float w : weight) EXPECT_FLOAT_EQ(w, 1.0f / 3);  // unbiased, normalised
  // Group ties: 4 groups of 2; groups 0 and 2 tie (same two biased scores), group 3
  // is just below, group 1 lowest.
  cfg.num_groups = 4;
  cfg.group_top_k = 2;
  cfg.top_k = 2;
  const std::vector<float> gbias = {0.1f, 0.0f, 0.0f, 0.0f, 0.0f, 0.1f, 0.04f, 0.04f};
  a.selection_bias = gbias.data();
  be->router_forward(cfg, a);
  // Group scores: g0 = g2 = 0.35 > g3 = 0.33 > g1 -> groups 0 and 2; experts 0 and 5 tie -> 0 first.
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 5);
}

TEST_F(CpuOps, RouterRejectsBadConfigsNamingTheField) {
  RouterConfig cfg;
  cfg.num_tokens = 1;
  cfg.hidden = 4;
  cfg.num_experts = 6;
  cfg.top_k = 7;
  try {
    cfg.validate();
    FAIL() << "top_k > experts accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_k"), std::string::npos) << e.what();
  }
  cfg.top_k = 2;
  cfg.num_groups = 4;  // 6 % 4 != 0
  cfg.group_top_k = 1;
  EXPECT_THROW(cfg.validate(), Error);
}

// ---------------------------------------------------------------------------
// Capacity

TEST_F(CpuOps, CapacityMatchesReferenceForBothPolicies) {
  const int64_t T = 500;
  const int E = 16, K = 4;
  // Skewed selection so some experts overflow.
  std::vector<int32_t> idx(T * K);
  std::vector<float> w = normal_vector(T * K, 9);
  for (auto& v : w) v = std::fabs(v);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) idx[t * K + k] = static_cast<int32_t>((t % 3 == 0 ? k : (t * 7 + k * 5)) % E);
  for (DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition})
    for (double cf : {0.0, 0.5, 1.0, 1.3}) {
      CapacityConfig cfg{T, E, K, cf, policy};
      std::vector<int32_t> kept(T * K);
      be->capacity_drop(cfg, {idx.data(), w.data(), kept.data(), workspace(be->capacity_workspace_bytes(cfg))});
      // Reference drop by the same rule.
      std::vector<int32_t> want = idx;
      if (cf > 0) {
        const int64_t cap = ref::capacity(cf, T, K, E);
        for (int e = 0; e < E; ++e) {
          std::vector<int64_t> pairs;
          for (int64_t p = 0; p < T * K; ++p)
            if (idx[p] == e) pairs.push_back(p);
          if (policy == DropPolicy::kProbs)
            std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return w[a] > w[b]; });
          for (size_t i = cap; i < pairs.size(); ++i) want[pairs[i]] = -1;
        }
      }
      EXPECT_EQ(kept, want) << drop_policy_name(policy) << " cf " << cf;
      const int64_t dropped = std::count(kept.begin(), kept.end(), -1);
      if (cf > 0 && cf < 1.1) {
        EXPECT_GT(dropped, 0) << "cf " << cf;
      }
      if (cf == 0) {
        EXPECT_EQ(dropped, 0);
      }
    }
}

TEST_F(CpuOps, CapacityWithNaNWeightsDropsThemFirstAndStaysInBounds) {
  // NaN routing weights (a diverging model) must not break the drop order's sort.
  const int64_t T = 400;
  const int E = 2, K = 1;
  std::vector<int32_t> idx(T, 0);
  std::vector<float> w(T);
  for (int64_t t = 0; t < T; ++t) w[t] = t % 3 == 0 ? std::numeric_limits<float>::quiet_NaN() : 0.001f * t;
  CapacityConfig cfg{T, E, K, 1.0, DropPolicy::kProbs};  // capacity 200 of 400 pairs on expert 0
  std::vector<int32_t> kept(T);
  be->capacity_drop(cfg, {idx.data(), w.data(), kept.data(), workspace(be->capacity_workspace_bytes(cfg))});
  int64_t kept_pairs = 0;
  for (int64_t t = 0; t < T; ++t) {
    kept_pairs += kept[t] >= 0;
    if (t % 3 == 0) {
      EXPECT_EQ(kept[t], -1) << "a NaN-weight pair outranked a real one at token " << t;
    }
  }
  EXPECT_EQ(kept_pairs, 200);
}

TEST_F(CpuOps, UnpermuteHandlesManyPairsPerRow) {
  // An EP combine has top_k = ranks; more than 64 must work.
  const int64_t N = 3;
  const int K = 100, H = 24;
  std::vector<int32_t> pos(N * K);
  for (int64_t p = 0; p < N * K; ++p) pos[p] = p % 7 == 0 ? -1 : static_cast<int32_t>((p * 13) % (N * K));
  const std::vector<float> perm = normal_vector(N * K * H, 3), w = normal_vector(N * K, 4);
  std::vector<float> out(N * H);
  be->unpermute({N, K, H, DType::kF32, false, DType::kF32}, {perm.data(), pos.data(), w.data(), out.data()});
  std::vector<double> want(N * H, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k)
      if (pos[n * K + k] >= 0)
        for (int h = 0; h < H; ++h) want[n * H + h] += static_cast<double>(w[n * K + k]) * perm[pos[n * K + k] * H + h];
  EXPECT_TRUE(close("unpermute with 100 pairs per row", to_double(out), want, 1e-4, 1e-5));
}

// ---------------------------------------------------------------------------
// Layouts and permutes

TEST_F(CpuOps, DispatchLayoutMatchesReference) {
  for (int64_t T : {0, 1, 17, 3000}) {
    const int K = 4, R = 5, S = 3;
    std::vector<int32_t> slots(T * K);
    const std::vector<float> w = normal_vector(T * K, 8);
    for (int64_t p = 0; p < T * K; ++p) {
      const uint64_t h = model::key_hash({7, static_cast<uint64_t>(p)});
      slots[p] = h % 7 == 0 ? -1 : static_cast<int32_t>(h % (R * S));
    }
    DispatchLayoutConfig cfg{T, K, R, S};
    std::vector<int32_t> per_rank(R), per_slot(R * S), send_row(T * R), src(T * R), send_slot(T * R * K);
    std::vector<float> send_w(T * R * K);
    std::vector<int64_t> offset(R + 1);
    std::vector<uint8_t> in_rank(T * R);
    DispatchLayoutArgs a;
    a.topk_slot = slots.data();
    a.topk_weight = w.data();
    a.num_tokens_per_rank = per_rank.data();
    a.num_tokens_per_slot = per_slot.data();
    a.rank_offset = offset.data();
    a.is_token_in_rank = in_rank.data();
    a.token_send_row = send_row.data();
    a.send_src_token = src.data();
    a.send_slot = send_slot.data();
    a.send_weight = send_w.data();
    a.workspace = workspace(be->dispatch_layout_workspace_bytes(cfg));
    be->dispatch_layout(cfg, a);
    const ref::DispatchLayout want = ref::dispatch_layout(slots, w, T, K, R, S);
    EXPECT_EQ(per_rank, want.num_tokens_per_rank) << "T=" << T;
    EXPECT_EQ(per_slot, want.num_tokens_per_slot);
    EXPECT_EQ(in_rank, want.is_token_in_rank);
    EXPECT_EQ(send_row, want.token_send_row);
    const int64_t rows = offset[R];
    EXPECT_EQ(std::vector<int32_t>(src.begin(), src.begin() + rows), want.send_src_token);
    EXPECT_EQ(std::vector<int32_t>(send_slot.begin(), send_slot.begin() + rows * K), want.send_slot);
    EXPECT_EQ(std::vector<float>(send_w.begin(), send_w.begin() + rows * K), want.send_weight);
    for (int r = 0; r < R; ++r) EXPECT_EQ(offset[r + 1] - offset[r], per_rank[r]);
  }
}

TEST_F(CpuOps, DispatchLayoutRejectsOutOfRangeSlots) {
  DispatchLayoutConfig cfg{1, 2, 2, 2};
  const std::vector<int32_t> slots = {0, 4};
  std::vector<int32_t> per_rank(2), per_slot(4), pos(2);
  std::vector<int64_t> offset(3);
  std::vector<uint8_t> in_rank(2);
  DispatchLayoutArgs a;
  a.topk_slot = slots.data();
  a.num_tokens_per_rank = per_rank.data();
  a.num_tokens_per_slot = per_slot.data();
  a.rank_offset = offset.data();
  a.is_token_in_rank = in_rank.data();
  a.token_send_row = pos.data();
  a.workspace = workspace(be->dispatch_layout_workspace_bytes(cfg));
  EXPECT_THROW(be->dispatch_layout(cfg, a), Error);
}

TEST_F(CpuOps, PermuteLayoutIsStableExpertMajorAndInvertible) {
  const int64_t N = 2000;
  const int K = 3, L = 7;
  std::vector<int32_t> row_expert(N * K);
  std::vector<float> row_w = normal_vector(N * K, 3);
  for (int64_t n = 0; n < N; ++n) {
    std::set<int> used;
    for (int k = 0; k < K; ++k) {
      int e = static_cast<int>(model::key_hash({9, static_cast<uint64_t>(n * K + k)}) % (L + 1)) - 1;
      if (e == 6) e = -1;  // expert 6 receives nothing
      if (e >= 0 && !used.insert(e).second) e = -1;
      row_expert[n * K + k] = e;
    }
  }
  PermuteLayoutConfig cfg{N, K, L};
  std::vector<int64_t> offset(L + 1);
  std::vector<int32_t> src(N * K), pos(N * K);
  std::vector<float> perm_w(N * K);
  be->permute_layout(cfg, {row_expert.data(), row_w.data(), offset.data(), src.data(), perm_w.data(), pos.data(),
                           workspace(be->permute_layout_workspace_bytes(cfg))});
  EXPECT_EQ(offset[0], 0);
  EXPECT_EQ(offset[6], offset[7]) << "expert 6 must be empty";
  int64_t pairs = 0;
  for (int32_t e : row_expert) pairs += e >= 0;
  EXPECT_EQ(offset[L], pairs);
  for (int e = 0; e < L; ++e)
    for (int64_t m = offset[e]; m < offset[e + 1]; ++m) {
      if (m > offset[e]) {
        EXPECT_LT(src[m - 1], src[m]) << "stable row order inside expert " << e;
      }
    }
  for (int64_t n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const int32_t e = row_expert[n * K + k], m = pos[n * K + k];
      if (e < 0) {
        EXPECT_EQ(m, -1);
        continue;
      }
      ASSERT_GE(m, offset[e]);
      ASSERT_LT(m, offset[e + 1]);
      EXPECT_EQ(src[m], n);
      EXPECT_EQ(perm_w[m], row_w[n * K + k]);
    }

  // With a row order (here: rows reversed), each expert's pairs follow it instead.
  std::vector<int32_t> order(N);
  for (int64_t i = 0; i < N; ++i) order[i] = static_cast<int32_t>(N - 1 - i);
  std::vector<int64_t> offset_r(L + 1);
  std::vector<int32_t> src_r(N * K), pos_r(N * K);
  PermuteLayoutArgs ordered{row_expert.data(), row_w.data(), offset_r.data(), src_r.data(), perm_w.data(),
                            pos_r.data(), workspace(be->permute_layout_workspace_bytes(cfg))};
  ordered.row_order = order.data();
  be->permute_layout(cfg, ordered);
  EXPECT_EQ(offset_r, offset);
  for (int e = 0; e < L; ++e)
    for (int64_t m = offset[e]; m < offset[e + 1]; ++m) ASSERT_EQ(src_r[m], src[offset[e + 1] - 1 - (m - offset[e])]);
  for (int64_t i = 0; i < N * K; ++i)
    if (pos[i] >= 0) ASSERT_EQ(src_r[pos_r[i]], i / K);
  order[5] = static_cast<int32_t>(N);  // out of range: refused
  EXPECT_THROW(be->permute_layout(cfg, ordered), Error);
  be->permute_layout(cfg, {row_expert.data(), row_w.data(), offset.data(), src.data(), perm_w.data(), pos.data(),
                           workspace(be->permute_layout_workspace_bytes(cfg))});

  // permute then weighted unpermute equals the direct weighted sum; both dtypes.
  const int H = 40;
  const std::vector<float> rows = normal_vector(N * H, 4);
  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    std::vector<float> perm(offset[L] * H);
    be->permute({N, K, offset[L], H, DType::kF32, DType::kF32}, {rows.data(), src.data(), pos.data(), perm.data()});
    std::vector<uint8_t> out(N * H * dtype_size(out_dtype));
    be->unpermute({N, K, H, out_dtype, false, DType::kF32}, {perm.data(), pos.data(), row_w.data(), out.data()});
    std::vector<double> got(N * H), want(N * H, 0.0);
    for (int64_t i = 0; i < N * H; ++i)
      got[i] = out_dtype == DType::kF32 ? reinterpret_cast<float*>(out.data())[i]
                                        : bf16_to_f32(reinterpret_cast<bf16_t*>(out.data())[i]);
    for (int64_t n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        if (row_expert[n * K + k] >= 0)
          for (int h = 0; h < H; ++h) want[n * H + h] += static_cast<double>(row_w[n * K + k]) * rows[n * H + h];
    // bf16 output: one rounding of the fp32 sum, at most 2^-9 relative.
    EXPECT_TRUE(close(std::string("unpermute ") + dtype_name(out_dtype), got, want,
                      out_dtype == DType::kF32 ? 1e-5 : 0x1.0p-8, 1e-6));
  }
  // bf16 -> fp32 permute converts exactly.
  const std::vector<bf16_t> rows16 = float_to_bf16(rows);
  std::vector<float> perm32(offset[L] * H);
  be->permute({N, K, offset[L], H, DType::kBF16, DType::kF32}, {rows16.data(), src.data(), pos.data(), perm32.data()});
  for (int64_t m = 0; m < offset[L]; ++m)
    for (int h = 0; h < H; ++h) ASSERT_EQ(perm32[m * H + h], bf16_to_f32(rows16[src[m] * H + h]));
}

TEST_F(CpuOps, UnpermuteStreamsLargeOutputsWithTheSameBits) {
  // 64 MiB of output and more bypasses the cache (non-temporal stores): same sums.
  const int64_t N = 16384 + 3;
  const int K = 2, H = 1024;
  std::vector<int32_t> pos(N * K);
  for (int64_t p = 0; p < N * K; ++p) pos[p] = static_cast<int32_t>((p * 7919) % (N * K));
  std::vector<float> perm = normal_vector(N * K * H, 11), w = normal_vector(N * K, 12);
  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    const int64_t rows = out_dtype == DType::kF32 ? N : 2 * N;  // bf16 needs twice the rows for 64 MiB
    std::vector<int32_t> p2(rows * K);
    for (int64_t i = 0; i < rows * K; ++i) p2[i] = pos[i % (N * K)];
    std::vector<uint8_t> big(rows * H * dtype_size(out_dtype) + 64);
    void* out = big.data() + (32 - reinterpret_cast<uintptr_t>(big.data()) % 32) % 32;
    std::vector<float> wf(rows * K);
    for (int64_t i = 0; i < rows * K; ++i) wf[i] = w[i % (N * K)];
    be->unpermute({rows, K, H, out_dtype, false, DType::kF32}, {perm.data(), p2.data(), wf.data(), out});
    for (int64_t n : {int64_t{0}, int64_t{1}, N / 2, rows - 1}) {
      std::vector<float> small(H);
      be->unpermute({1, K, H, DType::kF32, false, DType::kF32}, {perm.data(), p2.data() + n * K, wf.data() + n * K, small.data()});
      for (int h = 0; h < H; ++h) {
        const float got = out_dtype == DType::kF32 ? static_cast<float*>(out)[n * H + h]
                                                   : bf16_to_f32(static_cast<bf16_t*>(out)[n * H + h]);
        const float want = out_dtype == DType::kF32 ? small[h] : round_to_bf16(small[h]);
        ASSERT_EQ(got, want) << dtype_name(out_dtype) << " row " << n << " col " << h;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// SwiGLU and grouped GEMM

TEST_F(CpuOps, SwigluForwardBackwardMatchDoubleFormulas) {
  const int64_t M = 37;
  const int I = 29;  // not a multiple of 8: exercises the scalar tail
  const std::vector<float> gu = normal_vector(M * 2 * I, 1, 3.0);
  const std::vector<float> scale = normal_vector(M, 2);
  const std::vector<float> dh = normal_vector(M * I, 3);
  std::vector<float> h(M * I), dgu(M * 2 * I), dscale(M), h2(M * I);
  be->swiglu_forward({M, I}, {gu.data(), scale.data(), h.data()});
  be->swiglu_backward({M, I}, {gu.data(), dh.data(), scale.data(), dgu.data(), dscale.data(), h2.data()});
  std::vector<double> wh(M * I), wdgu(M * 2 * I), wds(M, 0.0);
  for (int64_t r = 0; r < M; ++r)
    for (int i = 0; i < I; ++i) {
      const double g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
      const double s = 1 / (1 + std::exp(-g)), silu = g * s;
      wh[r * I + i] = scale[r] * silu * u;
      wds[r] += dh[r * I + i] * silu * u;
      wdgu[r * 2 * I + i] = scale[r] * dh[r * I + i] * u * s * (1 + g * (1 - s));
      wdgu[r * 2 * I + I + i] = scale[r] * dh[r * I + i] * silu;
    }
  EXPECT_TRUE(close("h", to_double(h), wh, 1e-5, 1e-6));
  EXPECT_TRUE(close("h recomputed", to_double(h2), wh, 1e-5, 1e-6));
  EXPECT_TRUE(close("grad_gu", to_double(dgu), wdgu, 1e-5, 1e-6));
  EXPECT_TRUE(close("grad_scale", to_double(dscale), wds, 1e-5, 1e-6));
}

TEST_F(CpuOps, OptimizerStepsMatchTheirFormulas) {
  const int64_t n = 3001;
  const std::vector<float> w0 = normal_vector(n, 1), g1 = normal_vector(n, 2, 0.01), g2 = normal_vector(n, 3, 0.01);
  // Adam, two steps, against the bias-corrected formula in double.
  std::vector<float> w = w0, m(n, 0.0f), v(n, 0.0f), rounded(n);
  OptimizerConfig cfg;
  cfg.lr = 0.05f;
  be->optimizer_step(cfg, {n, 1, w.data(), g1.data(), m.data(), v.data(), nullptr});
  be->optimizer_step(cfg, {n, 2, w.data(), g2.data(), m.data(), v.data(), rounded.data()});
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) {
    double wi = w0[i], mi = 0, vi = 0;
    int t = 0;
    for (double g : {static_cast<double>(g1[i]), static_cast<double>(g2[i])}) {
      ++t;
      mi = 0.9 * mi + 0.1 * g;
      vi = 0.999 * vi + 0.001 * g * g;
      wi -= 0.05 * (mi / (1 - std::pow(0.9, t))) / (std::sqrt(vi / (1 - std::pow(0.999, t))) + 1e-8);
    }
    want[i] = wi;
    ASSERT_EQ(rounded[i], round_to_bf16(w[i]));
  }
  EXPECT_TRUE(close("adam", to_double(w), want, 1e-5, 1e-6));
  // The update moved the weights (Adam's first step is about lr in size).
  double moved = 0;
  for (int64_t i = 0; i < n; ++i) moved = std::max(moved, std::fabs(static_cast<double>(w[i]) - w0[i]));
  EXPECT_GT(moved, 0.05);
  // The same bits on one thread (elements fall in other blocks, vector body or
  // scalar tail), and NaN stays NaN in the rounded copy.
  {
    ThreadPool one(1);
    auto be1 = make_cpu_backend(one);
    std::vector<float> w1 = w0, m1(n, 0.0f), v1(n, 0.0f), r1(n);
    std::vector<float> g2n = g2;
    be1->optimizer_step(cfg, {n, 1, w1.data(), g1.data(), m1.data(), v1.data(), nullptr});
    be1->optimizer_step(cfg, {n, 2, w1.data(), g2n.data(), m1.data(), v1.data(), r1.data()});
    EXPECT_EQ(w1, w);
    EXPECT_EQ(m1, m);
    EXPECT_EQ(v1, v);
    std::vector<float> wn = w0, mn(n, 0.0f), vn(n, 0.0f), rn(n);
    std::vector<float> gn = g1;
    gn[5] = gn[n - 1] = std::numeric_limits<float>::quiet_NaN();  // one in a vector, one in a tail
    be->optimizer_step(cfg, {n, 1, wn.data(), gn.data(), mn.data(), vn.data(), rn.data()});
    EXPECT_TRUE(std::isnan(rn[5]) && std::isnan(rn[n - 1]));
    EXPECT_FALSE(std::isnan(rn[6]));
  }
  // SGD: w -= lr g exactly, rounded once (a fused multiply-add).
  std::vector<float> ws = w0;
  cfg.kind = OptimizerKind::kSgd;
  be->optimizer_step(cfg, {n, 1, ws.data(), g1.data(), nullptr, nullptr, nullptr});
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ws[i], std::fma(-0.05f, g1[i], w0[i]));
  cfg.lr = -1;
  EXPECT_THROW(be->optimizer_step(cfg, {n, 1, ws.data(), g1.data(), nullptr, nullptr, nullptr}), Error);
}

// bf16 moments (their fp64 bounds: tests/gpu/gpu_checks.cc, optimizer/adam_bf16_moments):
// the weights move by the unrounded moments, so the first step's weights are
// those of fp32 moments bit for bit; the stored moments are those moments
// rounded to nearest even; and the bits do not depend on the thread split.
TEST_F(CpuOps, AdamWithBf16MomentsRoundsOnlyWhatItStores) {
  const int64_t n = 3001;
  const std::vector<float> w0 = normal_vector(n, 1), g1 = normal_vector(n, 2, 0.01), g2 = normal_vector(n, 3, 0.01);
  OptimizerConfig f32;
  f32.lr = 0.05f;
  OptimizerConfig b16 = f32;
  b16.moments = DType::kBF16;
  std::vector<float> wf = w0, mf(n, 0.0f), vf(n, 0.0f), wb = w0;
  std::vector<bf16_t> mb(n, 0), vb(n, 0);
  be->optimizer_step(f32, {n, 1, wf.data(), g1.data(), mf.data(), vf.data(), nullptr});
  be->optimizer_step(b16, {n, 1, wb.data(), g1.data(), mb.data(), vb.data(), nullptr});
  EXPECT_EQ(wb, wf);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(mb[i], f32_to_bf16(mf[i])) << i;
    ASSERT_EQ(vb[i], f32_to_bf16(vf[i])) << i;
  }
  // Step 2 from the rounded moments: on one thread (other blocks, vector body or
  // scalar tail) the same bits; a NaN gradient leaves NaN moments in the vector
  // body and in the tail alike.
  ThreadPool one(1);
  auto be1 = make_cpu_backend(one);
  std::vector<float> w1 = wb;
  std::vector<bf16_t> m1 = mb, v1 = vb;
  be->optimizer_step(b16, {n, 2, wb.data(), g2.data(), mb.data(), vb.data(), nullptr});
  be1->optimizer_step(b16, {n, 2, w1.data(), g2.data(), m1.data(), v1.data(), nullptr});
  EXPECT_EQ(w1, wb);
  EXPECT_EQ(m1, mb);
  EXPECT_EQ(v1, vb);
  std::vector<float> gn = g1;
  gn[5] = gn[n - 1] = std::numeric_limits<float>::quiet_NaN();
  be->optimizer_step(b16, {n, 3, wb.data(), gn.data(), mb.data(), vb.data(), nullptr});
  for (int64_t i : {int64_t{5}, n - 1}) EXPECT_TRUE(std::isnan(bf16_to_f32(mb[i])) && std::isnan(wb[i])) << i;
  EXPECT_FALSE(std::isnan(bf16_to_f32(mb[6])));
  b16.moments = static_cast<DType>(7);
  EXPECT_THROW(be->optimizer_step(b16, {n, 1, wb.data(), g1.data(), mb.data(), vb.data(), nullptr}), Error);
}

// The fused update (a block of rows stepped, then packed while in cache) against
// the optimizer step on each weight and the full repack: the same masters,
// moments and packed bytes, on both engines and dtypes, with rows (w13: 200 = 6
// blocks of 32 and 8) and columns (40) that leave tails in every pack.
class UpdateExpertWeights : public ::testing::TestWithParam<std::tuple<GemmEngine, DType>> {};

TEST_P(UpdateExpertWeights, GivesTheBitsOfTheStepAndTheRepack) {
  const auto [engine, dtype] = GetParam();
  if (engine == GemmEngine::kOneDnn && !onednn_supports(dtype)) GTEST_SKIP() << "oneDNN has no such matmul here";
  ThreadPool pool(2);
  CpuEngines engines = cpu_backend_info().engines;
  (dtype == DType::kF32 ? engines.fp32 : engines.bf16) = engine;
  auto be = make_cpu_backend(pool, engines);
  const int L = 3, H = 40, I = 100;
  const ExpertMlpConfig cfg{.num_experts = L, .hidden = H, .ffn_hidden = I, .x_dtype = dtype, .train = true};
  const int64_t n13 = int64_t{L} * 2 * I * H, n2 = int64_t{L} * H * I;
  auto bytes_of = [](const cpu::PanelTensor& t, int experts) {
    return std::vector<uint8_t>(t.data.get(), t.data.get() + t.stride * experts);
  };
  auto packed_bytes = [&](const PackedWeights& pw) {
    const auto& p = dynamic_cast<const cpu::CpuExpertWeights&>(pw);
    return std::vector<std::vector<uint8_t>>{bytes_of(p.w13_fwd, L), bytes_of(p.w2_fwd, L)};
  };
  struct Case {
    OptimizerKind kind;
    DType moments;
  };
  for (const Case c : {Case{OptimizerKind::kAdam, DType::kF32}, Case{OptimizerKind::kAdam, DType::kBF16},
                       Case{OptimizerKind::kSgd, DType::kF32}}) {
    SCOPED_TRACE(std::string(c.kind == OptimizerKind::kSgd ? "sgd" : "adam") + " moments " + dtype_name(c.moments));
    OptimizerConfig opt;
    opt.kind = c.kind;
    opt.moments = c.moments;
    opt.lr = 0.01f;
    struct Layer {
      std::vector<float> w13, w2;
      std::vector<uint8_t> m13, v13, m2, v2;
      std::unique_ptr<PackedWeights> packed;
    };
    const size_t ms = dtype_size(c.moments);
    auto make = [&] {
      return Layer{normal_vector(n13, 1), normal_vector(n2, 2), std::vector<uint8_t>(ms * n13),
                   std::vector<uint8_t>(ms * n13), std::vector<uint8_t>(ms * n2), std::vector<uint8_t>(ms * n2),
                   be->make_expert_weights(cfg)};
    };
    Layer fused = make(), apart = make();
    int64_t step = 0;
    for (uint64_t seed : {3, 4}) {
      ++step;
      const std::vector<float> g13 = normal_vector(n13, seed, 0.01), g2 = normal_vector(n2, seed + 10, 0.01);
      auto args = [&](Layer& l, bool w13) {
        return w13 ? OptimizerArgs{n13, step, l.w13.data(), g13.data(), l.m13.data(), l.v13.data(), nullptr}
                   : OptimizerArgs{n2, step, l.w2.data(), g2.data(), l.m2.data(), l.v2.data(), nullptr};
      };
      be->update_expert_weights(opt, args(fused, true), args(fused, false), *fused.packed, L);
      be->optimizer_step(opt, args(apart, true));
      be->optimizer_step(opt, args(apart, false));
      be->pack_expert_weights(*apart.packed, apart.w13.data(), apart.w2.data(), 0, L);
      ASSERT_EQ(fused.w13, apart.w13) << "step " << step;
      ASSERT_EQ(fused.w2, apart.w2) << "step " << step;
      ASSERT_EQ(fused.m13, apart.m13);
      ASSERT_EQ(fused.v2, apart.v2);
      const auto got = packed_bytes(*fused.packed), want = packed_bytes(*apart.packed);
      for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << "packed tensor " << i << ", step " << step;
      if (engine == GemmEngine::kOneDnn) EXPECT_FALSE(want[0].empty()) << "no forward pack to compare";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, UpdateExpertWeights,
                         ::testing::Combine(::testing::Values(GemmEngine::kOpenBlas, GemmEngine::kOneDnn),
                                            ::testing::Values(DType::kF32, DType::kBF16)),
                         [](const auto& info) {
                           return std::string(gemm_engine_name(std::get<0>(info.param))) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

TEST_F(CpuOps, GroupedGemmAllKindsWithEmptyGroups) {
  // Groups of 0, 5, 0, 1300 (split over several tiles), 64 rows.
  const std::vector<int64_t> off = {0, 0, 5, 5, 1305, 1369};
  const int G = 5;
  const int64_t M = off[G], n = 24, k = 40;
  const std::vector<float> w = normal_vector(G * n * k, 1);
  for (GemmKind kind : {GemmKind::kForward, GemmKind::kDgrad, GemmKind::kWgrad})
    for (bool acc : {false, true}) {
      const int64_t a_cols = kind == GemmKind::kForward ? k : n;
      const std::vector<float> a = normal_vector(M * a_cols, 2);
      const std::vector<float> d = normal_vector(M * k, 3);  // wgrad's second operand
      const size_t c_size = kind == GemmKind::kWgrad ? G * n * k : M * (kind == GemmKind::kForward ? n : k);
      std::vector<float> c = normal_vector(c_size, 4);
      const std::vector<float> c0 = c;
      be->grouped_gemm({kind, G, n, k, acc}, {off.data(), a.data(), kind == GemmKind::kWgrad ? d.data() : w.data(),
                                              c.data()});
      std::vector<double> want(c_size, 0.0);
      for (int g = 0; g < G; ++g)
        for (int64_t m = off[g]; m < off[g + 1]; ++m) {
          if (kind == GemmKind::kForward)
            for (int64_t j = 0; j < n; ++j)
              for (int64_t i = 0; i < k; ++i) want[m * n + j] += static_cast<double>(a[m * k + i]) * w[(g * n + j) * k + i];
          else if (kind == GemmKind::kDgrad)
            for (int64_t i = 0; i < k; ++i)
              for (int64_t j = 0; j < n; ++j) want[m * k + i] += static_cast<double>(a[m * n + j]) * w[(g * n + j) * k + i];
          else
            for (int64_t j = 0; j < n; ++j)
              for (int64_t i = 0; i < k; ++i) want[(g * n + j) * k + i] += static_cast<double>(a[m * n + j]) * d[m * k + i];
        }
      if (acc)
        for (size_t i = 0; i < c_size; ++i) want[i] += c0[i];
      EXPECT_TRUE(close("grouped gemm", to_double(c), want, 1e-5, 1e-6))
          << "kind " << static_cast<int>(kind) << " accumulate " << acc;
    }
}

// The fused expert MLP of each (dtype, engine) against a plain double
// composition. The forward and the dgrad compute in fp32 on every engine (bf16
// weights and rows are exact in fp32): accumulation-order noise only. oneDNN's
// bf16 weight gradients read h and dgu rounded to bf16 (expert_mlp_wgrad.cc): a
// gradient moves by at most 2^-8 (bf16 roundoff) of its sum of |terms|; 2^-7 of
// that sum leaves as much again for the fp32 accumulation behind them.
class ExpertMlpOp : public CpuOps, public ::testing::WithParamInterface<std::tuple<DType, GemmEngine>> {};

TEST_P(ExpertMlpOp, ForwardBackwardMatchComposition) {
  const auto [dtype, engine] = GetParam();
  std::string skip;
  std::unique_ptr<Backend> be = backend_with(pool, dtype, engine, &skip);
  if (!be) GTEST_SKIP() << skip;
  ASSERT_EQ(be->gemm_engine(dtype), gemm_engine_name(engine));
  const bool bf16 = dtype == DType::kBF16;
  auto as_used = [&](std::vector<float> v) {
    if (bf16) model::round_to_bf16(v);
    return v;
  };
  // Expert 1 gets 1100 rows (three tiles), expert 0 gets 3, expert 2 none.
  const int L = 3, H = 20, I = 12;
  const int64_t N = 700, M = 1103;
  const std::vector<int64_t> off = {0, 3, 1103, 1103};
  std::vector<int32_t> src(M);
  for (int64_t m = 0; m < M; ++m) src[m] = static_cast<int32_t>((m * 37) % N);
  const std::vector<float> rows = as_used(normal_vector(N * H, 1)), pw = normal_vector(M, 2);
  const std::vector<float> w13 = as_used(normal_vector(L * 2 * I * H, 3, 0.3)), w2 = as_used(normal_vector(L * H * I, 4, 0.3));
  const std::vector<float> grad_rows = as_used(normal_vector(N * H, 5));
  const std::vector<uint8_t> rows_s = model::to_storage(rows, dtype), grad_rows_s = model::to_storage(grad_rows, dtype);
  ExpertMlpConfig cfg{L, H, I, M, N, dtype, true};
  const std::unique_ptr<PackedWeights> packed = be->make_expert_weights(cfg);
  be->pack_expert_weights(*packed, w13.data(), w2.data(), 0, 1);  // in two ranges: each packs only its own
  be->pack_expert_weights(*packed, w13.data(), w2.data(), 1, L - 1);
  std::vector<float> y(M * H), gu(M * 2 * I), gx(M * H), gpw(M), g13(L * 2 * I * H, 7.0f), g2(L * H * I, 7.0f);
  void* ws = workspace(be->expert_mlp_workspace_bytes(cfg));
  ExpertMlpStats stats;
  ExpertMlpForwardArgs f{rows_s.data(), off.data(), src.data(), pw.data(), w13.data(), w2.data(), packed.get(),
                         y.data(), gu.data(), ws, &stats};
  be->expert_mlp_forward(cfg, f);
  EXPECT_GT(stats.gemm_seconds, 0.0);
  ExpertMlpBackwardArgs b{grad_rows_s.data(), rows_s.data(), off.data(), src.data(), pw.data(), w13.data(),
                          w2.data(), packed.get(), gu.data(), gx.data(), gpw.data(), g13.data(), g2.data(), ws,
                          nullptr};
  be->expert_mlp_backward(cfg, b);

  // want: the composition in double; sg13, sg2: the |terms| behind each weight
  // gradient (oneDNN bf16 reads them from a bf16-rounded h or dgu).
  std::vector<double> wy(M * H, 0), wgx(M * H, 0), wgpw(M, 0), wg13(L * 2 * I * H, 0), wg2(L * H * I, 0);
  std::vector<double> sg13(L * 2 * I * H, 0), sg2(L * H * I, 0);
  for (int e = 0; e < L; ++e)
    for (int64_t m = off[e]; m < off[e + 1]; ++m) {
      const float* x = &rows[src[m] * H];
      const float* go = &grad_rows[src[m] * H];
      std::vector<double> g(I), u(I), hh(I), dh(I, 0.0);
      for (int i = 0; i < I; ++i) {
        for (int j = 0; j < H; ++j) {
          g[i] += static_cast<double>(w13[(e * 2 * I + i) * H + j]) * x[j];
          u[i] += static_cast<double>(w13[(e * 2 * I + I + i) * H + j]) * x[j];
        }
        hh[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      }
      for (int j = 0; j < H; ++j) {
        double yu = 0;
        for (int i = 0; i < I; ++i) {
          yu += static_cast<double>(w2[(e * H + j) * I + i]) * hh[i];
        }
        wy[m * H + j] = pw[m] * yu;
        wgpw[m] += go[j] * yu;
        for (int i = 0; i < I; ++i) {
          dh[i] += pw[m] * go[j] * w2[(e * H + j) * I + i];
          wg2[(e * H + j) * I + i] += pw[m] * go[j] * hh[i];
          sg2[(e * H + j) * I + i] += std::fabs(pw[m] * go[j] * hh[i]);
        }
      }
      for (int i = 0; i < I; ++i) {
        const double s = 1 / (1 + std::exp(-g[i]));
        const double dg = dh[i] * u[i] * s * (1 + g[i] * (1 - s)), du = dh[i] * g[i] * s;
        for (int j = 0; j < H; ++j) {
          const double wg = w13[(e * 2 * I + i) * H + j], wu = w13[(e * 2 * I + I + i) * H + j];
          wg13[(e * 2 * I + i) * H + j] += dg * x[j];
          wg13[(e * 2 * I + I + i) * H + j] += du * x[j];
          sg13[(e * 2 * I + i) * H + j] += std::fabs(dg * x[j]);
          sg13[(e * 2 * I + I + i) * H + j] += std::fabs(du * x[j]);
          wgx[m * H + j] += dg * wg + du * wu;
        }
      }
    }
  const double coef = bf16 && engine == GemmEngine::kOneDnn ? 0x1.0p-7 : 0.0;
  EXPECT_TRUE(close("y", to_double(y), wy, 1e-4, 1e-5));
  EXPECT_TRUE(close("grad_perm_x", to_double(gx), wgx, 1e-4, 1e-5));
  EXPECT_TRUE(close("grad_perm_weight", to_double(gpw), wgpw, 1e-4, 1e-5));  // reads no rounded operand
  EXPECT_TRUE(close_bounded("grad_w13", to_double(g13), wg13, sg13, coef, 1e-4, 1e-5));
  EXPECT_TRUE(close_bounded("grad_w2", to_double(g2), wg2, sg2, coef, 1e-4, 1e-5));
  // Expert 2 had no rows: its gradient is exactly zero (overwritten, not left at 7).
  for (int64_t i = 2 * 2 * I * H; i < 3 * 2 * I * H; ++i) ASSERT_EQ(g13[i], 0.0f);

  // In parts (a chunked layer, docs/layer.md#overlap): each expert's pairs in
  // three runs, forward then dgrad part by part, then the weight gradients alone:
  // the same bits on every engine and dtype (the row-invariant GEMM computes a
  // row alike in any call; the weight gradients then read the same operands).
  {
    std::vector<float> y2(M * H, 3.0f), gu2(M * 2 * I), gx2(M * H), gpw2(M), g13b(g13.size(), 7.0f), g2b(g2.size(), 7.0f);
    ExpertMlpForwardArgs fp = f;
    fp.y = y2.data();
    fp.saved_gu = gu2.data();
    ExpertMlpBackwardArgs bp = b;
    bp.saved_gu = gu2.data();
    bp.grad_perm_x = gx2.data();
    bp.grad_perm_weight = gpw2.data();
    bp.grad_w13 = g13b.data();
    bp.grad_w2 = g2b.data();
    bp.phase = MlpBackwardPhase::kDgrad;
    std::vector<std::vector<int64_t>> cut(4, std::vector<int64_t>(L));
    for (int p = 0; p <= 3; ++p)
      for (int e = 0; e < L; ++e) cut[p][e] = off[e] + (off[e + 1] - off[e]) * p / 3;
    for (int p = 0; p < 3; ++p) {
      fp.part = bp.part = {.pair_begin = cut[p].data(), .pair_end = cut[p + 1].data()};
      be->expert_mlp_forward(cfg, fp);
      be->expert_mlp_backward(cfg, bp);
    }
    bp.part = {};
    bp.phase = MlpBackwardPhase::kWgrad;
    be->expert_mlp_backward(cfg, bp);
    auto same = [&](const char* what, const std::vector<float>& got, const std::vector<float>& want) {
      EXPECT_EQ(got, want) << what;
    };
    same("parts y", y2, y);
    same("parts saved_gu", gu2, gu);
    same("parts grad_perm_x", gx2, gx);
    same("parts grad_perm_weight", gpw2, gpw);
    same("parts grad_w13", g13b, g13);
    same("parts grad_w2", g2b, g2);
    // A part beyond its expert's pairs, or a part given to a whole backward, is refused.
    std::vector<int64_t> bad_end = cut[3];
    bad_end[0] += 1;
    fp.part = {.pair_begin = cut[0].data(), .pair_end = bad_end.data()};
    EXPECT_THROW(be->expert_mlp_forward(cfg, fp), Error);
    bp.part = {.pair_begin = cut[0].data(), .pair_end = cut[1].data()};
    bp.phase = MlpBackwardPhase::kAll;
    EXPECT_THROW(be->expert_mlp_backward(cfg, bp), Error);
  }

  // No rows at all (T = 0 on a rank): nothing to compute, every gradient zero.
  const std::vector<int64_t> none = {0, 0, 0, 0};
  f.expert_offset = b.expert_offset = none.data();
  be->expert_mlp_forward(cfg, f);
  be->expert_mlp_backward(cfg, b);
  EXPECT_EQ(max_abs(to_double(g13)), 0.0);
  EXPECT_EQ(max_abs(to_double(g2)), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Engines, ExpertMlpOp,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(GemmEngine::kOpenBlas, GemmEngine::kOneDnn)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, GemmEngine>>& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  engine_suffix(std::get<1>(info.param));
                         });

// A decode step in the fused expert MLP (docs/backends.md#small-batches): a
// forward-only layer whose experts have 0, 1, 2, 3, 5, 16 and 17 rows. y against
// a double composition, and the same bits computed one row per part.
class ExpertMlpFewRows : public CpuOps, public ::testing::WithParamInterface<std::tuple<DType, GemmEngine>> {};

TEST_P(ExpertMlpFewRows, MatchCompositionAndEachRowAlone) {
  const auto [dtype, engine] = GetParam();
  std::string skip;
  std::unique_ptr<Backend> be = backend_with(pool, dtype, engine, &skip);
  if (!be) GTEST_SKIP() << skip;
  const bool bf16 = dtype == DType::kBF16;
  const int L = 7, H = 40, I = 24;
  const std::vector<int64_t> off = {0, 0, 1, 3, 6, 11, 27, 44};
  const int64_t M = off.back(), N = 30;
  std::vector<int32_t> src(M);
  for (int64_t m = 0; m < M; ++m) src[m] = static_cast<int32_t>((m * 7) % N);
  auto as_used = [&](std::vector<float> v) {
    if (bf16) model::round_to_bf16(v);
    return v;
  };
  const std::vector<float> rows = as_used(normal_vector(N * H, 21)), pw = normal_vector(M, 22);
  const std::vector<float> w13 = as_used(normal_vector(L * 2 * I * H, 23, 0.3));
  const std::vector<float> w2 = as_used(normal_vector(L * H * I, 24, 0.3));
  const std::vector<uint8_t> rows_s = model::to_storage(rows, dtype);
  ExpertMlpConfig cfg{L, H, I, M, N, dtype, false};
  const std::unique_ptr<PackedWeights> packed = be->make_expert_weights(cfg);
  be->pack_expert_weights(*packed, w13.data(), w2.data(), 0, L);
  std::vector<float> y(M * H, 5.0f);
  void* ws = workspace(be->expert_mlp_workspace_bytes(cfg));
  ExpertMlpForwardArgs f{rows_s.data(), off.data(), src.data(), pw.data(), w13.data(), w2.data(), packed.get(),
                         y.data(), nullptr, ws, nullptr};
  be->expert_mlp_forward(cfg, f);

  std::vector<double> want(M * H, 0);
  for (int e = 0; e < L; ++e)
    for (int64_t m = off[e]; m < off[e + 1]; ++m) {
      const float* x = &rows[src[m] * H];
      std::vector<double> h(I);
      for (int i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int j = 0; j < H; ++j) {
          g += static_cast<double>(w13[(e * 2 * I + i) * H + j]) * x[j];
          u += static_cast<double>(w13[(e * 2 * I + I + i) * H + j]) * x[j];
        }
        h[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int j = 0; j < H; ++j)
        for (int i = 0; i < I; ++i) want[m * H + j] += pw[m] * h[i] * w2[(e * H + j) * I + i];
    }
  EXPECT_TRUE(close("y", to_double(y), want, 1e-4, 1e-5));

  // One pair per part: every row gives the same bits alone.
  std::vector<float> y1(M * H, 9.0f);
  ExpertMlpForwardArgs fp = f;
  fp.y = y1.data();
  fp.stats = nullptr;
  const int64_t most = 17;
  for (int64_t p = 0; p < most; ++p) {
    std::vector<int64_t> b(L), e(L);
    for (int x = 0; x < L; ++x) {
      b[x] = std::min(off[x] + p, off[x + 1]);
      e[x] = std::min(off[x] + p + 1, off[x + 1]);
    }
    fp.part = {.pair_begin = b.data(), .pair_end = e.data()};
    be->expert_mlp_forward(cfg, fp);
  }
  EXPECT_EQ(y1, y);
}

INSTANTIATE_TEST_SUITE_P(Engines, ExpertMlpFewRows,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(GemmEngine::kOpenBlas, GemmEngine::kOneDnn)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, GemmEngine>>& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  engine_suffix(std::get<1>(info.param));
                         });

TEST_F(CpuOps, ExpertMlpRejectsMissingOrMismatchedPackedWeights) {
  const int L = 2, H = 16, I = 8;
  ExpertMlpConfig cfg{L, H, I, 4, 4, DType::kBF16, false};
  const std::vector<float> rows(4 * H, 0.0f), w13(L * 2 * I * H, 0.0f), w2(L * H * I, 0.0f);
  const std::vector<int64_t> off = {0, 2, 4};
  const std::vector<int32_t> src = {0, 1, 2, 3};
  std::vector<float> y(4 * H);
  void* ws = workspace(be->expert_mlp_workspace_bytes(cfg));
  ExpertMlpForwardArgs f{rows.data(), off.data(), src.data(), nullptr, w13.data(), w2.data(), nullptr,
                         y.data(), nullptr, ws, nullptr};
  auto message_of = [&](const ExpertMlpConfig& c) {
    try {
      be->expert_mlp_forward(c, f);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message_of(cfg).find("packed is null"), std::string::npos) << message_of(cfg);
  const std::unique_ptr<PackedWeights> packed = be->make_expert_weights(cfg);
  f.packed = packed.get();
  EXPECT_NE(message_of(cfg).find("pack_expert_weights was not called"), std::string::npos) << message_of(cfg);
  EXPECT_THROW(be->pack_expert_weights(*packed, w13.data(), w2.data(), 1, L), Error);  // past the last expert
  be->pack_expert_weights(*packed, w13.data(), w2.data(), 0, L);
  ExpertMlpConfig wider = cfg;
  wider.hidden = 2 * H;
  EXPECT_NE(message_of(wider).find("hidden"), std::string::npos) << message_of(wider);
  EXPECT_EQ(message_of(cfg), "no error");
}

TEST(CpuEngineTable, FollowsTheCpuAndTheOverride) {
  // The table: bf16 dot products -> oneDNN for bf16; none (AVX2) -> OpenBLAS.
  EXPECT_EQ(engine_table("avx512_core_bf16").bf16, GemmEngine::kOneDnn);
  EXPECT_EQ(engine_table("avx512_core_amx").bf16, GemmEngine::kOneDnn);
  EXPECT_EQ(engine_table("avx2").bf16, GemmEngine::kOpenBlas);
  EXPECT_EQ(engine_table("avx2").fp32, GemmEngine::kOpenBlas);
  const CpuBackendInfo table = cpu_backend_info();
  EXPECT_EQ(table.engine_source, "table");
  EXPECT_FALSE(table.isa.empty());
  EXPECT_EQ(table.bf16_dot, table.isa == "avx512_core_bf16" || table.isa == "avx512_core_amx");
  EXPECT_EQ(table.engines.bf16, engine_table(table.isa).bf16);

  ::setenv("MOE_GEMM_ENGINE", "fp32=openblas", 1);
  CpuBackendInfo info = cpu_backend_info();
  EXPECT_EQ(info.engines.fp32, GemmEngine::kOpenBlas);
  EXPECT_EQ(info.engines.bf16, table.engines.bf16);  // not named: the table's
  EXPECT_EQ(info.engine_source, "MOE_GEMM_ENGINE=fp32=openblas");
  ::setenv("MOE_GEMM_ENGINE", "openblas", 1);
  info = cpu_backend_info();
  EXPECT_EQ(info.engines.fp32, GemmEngine::kOpenBlas);
  EXPECT_EQ(info.engines.bf16, GemmEngine::kOpenBlas);
  ThreadPool pool(1);
  EXPECT_EQ(make_cpu_backend(pool)->gemm_engine(DType::kBF16), "openblas");
  for (const char* bad : {"mkl", "bf16=fast", "bf17=onednn", "bf16"}) {
    ::setenv("MOE_GEMM_ENGINE", bad, 1);
    try {
      cpu_backend_info();
      ADD_FAILURE() << "MOE_GEMM_ENGINE=" << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  ::unsetenv("MOE_GEMM_ENGINE");
}

// The probe behind every "oneDNN has no ... matmul on this CPU" skip agrees with
// the ISA oneDNN reports: on a CPU that has the matmul, an error building it fails
// here rather than turning the oneDNN cases into skips.
TEST(CpuEngineTable, TheOneDnnProbeAgreesWithTheIsa) {
  const std::string isa = cpu_backend_info().isa;
  const bool avx2_or_more = isa.rfind("avx2", 0) == 0 || isa.rfind("avx512", 0) == 0;
  const bool bf16_dot = isa == "avx512_core_bf16" || isa == "avx512_core_amx";
  if (avx2_or_more) EXPECT_TRUE(onednn_supports(DType::kF32)) << "ISA " << isa;
  if (bf16_dot) EXPECT_TRUE(onednn_supports(DType::kBF16)) << "ISA " << isa;
  if (isa.rfind("avx2", 0) == 0) EXPECT_FALSE(onednn_supports(DType::kBF16)) << "ISA " << isa;  // none on AVX2
}

TEST(CpuEngineTable, OneDnnRunsOnTheCallingThreadAlone) {
  // A pool of two runs oneDNN matmuls as teams of one: the process gains no
  // OpenMP worker thread. (The peak measurement may use a team; it is not run here.)
  if (!onednn_supports(DType::kBF16)) GTEST_SKIP() << "oneDNN has no bf16 matmul on this CPU (ISA " << cpu_backend_info().isa << ")";
  auto threads_now = [] {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
    return -1;
  };
  ThreadPool pool(2);
  CpuEngines e;
  e.bf16 = GemmEngine::kOneDnn;
  auto be = make_cpu_backend(pool, e);
  const int before = threads_now();
  ExpertMlpConfig cfg{4, 64, 32, 512, 512, DType::kBF16, false};
  const std::vector<float> w13 = normal_vector(4 * 64 * 64, 1, 0.1), w2 = normal_vector(4 * 64 * 32, 2, 0.1);
  const std::vector<uint8_t> rows = model::to_storage(normal_vector(512 * 64, 3), DType::kBF16);
  std::vector<int64_t> off = {0, 128, 256, 384, 512};
  std::vector<int32_t> src(512);
  std::iota(src.begin(), src.end(), 0);
  std::vector<float> y(512 * 64);
  std::vector<uint8_t> ws(be->expert_mlp_workspace_bytes(cfg));
  const std::unique_ptr<PackedWeights> packed = be->make_expert_weights(cfg);
  be->pack_expert_weights(*packed, w13.data(), w2.data(), 0, 4);
  ExpertMlpForwardArgs f{rows.data(), off.data(), src.data(), nullptr, w13.data(), w2.data(), packed.get(),
                         y.data(), nullptr, ws.data(), nullptr};
  for (int i = 0; i < 3; ++i) be->expert_mlp_forward(cfg, f);
  EXPECT_EQ(threads_now(), before);
  EXPECT_GT(nonzero_fraction(to_double(y)), 0.5);
}

}  // namespace
}  // namespace moe::test
