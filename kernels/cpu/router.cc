// Router forward (scores, group-limited top-k, weights) and backward (the four
// softmax/sigmoid x norm cases of docs/layer.md#router-gradient, then the GEMMs to x and W).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_ops.h"
#include "moe/base/check.h"
#include "packed_weights.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

constexpr int64_t kRowsPerGemmBlock = 64;

// x as fp32: the input itself, or its conversion into the workspace.
const float* x_as_f32(ThreadPool& pool, const RouterConfig& cfg, const void* x, void* workspace) {
  if (cfg.x_dtype == DType::kF32) return static_cast<const float*>(x);
  float* x32 = static_cast<float*>(workspace);
  convert(pool, x, DType::kBF16, x32, DType::kF32, cfg.num_tokens * cfg.hidden);
  return x32;
}

// NaN never wins a comparison: it selects as -inf.
inline float selection_key(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }

// Top-k of key[0..n) restricted to allowed (null = all), best first, ties to the
// lower index. Writes k indices into out.
void top_k_indices(const float* key, int n, const uint8_t* allowed, int k, int32_t* out,
                   float* out_key) {
  int filled = 0;
  for (int e = 0; e < n; ++e) {
    if (allowed && !allowed[e]) continue;
    const float v = selection_key(key[e]);
    // Strictly greater wins, so an equal later index stays behind (ties -> lower index).
    if (filled == k && !(v > out_key[k - 1])) continue;
    int pos = filled < k ? filled++ : k - 1;
    while (pos > 0 && v > out_key[pos - 1]) {
      out_key[pos] = out_key[pos - 1];
      out[pos] = out[pos - 1];
      --pos;
    }
    out_key[pos] = v;
    out[pos] = e;
  }
}

void sigmoid_row(const float* logits, float* s, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, sigmoid_ps(_mm256_loadu_ps(logits + i)));
  for (; i < n; ++i) s[i] = sigmoid_scalar(logits[i]);
}

void softmax_row(const float* logits, float* s, int n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, logits[i]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(logits + i), vmx));
    _mm256_storeu_ps(s + i, v);
    vsum = _mm256_add_ps(vsum, v);
  }
  float sum = hsum_ps(vsum);
  for (; i < n; ++i) {
    s[i] = exp_scalar(logits[i] - mx);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int j = 0; j < n; ++j) s[j] *= inv;
}

void scores_row(ScoreFunc score, const float* logits, float* s, int n) {
  switch (score) {
    case ScoreFunc::kSoftmax: return softmax_row(logits, s, n);
    case ScoreFunc::kSigmoid: return sigmoid_row(logits, s, n);
  }
}

// Workspace: [x as fp32 (bf16 input only)] [per-thread selection scratch, the
// row GEMM's scratch] x threads.
struct RouterScratch {
  float* biased;       // [E]
  float* group_score;  // [G]
  float* top_key;      // [max(K, group_top_k)]
  int32_t* top_groups; // [group_top_k]
  uint8_t* allowed;    // [E]
  void* gemm;          // row_gemm_scratch_bytes(max(E, H))
};

size_t router_x32_bytes(const RouterConfig& cfg) {
  return cfg.x_dtype == DType::kF32 ? 0 : align64(static_cast<size_t>(cfg.num_tokens) * cfg.hidden * 4);
}

size_t router_selection_bytes(const RouterConfig& cfg) {
  const size_t E = cfg.num_experts, G = std::max(cfg.num_groups, 1);
  const size_t k = std::max(cfg.top_k, cfg.group_top_k);
  return align64(4 * (E + G + k + std::max(cfg.group_top_k, 1)) + E);
}

size_t router_scratch_bytes(const RouterConfig& cfg) {
  return router_selection_bytes(cfg) + row_gemm_scratch_bytes(std::max(cfg.num_experts, cfg.hidden));
}

RouterScratch router_scratch(const RouterConfig& cfg, void* workspace, int thread) {
  uint8_t* base = static_cast<uint8_t*>(workspace) + router_x32_bytes(cfg) +
                  router_scratch_bytes(cfg) * thread;
  const size_t E = cfg.num_experts, G = std::max(cfg.num_groups, 1);
  const size_t k = std::max(cfg.top_k, cfg.group_top_k);
  RouterScratch s;
  s.biased = reinterpret_cast<float*>(base);
  s.group_score = s.biased + E;
  s.top_key = s.group_score + G;
  s.top_groups = reinterpret_cast<int32_t*>(s.top_key + k);
  s.allowed = reinterpret_cast<uint8_t*>(s.top_groups + std::max(cfg.group_top_k, 1));
  s.gemm = base + router_selection_bytes(cfg);
  return s;
}

}  // namespace

size_t router_workspace_bytes(const RouterConfig& cfg, int num_threads) {
  return router_x32_bytes(cfg) + router_scratch_bytes(cfg) * num_threads;
}

