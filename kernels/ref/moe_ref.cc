#include "moe/ref/moe_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "moe/base/check.h"

namespace moe::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double silu_grad(double g) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return s * (1.0 + g * (1.0 - s));
}

// Indices of the best `count` values among allowed ones, best first; equal values
// go to the lower index. Also returns the best value left out (-inf if none).
std::vector<int> best_indices(const std::vector<double>& v, const std::vector<bool>& allowed,
                              int count, double* first_left_out) {
  std::vector<int> order;
  for (int i = 0; i < static_cast<int>(v.size()); ++i)
    if (allowed[i]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  *first_left_out = static_cast<int>(order.size()) > count ? v[order[count]] : -kInf;
  order.resize(count);
  return order;
}

// P of the balancing loss: softmax scores as they are; sigmoid scores
// normalised per token (s_te / sum_j s_tj), as Megatron does.
std::vector<double> balance_probs(const Config& cfg, const double* s) {
  std::vector<double> p(s, s + cfg.num_experts);
  switch (cfg.score) {
    case ScoreFunc::kSoftmax:
      break;
    case ScoreFunc::kSigmoid: {
      double sum = 0.0;
      for (double v : p) sum += v;
      for (double& v : p) v /= sum;
      break;
    }
  }
  return p;
}

double logsumexp(const double* l, int n) {
  double mx = -kInf, sum = 0.0;
  for (int i = 0; i < n; ++i) mx = std::max(mx, l[i]);
  for (int i = 0; i < n; ++i) sum += std::exp(l[i] - mx);
  return mx + std::log(sum);
}

// The counts and both balancing losses of the batch (their share of the global ones).
void balance_forward(const Config& cfg, const ForwardOptions& opts, Forward& f) {
  const int E = cfg.num_experts, K = cfg.top_k;
  const int64_t T = f.num_tokens;
  f.counts.assign(E, 0.0);
  for (int64_t p = 0; p < T * K; ++p) f.counts[f.topk_idx[p]] += 1.0;
  f.balance_counts = opts.global_counts.empty() ? f.counts : opts.global_counts;
  f.balance_tokens = opts.global_tokens > 0 ? opts.global_tokens : T;
  const double Tg = static_cast<double>(f.balance_tokens);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> P = balance_probs(cfg, &f.scores[t * E]);
    for (int e = 0; e < E; ++e) f.aux_loss += cfg.aux_loss_coeff * E / (K * Tg * Tg) * f.balance_counts[e] * P[e];
    const double lse = logsumexp(&f.logits[t * E], E);
    f.z_loss += cfg.z_loss_coeff * lse * lse / Tg;
  }
}

// The shared experts' path: out += scale x down(silu(gate x) * up x).
void shared_forward(const Config& cfg, const Weights& w, const std::vector<double>& x, Forward& f) {
  const int H = cfg.hidden, Is = cfg.shared_ffn_hidden;
  const int64_t T = f.num_tokens;
  if (Is == 0) return;
  f.shared_gu.assign(T * 2 * Is, 0.0);
  f.shared_out.assign(T * H, 0.0);
  f.shared_scale.assign(T, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    if (cfg.shared_gate) {
      double g = 0.0;
      for (int h = 0; h < H; ++h) g += x[t * H + h] * w.shared_gate[h];
      f.shared_scale[t] = 1.0 / (1.0 + std::exp(-g));
    }
    double* gu = &f.shared_gu[t * 2 * Is];
    for (int j = 0; j < 2 * Is; ++j) {
      double acc = 0.0;
      for (int h = 0; h < H; ++h) acc += w.shared_w13[static_cast<int64_t>(j) * H + h] * x[t * H + h];
      gu[j] = acc;
    }
    for (int h = 0; h < H; ++h) {
      double acc = 0.0;
      for (int i = 0; i < Is; ++i) acc += w.shared_w2[static_cast<int64_t>(h) * Is + i] * silu(gu[i]) * gu[Is + i];
      f.shared_out[t * H + h] = acc;
      f.out[t * H + h] += f.shared_scale[t] * acc;
    }
  }
}

}  // namespace

