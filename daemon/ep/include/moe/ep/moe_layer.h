// One MoE layer on one rank that holds every expert (the R = 1 case of docs/layer.md):
// RouterStage on the tokens, then ExpertStage straight on the same rows.
// All buffers are allocated in the constructor from the config (max_tokens);
// forward and backward allocate nothing. Pointers passed in and returned are in
// the backend's memory (host memory for the CPU backend).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe/ep/expert_stage.h"
#include "moe/ep/router_stage.h"

namespace moe::ep {

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
  double optimizer = 0;  // the last optimizer_step
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
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeLayerConfig& config() const { return cfg_; }

  // Takes host weights in; in a bf16 layer they are rounded to bf16 first (the
  // values the layer computes with; weights() returns a copy of them, the
  // experts' read back from the backend: the layer keeps one copy of its own, and
  // a temporary passed in is rounded in place, not copied).
  void set_weights(model::LayerWeights w);
  model::LayerWeights weights() const;

  // x, out: [T, H] in the layer dtype, T <= max_tokens. x must stay valid until
  // backward.
  void forward(const void* x, int64_t T, void* out);
  // After forward on a train layer: grad_out [T, H] -> grad_x [T, H] (dtype, the
  // MoE path including the router). Weight gradients stay in the layer.
  void backward(const void* grad_out, void* grad_x);
  const float* grad_gate() const { return router_.grad_gate(); }  // [E, H], backend memory
  const float* grad_w13() const { return experts_.grad_w13(); }   // [E, 2I, H]
  const float* grad_w2() const { return experts_.grad_w2(); }     // [E, H, I]
  LayerGrads copy_grads() const;                                  // host copies of the three
  // One optimizer step on the layer's weights (gate and experts) from the last
  // backward's gradients; step counts from 1.
  void optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step);

  // State of the last forward, [T, K], backend memory.
  int64_t num_tokens() const { return router_.num_tokens(); }
  const int32_t* topk_idx() const { return router_.topk_idx(); }  // selection before capacity
  const int32_t* kept_idx() const { return router_.kept_idx(); }  // -1 where capacity dropped
  const float* topk_weight() const { return router_.topk_weight(); }
  const float* grad_topk_weight() const { return grad_topk_weight_.as<float>(); }  // after backward
  std::vector<int64_t> expert_tokens() const { return experts_.expert_rows(); }

  const PhaseTimes& times() const { return times_; }

 private:
  MoeLayerConfig cfg_;
  kernels::Backend& be_;
  RouterStage router_;
  ExpertStage experts_;
  model::LayerWeights used_;  // as set, less the experts' w13 and w2 (the stage has them)
  const void* x_ = nullptr;
  kernels::Buffer grad_topk_weight_, grad_x32_;
  PhaseTimes times_;
};

}  // namespace moe::ep
