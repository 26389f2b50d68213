// The op checks: each runs one op of the kernel API on the backend with seeded
// inputs and compares with a plain host reference written here (fp64 where there
// is arithmetic, exact where there are indices or bf16 bits), or with kernels/ref.
// The layer checks are layer_cases.cc's, shared with layer_test.
#include "gpu_checks.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "layer_cases.h"
#include "moe/kernels/buffer.h"
#include "numeric.h"

namespace moe::gpucheck {
namespace {

using kernels::Backend;
using kernels::Buffer;
using kernels::to_backend;
using kernels::to_host;
using kernels::DType;
using test::normal_vector;
using test::random_selection;
using test::to_double;

// ---------------------------------------------------------------------------
// Host <-> backend memory, seeded data, result bookkeeping.

// Uniform integers in [lo, hi] keyed by (seed, i).
std::vector<int32_t> random_ints(size_t n, uint64_t seed, int32_t lo, int32_t hi) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = lo + static_cast<int32_t>(model::key_hash({seed, i}) % static_cast<uint64_t>(hi - lo + 1));
  return v;
}

class Checker {
 public:
  void expect(const std::string& failure) {
    if (!failure.empty()) fail(failure);
  }
  void expect(bool ok, const std::string& what) {
    if (!ok) fail(what);
  }
  template <typename T>
  void equal(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
    if (got.size() != want.size()) return fail(what + ": size " + std::to_string(got.size()) + " != " +
                                               std::to_string(want.size()));
    for (size_t i = 0; i < got.size(); ++i)
      if (!(got[i] == want[i])) {
        std::ostringstream os;
        os << what << "[" << i << "]: got " << +got[i] << ", want " << +want[i];
        return fail(os.str());
      }
  }
  void close(const std::string& what, const std::vector<double>& got, const std::vector<double>& want, double rtol,
             double atol_rel, bool allow_zero = false) {
    expect(test::compare_within(what, got, want, nullptr, 0.0, rtol, atol_rel, allow_zero));
  }
  Result result() const { return {failures_.empty(), failures_}; }

 private:
  void fail(const std::string& s) { failures_ += (failures_.empty() ? "" : "; ") + s; }
  std::string failures_;
};

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// ---------------------------------------------------------------------------
// FP8 wire rows (kernels/types.h): the bytes and scales, and the values back, bit
// for bit against the host's scalar definition, for fp32 and bf16 rows.

Result check_fp8_rows(Backend& be) {
  Checker ck;
  const int H = 300;  // groups of 128, 128 and 44
  const int64_t n = 23;
  std::vector<float> x = normal_vector(n * H, 3, 4.0);
  for (int i = 0; i < 128; ++i) x[2 * H + i] = 0;  // an all-zero group
  x[4 * H + 7] = 3000.0f;
  x[6 * H + 250] = 1e-30f;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string tag = std::string(" (") + kernels::dtype_name(dtype) + ")";
    std::vector<float> xs = x;
    if (dtype == DType::kBF16)
      for (float& v : xs) v = kernels::round_to_bf16(v);
    Buffer rows = dtype == DType::kF32 ? to_backend(be, xs) : to_backend(be, test::float_to_bf16(xs));
    Buffer wire(be, n * kernels::fp8_row_bytes(H)), back(be, 4 * n * H);
    be.pack_rows(kernels::WireFormat::kFP8, rows.get(), dtype, n, H, wire.get());
    be.unpack_rows(kernels::WireFormat::kFP8, wire.get(), n, H, back.get(), DType::kF32);
    std::vector<uint8_t> want(n * kernels::fp8_row_bytes(H));
    std::vector<uint32_t> want_back(n * H);
    for (int64_t r = 0; r < n; ++r)
      for (int g0 = 0; g0 < H; g0 += kernels::kFp8GroupSize) {
        const int g1 = std::min(H, g0 + kernels::kFp8GroupSize);
        float amax = 0;
        for (int i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(xs[r * H + i]));
        const float scale = amax > 0 ? amax / kernels::kFp8Max : 1.0f;
        uint8_t* row = want.data() + r * kernels::fp8_row_bytes(H);
        for (int i = g0; i < g1; ++i) {
          row[i] = kernels::f32_to_e4m3(xs[r * H + i] / scale);
          want_back[r * H + i] = bits_of(kernels::e4m3_to_f32(row[i]) * scale);
        }
        std::memcpy(row + H + 4 * (g0 / kernels::kFp8GroupSize), &scale, 4);
      }
    ck.equal("fp8 wire bytes" + tag, to_host<uint8_t>(be, wire.get(), want.size()), want);
    std::vector<uint32_t> got_back;
    for (float f : to_host<float>(be, back.get(), n * H)) got_back.push_back(bits_of(f));
    ck.equal("fp8 wire values" + tag, got_back, want_back);
  }
  return ck.result();
}

// ---------------------------------------------------------------------------
// convert, add

Result check_convert_add(Backend& be) {
  Checker ck;
  std::vector<float> v = normal_vector(1000, 1);
  v[0] = NAN;
  v[1] = INFINITY;
  v[2] = -0.0f;
  v[3] = 1e-40f;                     // subnormal
  v[4] = 1.0f + 0x1.0p-8f;           // a tie: rounds to even
  v[5] = 3.0e38f;                    // rounds up to infinity
  const int64_t n = static_cast<int64_t>(v.size());
  Buffer src = to_backend(be, v), b16(be, 2 * n), back(be, 4 * n);
  be.convert(src.get(), DType::kF32, b16.get(), DType::kBF16, n);
  be.convert(b16.get(), DType::kBF16, back.get(), DType::kF32, n);
  const std::vector<uint16_t> got16 = to_host<uint16_t>(be, b16.get(), n);
  std::vector<uint16_t> want16(n);
  for (int64_t i = 0; i < n; ++i) want16[i] = kernels::f32_to_bf16(v[i]);
  ck.equal("fp32 -> bf16 bits", got16, want16);
  std::vector<uint32_t> got_back, want_back;
  for (float f : to_host<float>(be, back.get(), n)) got_back.push_back(bits_of(f));
  for (uint16_t h : want16) want_back.push_back(bits_of(kernels::bf16_to_f32(h)));
  ck.equal("bf16 -> fp32 bits", got_back, want_back);

  const std::vector<float> w = normal_vector(1000, 2);
  Buffer sum = to_backend(be, w), w16 = to_backend(be, test::float_to_bf16(w));
  be.add(sum.get(), src.get(), DType::kF32, n);
  be.add(w16.get(), b16.get(), DType::kBF16, n);
  std::vector<uint32_t> got_sum, want_sum;
  for (float f : to_host<float>(be, sum.get(), n)) got_sum.push_back(bits_of(f));
  for (int64_t i = 0; i < n; ++i) want_sum.push_back(bits_of(w[i] + v[i]));
  ck.equal("add fp32 bits", got_sum, want_sum);
  std::vector<uint16_t> want_sum16(n);
  for (int64_t i = 0; i < n; ++i)
    want_sum16[i] = kernels::f32_to_bf16(kernels::round_to_bf16(w[i]) + kernels::bf16_to_f32(want16[i]));
  ck.equal("add bf16 bits", to_host<uint16_t>(be, w16.get(), n), want_sum16);
  return ck.result();
}

