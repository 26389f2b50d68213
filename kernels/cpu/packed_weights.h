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

// Router weight gate [E, H]: logits [T, E] = x [T, H] gate^T, on panels of
// gate^T [H, E] (fp32: the layer's router keeps fp32 values, bf16-rounded in a
// bf16 layer).
struct CpuRouterWeights final : PackedWeights {
  RouterConfig cfg;
  GemmEngine engine = GemmEngine::kOpenBlas;  // the backward's grad_weight
  PanelTensor gate_t;
  bool packed = false;  // pack_router_weights ran
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
  bool packed = false;
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

}  // namespace moe::kernels::cpu