// logits [T, E] = x gate^T in fp32 on the row-invariant GEMM (a token's logits
// are the same bits whatever tokens share its rank), x widened to fp32 (bf16
// values are exact in fp32), gate^T in the panels pack_router_weights made.
void router_logits(ThreadPool& pool, const RouterConfig& cfg, const RouterForwardArgs& a,
                   const CpuRouterWeights& packed) {
  const int64_t T = cfg.num_tokens;
  const int H = cfg.hidden, E = cfg.num_experts;
  const float* x = x_as_f32(pool, cfg, a.x, a.workspace);
  const RowGemmPanels gate = packed.gate_t.expert(0);
  parallel_blocks(pool, T, kRowsPerGemmBlock, [&](int64_t t0, int64_t t1, int thread) {
    row_gemm(gate.kernel, x + t0 * H, t1 - t0, H, RowGemmB::of(gate), a.logits + t0 * E, E,
             router_scratch(cfg, a.workspace, thread).gemm);
  });
}

void router_forward(ThreadPool& pool, const RouterConfig& cfg, const RouterForwardArgs& a) {
  cfg.validate();
  const CpuRouterWeights& packed = checked_router_weights(a.packed_weight, cfg);
  const int64_t T = cfg.num_tokens;
  const int E = cfg.num_experts, K = cfg.top_k;
  if (T == 0) return;
  router_logits(pool, cfg, a, packed);

  const int G = cfg.group_limited() ? cfg.num_groups : 1;
  const int per_group = E / G;
  parallel_blocks(pool, T, 16, [&](int64_t t0, int64_t t1, int thread) {
    const RouterScratch sc = router_scratch(cfg, a.workspace, thread);
    float* biased = sc.biased;
    float* group_score = sc.group_score;
    float* top_key = sc.top_key;
    int32_t* top_groups = sc.top_groups;
    uint8_t* allowed = sc.allowed;
    int32_t pair[2];
    float pair_key[2];
    for (int64_t t = t0; t < t1; ++t) {
      float* logits = a.logits + t * E;
      float* s = a.scores + t * E;
      if (a.logit_bias)
        for (int e = 0; e < E; ++e) logits[e] += a.logit_bias[e];
      scores_row(cfg.score, logits, s, E);
      for (int e = 0; e < E; ++e) biased[e] = s[e] + (a.selection_bias ? a.selection_bias[e] : 0.0f);

      const uint8_t* mask = nullptr;
      if (cfg.group_limited()) {
        const int two = std::min(2, per_group);
        for (int g = 0; g < G; ++g) {
          top_k_indices(biased + g * per_group, per_group, nullptr, two, pair, pair_key);
          group_score[g] = two == 2 ? pair_key[0] + pair_key[1] : pair_key[0];
        }
        top_k_indices(group_score, G, nullptr, cfg.group_top_k, top_groups, top_key);
        std::memset(allowed, 0, E);
        for (int i = 0; i < cfg.group_top_k; ++i)
          std::memset(allowed + top_groups[i] * per_group, 1, per_group);
        mask = allowed;
      }
      int32_t* idx = a.topk_idx + t * K;
      float* w = a.topk_weight + t * K;
      top_k_indices(biased, E, mask, K, idx, top_key);
      float sum = 0.0f;
      for (int k = 0; k < K; ++k) {
        w[k] = s[idx[k]];
        sum += w[k];
      }
      const float scale = cfg.norm_topk_prob && sum > 0.0f ? cfg.routed_scaling_factor / sum
                                                           : cfg.routed_scaling_factor;
      for (int k = 0; k < K; ++k) w[k] *= scale;
    }
  });
}

