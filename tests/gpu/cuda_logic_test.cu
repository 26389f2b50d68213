// The CUDA kernels' per-item logic, run on the host: router_logic.cuh,
// capacity_logic.cuh, layout_logic.cuh and row_logic.cuh are the very functions
// the kernels call once per thread (or per row vector, or element), so emulating each launch with a host loop (and the host
// equivalents of its atomics, sort and scan) checks the device code's logic
// against the CPU backend on any machine. Launch configurations, memory and
// cuBLAS stay for gpu_test on a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "capacity_logic.cuh"
#include "layout_logic.cuh"
#include "moe/kernels/buffer.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/model/counter_rng.h"
#include "moe/model/synthetic.h"
#include "numeric.h"
#include "router_logic.cuh"
#include "row_logic.cuh"

namespace moe::kernels::cuda {
namespace {

using test::normal_vector;
using test::random_selection;

struct Cpu {
  ThreadPool pool{1};
  std::unique_ptr<Backend> be = make_cpu_backend(pool);
};

// ---------------------------------------------------------------------------
// Router

struct RouterCase {
  const char* name;
  int E, K, G, group_top_k;
  ScoreFunc score;
  bool norm;
  float scaling;
  bool biases;
};

void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }

// The CPU backend's router on a case: the raw logits (no logit bias: the
// emulation's input) and the forward with every bias.
struct CpuRouter {
  static constexpr int64_t T = 400;
  static constexpr int H = 32;
  RouterCase c;
  Cpu cpu;
  RouterConfig cfg;
  std::vector<float> x, gate, bias, logit_bias, raw, logits, scores, w, ws;
  std::vector<int32_t> idx;

  explicit CpuRouter(const RouterCase& rc) : c(rc) {
    static_cast<RoutingParams&>(cfg) = RoutingParams{c.E, c.K, c.score, c.G, c.group_top_k, c.norm, c.scaling};
    cfg.num_tokens = T;
    cfg.hidden = H;
    x = normal_vector(T * H, 1);
    gate = normal_vector(c.E * H, 2, 0.3);
    if (c.biases) {
      bias = normal_vector(c.E, 3, 0.05);
      logit_bias = normal_vector(c.E, 4, 0.5);
    }
    raw.resize(T * c.E);
    logits.resize(T * c.E);
    scores.resize(T * c.E);
    w.resize(T * c.K);
    idx.resize(T * c.K);
    ws.resize(cpu.be->router_workspace_bytes(cfg) / 4 + 1);
    auto packed = cpu.be->make_router_weights(cfg);
    cpu.be->pack_router_weights(*packed, gate.data());
    RouterForwardArgs a{x.data(), gate.data(), packed.get(), nullptr, nullptr, raw.data(), scores.data(),
                        idx.data(), w.data(), ws.data()};
    cpu.be->router_forward(cfg, a);
    a.selection_bias = selection_bias();
    a.logit_bias = c.biases ? logit_bias.data() : nullptr;
    a.logits = logits.data();
    cpu.be->router_forward(cfg, a);
  }
  const float* selection_bias() const { return c.biases ? bias.data() : nullptr; }
};

class RouterLogic : public ::testing::TestWithParam<RouterCase> {};

// The kernel, one "thread" per token, on the same raw logits.
TEST_P(RouterLogic, SelectionMatchesTheCpuBackend) {
  const CpuRouter r(GetParam());
  const RouterCase& c = r.c;
  const int64_t T = r.T;
  const int E = c.E, K = c.K;
  const router_logic::SelectParams p{T, E, K, c.G > 1 ? c.G : 1, c.group_top_k, c.score,
                                     c.norm, c.scaling};
  std::vector<float> el = r.raw, es(T * E), ew(T * K);
  std::vector<int32_t> ei(T * K);
  for (int64_t t = 0; t < T; ++t)
    router_logic::select_token(p, t, el.data(), es.data(), r.selection_bias(), c.biases ? r.logit_bias.data() : nullptr,
                               ei.data(), ew.data());
  EXPECT_EQ(el, r.logits) << "the logit bias is added as the CPU adds it";
  int near_ties = 0;
  const auto biased = [&](int64_t t, int32_t e) { return r.scores[t * E + e] + (c.biases ? r.bias[e] : 0.0f); };
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) ASSERT_NEAR(es[t * E + e], r.scores[t * E + e], 1e-6) << "token " << t;
    bool same = true;
    for (int k = 0; k < K; ++k) same &= ei[t * K + k] == r.idx[t * K + k];
    if (!same) {  // only where two biased scores sit within the exp approximations' noise
      ++near_ties;
      for (int k = 0; k < K; ++k)
        EXPECT_NEAR(biased(t, ei[t * K + k]), biased(t, r.idx[t * K + k]), 1e-5) << "token " << t << " k " << k;
      continue;
    }
    for (int k = 0; k < K; ++k) EXPECT_NEAR(ew[t * K + k], r.w[t * K + k], 1e-6 * (1 + std::fabs(r.w[t * K + k])));
  }
  EXPECT_LE(near_ties, T / 50);
}

