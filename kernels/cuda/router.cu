// Router forward (logits GEMM on cuBLAS, then one thread per token for scores,
// group-limited top-k and weights) and backward (one thread per token for the
// closed-form logit gradients of DESIGN 3, then two cuBLAS GEMMs to W and x).
#include <cfloat>

#include "cuda_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

// The per-thread selection keeps its top-k and group lists in registers.
constexpr int kMaxTopK = 32;
constexpr int kMaxGroups = 64;

struct SelectParams {
  int64_t T;
  int E, K, G, group_top_k;
  bool sigmoid, norm;
  float scaling;
};

// NaN never wins a comparison: it selects as -inf.
__device__ inline float selection_key(float v) { return isnan(v) ? -FLT_MAX * 2.0f : v; }

// Inserts (v, i) into the descending list key/idx of `filled` entries and capacity
// k; strictly greater wins, so an equal later index stays behind.
__device__ inline void insert_top(float v, int i, float* key, int* idx, int& filled, int k) {
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

__device__ inline float biased(const float* s, const float* bias, int e) {
  return selection_key(s[e] + (bias ? bias[e] : 0.0f));
}

// Writes the token's scores from its logits (logit bias added first).
__device__ void token_scores(const SelectParams& p, float* l, float* s, const float* logit_bias) {
  if (logit_bias)
    for (int e = 0; e < p.E; ++e) l[e] += logit_bias[e];
  if (p.sigmoid) {
    for (int e = 0; e < p.E; ++e) s[e] = sigmoidf_acc(l[e]);
    return;
  }
  float mx = -INFINITY, sum = 0.0f;
  for (int e = 0; e < p.E; ++e) mx = fmaxf(mx, l[e]);
  for (int e = 0; e < p.E; ++e) {
    s[e] = expf(l[e] - mx);
    sum += s[e];
  }
  const float inv = 1.0f / sum;
  for (int e = 0; e < p.E; ++e) s[e] *= inv;
}

// Bit g set when group g is among the best group_top_k (group score: the sum of
// its two highest biased scores).
__device__ uint64_t allowed_groups(const SelectParams& p, const float* s, const float* bias) {
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

__global__ void select_kernel(SelectParams p, float* logits, float* scores, const float* bias,
                              const float* logit_bias, int32_t* topk_idx, float* topk_weight) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= p.T) return;
  float* l = logits + t * p.E;
  float* s = scores + t * p.E;
  token_scores(p, l, s, logit_bias);
  const uint64_t mask = p.G > 1 ? allowed_groups(p, s, bias) : ~uint64_t{0};
  const int per_group = p.G > 1 ? p.E / p.G : p.E;
  float key[kMaxTopK];
  int idx[kMaxTopK], filled = 0;
  for (int e = 0; e < p.E; ++e)
    if (mask >> (e / per_group) & 1) insert_top(biased(s, bias, e), e, key, idx, filled, p.K);
  float sum = 0.0f;
  for (int k = 0; k < p.K; ++k) sum += s[idx[k]];
  const float scale = p.norm && sum > 0.0f ? p.scaling / sum : p.scaling;
  for (int k = 0; k < p.K; ++k) {
    topk_idx[t * p.K + k] = idx[k];
    topk_weight[t * p.K + k] = s[idx[k]] * scale;
  }
}

// ---------------------------------------------------------------------------
// Backward: dL/dlogits per token, the four closed forms, plus the balancing terms.

struct GradParams {
  int64_t T;
  int E, K;
  bool sigmoid, norm;
  float c;  // routed_scaling_factor
  float aux_scale, z_scale;
};

__device__ void routing_weight_grad(const GradParams& p, const float* s, const int32_t* idx, const float* w,
                                    const float* g, float* dl) {
  for (int e = 0; e < p.E; ++e) dl[e] = 0.0f;
  if (!p.sigmoid && p.norm) {
    float G = 0.0f;
    for (int k = 0; k < p.K; ++k) G += w[k] * g[k];
    G /= p.c;
    for (int k = 0; k < p.K; ++k) dl[idx[k]] = w[k] * (g[k] - G);
  } else if (!p.sigmoid) {
    float sg = 0.0f;
    for (int k = 0; k < p.K; ++k) sg += s[idx[k]] * g[k];
    for (int e = 0; e < p.E; ++e) dl[e] = -p.c * s[e] * sg;
    for (int k = 0; k < p.K; ++k) dl[idx[k]] += p.c * s[idx[k]] * g[k];
  } else if (p.norm) {
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
}

__device__ void add_aux_grad(const GradParams& p, const float* s, const float* c, float* dl) {
  float S = 0.0f, cs = 0.0f;
  for (int e = 0; e < p.E; ++e) {
    S += s[e];
    cs += c[e] * s[e];
  }
  if (!p.sigmoid) {
    for (int e = 0; e < p.E; ++e) dl[e] += p.aux_scale * s[e] * (c[e] - cs);
    return;
  }
  if (S <= 0.0f) return;
  cs /= S;
  for (int e = 0; e < p.E; ++e) dl[e] += p.aux_scale * s[e] * (1.0f - s[e]) * (c[e] - cs) / S;
}

__device__ void add_z_grad(const GradParams& p, const float* l, float* dl) {
  float mx = -INFINITY, sum = 0.0f;
  for (int e = 0; e < p.E; ++e) mx = fmaxf(mx, l[e]);
  for (int e = 0; e < p.E; ++e) sum += expf(l[e] - mx);
  const float lse = mx + logf(sum);
  for (int e = 0; e < p.E; ++e) dl[e] += 2.0f * p.z_scale * lse * expf(l[e] - lse);
}

__global__ void logit_grad_kernel(GradParams p, RouterBackwardArgs a) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= p.T) return;
  float* dl = a.grad_logits + t * p.E;
  const float* s = a.scores + t * p.E;
  routing_weight_grad(p, s, a.topk_idx + t * p.K, a.topk_weight + t * p.K, a.grad_topk_weight + t * p.K, dl);
  if (p.aux_scale != 0.0f) add_aux_grad(p, s, a.balance_counts, dl);
  if (p.z_scale != 0.0f) add_z_grad(p, a.logits + t * p.E, dl);
}

