// One MoE layer on one rank that holds every expert (the R = 1 case of DESIGN 3),
// built from the kernel ops of a Backend:
//   router -> capacity -> permute layout -> fused expert MLP -> local combine.
// Backward mirrors it through the forward's saved state.
//
// All buffers are allocated once in the constructor from the config (max_tokens);
// forward/backward allocate nothing. Pointers passed in and returned are in the
// backend's memory (host memory for the CPU backend).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/kernels/api.h"
#include "model/synthetic.h"

namespace moe::ep {

using kernels::DType;

struct MoeLayerConfig {
  int hidden = 0;
  int ffn_hidden = 0;
  int num_experts = 0;
  int top_k = 0;
  kernels::ScoreFunc score = kernels::ScoreFunc::kSoftmax;
  int num_groups = 0;
  int group_top_k = 0;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  double capacity_factor = 0.0;
  kernels::DropPolicy drop_policy = kernels::DropPolicy::kProbs;
  DType dtype = DType::kF32;
  int64_t max_tokens = 0;
  bool train = false;

  void validate() const;  // throws moe::Error naming the field
  kernels::RouterConfig router(int64_t T) const;
};

// Wall-clock seconds per phase of the last forward/backward (synchronised).
// permute = layout + the gather inside the fused tiles; expert_gemm and swiglu are
// the fused tiles' shares, split by their per-thread clocks.
struct PhaseTimes {
  double router = 0;
  double permute = 0;
  double expert_gemm = 0;
  double swiglu = 0;
  double combine = 0;
  double backward = 0;
};

// fp32 weight gradients, host memory, shapes as in model::LayerWeights.
struct LayerGrads {
  std::vector<float> gate;
  std::vector<float> w13;
  std::vector<float> w2;
};

class MoeLayer {
 public:
  MoeLayer(const MoeLayerConfig& cfg, kernels::Backend& backend);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeLayerConfig& config() const { return cfg_; }

  // Copies host weights in; in a bf16 layer they are rounded to bf16 first (the
  // values the layer computes with; weights() returns them).
  void set_weights(const model::LayerWeights& w);
  const model::LayerWeights& weights() const { return host_weights_; }

  // x, out: [T, H] in the layer dtype, T <= max_tokens.
  void forward(const void* x, int64_t T, void* out);
  // After forward on a train layer: grad_out [T, H] -> grad_x [T, H] (dtype, the
  // MoE path including the router). Weight gradients stay in the layer: see
  // grad_gate()/grad_w13()/grad_w2() or copy_grads().
  void backward(const void* grad_out, void* grad_x);
  const float* grad_gate() const;  // [E, H], backend memory
  const float* grad_w13() const;   // [E, 2I, H]
  const float* grad_w2() const;    // [E, H, I]
  LayerGrads copy_grads() const;   // host copies of the three

  // State of the last forward, [T, K], backend memory.
  int64_t num_tokens() const { return T_; }
  const int32_t* topk_idx() const;     // selection before capacity
  const int32_t* kept_idx() const;     // -1 where capacity dropped the pair
  const float* topk_weight() const;
  const float* grad_topk_weight() const;  // after backward
  // Tokens each expert received in the last forward (after capacity), host.
  std::vector<int64_t> expert_tokens() const;

  const PhaseTimes& times() const { return times_; }

 private:
  struct Buffers;
  MoeLayerConfig cfg_;
  kernels::Backend& be_;
  std::unique_ptr<Buffers> buf_;
  model::LayerWeights host_weights_;
  int64_t T_ = 0;
  const void* x_ = nullptr;  // input of the last forward (must stay valid for backward)
  bool has_forward_ = false;
  PhaseTimes times_;
};

}  // namespace moe::ep