int64_t capacity(double cf, int64_t T, int K, int E) {
  const double v = cf * static_cast<double>(T) * K / E;
  const double f = std::floor(v);
  return v - f <= 1e-9 * std::max(1.0, v) ? static_cast<int64_t>(f) : static_cast<int64_t>(f) + 1;
}

Forward forward(const Config& cfg, const Weights& w, const std::vector<double>& x, int64_t T,
                const ForwardOptions& opts) {
  const int H = cfg.hidden, I = cfg.ffn_hidden, E = cfg.num_experts, K = cfg.top_k;
  MOE_CHECK(static_cast<int64_t>(x.size()) == T * H, "ref: x has ", x.size(), " values, expected ",
            T * H);
  Forward f;
  f.num_tokens = T;
  f.logits.assign(T * E, 0.0);
  f.scores.assign(T * E, 0.0);
  f.topk_idx.assign(T * K, -1);
  f.topk_weight.assign(T * K, 0.0);
  f.selection_margin.assign(T, kInf);

  for (int64_t t = 0; t < T; ++t) {
    // Router logits and scores.
    for (int e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int h = 0; h < H; ++h) acc += x[t * H + h] * w.gate[e * H + h];
      if (!w.logit_bias.empty()) acc += w.logit_bias[e];
      f.logits[t * E + e] = acc;
    }
    double* s = &f.scores[t * E];
    switch (cfg.score) {
      case ScoreFunc::kSigmoid:
        for (int e = 0; e < E; ++e) s[e] = 1.0 / (1.0 + std::exp(-f.logits[t * E + e]));
        break;
      case ScoreFunc::kSoftmax: {
        double mx = -kInf, sum = 0.0;
        for (int e = 0; e < E; ++e) mx = std::max(mx, f.logits[t * E + e]);
        for (int e = 0; e < E; ++e) sum += (s[e] = std::exp(f.logits[t * E + e] - mx));
        for (int e = 0; e < E; ++e) s[e] /= sum;
        break;
      }
    }

    // Selection on biased scores, optionally inside the best groups.
    std::vector<double> biased(E);
    for (int e = 0; e < E; ++e) biased[e] = s[e] + (w.selection_bias.empty() ? 0.0 : w.selection_bias[e]);
    std::vector<bool> allowed(E, true);
    if (cfg.num_groups > 1) {
      const int per_group = E / cfg.num_groups;
      std::vector<double> group_score(cfg.num_groups);
      for (int g = 0; g < cfg.num_groups; ++g) {
        std::vector<double> members(biased.begin() + g * per_group, biased.begin() + (g + 1) * per_group);
        std::sort(members.rbegin(), members.rend());
        group_score[g] = members[0] + (per_group > 1 ? members[1] : 0.0);
      }
      double left_out;
      const std::vector<int> groups = best_indices(
          group_score, std::vector<bool>(cfg.num_groups, true), cfg.group_top_k, &left_out);
      f.selection_margin[t] = group_score[groups.back()] - left_out;
      allowed.assign(E, false);
      for (int g : groups)
        for (int e = g * per_group; e < (g + 1) * per_group; ++e) allowed[e] = true;
    }
    if (opts.forced_topk_idx) {
      for (int k = 0; k < K; ++k) f.topk_idx[t * K + k] = opts.forced_topk_idx[t * K + k];
    } else {
      double left_out;
      const std::vector<int> chosen = best_indices(biased, allowed, K, &left_out);
      f.selection_margin[t] = std::min(f.selection_margin[t], biased[chosen.back()] - left_out);
      for (int k = 0; k < K; ++k) f.topk_idx[t * K + k] = chosen[k];
    }

    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += s[f.topk_idx[t * K + k]];
    for (int k = 0; k < K; ++k) {
      double wk = s[f.topk_idx[t * K + k]];
      if (cfg.norm_topk_prob) wk /= sum;
      f.topk_weight[t * K + k] = wk * cfg.routed_scaling_factor;
    }
  }

  // Capacity, per source segment and expert.
  f.kept_idx = f.topk_idx;
  if (cfg.capacity_factor > 0.0) {
    std::vector<int64_t> segments = opts.capacity_segments;
    if (segments.empty()) segments.push_back(T);
    MOE_CHECK(std::accumulate(segments.begin(), segments.end(), int64_t{0}) == T,
              "ref: capacity_segments do not add up to T");
    int64_t seg_begin = 0;
    for (int64_t seg_len : segments) {
      const int64_t cap = capacity(cfg.capacity_factor, seg_len, K, E);
      for (int e = 0; e < E; ++e) {
        std::vector<int64_t> pairs;  // t * K + k, in token order
        for (int64_t p = seg_begin * K; p < (seg_begin + seg_len) * K; ++p)
          if (f.topk_idx[p] == e) pairs.push_back(p);
        if (cfg.drop_policy == DropPolicy::kProbs)
          std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) {
            return f.topk_weight[a] > f.topk_weight[b];
          });
        for (size_t i = cap; i < pairs.size(); ++i) f.kept_idx[pairs[i]] = -1;
      }
      seg_begin += seg_len;
    }
  }

  // Experts: y = down(silu(gate x) * up x), weighted sum into out.
  if (opts.expert_x) {
    MOE_CHECK(static_cast<int64_t>(opts.expert_x->size()) == T * H, "ref: expert_x holds ", opts.expert_x->size(),
              " values, expected ", T * H);
    f.expert_x = *opts.expert_x;
  }
  const std::vector<double>& ex = opts.expert_x ? *opts.expert_x : x;
  f.gu.assign(T * K * 2 * I, 0.0);
  f.expert_out.assign(T * K * H, 0.0);
  f.out.assign(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = f.kept_idx[t * K + k];
      if (e < 0) continue;
      double* gu = &f.gu[(t * K + k) * 2 * I];
      for (int j = 0; j < 2 * I; ++j) {
        double acc = 0.0;
        for (int h = 0; h < H; ++h) acc += w.w13[(static_cast<int64_t>(e) * 2 * I + j) * H + h] * ex[t * H + h];
        gu[j] = acc;
      }
      double* y = &f.expert_out[(t * K + k) * H];
      for (int h = 0; h < H; ++h) {
        double acc = 0.0;
        for (int i = 0; i < I; ++i) acc += w.w2[(static_cast<int64_t>(e) * H + h) * I + i] * silu(gu[i]) * gu[I + i];
        y[h] = acc;
        f.out[t * H + h] += f.topk_weight[t * K + k] * acc;
      }
    }
  balance_forward(cfg, opts, f);
  shared_forward(cfg, w, x, f);
  return f;
}