// dL/dlogits per token, with both balancing terms.
TEST_P(RouterLogic, LogitGradientsMatchTheCpuBackend) {
  CpuRouter r(GetParam());
  const RouterCase& c = r.c;
  const int64_t T = r.T;
  const int E = c.E, K = c.K;
  const std::vector<float> gtw = normal_vector(T * K, 5), counts = normal_vector(E, 6, 10.0);
  std::vector<float> gl(T * E), gw(E * r.H), gx(T * r.H, 0.0f), egl(T * E);
  RouterBackwardArgs b{r.scores.data(), r.idx.data(), r.w.data(), gtw.data(),  r.x.data(),   r.gate.data(), gl.data(),
                       gw.data(),       gx.data(),    r.ws.data(), 0.01f,     counts.data(), 0.001f,        r.logits.data()};
  r.cpu.be->router_backward(r.cfg, b);
  const router_logic::GradParams gp{T, E, K, c.score, c.norm, c.scaling, 0.01f, 0.001f};
  b.grad_logits = egl.data();
  for (int64_t t = 0; t < T; ++t) router_logic::logit_grad_token(gp, b, t);
  float scale = 0;
  for (float v : gl) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0.0f);
  for (int64_t i = 0; i < T * E; ++i) ASSERT_NEAR(egl[i], gl[i], 1e-5 * scale) << "grad_logits[" << i << "]";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RouterLogic,
    ::testing::Values(RouterCase{"softmax_norm", 16, 4, 0, 0, ScoreFunc::kSoftmax, true, 1.0f, false},
                      RouterCase{"softmax_nonorm", 16, 4, 0, 0, ScoreFunc::kSoftmax, false, 2.5f, true},
                      RouterCase{"sigmoid_grouped", 64, 8, 8, 4, ScoreFunc::kSigmoid, true, 2.5f, true},
                      RouterCase{"sigmoid_nonorm_grouped_pairs", 32, 4, 16, 3, ScoreFunc::kSigmoid, false, 1.0f, true},
                      RouterCase{"softmax_top1", 8, 1, 0, 0, ScoreFunc::kSoftmax, true, 1.0f, false}),
    [](const ::testing::TestParamInfo<RouterCase>& i) { return std::string(i.param.name); });

// ---------------------------------------------------------------------------
// Capacity: keys, a stable sort (what CUB's radix sort is), starts, drops.