// ---------------------------------------------------------------------------
// Router forward and backward against kernels/ref.

struct RouterCase {
  int64_t T;
  int H, E, K;
  kernels::ScoreFunc score;
  bool norm;
  float scaling;
  int groups = 0, group_top_k = 0;
  bool biases = false;  // selection bias and logit bias
  DType dtype = DType::kF32;
  double aux = 0.0, z = 0.0;  // balancing coefficients (backward)
};

ref::Config ref_config(const RouterCase& c, int I) {
  ref::Config rc;
  rc.num_experts = c.E;
  rc.top_k = c.K;
  rc.score = c.score;
  rc.num_groups = c.groups;
  rc.group_top_k = c.group_top_k;
  rc.norm_topk_prob = c.norm;
  rc.routed_scaling_factor = c.scaling;
  rc.hidden = c.H;
  rc.ffn_hidden = I;
  rc.aux_loss_coeff = c.aux;
  rc.z_loss_coeff = c.z;
  return rc;
}

kernels::RouterConfig router_config(const RouterCase& c) {
  kernels::RouterConfig rc;
  static_cast<kernels::RoutingParams&>(rc) = ref_config(c, 1).routing();
  rc.num_tokens = c.T;
  rc.hidden = c.H;
  rc.x_dtype = c.dtype;
  return rc;
}

// Inputs of a router case: x and the weights, rounded to the dtype where it stores them.
struct RouterInputs {
  std::vector<float> x, gate, bias, logit_bias;
  model::LayerWeights experts;  // for the reference's expert outputs (backward)
};

RouterInputs router_inputs(const RouterCase& c, int I) {
  RouterInputs in;
  in.x = normal_vector(c.T * c.H, 11);
  in.experts = model::make_layer_weights(5, 0, {c.H, I, c.E});
  in.gate = in.experts.gate;
  if (c.dtype == DType::kBF16) {
    model::round_to_bf16(in.x);
    model::round_to_bf16(in.gate);
  }
  if (c.biases) {
    in.bias = normal_vector(c.E, 12, 0.05);
    in.logit_bias = normal_vector(c.E, 13, 0.5);
  }
  return in;
}

ref::Weights ref_weights(const RouterInputs& in) {
  ref::Weights w;
  w.gate = to_double(in.gate);
  w.selection_bias = to_double(in.bias);
  w.logit_bias = to_double(in.logit_bias);
  w.w13 = to_double(in.experts.w13);
  w.w2 = to_double(in.experts.w2);
  return w;
}

Result check_router_forward(Backend& be, const RouterCase& c) {
  Checker ck;
  const RouterInputs in = router_inputs(c, 4);
  const kernels::RouterConfig cfg = router_config(c);
  const int64_t T = c.T;
  Buffer x = to_backend(be, model::to_storage(in.x, c.dtype)), gate = to_backend(be, in.gate);
  Buffer bias = to_backend(be, in.bias), lbias = to_backend(be, in.logit_bias);
  Buffer logits(be, 4 * T * c.E + 64), scores(be, 4 * T * c.E + 64), idx(be, 4 * T * c.K + 64),
      w(be, 4 * T * c.K + 64), ws(be, be.router_workspace_bytes(cfg) + 64);
  auto packed = be.make_router_weights(cfg);
  be.pack_router_weights(*packed, gate.as<float>());
  kernels::RouterForwardArgs a;
  a.x = x.get();
  a.weight = gate.as<float>();
  a.packed_weight = packed.get();
  a.selection_bias = c.biases ? bias.as<float>() : nullptr;
  a.logit_bias = c.biases ? lbias.as<float>() : nullptr;
  a.logits = logits.as<float>();
  a.scores = scores.as<float>();
  a.topk_idx = idx.as<int32_t>();
  a.topk_weight = w.as<float>();
  a.workspace = ws.get();
  be.router_forward(cfg, a);

  const ref::Forward f = ref::forward(ref_config(c, 4), ref_weights(in), to_double(in.x), T);
  const bool empty = T == 0;
  ck.close("logits", to_double(to_host<float>(be, logits.get(), T * c.E)), f.logits, 1e-4, 1e-5, empty);
  ck.close("scores", to_double(to_host<float>(be, scores.get(), T * c.E)), f.scores, 1e-4, 1e-6, empty);
  const std::vector<int32_t> got_idx = to_host<int32_t>(be, idx.get(), T * c.K);
  const std::vector<double> got_w = to_double(to_host<float>(be, w.get(), T * c.K));
  int near_ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (f.selection_margin[t] < 1e-5) {
      ++near_ties;
      continue;
    }
    for (int k = 0; k < c.K; ++k) {
      const int64_t p = t * c.K + k;
      ck.expect(got_idx[p] == f.topk_idx[p], "topk_idx of token " + std::to_string(t));
      ck.expect(std::fabs(got_w[p] - f.topk_weight[p]) <= 1e-5 * std::fabs(f.topk_weight[p]) + 1e-6,
                "topk_weight of token " + std::to_string(t));
      if (got_idx[p] != f.topk_idx[p]) return ck.result();
    }
  }
  ck.expect(near_ties <= std::max<int64_t>(1, T / 50), std::to_string(near_ties) + " near-ties");
  return ck.result();
}