namespace {

// dL/dlogits of the balancing losses, by the chain rule through P's Jacobian.
void balance_backward(const Config& cfg, const Forward& f, int64_t t, double* dl) {
  const int E = cfg.num_experts, K = cfg.top_k;
  const double Tg = static_cast<double>(f.balance_tokens);
  const double* s = &f.scores[t * E];
  if (cfg.aux_loss_coeff > 0) {
    std::vector<double> dP(E);  // dL_aux / dP_te
    for (int e = 0; e < E; ++e) dP[e] = cfg.aux_loss_coeff * E / (K * Tg * Tg) * f.balance_counts[e];
    switch (cfg.score) {
      case ScoreFunc::kSoftmax:
        for (int i = 0; i < E; ++i)
          for (int e = 0; e < E; ++e) dl[i] += dP[e] * s[e] * ((i == e ? 1.0 : 0.0) - s[i]);
        break;
      case ScoreFunc::kSigmoid: {
        double S = 0.0;
        for (int e = 0; e < E; ++e) S += s[e];
        for (int j = 0; j < E; ++j) {
          double ds = 0.0;  // dL/ds_j with P_e = s_e / S
          for (int e = 0; e < E; ++e) ds += dP[e] * ((e == j ? 1.0 : 0.0) / S - s[e] / (S * S));
          dl[j] += ds * s[j] * (1.0 - s[j]);
        }
        break;
      }
    }
  }
  if (cfg.z_loss_coeff > 0) {
    const double* l = &f.logits[t * E];
    const double lse = logsumexp(l, E);
    for (int i = 0; i < E; ++i) dl[i] += cfg.z_loss_coeff * 2.0 * lse * std::exp(l[i] - lse) / Tg;
  }
}

// The shared experts' gradients, and their path's share of grad_x.
void shared_backward(const Config& cfg, const Weights& w, const std::vector<double>& x, const Forward& f,
                     const std::vector<double>& grad_out, Grads& g) {
  const int H = cfg.hidden, Is = cfg.shared_ffn_hidden;
  const int64_t T = f.num_tokens;
  if (Is == 0) return;
  g.grad_shared_w13.assign(static_cast<size_t>(2) * Is * H, 0.0);
  g.grad_shared_w2.assign(static_cast<size_t>(H) * Is, 0.0);
  g.grad_shared_gate.assign(cfg.shared_gate ? H : 0, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* go = &grad_out[t * H];
    const double* gu = &f.shared_gu[t * 2 * Is];
    const double sc = f.shared_scale[t];
    if (cfg.shared_gate) {  // d out / d g_t = s (1 - s) shared(x)
      double dot = 0.0;
      for (int h = 0; h < H; ++h) dot += go[h] * f.shared_out[t * H + h];
      const double dg = dot * sc * (1.0 - sc);
      for (int h = 0; h < H; ++h) {
        g.grad_shared_gate[h] += dg * x[t * H + h];
        g.grad_x[t * H + h] += dg * w.shared_gate[h];
      }
    }
    std::vector<double> dh(Is, 0.0);
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < Is; ++i) {
        dh[i] += sc * go[h] * w.shared_w2[static_cast<int64_t>(h) * Is + i];
        g.grad_shared_w2[static_cast<int64_t>(h) * Is + i] += sc * go[h] * silu(gu[i]) * gu[Is + i];
      }
    for (int i = 0; i < Is; ++i) {
      const double dg = dh[i] * gu[Is + i] * silu_grad(gu[i]);
      const double du = dh[i] * silu(gu[i]);
      for (int h = 0; h < H; ++h) {
        g.grad_shared_w13[static_cast<int64_t>(i) * H + h] += dg * x[t * H + h];
        g.grad_shared_w13[static_cast<int64_t>(Is + i) * H + h] += du * x[t * H + h];
        g.grad_x[t * H + h] +=
            dg * w.shared_w13[static_cast<int64_t>(i) * H + h] + du * w.shared_w13[static_cast<int64_t>(Is + i) * H + h];
      }
    }
  }
}

}  // namespace

