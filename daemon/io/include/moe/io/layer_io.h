// Layer weights and dumps in safetensors with the Hugging Face MoE names (DESIGN 6):
//   {prefix}gate.weight [E, H], {prefix}gate.e_score_correction_bias [E] (optional),
//   {prefix}experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H],
//   .down_proj.weight [H, I]; F32 or BF16.
#pragma once

#include <string>
#include <vector>

#include "moe/io/safetensors.h"
#include "moe/model/synthetic.h"
#include "moe/kernels/types.h"

namespace moe::io {

// Reads one layer; every missing tensor or wrong shape is an error naming it.
model::LayerWeights load_layer_weights(const SafetensorsReader& file, const std::string& prefix,
                                       const model::LayerShape& shape);

// Adds one layer's weights for `experts` under `prefix`, stored as `dtype`.
void add_layer_weights(SafetensorsWriter& out, const std::string& prefix,
                       const model::LayerShape& shape, const model::LayerWeights& w,
                       const std::vector<int>& experts, kernels::DType dtype);

// What a rank dumps for layer 0 at step 0 (rank{r}.safetensors).
struct LayerDump {
  kernels::DType dtype = kernels::DType::kF32;
  model::LayerShape shape;
  int top_k = 0;
  int64_t num_tokens = 0;
  const void* x = nullptr;              // [T, H] dtype
  const void* out = nullptr;            // [T, H] dtype, before the residual add
  const int32_t* topk_idx = nullptr;    // [T, K] logical ids, -1 where dropped
  const float* topk_weight = nullptr;   // [T, K]
  const model::LayerWeights* weights = nullptr;
  std::vector<int> experts;             // experts this rank hosts
  // train mode only (null otherwise)
  const void* grad_out = nullptr;       // [T, H] dtype
  const void* grad_x = nullptr;         // [T, H] dtype
  const float* grad_gate = nullptr;     // [E, H], summed over ranks
  const float* grad_w13 = nullptr;      // [E, 2I, H], indexed by logical expert
  const float* grad_w2 = nullptr;       // [E, H, I]
  const float* grad_shared_w13 = nullptr;   // [2Is, H] summed over ranks, or null
  const float* grad_shared_w2 = nullptr;    // [H, Is]
  const float* grad_shared_gate = nullptr;  // [H] or null
};

void write_layer_dump(const std::string& path, const LayerDump& d);

}  // namespace moe::io
