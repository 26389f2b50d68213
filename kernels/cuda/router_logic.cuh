// The router's per-token work, shared by its CUDA kernels (one thread per token)
// and by the host emulation of those kernels in tests/gpu/cuda_logic_test.cu:
// __host__ __device__ functions over one token's row, with the CPU backend's
// rules (kernels/cpu/router.cc): ties to the lower index, NaN selects as -inf,
// group score = the sum of the group's two best biased scores.
#pragma once

#include <cmath>
#include <cstdint>

#include "moe/kernels/api.h"

namespace moe::kernels::cuda::router_logic {

// The per-thread selection keeps its top-k and group lists in registers.
constexpr int kMaxTopK = 32;
constexpr int kMaxGroups = 64;

struct SelectParams {
  int64_t T;
  int E, K, G, group_top_k;
  ScoreFunc score;
  bool norm;
  float scaling;
};

// NaN never wins a comparison: it selects as -inf.
MOE_HOST_DEVICE inline float selection_key(float v) { return v != v ? -INFINITY : v; }

// Inserts (v, i) into the descending list key/idx of `filled` entries and capacity
// k; strictly greater wins, so an equal later index stays behind.
MOE_HOST_DEVICE inline void insert_top(float v, int i, float* key, int* idx, int& filled, int k) {
  if (filled == k && !(v > key[k - 1])) return;
  int pos = filled < k ? filled++ : k - 1;
  while (pos > 0 && v > key[pos - 1]) {
    key[pos] = key[pos - 1];
    idx[pos] = idx[pos - 1];
    --pos;
  }
  key[pos] = v;
  idx[pos] = i;
}

MOE_HOST_DEVICE inline float biased(const float* s, const float* bias, int e) {
  return selection_key(s[e] + (bias ? bias[e] : 0.0f));
}

// Writes the token's scores from its logits (logit bias added first).
MOE_HOST_DEVICE inline void token_scores(const SelectParams& p, float* l, float* s, const float* logit_bias) {
  if (logit_bias)
    for (int e = 0; e < p.E; ++e) l[e] += logit_bias[e];
  switch (p.score) {
    case ScoreFunc::kSigmoid:
      for (int e = 0; e < p.E; ++e) s[e] = 1.0f / (1.0f + expf(-l[e]));
      return;
    case ScoreFunc::kSoftmax: {
      float mx = -INFINITY, sum = 0.0f;
      for (int e = 0; e < p.E; ++e) mx = fmaxf(mx, l[e]);
      for (int e = 0; e < p.E; ++e) {
        s[e] = expf(l[e] - mx);
        sum += s[e];
      }
      const float inv = 1.0f / sum;
      for (int e = 0; e < p.E; ++e) s[e] *= inv;
      return;
    }
  }
}

// Bit g set when group g is among the best group_top_k (group score: the sum of
// its two highest biased scores).
MOE_HOST_DEVICE inline uint64_t allowed_groups(const SelectParams& p, const float* s, const float* bias) {
  const int per_group = p.E / p.G;
  float gkey[kMaxGroups];
  int gidx[kMaxGroups];
  int gfilled = 0;
  for (int g = 0; g < p.G; ++g) {
    float key[2];
    int idx[2], filled = 0;
    const int two = per_group < 2 ? per_group : 2;
    for (int j = 0; j < per_group; ++j) insert_top(biased(s, bias, g * per_group + j), j, key, idx, filled, two);
    // As the CPU: a NaN group score (inf + -inf) selects as -inf.
    insert_top(selection_key(two == 2 ? key[0] + key[1] : key[0]), g, gkey, gidx, gfilled, p.group_top_k);
  }
  uint64_t mask = 0;
  for (int i = 0; i < p.group_top_k; ++i) mask |= uint64_t{1} << gidx[i];
  return mask;
}

// ---------------------------------------------------------------------------
// Backward: dL/dlogits per token, the four closed forms, plus the balancing terms.

struct GradParams {
  int64_t T;
  int E, K;
  ScoreFunc score;
  bool norm;
  float c;  // routed_scaling_factor
  float aux_scale, z_scale;
};

MOE_HOST_DEVICE inline void routing_weight_grad(const GradParams& p, const float* s, const int32_t* idx, const float* w,
                                    const float* g, float* dl) {
  for (int e = 0; e < p.E; ++e) dl[e] = 0.0f;
  switch (p.score) {
    case ScoreFunc::kSoftmax:
      if (p.norm) {
        float G = 0.0f;
        for (int k = 0; k < p.K; ++k) G += w[k] * g[k];
        G /= p.c;
        for (int k = 0; k < p.K; ++k) dl[idx[k]] = w[k] * (g[k] - G);
      } else {
        float sg = 0.0f;
        for (int k = 0; k < p.K; ++k) sg += s[idx[k]] * g[k];
        for (int e = 0; e < p.E; ++e) dl[e] = -p.c * s[e] * sg;
        for (int k = 0; k < p.K; ++k) dl[idx[k]] += p.c * s[idx[k]] * g[k];
      }
      return;
    case ScoreFunc::kSigmoid:
      if (p.norm) {
        float G = 0.0f, ssum = 0.0f;
        for (int k = 0; k < p.K; ++k) {
          G += w[k] * g[k];
          ssum += s[idx[k]];
        }
        G /= p.c;
        if (ssum > 0.0f)
          for (int k = 0; k < p.K; ++k) {
            const float sk = s[idx[k]];
            dl[idx[k]] = sk * (1.0f - sk) * p.c * (g[k] - G) / ssum;
          }
      } else {
        for (int k = 0; k < p.K; ++k) {
          const float sk = s[idx[k]];
          dl[idx[k]] = p.c * sk * (1.0f - sk) * g[k];
        }
      }
      return;
  }
}

MOE_HOST_DEVICE inline void add_aux_grad(const GradParams& p, const float* s, const float* c, float* dl) {
  float S = 0.0f, cs = 0.0f;
  for (int e = 0; e < p.E; ++e) {
    S += s[e];
    cs += c[e] * s[e];
  }
  switch (p.score) {
    case ScoreFunc::kSoftmax:
      for (int e = 0; e < p.E; ++e) dl[e] += p.aux_scale * s[e] * (c[e] - cs);
      return;
    case ScoreFunc::kSigmoid:
      if (S <= 0.0f) return;
      cs /= S;
      for (int e = 0; e < p.E; ++e) dl[e] += p.aux_scale * s[e] * (1.0f - s[e]) * (c[e] - cs) / S;
      return;
  }
}

MOE_HOST_DEVICE inline void add_z_grad(const GradParams& p, const float* l, float* dl) {
  float mx = -INFINITY, sum = 0.0f;
  for (int e = 0; e < p.E; ++e) mx = fmaxf(mx, l[e]);
  for (int e = 0; e < p.E; ++e) sum += expf(l[e] - mx);
  const float lse = mx + logf(sum);
  for (int e = 0; e < p.E; ++e) dl[e] += 2.0f * p.z_scale * lse * expf(l[e] - lse);
}

// Token t of the forward: scores from logits (logit bias added in place), then the
// selection and its weights.
MOE_HOST_DEVICE inline void select_token(const SelectParams& p, int64_t t, float* logits, float* scores,
                                         const float* bias, const float* logit_bias, int32_t* topk_idx,
                                         float* topk_weight) {
  float* l = logits + t * p.E;
  float* s = scores + t * p.E;
  token_scores(p, l, s, logit_bias);
  const uint64_t mask = p.G > 1 ? allowed_groups(p, s, bias) : ~uint64_t{0};
  const int per_group = p.G > 1 ? p.E / p.G : p.E;
  float key[kMaxTopK];
  int idx[kMaxTopK], filled = 0;
  for (int e = 0; e < p.E; ++e)
    if ((mask >> (e / per_group)) & 1) insert_top(biased(s, bias, e), e, key, idx, filled, p.K);
  float sum = 0.0f;
  for (int k = 0; k < p.K; ++k) sum += s[idx[k]];
  const float scale = p.norm && sum > 0.0f ? p.scaling / sum : p.scaling;
  for (int k = 0; k < p.K; ++k) {
    topk_idx[t * p.K + k] = idx[k];
    topk_weight[t * p.K + k] = s[idx[k]] * scale;
  }
}

// Token t of the backward: dL/dlogits through the routing weights and the
// balancing losses.
MOE_HOST_DEVICE inline void logit_grad_token(const GradParams& p, const RouterBackwardArgs& a, int64_t t) {
  float* dl = a.grad_logits + t * p.E;
  const float* s = a.scores + t * p.E;
  routing_weight_grad(p, s, a.topk_idx + t * p.K, a.topk_weight + t * p.K, a.grad_topk_weight + t * p.K, dl);
  if (p.aux_scale != 0.0f) add_aux_grad(p, s, a.balance_counts, dl);
  if (p.z_scale != 0.0f) add_z_grad(p, a.logits + t * p.E, dl);
}

}  // namespace moe::kernels::cuda::router_logic