// dl given (the reference's selection and routing-weight gradients): grad_logits
// against the reference's (balancing terms included), then grad_weight = dl^T x
// and grad_x (+)= dl W against fp64 products of the reference's dl.
Result check_router_backward(Backend& be, const RouterCase& c) {
  Checker ck;
  const int I = 8;
  const RouterInputs in = router_inputs(c, I);
  const kernels::RouterConfig cfg = router_config(c);
  const int64_t T = c.T;
  const int H = c.H, E = c.E, K = c.K;
  const ref::Config rc = ref_config(c, I);
  const ref::Weights rw = ref_weights(in);
  const std::vector<double> xd = to_double(in.x);
  const ref::Forward f = ref::forward(rc, rw, xd, T);
  const ref::Grads g = ref::backward(rc, rw, xd, f, to_double(normal_vector(T * H, 14)));

  auto as_float = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> gx0 = normal_vector(T * H, 15);
  Buffer x = to_backend(be, model::to_storage(in.x, c.dtype)), gate = to_backend(be, in.gate);
  Buffer scores = to_backend(be, as_float(f.scores)), logits = to_backend(be, as_float(f.logits));
  Buffer idx = to_backend(be, f.topk_idx), w = to_backend(be, as_float(f.topk_weight));
  Buffer gtw = to_backend(be, as_float(g.grad_topk_weight)), counts = to_backend(be, as_float(f.balance_counts));
  Buffer gl(be, 4 * T * E + 64), gw(be, 4 * E * H), gx = to_backend(be, gx0), ws(be, be.router_workspace_bytes(cfg) + 64);
  kernels::RouterBackwardArgs a;
  a.scores = scores.as<float>();
  a.topk_idx = idx.as<int32_t>();
  a.topk_weight = w.as<float>();
  a.grad_topk_weight = gtw.as<float>();
  a.x = x.get();
  a.weight = gate.as<float>();
  a.grad_logits = gl.as<float>();
  a.grad_weight = gw.as<float>();
  a.grad_x = gx.as<float>();
  a.workspace = ws.get();
  const double Tg = static_cast<double>(std::max<int64_t>(T, 1));
  a.aux_scale = static_cast<float>(c.aux * E / (K * Tg * Tg));
  a.balance_counts = counts.as<float>();
  a.z_scale = static_cast<float>(c.z / Tg);
  a.logits = logits.as<float>();
  be.router_backward(cfg, a);

  const bool empty = T == 0;
  ck.close("grad_logits", to_double(to_host<float>(be, gl.get(), T * E)), g.grad_logits, 1e-4, 1e-5, empty);
  std::vector<double> want_gw(static_cast<size_t>(E) * H, 0.0), want_gx = to_double(gx0);
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      const double dl = g.grad_logits[t * E + e];
      for (int h = 0; h < H; ++h) {
        want_gw[e * H + h] += dl * xd[t * H + h];
        want_gx[t * H + h] += dl * in.gate[e * H + h];
      }
    }
  ck.close("grad_weight", to_double(to_host<float>(be, gw.get(), E * H)), want_gw, 1e-4, 1e-5, empty);
  ck.close("grad_x", to_double(to_host<float>(be, gx.get(), T * H)), want_gx, 1e-4, 1e-5, empty);
  return ck.result();
}

// ---------------------------------------------------------------------------
// Capacity, replicas, layouts.

// Per expert, pairs in (token, k) order; probs: stable by weight, highest first.
std::vector<int32_t> host_capacity(const std::vector<int32_t>& idx, const std::vector<float>& w, int E,
                                   int64_t cap, kernels::DropPolicy policy) {
  std::vector<int32_t> kept = idx;
  for (int e = 0; e < E; ++e) {
    std::vector<int32_t> pairs;
    for (size_t p = 0; p < idx.size(); ++p)
      if (idx[p] == e) pairs.push_back(static_cast<int32_t>(p));
    if (policy == kernels::DropPolicy::kProbs)
      std::stable_sort(pairs.begin(), pairs.end(), [&](int32_t a, int32_t b) { return w[a] > w[b]; });
    for (size_t i = static_cast<size_t>(cap); i < pairs.size(); ++i) kept[pairs[i]] = -1;
  }
  return kept;
}

Result check_capacity(Backend& be, kernels::DropPolicy policy) {
  Checker ck;
  const int64_t T = 500;
  const int E = 8, K = 2;
  const std::vector<int32_t> idx = random_selection(T, K, E, 21, 5);
  std::vector<float> w(T * K);  // quarter steps: many equal weights, so the tie rule matters
  for (size_t p = 0; p < w.size(); ++p) w[p] = 0.25f * static_cast<float>(model::key_hash({22, p}) % 4);
  for (double cf : {0.0, 0.5, 1.0}) {
    const kernels::CapacityConfig cfg{T, E, K, cf, policy};
    Buffer di = to_backend(be, idx), dw = to_backend(be, w), kept(be, 4 * T * K), ws(be, be.capacity_workspace_bytes(cfg) + 64);
    be.capacity_drop(cfg, {di.as<int32_t>(), dw.as<float>(), kept.as<int32_t>(), ws.get()});
    const int64_t cap = cf == 0.0 ? T * K : cfg.capacity();
    ck.equal("kept_idx (cf " + std::to_string(cf) + ")", to_host<int32_t>(be, kept.get(), T * K),
             host_capacity(idx, w, E, cap, policy));
  }
  return ck.result();
}

Result check_select_replicas(Backend& be) {
  Checker ck;
  const int64_t T = 400;
  const int K = 4, E = 16, R = 3;
  const std::vector<int32_t> idx = random_selection(T, K, E, 31, 10);
  const std::vector<int32_t> logcnt = random_ints(E, 32, 1, R);
  std::vector<int32_t> log2phy(E * R, -1);
  for (int e = 0; e < E; ++e)
    for (int r = 0; r < logcnt[e]; ++r) log2phy[e * R + r] = e * R + r + 7;
  Buffer di = to_backend(be, idx), dl = to_backend(be, log2phy), dc = to_backend(be, logcnt), slot(be, 4 * T * K);
  kernels::ReplicaArgs a{di.as<int32_t>(), 1000, dl.as<int32_t>(), dc.as<int32_t>(), R, slot.as<int32_t>()};
  be.select_replicas(T, K, E, a);
  std::vector<int32_t> want(T * K, -1);
  for (int64_t p = 0; p < T * K; ++p)
    if (idx[p] >= 0)
      want[p] = log2phy[idx[p] * R + kernels::replica_index(1000 + p / K, idx[p], logcnt[idx[p]])];
  ck.equal("topk_slot", to_host<int32_t>(be, slot.get(), T * K), want);
  return ck.result();
}