std::vector<int32_t> emulate_capacity(const CapacityConfig& cfg, const std::vector<int32_t>& idx,
                                      const std::vector<float>& w) {
  const int64_t n = static_cast<int64_t>(idx.size());
  const int E = cfg.num_experts;
  std::vector<uint64_t> keys(n);
  for (int64_t p = 0; p < n; ++p) keys[p] = capacity_logic::pair_key(idx[p], E, cfg.policy == DropPolicy::kProbs, w[p]);
  std::vector<int32_t> vals(n);
  std::iota(vals.begin(), vals.end(), 0);
  std::stable_sort(vals.begin(), vals.end(), [&](int32_t a, int32_t b) { return keys[a] < keys[b]; });
  std::vector<uint64_t> sorted(n);
  for (int64_t i = 0; i < n; ++i) sorted[i] = keys[vals[i]];
  std::vector<int32_t> start(E + 1, 0), kept = idx;
  for (int64_t i = 0; i < n; ++i) capacity_logic::mark_start(i, sorted.data(), start.data());
  for (int64_t i = 0; i < n; ++i)
    capacity_logic::drop_if_over(i, E, cfg.capacity(), sorted.data(), vals.data(), start.data(), kept.data());
  return kept;
}

TEST(CapacityLogic, DropsWhatTheCpuBackendDrops) {
  const int64_t T = 600;
  const int E = 8, K = 2;
  const std::vector<int32_t> idx = random_selection(T, K, E, 7, 5);
  std::vector<float> w(T * K);
  for (size_t p = 0; p < w.size(); ++p) w[p] = 0.25f * static_cast<float>(model::key_hash({8, p}) % 4);  // ties
  w[3] = -0.0f;  // ties +0
  w[5] = NAN;    // sorts last
  Cpu cpu;
  for (DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition})
    for (double cf : {0.3, 0.8, 1.0}) {
      const CapacityConfig cfg{T, E, K, cf, policy};
      std::vector<int32_t> kept(T * K);
      std::vector<uint8_t> ws(cpu.be->capacity_workspace_bytes(cfg) + 64);
      cpu.be->capacity_drop(cfg, {idx.data(), w.data(), kept.data(), ws.data()});
      EXPECT_EQ(emulate_capacity(cfg, idx, w), kept) << drop_policy_name(policy) << " cf " << cf;
    }
}

// ---------------------------------------------------------------------------
// Layouts: counts (the atomics as plain adds), the host scan, the row functions.

std::vector<int64_t> exclusive_scan(const std::vector<int32_t>& counts) {
  std::vector<int64_t> out(counts.size());
  int64_t acc = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i] = acc;
    acc += counts[i];
  }
  return out;
}