Grads backward(const Config& cfg, const Weights& w, const std::vector<double>& x,
               const Forward& f, const std::vector<double>& grad_out) {
  const int H = cfg.hidden, I = cfg.ffn_hidden, E = cfg.num_experts, K = cfg.top_k;
  const int64_t T = f.num_tokens;
  Grads g;
  g.grad_x.assign(T * H, 0.0);
  g.grad_gate.assign(static_cast<size_t>(E) * H, 0.0);
  g.grad_w13.assign(static_cast<size_t>(E) * 2 * I * H, 0.0);
  g.grad_w2.assign(static_cast<size_t>(E) * H * I, 0.0);
  g.grad_topk_weight.assign(T * K, 0.0);
  g.grad_logits.assign(T * E, 0.0);
  g.grad_gu.assign(T * K * 2 * I, 0.0);
  const std::vector<double>& ex = f.expert_x.empty() ? x : f.expert_x;

  for (int64_t t = 0; t < T; ++t) {
    const double* go = &grad_out[t * H];
    // Experts.
    for (int k = 0; k < K; ++k) {
      const int e = f.kept_idx[t * K + k];
      if (e < 0) continue;
      const double wk = f.topk_weight[t * K + k];
      const double* y = &f.expert_out[(t * K + k) * H];
      const double* gu = &f.gu[(t * K + k) * 2 * I];
      double dot = 0.0;
      for (int h = 0; h < H; ++h) dot += go[h] * y[h];
      g.grad_topk_weight[t * K + k] = dot;
      std::vector<double> dh(I, 0.0);
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < I; ++i) {
          const double wv = w.w2[(static_cast<int64_t>(e) * H + h) * I + i];
          dh[i] += wk * go[h] * wv;
          g.grad_w2[(static_cast<int64_t>(e) * H + h) * I + i] += wk * go[h] * silu(gu[i]) * gu[I + i];
        }
      for (int i = 0; i < I; ++i) {
        const double dg = dh[i] * gu[I + i] * silu_grad(gu[i]);
        const double du = dh[i] * silu(gu[i]);
        g.grad_gu[(t * K + k) * 2 * I + i] = dg;
        g.grad_gu[(t * K + k) * 2 * I + I + i] = du;
        for (int h = 0; h < H; ++h) {
          const int64_t gate_row = (static_cast<int64_t>(e) * 2 * I + i) * H;
          const int64_t up_row = (static_cast<int64_t>(e) * 2 * I + I + i) * H;
          g.grad_w13[gate_row + h] += dg * ex[t * H + h];
          g.grad_w13[up_row + h] += du * ex[t * H + h];
          g.grad_x[t * H + h] += dg * w.w13[gate_row + h] + du * w.w13[up_row + h];
        }
      }
    }

    // Router, by the chain rule: dL/ds_j from the weights, then the score Jacobian.
    const double* s = &f.scores[t * E];
    const double c = cfg.routed_scaling_factor;
    double sel_sum = 0.0;
    for (int k = 0; k < K; ++k) sel_sum += s[f.topk_idx[t * K + k]];
    std::vector<double> ds(E, 0.0);
    for (int k = 0; k < K; ++k) {
      const int ek = f.topk_idx[t * K + k];
      const double gk = g.grad_topk_weight[t * K + k];
      if (cfg.norm_topk_prob) {
        // w_k = c s_ek / sum_S s
        ds[ek] += gk * c / sel_sum;
        for (int j = 0; j < K; ++j) ds[f.topk_idx[t * K + j]] -= gk * c * s[ek] / (sel_sum * sel_sum);
      } else {
        ds[ek] += gk * c;
      }
    }
    double* dl = &g.grad_logits[t * E];
    for (int i = 0; i < E; ++i) {
      switch (cfg.score) {
        case ScoreFunc::kSigmoid:
          dl[i] = ds[i] * s[i] * (1.0 - s[i]);
          break;
        case ScoreFunc::kSoftmax: {
          double acc = 0.0;
          for (int j = 0; j < E; ++j) acc += ds[j] * s[j] * ((i == j ? 1.0 : 0.0) - s[i]);
          dl[i] = acc;
          break;
        }
      }
    }
    balance_backward(cfg, f, t, dl);
    for (int e = 0; e < E; ++e)
      for (int h = 0; h < H; ++h) {
        g.grad_gate[e * H + h] += dl[e] * x[t * H + h];
        g.grad_x[t * H + h] += dl[e] * w.gate[e * H + h];
      }
  }
  shared_backward(cfg, w, x, f, grad_out, g);
  return g;
}