Result check_dispatch_layout(Backend& be, int64_t T) {
  Checker ck;
  const int K = 4, R = 4, S = 5;
  const std::vector<int32_t> slots = random_selection(T, K, R * S, 41, 10);
  const std::vector<float> w = normal_vector(T * K, 42);
  const kernels::DispatchLayoutConfig cfg{T, K, R, S};
  const int64_t max_rows = T * std::min(R, K);
  Buffer ds = to_backend(be, slots), dw = to_backend(be, w), per_rank(be, 4 * R), per_slot(be, 4 * R * S),
      in_rank(be, T * R + 64), send_row(be, 4 * T * R + 64), src(be, 4 * max_rows + 64), sslot(be, 4 * max_rows * K + 64),
      sw(be, 4 * max_rows * K + 64), ws(be, be.dispatch_layout_workspace_bytes(cfg) + 64);
  std::vector<int64_t> rank_offset(R + 1);
  kernels::DispatchLayoutArgs a;
  a.topk_slot = ds.as<int32_t>();
  a.topk_weight = dw.as<float>();
  a.num_tokens_per_rank = per_rank.as<int32_t>();
  a.num_tokens_per_slot = per_slot.as<int32_t>();
  a.rank_offset = rank_offset.data();
  a.is_token_in_rank = in_rank.as<uint8_t>();
  a.token_send_row = send_row.as<int32_t>();
  a.send_src_token = src.as<int32_t>();
  a.send_slot = sslot.as<int32_t>();
  a.send_weight = sw.as<float>();
  a.workspace = ws.get();
  be.dispatch_layout(cfg, a);
  const ref::DispatchLayout want = ref::dispatch_layout(slots, w, T, K, R, S);
  const int64_t rows = rank_offset[R];
  ck.equal("num_tokens_per_rank", to_host<int32_t>(be, per_rank.get(), R), want.num_tokens_per_rank);
  ck.equal("num_tokens_per_slot", to_host<int32_t>(be, per_slot.get(), R * S), want.num_tokens_per_slot);
  ck.equal("is_token_in_rank", to_host<uint8_t>(be, in_rank.get(), T * R), want.is_token_in_rank);
  ck.equal("token_send_row", to_host<int32_t>(be, send_row.get(), T * R), want.token_send_row);
  ck.equal("send_src_token", to_host<int32_t>(be, src.get(), rows), want.send_src_token);
  ck.equal("send_slot", to_host<int32_t>(be, sslot.get(), rows * K), want.send_slot);
  ck.equal("send_weight", to_host<float>(be, sw.get(), rows * K), want.send_weight);
  int64_t acc = 0;
  for (int r = 0; r <= R; ++r) {
    ck.expect(rank_offset[r] == acc, "rank_offset[" + std::to_string(r) + "]");
    if (r < R) acc += want.num_tokens_per_rank[r];
  }
  return ck.result();
}

// The permute layout of row_expert [N, K] over L experts, on the host.
struct HostPermuteLayout {
  std::vector<int64_t> offset;
  std::vector<int32_t> src_row, pair_pos;
  std::vector<float> weight;
};

// Expert-major; within an expert, pairs in row order, or in the order of their
// rows' positions in row_order when one is given.
HostPermuteLayout host_permute_layout(const std::vector<int32_t>& row_expert, const std::vector<float>& row_weight,
                                      int64_t N, int K, int L, const std::vector<int32_t>& row_order = {}) {
  HostPermuteLayout h;
  h.offset.assign(L + 1, 0);
  h.pair_pos.assign(N * K, -1);
  for (int e = 0; e < L; ++e) {
    h.offset[e] = static_cast<int64_t>(h.src_row.size());
    for (int64_t i = 0; i < N * K; ++i) {
      const int64_t p = row_order.empty() ? i : row_order[i / K] * int64_t{K} + i % K;
      if (row_expert[p] == e) {
        h.pair_pos[p] = static_cast<int32_t>(h.src_row.size());
        h.src_row.push_back(static_cast<int32_t>(p / K));
        h.weight.push_back(row_weight[p]);
      }
    }
  }
  h.offset[L] = static_cast<int64_t>(h.src_row.size());
  return h;
}

// A seeded permutation of [0, n).
std::vector<int32_t> shuffled(int64_t n, uint64_t seed) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[i], v[model::key_hash({seed, uint64_t(i)}) % (i + 1)]);
  return v;
}

// ordered: with a row_order (a chunked layer's, docs/layer.md#overlap).
Result check_permute_layout(Backend& be, int64_t N, int L, bool ordered = false) {
  Checker ck;
  const int K = 4;
  const std::vector<int32_t> re = L > 0 ? random_selection(N, K, std::max(L, K), 51, 15) : std::vector<int32_t>(N * K, -1);
  std::vector<int32_t> row_expert = re;
  for (int32_t& e : row_expert)
    if (e >= L) e = -1;  // K distinct values of max(L, K): those beyond L are "not here"
  const std::vector<float> rw = normal_vector(N * K, 52);
  const kernels::PermuteLayoutConfig cfg{N, K, L};
  Buffer dre = to_backend(be, row_expert), drw = to_backend(be, rw), src(be, 4 * N * K + 64), pw(be, 4 * N * K + 64),
      pos(be, 4 * N * K + 64), ws(be, be.permute_layout_workspace_bytes(cfg) + 64);
  std::vector<int64_t> offset(L + 1, -7);
  const std::vector<int32_t> order = ordered ? shuffled(N, 53) : std::vector<int32_t>{};
  Buffer dorder = to_backend(be, order);
  be.permute_layout(cfg, {dre.as<int32_t>(), drw.as<float>(), offset.data(), src.as<int32_t>(), pw.as<float>(),
                          pos.as<int32_t>(), ws.get(), ordered ? dorder.as<int32_t>() : nullptr});
  const HostPermuteLayout want = host_permute_layout(row_expert, rw, N, K, L, order);
  const size_t M = want.src_row.size();
  ck.equal("expert_offset", offset, want.offset);
  ck.equal("perm_src_row", to_host<int32_t>(be, src.get(), M), want.src_row);
  ck.equal("perm_weight", to_host<float>(be, pw.get(), M), want.weight);
  ck.equal("pair_pos", to_host<int32_t>(be, pos.get(), N * K), want.pair_pos);
  return ck.result();
}

// ---------------------------------------------------------------------------
// Permute, unpermute, per-pair scalars.

std::vector<float> as_stored(const std::vector<float>& v, DType d) {
  std::vector<float> r = v;
  if (d == DType::kBF16) model::round_to_bf16(r);
  return r;
}