TEST(LayoutLogic, DispatchLayoutMatchesTheCpuBackend) {
  const int64_t T = 333;  // chunks of 32 and a partial one
  const int K = 4, R = 5, S = 3;
  const std::vector<int32_t> slots = random_selection(T, K, R * S, 9, 10);
  const std::vector<float> w = normal_vector(T * K, 10);
  const int64_t rows_max = T * std::min(R, K);
  struct Out {
    std::vector<int32_t> per_rank, per_slot, send_row, src, sslot;
    std::vector<uint8_t> in_rank;
    std::vector<float> sw;
    std::vector<int64_t> offset;
    Out(int64_t T, int K, int R, int S, int64_t rows)
        : per_rank(R), per_slot(R * S), send_row(T * R), src(rows), sslot(rows * K), in_rank(T * R), sw(rows * K),
          offset(R + 1) {}
    DispatchLayoutArgs args(const std::vector<int32_t>& slots, const std::vector<float>& w, void* ws) {
      return {slots.data(), w.data(), per_rank.data(), per_slot.data(), offset.data(), in_rank.data(),
              send_row.data(), src.data(), sslot.data(), sw.data(), ws};
    }
  } cpu_out(T, K, R, S, rows_max), emu(T, K, R, S, rows_max);
  Cpu cpu;
  const DispatchLayoutConfig cfg{T, K, R, S};
  std::vector<uint8_t> ws(cpu.be->dispatch_layout_workspace_bytes(cfg) + 64);
  cpu.be->dispatch_layout(cfg, cpu_out.args(slots, w, ws.data()));

  const layout_logic::DispatchParams p{T, K, R, S, (T + layout_logic::kChunk - 1) / layout_logic::kChunk};
  const DispatchLayoutArgs a = emu.args(slots, w, nullptr);
  std::vector<int32_t> counts(R * p.C + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    EXPECT_EQ(layout_logic::dispatch_count_token(p, a, t, counts.data(), [](int32_t* c) { ++*c; }).position, -1);
  const std::vector<int64_t> bases = exclusive_scan(counts);
  for (int r = 0; r < R; ++r) emu.per_rank[r] = static_cast<int32_t>(bases[(r + 1) * p.C] - bases[r * p.C]);
  for (int64_t i = 0; i < T * R; ++i) layout_logic::dispatch_row(p, a, bases.data(), i);
  for (int r = 0; r <= R; ++r) emu.offset[r] = bases[r * p.C];

  const int64_t rows = cpu_out.offset[R];
  EXPECT_EQ(emu.offset, cpu_out.offset);
  EXPECT_EQ(emu.per_rank, cpu_out.per_rank);
  EXPECT_EQ(emu.per_slot, cpu_out.per_slot);
  EXPECT_EQ(emu.in_rank, cpu_out.in_rank);
  EXPECT_EQ(emu.send_row, cpu_out.send_row);
  for (int64_t row = 0; row < rows; ++row) {
    ASSERT_EQ(emu.src[row], cpu_out.src[row]) << "send row " << row;
    for (int k = 0; k < K; ++k) {
      ASSERT_EQ(emu.sslot[row * K + k], cpu_out.sslot[row * K + k]) << "send row " << row;
      ASSERT_EQ(emu.sw[row * K + k], cpu_out.sw[row * K + k]) << "send row " << row;
    }
  }
}

// Without and with a row_order (a chunked layer's, docs/layer.md#overlap: an
// expert's pairs follow their rows' positions in it), against the CPU backend.
TEST(LayoutLogic, PermuteLayoutMatchesTheCpuBackend) {
  for (const auto& [N, L] : std::vector<std::pair<int64_t, int>>{{500, 7}, {40, 0}, {0, 3}, {65, 1}})
    for (const bool ordered : {false, true}) {
      const int K = 3;
      std::vector<int32_t> re = random_selection(N, K, std::max(L, K), 11, 15);
      for (int32_t& e : re)
        if (e >= L) e = -1;
      const std::vector<float> rw = normal_vector(N * K, 12);
      std::vector<int32_t> order(N);  // a seeded shuffle of the rows
      std::iota(order.begin(), order.end(), 0);
      for (int64_t i = N - 1; i > 0; --i) std::swap(order[i], order[model::key_hash({13, uint64_t(i)}) % (i + 1)]);
      const int32_t* row_order = ordered ? order.data() : nullptr;
      Cpu cpu;
      const PermuteLayoutConfig cfg{N, K, L};
      std::vector<uint8_t> ws(cpu.be->permute_layout_workspace_bytes(cfg) + 64);
      std::vector<int64_t> off(L + 1), eoff(L + 1);
      std::vector<int32_t> src(N * K + 1), pos(N * K + 1), esrc(N * K + 1), epos(N * K + 1);
      std::vector<float> pw(N * K + 1), epw(N * K + 1);
      cpu.be->permute_layout(cfg, {re.data(), rw.data(), off.data(), src.data(), pw.data(), pos.data(), ws.data(),
                                   row_order});

      const layout_logic::PermuteParams p{N, K, L, (N + layout_logic::kChunk - 1) / layout_logic::kChunk};
      std::vector<int32_t> counts(L * p.C + 1, 0);
      for (int64_t i = 0; i < N * K; ++i) {
        const int64_t c = layout_logic::permute_count_slot(p, re.data(), row_order, i);
        ASSERT_GE(c, -1);
        if (c >= 0) ++counts[c];
      }
      const std::vector<int64_t> bases = exclusive_scan(counts);
      const PermuteLayoutArgs a{re.data(), rw.data(), eoff.data(), esrc.data(), epw.data(), epos.data(), nullptr,
                                row_order};
      for (int64_t i = 0; i < N * K; ++i) layout_logic::permute_row(p, a, bases.data(), i);
      for (int e = 0; e <= L; ++e) eoff[e] = bases[e * p.C];
      const std::string at = "N " + std::to_string(N) + " L " + std::to_string(L) + (ordered ? " row_order" : "");
      EXPECT_EQ(eoff, off) << at;
      EXPECT_EQ(epos, pos) << at;
      const int64_t M = off[L];
      EXPECT_TRUE(std::equal(esrc.begin(), esrc.begin() + M, src.begin())) << at;
      EXPECT_TRUE(std::equal(epw.begin(), epw.begin() + M, pw.begin())) << at;
      if (ordered && M > 1 && L > 1) EXPECT_FALSE(std::is_sorted(esrc.begin(), esrc.begin() + off[1])) << at;
    }
}

TEST(LayoutLogic, OutOfRangeValuesAreFaults) {
  const layout_logic::PermuteParams p{1, 2, 4, 1};
  const std::vector<int32_t> re = {2, 4};
  EXPECT_EQ(layout_logic::permute_count_slot(p, re.data(), nullptr, 0), 2);
  EXPECT_EQ(layout_logic::permute_count_slot(p, re.data(), nullptr, 1), -2);
  const std::vector<int32_t> order = {1};  // N = 1: row 1 does not exist
  EXPECT_EQ(layout_logic::permute_count_slot(p, re.data(), order.data(), 0), -3);
  const std::vector<int32_t> slots = {1, 9};  // R * S = 6
  std::vector<int32_t> per_slot(6, 0), counts(3, 0);
  std::vector<uint8_t> in_rank(3);
  DispatchLayoutArgs a{};
  a.topk_slot = slots.data();
  a.num_tokens_per_slot = per_slot.data();
  a.is_token_in_rank = in_rank.data();
  const layout_logic::ItemFault f =
      layout_logic::dispatch_count_token({1, 2, 3, 2, 1}, a, 0, counts.data(), [](int32_t* c) { ++*c; });
  EXPECT_EQ(f.position, 1);
  EXPECT_EQ(f.value, 9);
}

// ---------------------------------------------------------------------------
// Rows: the gather and the weighted per-row sum, per vector as the kernels run
// them (V = 8 where rows allow, else 1), in every dtype pair.

template <typename T>
std::vector<T> stored(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f32<T>(v[i]);
  return out;
}

template <typename T>
std::vector<float> widened(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_f32(v[i]);
  return out;
}

template <typename In, typename Out, int V>
void check_rows(DType in, DType out, int H) {
  const int64_t N = 120;
  const int K = 3, L = 5;
  std::vector<int32_t> re = random_selection(N, K, L, 21, 20);
  Cpu cpu;
  // The permute layout of the CPU backend gives both maps.
  std::vector<int64_t> off(L + 1);
  std::vector<int32_t> src(N * K), pos(N * K);
  std::vector<float> pw(N * K);
  std::vector<uint8_t> ws(cpu.be->permute_layout_workspace_bytes({N, K, L}) + 64);
  cpu.be->permute_layout({N, K, L}, {re.data(), nullptr, off.data(), src.data(), pw.data(), pos.data(), ws.data()});
  const int64_t M = off[L];
  const std::vector<In> rows = stored<In>(normal_vector(N * H, 22));
  std::vector<Out> got(M * H), want(M * H);
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < H / V; ++j) row_logic::gather_vec<In, Out, V>(rows.data(), H, src[m], m, j, got.data());
  cpu.be->permute({N, K, M, H, in, out}, {rows.data(), src.data(), pos.data(), want.data()});
  EXPECT_EQ(widened(got), widened(want)) << "gather V=" << V;

  const std::vector<In> perm = stored<In>(normal_vector(M * H, 23));
  const std::vector<float> w = normal_vector(N * K, 24);
  for (bool accumulate : {false, true}) {
    if (accumulate && out == DType::kBF16) continue;  // fp32 outputs only
    const std::vector<Out> start = stored<Out>(normal_vector(N * H, 25));
    std::vector<Out> e_out = start, c_out = start;
    for (int64_t n = 0; n < N; ++n)
      for (int j = 0; j < H / V; ++j)
        EXPECT_EQ((row_logic::unpermute_vec<In, Out, V>(perm.data(), pos.data(), w.data(), n, K, H, M, accumulate, j,
                                                         e_out.data())),
                  -1);
    cpu.be->unpermute({N, K, H, out, accumulate, in}, {perm.data(), pos.data(), w.data(), c_out.data()});
    const std::vector<float> a = widened(e_out), b = widened(c_out);
    const double tol = out == DType::kBF16 ? 1.0 / 128 : 1e-5;
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_NEAR(a[i], b[i], tol * (1 + std::fabs(b[i]))) << "unpermute V=" << V << " accumulate " << accumulate;
  }
}