size_t x32_bytes(const RouterConfig& cfg) {
  return cfg.x_dtype == DType::kF32 ? 0 : align256(4 * static_cast<size_t>(cfg.num_tokens) * cfg.hidden);
}

void check_router_config(const RouterConfig& cfg) {
  cfg.validate();
  MOE_CHECK(cfg.top_k <= kMaxTopK, "cuda router: top_k ", cfg.top_k, " exceeds ", kMaxTopK);
  MOE_CHECK(!cfg.group_limited() || cfg.num_groups <= kMaxGroups, "cuda router: num_groups ", cfg.num_groups,
            " exceeds ", kMaxGroups);
}

}  // namespace

size_t router_workspace_bytes(const RouterConfig& cfg) { return x32_bytes(cfg); }

void router_forward(CudaExec& ex, const RouterConfig& cfg, const RouterForwardArgs& a) {
  check_router_config(cfg);
  const auto* packed = dynamic_cast<const CudaRouterWeights*>(a.packed_weight);
  MOE_CHECK(packed, "cuda router: packed_weight is missing or not the CUDA backend's");
  MOE_CHECK(packed->cfg.hidden == cfg.hidden && packed->cfg.num_experts == cfg.num_experts &&
                packed->cfg.x_dtype == cfg.x_dtype,
            "cuda router: packed weights were made for another shape or dtype");
  const int64_t T = cfg.num_tokens;
  const int E = cfg.num_experts, H = cfg.hidden;
  if (T == 0) return;
  // logits^T [E, T] = gate [E, H] . x^T (column-major view of row-major logits).
  const float one = 1.0f, zero = 0.0f;
  const bool bf16 = cfg.x_dtype == DType::kBF16;
  const void* w = bf16 ? static_cast<const void*>(packed->gate) : a.weight;
  check(cublasGemmEx(ex.blas, CUBLAS_OP_T, CUBLAS_OP_N, E, static_cast<int>(T), H, &one, w, cuda_type(cfg.x_dtype), H,
                     a.x, cuda_type(cfg.x_dtype), H, &zero, a.logits, CUDA_R_32F, E, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "router logits GEMM");
  const SelectParams p{T,
                       E,
                       cfg.top_k,
                       cfg.group_limited() ? cfg.num_groups : 1,
                       cfg.group_top_k,
                       cfg.score == ScoreFunc::kSigmoid,
                       cfg.norm_topk_prob,
                       cfg.routed_scaling_factor};
  select_kernel<<<blocks_for(T, 128), 128, 0, ex.stream>>>(p, a.logits, a.scores, a.selection_bias, a.logit_bias,
                                                           a.topk_idx, a.topk_weight);
  check(cudaGetLastError(), "router select");
}

void router_backward(CudaExec& ex, const RouterConfig& cfg, const RouterBackwardArgs& a) {
  check_router_config(cfg);
  const int64_t T = cfg.num_tokens;
  const int E = cfg.num_experts, H = cfg.hidden;
  if (T == 0) {
    check(cudaMemsetAsync(a.grad_weight, 0, 4 * static_cast<size_t>(E) * H, ex.stream), "router backward");
    return;
  }
  MOE_CHECK(a.aux_scale == 0.0f || a.balance_counts, "router backward: aux loss without balance_counts");
  MOE_CHECK(a.z_scale == 0.0f || a.logits, "router backward: z-loss without logits");
  const GradParams p{T, E, cfg.top_k, cfg.score == ScoreFunc::kSigmoid, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                     a.aux_scale, a.z_scale};
  logit_grad_kernel<<<blocks_for(T, 128), 128, 0, ex.stream>>>(p, a);
  check(cudaGetLastError(), "router logit gradients");

  const float* x = static_cast<const float*>(a.x);
  if (cfg.x_dtype == DType::kBF16) {
    float* x32 = static_cast<float*>(a.workspace);
    convert(ex, a.x, DType::kBF16, x32, DType::kF32, T * H);
    x = x32;
  }
  const float one = 1.0f, zero = 0.0f;
  // grad_weight [E, H] = grad_logits^T x: column-major grad_weight^T [H, E] = x^T grad_logits.
  check(cublasGemmEx(ex.blas, CUBLAS_OP_N, CUBLAS_OP_T, H, E, static_cast<int>(T), &one, x, CUDA_R_32F, H,
                     a.grad_logits, CUDA_R_32F, E, &zero, a.grad_weight, CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "router weight-gradient GEMM");
  // grad_x [T, H] += grad_logits W: column-major grad_x^T [H, T] += W^T grad_logits^T.
  check(cublasGemmEx(ex.blas, CUBLAS_OP_N, CUBLAS_OP_N, H, static_cast<int>(T), E, &one, a.weight, CUDA_R_32F, H,
                     a.grad_logits, CUDA_R_32F, E, &one, a.grad_x, CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "router input-gradient GEMM");
}

}  // namespace moe::kernels::cuda