Result check_permute(Backend& be, int H, DType in, DType out) {
  Checker ck;
  const int64_t N = 300;
  const int K = 3, L = 6;
  std::vector<int32_t> row_expert = random_selection(N, K, L, 61, 20);
  const HostPermuteLayout lay = host_permute_layout(row_expert, std::vector<float>(N * K, 1.0f), N, K, L);
  const int64_t M = static_cast<int64_t>(lay.src_row.size());
  const std::vector<float> rows = as_stored(normal_vector(N * H, 62), in);
  Buffer drows = to_backend(be, model::to_storage(rows, in)), src = to_backend(be, lay.src_row), pos = to_backend(be, lay.pair_pos),
         dout(be, kernels::dtype_size(out) * M * H + 64);
  be.permute({N, K, M, H, in, out}, {drows.get(), src.as<int32_t>(), pos.as<int32_t>(), dout.get()});
  std::vector<float> want(M * H);
  for (int64_t m = 0; m < M; ++m)
    for (int h = 0; h < H; ++h) want[m * H + h] = rows[lay.src_row[m] * H + h];
  const std::vector<uint8_t> got = to_host<uint8_t>(be, dout.get(), kernels::dtype_size(out) * M * H);
  ck.equal("permuted rows", model::from_storage(got.data(), M * H, out), as_stored(want, out));
  return ck.result();
}

Result check_unpermute(Backend& be, int H, DType in, DType out, bool weighted, bool accumulate) {
  Checker ck;
  const int64_t N = 250;
  const int K = 4, L = 5;
  const std::vector<int32_t> row_expert = random_selection(N, K, L, 71, 25);
  const std::vector<float> w = normal_vector(N * K, 72);
  const HostPermuteLayout lay = host_permute_layout(row_expert, w, N, K, L);
  const int64_t M = static_cast<int64_t>(lay.src_row.size());
  const std::vector<float> perm = as_stored(normal_vector(M * H, 73), in);
  const std::vector<float> out0 = as_stored(normal_vector(N * H, 74), out);
  Buffer dperm = to_backend(be, model::to_storage(perm, in)), pos = to_backend(be, lay.pair_pos), dw = to_backend(be, w),
         dout = to_backend(be, model::to_storage(out0, out));
  be.unpermute({N, K, H, out, accumulate, in},
               {dperm.get(), pos.as<int32_t>(), weighted ? dw.as<float>() : nullptr, dout.get()});
  std::vector<double> want(N * H, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) {
      double acc = accumulate ? out0[n * H + h] : 0.0;
      for (int k = 0; k < K; ++k) {
        const int32_t m = lay.pair_pos[n * K + k];
        if (m >= 0) acc += (weighted ? w[n * K + k] : 1.0) * perm[m * H + h];
      }
      want[n * H + h] = acc;
    }
  const std::vector<uint8_t> got = to_host<uint8_t>(be, dout.get(), kernels::dtype_size(out) * N * H);
  const double rtol = out == DType::kBF16 ? test::kBf16Roundoff : 1e-6;
  ck.close("combined rows", to_double(model::from_storage(got.data(), N * H, out)), want, rtol, 1e-6);
  return ck.result();
}

// Rows [first, first + n) of a layout's combine (a part of a chunked layer): their
// pair_pos point anywhere in the whole layout's perm, past n * K.
Result check_unpermute_part(Backend& be) {
  Checker ck;
  const int64_t N = 256, first = 64, n = 40;
  const int K = 4, L = 6, H = 64;
  const std::vector<int32_t> row_expert = random_selection(N, K, L, 75, 25);
  const HostPermuteLayout lay = host_permute_layout(row_expert, std::vector<float>(N * K, 1.0f), N, K, L);
  const int64_t M = static_cast<int64_t>(lay.src_row.size());
  const std::vector<float> perm = normal_vector(M * H, 76);
  Buffer dperm = to_backend(be, perm), pos = to_backend(be, lay.pair_pos), dout(be, 4 * n * H);
  be.unpermute({.num_rows = n, .top_k = K, .hidden = H, .out_dtype = DType::kF32, .accumulate = false,
                .in_dtype = DType::kF32, .num_perm_rows = M},
               {dperm.get(), pos.as<int32_t>() + first * K, nullptr, dout.get()});
  std::vector<double> want(n * H, 0.0);
  int32_t furthest = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int k = 0; k < K; ++k) {
      const int32_t m = lay.pair_pos[(first + r) * K + k];
      furthest = std::max(furthest, m);
      if (m >= 0)
        for (int h = 0; h < H; ++h) want[r * H + h] += perm[m * H + h];
    }
  ck.expect(furthest >= n * K, "the part's positions stay below n * K: the check checks nothing");
  ck.close("combined rows", to_double(to_host<float>(be, dout.get(), n * H)), want, 1e-6, 1e-6);
  return ck.result();
}

Result check_pair_scalars(Backend& be) {
  Checker ck;
  const int64_t N = 200;
  const int K = 3, L = 4;
  const std::vector<int32_t> row_expert = random_selection(N, K, L, 81, 20);
  const HostPermuteLayout lay = host_permute_layout(row_expert, std::vector<float>(N * K, 0.0f), N, K, L);
  const std::vector<float> perm = normal_vector(lay.src_row.size(), 82);
  Buffer pos = to_backend(be, lay.pair_pos), dperm = to_backend(be, perm), pair(be, 4 * N * K);
  be.unpermute_scalars(pos.as<int32_t>(), N, K, dperm.as<float>(), pair.as<float>());
  std::vector<float> want(N * K);
  for (int64_t p = 0; p < N * K; ++p) want[p] = lay.pair_pos[p] >= 0 ? perm[lay.pair_pos[p]] : 0.0f;
  ck.equal("unpermute_scalars", to_host<float>(be, pair.get(), N * K), want);

  // combine_pair_scalars through a dispatch layout of R = 3 ranks, S = 2 slots.
  const int R = 3, S = 2;
  const std::vector<int32_t> slots = random_selection(N, K, R * S, 83, 10);
  const ref::DispatchLayout dl = ref::dispatch_layout(slots, std::vector<float>(N * K, 1.0f), N, K, R, S);
  const std::vector<float> rows = normal_vector(dl.send_src_token.size() * K, 84);
  Buffer ds = to_backend(be, slots), dsr = to_backend(be, dl.token_send_row), drows = to_backend(be, rows), out(be, 4 * N * K);
  be.combine_pair_scalars(ds.as<int32_t>(), dsr.as<int32_t>(), N, K, R, S, drows.as<float>(), out.as<float>());
  for (int64_t p = 0; p < N * K; ++p)
    want[p] = slots[p] < 0 ? 0.0f : rows[static_cast<int64_t>(dl.token_send_row[(p / K) * R + slots[p] / S]) * K + p % K];
  ck.equal("combine_pair_scalars", to_host<float>(be, out.get(), N * K), want);
  return ck.result();
}