TEST(RowLogic, GatherAndWeightedSumMatchTheCpuBackend) {
  check_rows<float, float, 8>(DType::kF32, DType::kF32, 64);
  check_rows<float, float, 1>(DType::kF32, DType::kF32, 36);
  check_rows<bf16s, bf16s, 8>(DType::kBF16, DType::kBF16, 64);
  check_rows<float, bf16s, 8>(DType::kF32, DType::kBF16, 64);
  check_rows<bf16s, float, 1>(DType::kBF16, DType::kF32, 36);
}

// A part of a layout (rows [first, first + n) of a chunked layer) reads the whole
// layout's perm: its positions go past n * K and are no fault.
TEST(RowLogic, APartOfALayoutCombinesRowsFromTheWholePerm) {
  const int64_t N = 40, first = 10, n = 6;
  const int K = 2, H = 8, L = 5;
  Cpu cpu;
  const std::vector<int32_t> re = random_selection(N, K, L, 27, 15);
  std::vector<int64_t> off(L + 1);
  std::vector<int32_t> src(N * K), pos(N * K);
  std::vector<uint8_t> ws(cpu.be->permute_layout_workspace_bytes({N, K, L}) + 64);
  cpu.be->permute_layout({N, K, L}, {re.data(), nullptr, off.data(), src.data(), nullptr, pos.data(), ws.data()});
  const int64_t M = off[L];
  const std::vector<float> perm = normal_vector(M * H, 28);
  UnpermuteConfig cfg;
  cfg.num_rows = n;
  cfg.top_k = K;
  cfg.hidden = H;
  cfg.num_perm_rows = M;
  ASSERT_GT(*std::max_element(pos.begin() + first * K, pos.begin() + (first + n) * K), n * K);
  std::vector<float> e_out(n * H), c_out(n * H);
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < H; ++j)
      ASSERT_EQ((row_logic::unpermute_vec<float, float, 1>(perm.data(), pos.data() + first * K, nullptr, r, K, H,
                                                           row_logic::perm_rows(cfg), false, j, e_out.data())),
                -1)
          << "row " << r;
  cpu.be->unpermute(cfg, {perm.data(), pos.data() + first * K, nullptr, c_out.data()});
  EXPECT_EQ(e_out, c_out);
}

