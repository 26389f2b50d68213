// The CPU backend's PackedWeights: the experts' forward weights in the
// row-invariant GEMM's panels, the oneDNN primitives of the weight gradients and
// of the router's logits, and the router's weight in oneDNN's layout.
#pragma once

#include <memory>
#include <utility>

#include "cpu_ops.h"
#include "onednn_matmul.h"
#include "row_gemm.h"

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

// One weight of L experts as row-invariant GEMM panels of `panels` (whose data is
// unset): expert e's at data + e * stride.
struct PanelTensor {
  RowGemmPanels panels;
  size_t stride = 0;  // bytes per expert, a multiple of 64
  HostBytes data;
  PanelTensor() = default;
  PanelTensor(const RowGemmPanels& shape, int num_experts);
  RowGemmPanels expert(int e) const;
  void* expert_data(int e) { return data.get() + stride * e; }
};

// Expert weights w13 [L, 2I, H], w2 [L, H, I], in the compute dtype (x_dtype).
struct CpuExpertWeights final : PackedWeights {
  ExpertMlpConfig cfg;
  GemmEngine engine = GemmEngine::kOpenBlas;  // the weight gradients' engine
  // Forward (docs/backends.md#row-invariant-gemm): gu = x w13^T and y = h w2^T
  // on panels of w13_e^T [H, 2I] and w2_e^T [I, H], in x_dtype (a bf16 layer's
  // values rounded). The dgrad packs w2 and w13 per call.
  PanelTensor w13_fwd, w2_fwd;
  // oneDNN, train: dW2 = g^T h, dW13 = dgu^T x (runtime m and k, no packed
  // operand; the _acc ones add to the gradient, for the row chunks after the first).
  std::unique_ptr<OneDnnMatmul> down_wgrad, gate_up_wgrad, down_wgrad_acc, gate_up_wgrad_acc;
  // The small-batch path's weights for bf16 layers that are forward-only: w13
  // and w2 rounded to bf16 in pack_small_bf16_weights' layout, small_w13_elems /
  // small_w2_elems values per expert (fp32 layers read w13 and w2 as given).
  HostBytes small_w13, small_w2;
  size_t small_w13_elems = 0, small_w2_elems = 0;
  bool packed = false;

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

// The weight gradients of the fused expert MLP (expert_mlp_wgrad.cc), on the
// packed weights' engine: dW2_e = g_e^T h_e, dW13_e = dgu_e^T x_e over every pair.
// Operands: h and dgu per pair as the dgrad stored them (wgrad_operand_dtype),
// g and x gathered again from the call's rows. panel: a thread's [tile, H] fp32
// region for those gathers, panel_bytes apart per thread.
DType wgrad_operand_dtype(const ExpertMlpConfig& cfg, GemmEngine engine);
struct WgradInputs {
  const void* h = nullptr;    // [M, I] wgrad_operand_dtype
  const void* dgu = nullptr;  // [M, 2I] wgrad_operand_dtype
  uint8_t* panels = nullptr;
  size_t panel_bytes = 0;
};
void expert_weight_grads(CpuExec& exec, const ExpertMlpConfig& cfg, const ExpertMlpBackwardArgs& a,
                         const CpuExpertWeights& p, const WgradInputs& in);

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