// ---------------------------------------------------------------------------
// SwiGLU, grouped GEMM, optimizer.

Result check_swiglu(Backend& be) {
  Checker ck;
  const int64_t M = 100;
  const int I = 40;
  const std::vector<float> gu = normal_vector(M * 2 * I, 91, 2.0), dh = normal_vector(M * I, 92),
                           scale = normal_vector(M, 93);
  Buffer dgu = to_backend(be, gu), ddh = to_backend(be, dh), dscale = to_backend(be, scale), h(be, 4 * M * I),
         ggu(be, 4 * M * 2 * I), gscale(be, 4 * M), h2(be, 4 * M * I);
  be.swiglu_forward({M, I}, {dgu.as<float>(), dscale.as<float>(), h.as<float>()});
  be.swiglu_backward({M, I}, {dgu.as<float>(), ddh.as<float>(), dscale.as<float>(), ggu.as<float>(),
                              gscale.as<float>(), h2.as<float>()});
  std::vector<double> want_h(M * I), want_ggu(M * 2 * I), want_gs(M, 0.0);
  for (int64_t r = 0; r < M; ++r)
    for (int i = 0; i < I; ++i) {
      const double g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i], s = scale[r], d = dh[r * I + i];
      const double sig = 1.0 / (1.0 + std::exp(-g));
      want_h[r * I + i] = s * g * sig * u;
      want_gs[r] += d * g * sig * u;
      want_ggu[r * 2 * I + I + i] = d * s * g * sig;
      want_ggu[r * 2 * I + i] = d * s * u * sig * (1.0 + g * (1.0 - sig));
    }
  ck.close("h", to_double(to_host<float>(be, h.get(), M * I)), want_h, 1e-5, 1e-6);
  ck.close("h (backward)", to_double(to_host<float>(be, h2.get(), M * I)), want_h, 1e-5, 1e-6);
  ck.close("grad_gu", to_double(to_host<float>(be, ggu.get(), M * 2 * I)), want_ggu, 1e-5, 1e-6);
  ck.close("grad_row_scale", to_double(to_host<float>(be, gscale.get(), M)), want_gs, 1e-5, 1e-6);
  return ck.result();
}

// The expert MLP in parts (a chunked layer, docs/layer.md#overlap) against the
// same layout in one call: each expert's pairs in three runs (expert 2 has none),
// forward then the dgrad chain part by part, then the weight gradients alone. A
// part leaves the other pairs' outputs as they were. fp32: the values to fp32
// rounding (a GEMM of fewer rows may sum in another order); bf16: to one rounding
// of the bf16 operands.
Result check_expert_mlp_parts(Backend& be, DType dtype) {
  Checker ck;
  const int L = 4, H = 64, I = 48, K = 2, P = 3;
  const int64_t N = 300;
  std::vector<int32_t> re = random_selection(N, K, L, 111, 20);
  for (int32_t& e : re)
    if (e == 2) e = -1;
  const HostPermuteLayout lay = host_permute_layout(re, normal_vector(N * K, 112), N, K, L, shuffled(N, 113));
  const int64_t M = lay.offset[L];
  const kernels::ExpertMlpConfig cfg{L, H, I, M, N, dtype, true};
  const std::vector<float> rows = as_stored(normal_vector(N * H, 114), dtype), grad = as_stored(normal_vector(N * H, 115), dtype);
  Buffer drows = to_backend(be, model::to_storage(rows, dtype)), dgrad = to_backend(be, model::to_storage(grad, dtype)),
         src = to_backend(be, lay.src_row), pw = to_backend(be, lay.weight),
         w13 = to_backend(be, normal_vector(L * 2 * I * H, 116, 0.3)), w2 = to_backend(be, normal_vector(L * H * I, 117, 0.3)),
         ws(be, be.expert_mlp_workspace_bytes(cfg));
  const std::unique_ptr<kernels::PackedWeights> packed = be.make_expert_weights(cfg);
  be.pack_expert_weights(*packed, w13.as<float>(), w2.as<float>(), 0, L);
  // What one way of computing gives: y, saved_gu, grad_perm_x, grad_perm_weight, grad_w13, grad_w2.
  const char* names[] = {"y", "saved_gu", "grad_perm_x", "grad_perm_weight", "grad_w13", "grad_w2"};
  const int64_t sizes[] = {M * H, M * 2 * I, M * H, M, int64_t{L} * 2 * I * H, int64_t{L} * H * I};
  struct Outputs {
    std::vector<Buffer> b;
    float* at(int i) { return b[i].as<float>(); }
  };
  auto outputs = [&] {
    Outputs o;
    for (int64_t n : sizes) o.b.push_back(to_backend(be, std::vector<float>(n, 3.0f)));
    return o;
  };
  auto args = [&](Outputs& o) {
    const kernels::ExpertMlpForwardArgs f{.rows = drows.get(), .expert_offset = lay.offset.data(),
                                          .perm_src_row = src.as<int32_t>(), .perm_weight = pw.as<float>(),
                                          .w13 = w13.as<float>(), .w2 = w2.as<float>(), .packed = packed.get(),
                                          .y = o.at(0), .saved_gu = o.at(1), .workspace = ws.get(),
                                          .stats = nullptr, .part = {}};
    const kernels::ExpertMlpBackwardArgs b{.grad_rows = dgrad.get(), .rows = drows.get(),
                                           .expert_offset = lay.offset.data(), .perm_src_row = src.as<int32_t>(),
                                           .perm_weight = pw.as<float>(), .w13 = w13.as<float>(), .w2 = w2.as<float>(),
                                           .packed = packed.get(), .saved_gu = o.at(1), .grad_perm_x = o.at(2),
                                           .grad_perm_weight = o.at(3), .grad_w13 = o.at(4), .grad_w2 = o.at(5),
                                           .workspace = ws.get(), .stats = nullptr,
                                           .phase = kernels::MlpBackwardPhase::kAll, .part = {}};
    return std::pair{f, b};
  };
  Outputs whole = outputs(), parts = outputs();
  auto [f, b] = args(whole);
  be.expert_mlp_forward(cfg, f);
  be.expert_mlp_backward(cfg, b);

  auto [fp, bp] = args(parts);
  bp.phase = kernels::MlpBackwardPhase::kDgrad;
  std::vector<std::vector<int64_t>> cut(P + 1, std::vector<int64_t>(L));
  for (int p = 0; p <= P; ++p)
    for (int e = 0; e < L; ++e) cut[p][e] = lay.offset[e] + (lay.offset[e + 1] - lay.offset[e]) * p * p / (P * P);
  for (int p = 0; p < P; ++p) {
    fp.part = bp.part = {.pair_begin = cut[p].data(), .pair_end = cut[p + 1].data()};
    be.expert_mlp_forward(cfg, fp);
    if (p == 0) {  // only part 0's pairs have a y
      const std::vector<float> y = to_host<float>(be, parts.at(0), M * H);
      for (int e = 0; e < L; ++e)
        for (int64_t m = cut[1][e]; m < lay.offset[e + 1]; ++m)
          ck.expect(y[m * H] == 3.0f && y[m * H + H - 1] == 3.0f, "part 0 wrote y of pair " + std::to_string(m));
    }
    be.expert_mlp_backward(cfg, bp);
  }
  bp.part = {};
  bp.phase = kernels::MlpBackwardPhase::kWgrad;
  be.expert_mlp_backward(cfg, bp);
  const bool bf16 = dtype == DType::kBF16;
  for (int i = 0; i < 6; ++i) {
    ck.close(std::string("parts ") + names[i], to_double(to_host<float>(be, parts.at(i), sizes[i])),
             to_double(to_host<float>(be, whole.at(i), sizes[i])), bf16 ? 0x1.0p-7 : 1e-5, bf16 ? 0x1.0p-8 : 1e-6);
  }
  return ck.result();
}