TEST(RowLogic, UnpermuteReportsAPositionOutOfRange) {
  const std::vector<float> perm(8, 1.0f);
  const std::vector<int32_t> pos = {0, 5};  // M = 2 rows of H = 4
  std::vector<float> out(4);
  EXPECT_EQ((row_logic::unpermute_vec<float, float, 1>(perm.data(), pos.data(), nullptr, 0, 2, 4, 2, false, 0,
                                                        out.data())),
            1);
  EXPECT_EQ(out[0], 1.0f) << "the good pair still counts";
}

TEST(RowLogic, BfloatConversionIsTheCpusBitForBit) {
  std::vector<float> v = normal_vector(4000, 26);
  v.push_back(NAN);
  v.push_back(INFINITY);
  v.push_back(-0.0f);
  v.push_back(1.0f + 0x1.0p-8f);  // a tie: to even
  for (float f : v) {
    ASSERT_EQ(bf16_from_f32(f).bits, f32_to_bf16(f)) << f;
    ASSERT_EQ(to_f32(bf16_from_f32(f)) == bf16_to_f32(f32_to_bf16(f)), !std::isnan(f)) << f;
  }
}

// ---------------------------------------------------------------------------
// SwiGLU and the optimizer, element by element.

TEST(ElementLogic, SwigluMatchesTheCpuBackend) {
  const int64_t M = 30;
  const int I = 24;
  const std::vector<float> gu = normal_vector(M * 2 * I, 31, 2.0), dh = normal_vector(M * I, 32), scale = normal_vector(M, 33);
  Cpu cpu;
  std::vector<float> h(M * I), ggu(M * 2 * I), gs(M), h2(M * I);
  cpu.be->swiglu_forward({M, I}, {gu.data(), scale.data(), h.data()});
  cpu.be->swiglu_backward({M, I}, {gu.data(), dh.data(), scale.data(), ggu.data(), gs.data(), h2.data()});
  for (int64_t r = 0; r < M; ++r) {
    float dot = 0;
    for (int i = 0; i < I; ++i) {
      const float g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
      ASSERT_NEAR(row_logic::swiglu(g, u, scale[r]), h[r * I + i], 1e-5 * (1 + std::fabs(h[r * I + i])));
      const row_logic::SwigluGrad d = row_logic::swiglu_grad(g, u, dh[r * I + i], scale[r]);
      ASSERT_NEAR(d.dg, ggu[r * 2 * I + i], 1e-5 * (1 + std::fabs(d.dg)));
      ASSERT_NEAR(d.du, ggu[r * 2 * I + I + i], 1e-5 * (1 + std::fabs(d.du)));
      dot += dh[r * I + i] * d.h;
    }
    ASSERT_NEAR(dot, gs[r], 1e-4 * (1 + std::fabs(gs[r])));
  }
}

