// The CUDA backend's ops as free functions over a CudaExec, one file per group
// (router.cu, capacity.cu, layout.cu, permute.cu, swiglu.cu, gemm.cu,
// expert_mlp.cu, elementwise.cu); cuda_backend.cu binds them to the Backend table.
// Every function enqueues on exec.stream and returns without waiting, except where
// the API hands a result to HOST memory (dispatch_layout's rank_offset,
// permute_layout's expert_offset): those wait for the stream once.
#pragma once

#include <memory>

#include "cuda_exec.h"

namespace moe::kernels::cuda {

inline size_t align256(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

// Packed weights: bf16 copies of the weights a bf16 layer's GEMMs read (cuBLAS
// reads fp32 weights as they are, so an fp32 layer keeps nothing).
struct CudaRouterWeights final : PackedWeights {
  RouterConfig cfg;
  bf16s* gate = nullptr;  // [E, H] device, bf16 layers only
  ~CudaRouterWeights() override;
};
struct CudaExpertWeights final : PackedWeights {
  ExpertMlpConfig cfg;
  bf16s* w13 = nullptr;  // [L, 2I, H] device, bf16 layers only
  bf16s* w2 = nullptr;   // [L, H, I]
  ~CudaExpertWeights() override;
};
std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& cfg);
void pack_router_weights(CudaExec& ex, PackedWeights& p, const float* weight);
std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& cfg);
void pack_expert_weights(CudaExec& ex, PackedWeights& p, const float* w13, const float* w2, int first, int count);

// elementwise.cu
void convert(CudaExec& ex, const void* src, DType sd, void* dst, DType dd, int64_t count);
void add(CudaExec& ex, void* dst, const void* src, DType dtype, int64_t count);
// Backend::pack_rows / unpack_rows: one case per wire format.
void pack_rows(CudaExec& ex, WireFormat f, const void* rows, DType dtype, int64_t num_rows, int hidden, void* wire);
void unpack_rows(CudaExec& ex, WireFormat f, const void* wire, int64_t num_rows, int hidden, void* rows, DType dtype);
void optimizer_step(CudaExec& ex, const OptimizerConfig& cfg, const OptimizerArgs& a);
void select_replicas(CudaExec& ex, int64_t T, int K, int E, const ReplicaArgs& a);
void unpermute_scalars(CudaExec& ex, const int32_t* pair_pos, int64_t n, int k, const float* perm, float* pair);
void combine_pair_scalars(CudaExec& ex, const int32_t* topk_slot, const int32_t* token_send_row, int64_t T, int K,
                          int R, int S, const float* rows, float* pair);

// router.cu
size_t router_workspace_bytes(const RouterConfig& cfg);
void router_forward(CudaExec& ex, const RouterConfig& cfg, const RouterForwardArgs& a);
void router_backward(CudaExec& ex, const RouterConfig& cfg, const RouterBackwardArgs& a);

// capacity.cu
size_t capacity_workspace_bytes(const CapacityConfig& cfg);
void capacity_drop(CudaExec& ex, const CapacityConfig& cfg, const CapacityArgs& a);

// layout.cu
size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& cfg);
void dispatch_layout(CudaExec& ex, const DispatchLayoutConfig& cfg, const DispatchLayoutArgs& a);
size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& cfg);
void permute_layout(CudaExec& ex, const PermuteLayoutConfig& cfg, const PermuteLayoutArgs& a);

// permute.cu
void permute(CudaExec& ex, const PermuteConfig& cfg, const PermuteArgs& a);
void unpermute(CudaExec& ex, const UnpermuteConfig& cfg, const UnpermuteArgs& a);
// Gathers rows[src_row[m]] into out[m] for m in [first, first + M), both of
// `dtype` (the expert MLP's permute); src_row values must lie in [0, num_src_rows).
void gather_rows(CudaExec& ex, const void* rows, DType dtype, int hidden, const int32_t* src_row, int64_t first,
                 int64_t M, int64_t num_src_rows, void* out);

// swiglu.cu. h_dtype / grad_dtype: the storage of h, grad_gu and the recomputed h
// (bf16 where the next GEMM reads bf16 operands).
void swiglu_forward(CudaExec& ex, int64_t rows, int I, const float* gu, const float* row_scale, void* h,
                    DType h_dtype);
void swiglu_backward(CudaExec& ex, int64_t rows, int I, const float* gu, const float* grad_h, const float* row_scale,
                     void* grad_gu, float* grad_row_scale, void* h, DType dtype);

// gemm.cu: groups of rows (offsets in HOST memory) times per-group weights, the
// three kinds of GroupedGemmConfig, with operands of any storage type and fp32
// accumulation and output.
struct GemmOperands {
  const void* a = nullptr;
  cudaDataType_t a_type = CUDA_R_32F;
  const void* b = nullptr;  // W [G, n, k] (forward, dgrad) or D [M, k] (wgrad)
  cudaDataType_t b_type = CUDA_R_32F;
  float* c = nullptr;
};
void grouped_gemm(CudaExec& ex, const GroupedGemmConfig& cfg, const int64_t* group_offset, const GemmOperands& op);
// The same with group g owning rows [row_begin[g], row_end[g]) (HOST), ranges that
// need not touch: a part of a layout (ExpertMlpPart). The offsets form above is
// row_begin = group_offset, row_end = group_offset + 1.
void grouped_gemm(CudaExec& ex, const GroupedGemmConfig& cfg, const int64_t* row_begin, const int64_t* row_end,
                  const GemmOperands& op);

// expert_mlp.cu
size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& cfg);
void expert_mlp_forward(CudaExec& ex, const ExpertMlpConfig& cfg, const ExpertMlpForwardArgs& a);
void expert_mlp_backward(CudaExec& ex, const ExpertMlpConfig& cfg, const ExpertMlpBackwardArgs& a);

}  // namespace moe::kernels::cuda