Result check_grouped_gemm(Backend& be, kernels::GemmKind kind, bool accumulate) {
  Checker ck;
  const std::vector<int64_t> offset = {0, 3, 3, 20, 21, 61, 61};  // groups of 3, 0, 17, 1, 40, 0 rows
  const int G = 6;
  const int64_t n = 24, k = 40, M = offset[G];
  const bool wgrad = kind == kernels::GemmKind::kWgrad;
  const int64_t a_cols = kind == kernels::GemmKind::kForward ? k : n;
  const std::vector<float> a = normal_vector(M * a_cols, 101);
  const std::vector<float> b = wgrad ? normal_vector(M * k, 102) : normal_vector(G * n * k, 102);
  const int64_t c_size = wgrad ? G * n * k : M * (kind == kernels::GemmKind::kForward ? n : k);
  const std::vector<float> c0 = normal_vector(c_size, 103);
  Buffer da = to_backend(be, a), db = to_backend(be, b), dc = to_backend(be, c0);
  be.grouped_gemm({kind, G, n, k, accumulate}, {offset.data(), da.as<float>(), db.as<float>(), dc.as<float>()});
  std::vector<double> want(c_size);
  for (int64_t i = 0; i < c_size; ++i) want[i] = accumulate ? c0[i] : 0.0;
  for (int g = 0; g < G; ++g)
    for (int64_t r = offset[g]; r < offset[g + 1]; ++r)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) {
          const double w = wgrad ? 0.0 : b[(g * n + i) * k + j];
          if (kind == kernels::GemmKind::kForward)
            want[r * n + i] += a[r * k + j] * w;
          else if (kind == kernels::GemmKind::kDgrad)
            want[r * k + j] += a[r * n + i] * w;
          else
            want[(g * n + i) * k + j] += static_cast<double>(a[r * n + i]) * b[r * k + j];
        }
  ck.close("C", to_double(to_host<float>(be, dc.get(), c_size)), want, 1e-5, 1e-6);
  return ck.result();
}

// The step of kernels/api.h in fp64 from the same fp32 state.
void host_step(const kernels::OptimizerConfig& c, int64_t step, double& w, double g, double& m, double& v) {
  if (c.kind == kernels::OptimizerKind::kSgd) {
    w -= c.lr * g;
    return;
  }
  m = c.beta1 * m + (1.0 - c.beta1) * g;
  v = c.beta2 * v + (1.0 - c.beta2) * g * g;
  const double c1 = 1.0 - std::pow(static_cast<double>(c.beta1), static_cast<double>(step));
  const double c2 = 1.0 - std::pow(static_cast<double>(c.beta2), static_cast<double>(step));
  w -= c.lr * (m / c1) / (std::sqrt(v / c2) + c.eps);
}

// The moments as the backend stores them, widened to fp64.
std::vector<double> moments_on_host(Backend& be, const Buffer& b, int64_t n, DType dtype) {
  if (dtype == DType::kF32) return to_double(to_host<float>(be, b.get(), n));
  std::vector<double> out(n);
  const std::vector<kernels::bf16_t> bits = to_host<kernels::bf16_t>(be, b.get(), n);
  for (int64_t i = 0; i < n; ++i) out[i] = kernels::bf16_to_f32(bits[i]);
  return out;
}

// Three steps against fp64 (each step starts from the backend's own state, so
// errors do not compound), and the bf16 copy is exactly the rounded weight. bf16
// moments: the weight moves by the unrounded moments (so it holds fp32's bound)
// and the stored moments are within half a bf16 unit (2^-8 relative) of fp64's, plus fp32's rounding.
Result check_optimizer(Backend& be, kernels::OptimizerKind kind, DType moments = DType::kF32) {
  Checker ck;
  const int64_t n = 5000;
  kernels::OptimizerConfig cfg;
  cfg.kind = kind;
  cfg.lr = 3e-3f;
  cfg.moments = moments;
  const size_t moment_bytes = kernels::dtype_size(moments) * n;
  Buffer dw = to_backend(be, normal_vector(n, 111)), dm(be, moment_bytes), dv(be, moment_bytes), dr(be, 4 * n);
  be.fill_zero(dm.get(), moment_bytes);
  be.fill_zero(dv.get(), moment_bytes);
  const double moment_rtol = moments == DType::kF32 ? 1e-6 : 1.0 / 256 + 1e-6;
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<double> w = to_double(to_host<float>(be, dw.get(), n)), m = moments_on_host(be, dm, n, moments),
                        v = moments_on_host(be, dv, n, moments);
    const std::vector<float> g = normal_vector(n, 112 + step);
    Buffer dg = to_backend(be, g);
    be.optimizer_step(cfg, {n, step, dw.as<float>(), dg.as<float>(), dm.get(), dv.get(), dr.as<float>()});
    for (int64_t i = 0; i < n; ++i) host_step(cfg, step, w[i], g[i], m[i], v[i]);
    const std::string at = " (step " + std::to_string(step) + ")";
    const std::vector<float> got = to_host<float>(be, dw.get(), n);
    ck.close("weights" + at, to_double(got), w, 1e-6, 1e-7);
    if (kind == kernels::OptimizerKind::kAdam) {
      ck.close("m" + at, moments_on_host(be, dm, n, moments), m, moment_rtol, 1e-7);
      ck.close("v" + at, moments_on_host(be, dv, n, moments), v, moment_rtol, 1e-7);
    }
    std::vector<float> rounded = got;
    model::round_to_bf16(rounded);
    ck.equal("bf16-rounded weights" + at, to_host<float>(be, dr.get(), n), rounded);
  }
  return ck.result();
}

