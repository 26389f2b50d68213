// Router forward (logits GEMM on cuBLAS, then one thread per token for scores,
// group-limited top-k and weights) and backward (one thread per token for the
// closed-form logit gradients of docs/layer.md#router-gradient, then two cuBLAS GEMMs to W and x).
#include "cuda_ops.h"
#include "moe/base/check.h"
#include "router_logic.cuh"

namespace moe::kernels::cuda {
namespace {

using namespace router_logic;

__global__ void select_kernel(SelectParams p, float* logits, float* scores, const float* bias,
                              const float* logit_bias, int32_t* topk_idx, float* topk_weight) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t < p.T) select_token(p, t, logits, scores, bias, logit_bias, topk_idx, topk_weight);
}

__global__ void logit_grad_kernel(GradParams p, RouterBackwardArgs a) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t < p.T) logit_grad_token(p, a, t);
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
                       cfg.score,
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
  const GradParams p{T, E, cfg.top_k, cfg.score, cfg.norm_topk_prob, cfg.routed_scaling_factor,
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