DispatchLayout dispatch_layout(const std::vector<int32_t>& topk_slot, const std::vector<float>& topk_weight,
                               int64_t T, int K, int R, int S) {
  DispatchLayout d;
  d.num_tokens_per_rank.assign(R, 0);
  d.num_tokens_per_slot.assign(static_cast<size_t>(R) * S, 0);
  d.is_token_in_rank.assign(T * R, 0);
  d.token_send_row.assign(T * R, -1);
  std::vector<std::vector<int64_t>> tokens_of_rank(R);
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int32_t slot = topk_slot[t * K + k];
      if (slot < 0) continue;
      ++d.num_tokens_per_slot[slot];
      d.is_token_in_rank[t * R + slot / S] = 1;
    }
    for (int r = 0; r < R; ++r)
      if (d.is_token_in_rank[t * R + r]) {
        tokens_of_rank[r].push_back(t);
        ++d.num_tokens_per_rank[r];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t t : tokens_of_rank[r]) {
      const int32_t row = static_cast<int32_t>(d.send_src_token.size());
      d.token_send_row[t * R + r] = row;
      d.send_src_token.push_back(static_cast<int32_t>(t));
      for (int k = 0; k < K; ++k) {
        const int32_t slot = topk_slot[t * K + k];
        const bool here = slot >= 0 && slot / S == r;
        d.send_slot.push_back(here ? slot % S : -1);
        d.send_weight.push_back(here ? topk_weight[t * K + k] : 0.0f);
      }
    }
  return d;
}

