// The CPU backend's PackedWeights: for the oneDNN engine, the matmul primitives
// of a config and its weights packed in the layout each primitive prefers; for
// OpenBLAS, only the config (sgemm reads the fp32 weights).
#pragma once

#include <memory>
#include <utility>

#include "cpu_ops.h"
#include "onednn_matmul.h"

namespace moe::kernels::cpu {

// Host bytes owned by a packed copy (host_alloc / host_free).
class HostBytes {
 public:
  HostBytes() = default;
  explicit HostBytes(size_t bytes) : p_(bytes ? host_alloc(bytes) : nullptr) {}
  ~HostBytes() { host_free(p_); }
  HostBytes(HostBytes&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  HostBytes& operator=(HostBytes&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  uint8_t* get() const { return static_cast<uint8_t*>(p_); }

 private:
  void* p_ = nullptr;
};

// One weight tensor of L experts in one primitive's layout: expert e at
// data + e * stride.
struct PackedTensor {
  size_t stride = 0;  // bytes per expert, a multiple of 64
  HostBytes data;
  PackedTensor() = default;
  PackedTensor(const OneDnnMatmul& mm, int num_experts);
  bool empty() const { return data.get() == nullptr; }
  const uint8_t* expert(int e) const { return data.get() + stride * e; }
  uint8_t* expert(int e) { return data.get() + stride * e; }
};

// Router weight gate [E, H]: logits [T, E] = x [T, H] gate^T.
struct CpuRouterWeights final : PackedWeights {
  RouterConfig cfg;
  GemmEngine engine = GemmEngine::kOpenBlas;
  std::unique_ptr<OneDnnMatmul> logits;  // oneDNN: x (x_dtype) . gate^T -> fp32
  PackedTensor gate;
  bool packed = false;  // pack_router_weights ran
};

// Expert weights w13 [L, 2I, H], w2 [L, H, I], in the compute dtype (x_dtype).
struct CpuExpertWeights final : PackedWeights {
  ExpertMlpConfig cfg;
  GemmEngine engine = GemmEngine::kOpenBlas;
  // Forward: gu = x w13^T, y = h w2^T.
  std::unique_ptr<OneDnnMatmul> gate_up, down;
  // Train: dh = g w2, dx = dgu w13 (dgrad); dW2 = g^T h, dW13 = dgu^T x (wgrad,
  // runtime m and k, no packed operand; the _acc ones add to the gradient, for the
  // row chunks after the first).
  std::unique_ptr<OneDnnMatmul> down_dgrad, gate_up_dgrad, down_wgrad, gate_up_wgrad;
  std::unique_ptr<OneDnnMatmul> down_wgrad_acc, gate_up_wgrad_acc;
  // w2_dgrad / w13_dgrad stay empty where the dgrad primitive's layout is the
  // weight's own (fp32 on gemm:jit): the dgrad reads w2 / w13 as given.
  PackedTensor w13_fwd, w2_fwd, w2_dgrad, w13_dgrad;
  // The small-batch path's weights for bf16 layers that are forward-only: w13
  // and w2 rounded to bf16 in pack_small_bf16_weights' layout, small_w13_elems /
  // small_w2_elems values per expert (fp32 layers read w13 and w2 as given).
  HostBytes small_w13, small_w2;
  size_t small_w13_elems = 0, small_w2_elems = 0;
  // OpenBLAS engine, bf16 train configs: w13 and w2 rounded to bf16 values, kept
  // fp32 for sgemm (the caller's arrays are the fp32 masters, api.h).
  HostBytes blas_w13, blas_w2;
  bool packed = false;

  // Expert e's fp32 weights as the OpenBLAS path reads them (w13, w2: the call's).
  const float* blas_w13_of(int e, const float* w13) const;
  const float* blas_w2_of(int e, const float* w2) const;
  // Expert e's weight as the dgrad primitives read it (w13, w2: the call's).
  const void* w13_dgrad_of(int e, const float* w13) const;
  const void* w2_dgrad_of(int e, const float* w2) const;
  // Whether the small-batch path can run on these weights.
  bool has_small_weights() const { return cfg.x_dtype == DType::kF32 || small_w13.get() != nullptr; }
  // Expert e's w13 / w2 as the small-batch path reads them (w13, w2: the call's).
  const void* small_expert_w13(int e, const float* w13) const;
  const void* small_expert_w2(int e, const float* w2) const;
};

// The packed object behind `p`, checked against the op's config (the fields
// that shape it); throws naming the field that differs.
const CpuRouterWeights& checked_router_weights(const PackedWeights* p, const RouterConfig& cfg);
const CpuExpertWeights& checked_expert_weights(const PackedWeights* p, const ExpertMlpConfig& cfg, bool backward);

// The oneDNN path of the fused expert MLP (expert_mlp_onednn.cc); the entry points
// in expert_mlp.cc check the config and offsets, then call these.
size_t onednn_mlp_workspace_bytes(const ExpertMlpConfig& cfg, int num_threads);
void forward_onednn(CpuExec& exec, const ExpertMlpConfig& cfg, const ExpertMlpForwardArgs& a,
                    const CpuExpertWeights& p);
void backward_onednn(CpuExec& exec, const ExpertMlpConfig& cfg, const ExpertMlpBackwardArgs& a,
                     const CpuExpertWeights& p);

// The small-batch path (expert_mlp_small.cc), docs/backends.md#small-batches.
// Its per-thread panels follow the engine path's workspace.
size_t small_mlp_workspace_bytes(const ExpertMlpConfig& cfg, int num_threads);
// Splits a forward call: exec.small_experts gets the experts the rule gives the
// small-batch path (at most exec.small_rows.of(dtype) rows in the layout) that have
// pairs to compute; the returned part is everything else, for the engine path
// (empty = nothing left). Without small experts it returns a.part unchanged.
struct SmallBatchSplit {
  bool small = false;  // the small-batch path has experts
  bool rest = false;   // the engine path has pairs
  ExpertMlpPart rest_part;
};
SmallBatchSplit split_small_batch(CpuExec& exec, const ExpertMlpConfig& cfg, const ExpertMlpForwardArgs& a,
                                  const CpuExpertWeights& p);
// Forward of exec.small_experts' pairs; panels: small_mlp_workspace_bytes of scratch.
void forward_small(CpuExec& exec, const ExpertMlpConfig& cfg, const ExpertMlpForwardArgs& a,
                   const CpuExpertWeights& p, uint8_t* panels);

}  // namespace moe::kernels::cpu