// ---------------------------------------------------------------------------
// The lists.

std::vector<Check> router_checks() {
  using kernels::ScoreFunc;
  std::vector<Check> v;
  auto add = [&](const std::string& name, RouterCase c) {
    v.push_back({"router_forward/" + name, [c](Backend& be) { return check_router_forward(be, c); }});
    v.push_back({"router_backward/" + name, [c](Backend& be) { return check_router_backward(be, c); }});
  };
  add("softmax_norm", {300, 64, 16, 4, ScoreFunc::kSoftmax, true, 1.0f});
  add("softmax_nonorm_bf16", {300, 64, 16, 4, ScoreFunc::kSoftmax, false, 2.5f, 0, 0, false, DType::kBF16});
  add("sigmoid_grouped_biases", {300, 48, 32, 4, ScoreFunc::kSigmoid, true, 2.5f, 8, 3, true});
  add("sigmoid_nonorm", {200, 48, 16, 2, ScoreFunc::kSigmoid, false, 1.0f});
  add("softmax_aux_z", {200, 48, 16, 4, ScoreFunc::kSoftmax, true, 1.0f, 0, 0, false, DType::kF32, 0.01, 0.001});
  add("sigmoid_aux_z", {200, 48, 16, 4, ScoreFunc::kSigmoid, true, 1.0f, 0, 0, false, DType::kF32, 0.01, 0.001});
  add("T0", {0, 32, 8, 2, ScoreFunc::kSoftmax, true, 1.0f});
  return v;
}

std::vector<Check> grouped_gemm_list() {
  using kernels::GemmKind;
  std::vector<Check> v;
  for (auto [name, kind] : {std::pair{"forward", GemmKind::kForward}, std::pair{"dgrad", GemmKind::kDgrad},
                            std::pair{"wgrad", GemmKind::kWgrad}})
    for (bool acc : {false, true})
      v.push_back({std::string("grouped_gemm/") + name + (acc ? "_accumulate" : ""),
                   [kind = kind, acc](Backend& be) { return check_grouped_gemm(be, kind, acc); }});
  return v;
}

std::vector<Check> layer_list() {
  std::vector<Check> v;
  for (const test::LayerCase& c : test::layer_cases()) {
    if (c.engine != test::Engine::kTable) continue;  // CPU engine variants
    v.push_back({std::string("layer/") + c.name, [c](Backend& be) {
                   const std::string failures = test::check_layer(be, c);
                   return Result{failures.empty(), failures};
                 }});
  }
  return v;
}

std::vector<Check> op_list() {
  using kernels::DropPolicy;
  std::vector<Check> v = {{"convert_add", check_convert_add}, {"fp8_rows", check_fp8_rows}};
  for (Check& c : router_checks()) v.push_back(std::move(c));
  v.push_back({"capacity/probs", [](Backend& be) { return check_capacity(be, DropPolicy::kProbs); }});
  v.push_back({"capacity/position", [](Backend& be) { return check_capacity(be, DropPolicy::kPosition); }});
  v.push_back({"select_replicas", check_select_replicas});
  v.push_back({"dispatch_layout", [](Backend& be) { return check_dispatch_layout(be, 700); }});
  v.push_back({"dispatch_layout/T0", [](Backend& be) { return check_dispatch_layout(be, 0); }});
  v.push_back({"permute_layout", [](Backend& be) { return check_permute_layout(be, 600, 7); }});
  v.push_back({"permute_layout/no_experts", [](Backend& be) { return check_permute_layout(be, 50, 0); }});
  v.push_back({"permute_layout/N0", [](Backend& be) { return check_permute_layout(be, 0, 3); }});
  v.push_back({"permute_layout/row_order", [](Backend& be) { return check_permute_layout(be, 600, 7, true); }});
  for (DType d : {DType::kF32, DType::kBF16})
    v.push_back({std::string("expert_mlp/parts_") + kernels::dtype_name(d),
                 [d](Backend& be) { return check_expert_mlp_parts(be, d); }});
  for (int H : {72, 128})
    for (DType in : {DType::kF32, DType::kBF16})
      for (DType out : {DType::kF32, DType::kBF16}) {
        const std::string tag = std::to_string(H) + "_" + kernels::dtype_name(in) + "_" + kernels::dtype_name(out);
        v.push_back({"permute/" + tag, [=](Backend& be) { return check_permute(be, H, in, out); }});
        v.push_back({"unpermute/" + tag, [=](Backend& be) { return check_unpermute(be, H, in, out, true, false); }});
      }
  v.push_back({"unpermute/unweighted_accumulate",
               [](Backend& be) { return check_unpermute(be, 128, DType::kF32, DType::kF32, false, true); }});
  v.push_back({"unpermute/part_of_a_layout", check_unpermute_part});
  v.push_back({"pair_scalars", check_pair_scalars});
  v.push_back({"swiglu", check_swiglu});
  v.push_back({"optimizer/adam", [](Backend& be) { return check_optimizer(be, kernels::OptimizerKind::kAdam); }});
  v.push_back({"optimizer/adam_bf16_moments",
               [](Backend& be) { return check_optimizer(be, kernels::OptimizerKind::kAdam, DType::kBF16); }});
  v.push_back({"optimizer/sgd", [](Backend& be) { return check_optimizer(be, kernels::OptimizerKind::kSgd); }});
  for (Check& c : grouped_gemm_list()) v.push_back(std::move(c));
  return v;
}

std::vector<Check> joined(std::vector<Check> a, const std::vector<Check>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

const std::vector<Check>& op_checks() {
  static const std::vector<Check> checks = op_list();
  return checks;
}

const std::vector<Check>& layer_checks() {
  static const std::vector<Check> checks = layer_list();
  return checks;
}

const std::vector<Check>& gemm_checks() {
  static const std::vector<Check> checks = joined(grouped_gemm_list(), layer_checks());
  return checks;
}

const std::vector<Check>& all_checks() {
  static const std::vector<Check> checks = joined(op_checks(), layer_checks());
  return checks;
}

std::string case_name(const Check& c) {
  std::string s = c.name;
  std::replace_if(s.begin(), s.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return s;
}

void PrintTo(const Check& c, std::ostream* os) { *os << c.name; }

}  // namespace moe::gpucheck