double round_e4m3(double v) {
  if (std::isnan(v)) return v;
  const double a = std::fabs(v);
  double q;
  if (a >= 448.0) {
    q = 448.0;
  } else if (a < std::ldexp(1.0, -6)) {  // subnormals: multiples of 2^-9
    q = std::nearbyint(a * 512.0) / 512.0;  // the default mode rounds half to even
  } else {
    const double step = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - 3);
    q = std::min(448.0, std::nearbyint(a / step) * step);
  }
  return std::copysign(q, v);
}

std::vector<double> through_fp8_wire(const std::vector<float>& rows, int64_t n, int H) {
  MOE_CHECK(static_cast<int64_t>(rows.size()) == n * H, "ref: ", rows.size(), " values for ", n, " rows of ", H);
  constexpr int kGroup = 128;
  // fp32 division and multiplication, each correctly rounded: the exact quotient
  // or product in fp64 rounded once to fp32 (fp64 holds them exactly enough).
  auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  std::vector<double> out(rows.size());
  for (int64_t r = 0; r < n; ++r)
    for (int g0 = 0; g0 < H; g0 += kGroup) {
      const int g1 = std::min(H, g0 + kGroup);
      double amax = 0;
      for (int i = g0; i < g1; ++i)
        if (!std::isnan(rows[r * H + i])) amax = std::max(amax, std::fabs(static_cast<double>(rows[r * H + i])));
      const double scale = amax > 0 ? f32(amax / 448.0) : 1.0;
      for (int i = g0; i < g1; ++i) out[r * H + i] = f32(round_e4m3(f32(rows[r * H + i] / scale)) * scale);
    }
  return out;
}

std::vector<double> through_bf16_wire(const std::vector<float>& rows) {
  std::vector<double> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {  // to nearest even at 8 significant bits
    const double v = rows[i];
    if (v == 0 || !std::isfinite(v)) {
      out[i] = v;
      continue;
    }
    const double step = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::fabs(v)))) - 7);
    out[i] = std::nearbyint(v / step) * step;
  }
  return out;
}

std::vector<double> through_wire(kernels::WireFormat f, const std::vector<float>& rows, int64_t n, int H) {
  MOE_CHECK(static_cast<int64_t>(rows.size()) == n * H, "ref: ", rows.size(), " values for ", n, " rows of ", H);
  switch (f) {
    case kernels::WireFormat::kF32: return {rows.begin(), rows.end()};
    case kernels::WireFormat::kBF16: return through_bf16_wire(rows);
    case kernels::WireFormat::kFP8: return through_fp8_wire(rows, n, H);
  }
  detail::fail("ref: invalid wire format ", static_cast<int>(f));
}

std::vector<double> expert_rows_through(kernels::WireFormat f, kernels::DType layer, const std::vector<float>& x,
                                        int H) {
  if (f == kernels::wire_of(layer)) return {};
  std::vector<double> ex = through_wire(f, x, static_cast<int64_t>(x.size()) / H, H);
  if (layer != kernels::DType::kBF16) return ex;
  return through_bf16_wire(std::vector<float>(ex.begin(), ex.end()));  // decoded into bf16 rows
}

}  // namespace moe::ref
