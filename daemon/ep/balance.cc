#include "moe/ep/balance.h"

#include <algorithm>
#include <cmath>

#include "moe/base/check.h"

namespace moe::ep {

double aux_loss_scale(double coeff, int E, int K, double Tg) {
  return coeff > 0 && Tg > 0 ? coeff * E / (K * Tg * Tg) : 0.0;
}

double z_loss_scale(double coeff, double Tg) { return coeff > 0 && Tg > 0 ? coeff / Tg : 0.0; }

namespace {

double logsumexp(const float* l, int n) {
  double mx = -INFINITY, sum = 0.0;
  for (int i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(l[i]));
  for (int i = 0; i < n; ++i) sum += std::exp(l[i] - mx);
  return mx + std::log(sum);
}

// sum_e c_e P_te for one token.
double weighted_probs(kernels::ScoreFunc score, const float* s, const float* c, int E) {
  double cs = 0.0, S = 0.0;
  for (int e = 0; e < E; ++e) {
    cs += static_cast<double>(c[e]) * s[e];
    S += s[e];
  }
  switch (score) {
    case kernels::ScoreFunc::kSoftmax: return cs;
    case kernels::ScoreFunc::kSigmoid: return S > 0 ? cs / S : 0.0;
  }
  MOE_ASSERT(false);  // not a ScoreFunc
}

}  // namespace

BalanceLosses balance_losses(const kernels::RoutingParams& r, double aux_coeff, double z_coeff,
                             const std::vector<float>& logits, const std::vector<float>& scores, int64_t T,
                             const std::vector<float>& counts, double Tg) {
  const int E = r.num_experts;
  const double aux_scale = aux_loss_scale(aux_coeff, E, r.top_k, Tg), z_scale = z_loss_scale(z_coeff, Tg);
  BalanceLosses out;
  for (int64_t t = 0; t < T; ++t) {
    if (aux_scale > 0) out.aux += aux_scale * weighted_probs(r.score, &scores[t * E], counts.data(), E);
    if (z_scale > 0) {
      const double lse = logsumexp(&logits[t * E], E);
      out.z += z_scale * lse * lse;
    }
  }
  return out;
}

void update_selection_bias(std::vector<float>& bias, const std::vector<float>& counts, double rate) {
  double mean = 0.0;
  for (float c : counts) mean += c;
  mean /= static_cast<double>(counts.size());
  for (size_t e = 0; e < bias.size(); ++e) {
    const double d = mean - counts[e];
    bias[e] += static_cast<float>(rate * ((d > 0) - (d < 0)));
  }
}

}  // namespace moe::ep