TEST(ElementLogic, OptimizerStepsMatchTheCpuBackend) {
  const int64_t n = 3000;
  Cpu cpu;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    OptimizerConfig cfg;
    cfg.kind = kind;
    cfg.lr = 3e-3f;
    std::vector<float> w = normal_vector(n, 41), m(n, 0.0f), v(n, 0.0f), ew = w, em = m, ev = v;
    for (int64_t step = 1; step <= 3; ++step) {
      const std::vector<float> g = normal_vector(n, 41 + step);
      cpu.be->optimizer_step(cfg, {n, step, w.data(), g.data(), m.data(), v.data(), nullptr});
      const AdamConstants p = adam_constants(cfg, step);
      for (int64_t i = 0; i < n; ++i) {
        if (kind == OptimizerKind::kAdam)
          row_logic::adam_step(p, ew[i], g[i], em[i], ev[i]);
        else
          row_logic::sgd_step(cfg.lr, ew[i], g[i]);
      }
    }
    // The same operations: the same bits, weights and moments.
    EXPECT_EQ(ew, w);
    if (kind == OptimizerKind::kAdam) {
      EXPECT_EQ(em, m);
      EXPECT_EQ(ev, v);
    }
  }
}

}  // namespace
}  // namespace moe::kernels::cuda