namespace {

// dL/dlogits of token t through its routing weights: the four closed forms of docs/layer.md#router-gradient.
void routing_weight_grad(const RouterConfig& cfg, const RouterBackwardArgs& a, int64_t t, float* dl) {
  const int E = cfg.num_experts, K = cfg.top_k;
  const float c = cfg.routed_scaling_factor;
  const float* s = a.scores + t * E;
  const int32_t* idx = a.topk_idx + t * K;
  const float* w = a.topk_weight + t * K;
  const float* g = a.grad_topk_weight + t * K;
  std::memset(dl, 0, sizeof(float) * E);
  switch (cfg.score) {
    case ScoreFunc::kSoftmax:
      if (cfg.norm_topk_prob) {
        float G = 0.0f;
        for (int k = 0; k < K; ++k) G += w[k] * g[k];
        G /= c;
        for (int k = 0; k < K; ++k) dl[idx[k]] = w[k] * (g[k] - G);
      } else {
        float sg = 0.0f;
        for (int k = 0; k < K; ++k) sg += s[idx[k]] * g[k];
        for (int e = 0; e < E; ++e) dl[e] = -c * s[e] * sg;
        for (int k = 0; k < K; ++k) dl[idx[k]] += c * s[idx[k]] * g[k];
      }
      return;
    case ScoreFunc::kSigmoid:
      if (cfg.norm_topk_prob) {
        float G = 0.0f, ssum = 0.0f;
        for (int k = 0; k < K; ++k) {
          G += w[k] * g[k];
          ssum += s[idx[k]];
        }
        G /= c;
        if (ssum > 0.0f)
          for (int k = 0; k < K; ++k) {
            const float sk = s[idx[k]];
            dl[idx[k]] = sk * (1.0f - sk) * c * (g[k] - G) / ssum;
          }
      } else {
        for (int k = 0; k < K; ++k) {
          const float sk = s[idx[k]];
          dl[idx[k]] = c * sk * (1.0f - sk) * g[k];
        }
      }
      return;
  }
}

// The aux loss's dL/dlogits of token t, with P the balancing probabilities:
// softmax: aux_scale s_i (c_i - sum_e c_e s_e); sigmoid, P = s / S:
// aux_scale s_j (1 - s_j) (c_j - sum_e c_e P_e) / S.
void add_aux_loss_grad(const RouterConfig& cfg, const RouterBackwardArgs& a, int64_t t, float* dl) {
  const int E = cfg.num_experts;
  const float* s = a.scores + t * E;
  const float* c = a.balance_counts;
  switch (cfg.score) {
    case ScoreFunc::kSoftmax: {
      float cs = 0.0f;
      for (int e = 0; e < E; ++e) cs += c[e] * s[e];
      for (int e = 0; e < E; ++e) dl[e] += a.aux_scale * s[e] * (c[e] - cs);
      return;
    }
    case ScoreFunc::kSigmoid: {
      float S = 0.0f, cs = 0.0f;
      for (int e = 0; e < E; ++e) {
        S += s[e];
        cs += c[e] * s[e];
      }
      if (S <= 0.0f) return;
      cs /= S;
      for (int e = 0; e < E; ++e) dl[e] += a.aux_scale * s[e] * (1.0f - s[e]) * (c[e] - cs) / S;
      return;
    }
  }
}

// The z-loss's dL/dlogits of token t: 2 z_scale lse(l) softmax(l)_i.
void add_z_loss_grad(const RouterConfig& cfg, const RouterBackwardArgs& a, int64_t t, float* dl) {
  const int E = cfg.num_experts;
  const float* l = a.logits + t * E;
  float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  for (int e = 0; e < E; ++e) mx = std::max(mx, l[e]);
  for (int e = 0; e < E; ++e) sum += std::exp(l[e] - mx);
  const float lse = mx + std::log(sum);
  for (int e = 0; e < E; ++e) dl[e] += 2.0f * a.z_scale * lse * std::exp(l[e] - lse);
}

}  // namespace

void router_backward(ThreadPool& pool, const RouterConfig& cfg, const RouterBackwardArgs& a) {
  cfg.validate();
  const int64_t T = cfg.num_tokens;
  const int H = cfg.hidden, E = cfg.num_experts;
  if (T == 0) {
    std::memset(a.grad_weight, 0, sizeof(float) * E * H);
    return;
  }
  MOE_CHECK(a.aux_scale == 0.0f || a.balance_counts, "router backward: aux loss without balance_counts");
  MOE_CHECK(a.z_scale == 0.0f || a.logits, "router backward: z-loss without logits");

  parallel_blocks(pool, T, 64, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      float* dl = a.grad_logits + t * E;
      routing_weight_grad(cfg, a, t, dl);
      if (a.aux_scale != 0.0f) add_aux_loss_grad(cfg, a, t, dl);
      if (a.z_scale != 0.0f) add_z_loss_grad(cfg, a, t, dl);
    }
  });

  const float* x = x_as_f32(pool, cfg, a.x, a.workspace);
  // grad_weight[E, H] = grad_logits^T x: split the H columns so no two tasks share output.
  parallel_blocks(pool, H, 64, [&](int64_t h0, int64_t h1, int) {
    sgemm(true, false, E, h1 - h0, T, 1.0f, a.grad_logits, E, x + h0, H, 0.0f,
          a.grad_weight + h0, H);
  });
  // grad_x[T, H] += grad_logits W, a token's row alike whatever tokens share the rank.
  parallel_blocks(pool, T, kRowsPerGemmBlock, [&](int64_t t0, int64_t t1, int thread) {
    row_gemm(a.grad_logits + t0 * E, t1 - t0, E, RowGemmB::weight(a.weight, false, E, H, false), a.grad_x + t0 * H, H,
             router_scratch(cfg, a.workspace, thread).gemm, true);
  });
}

}  // namespace moe::kernels::cpu
