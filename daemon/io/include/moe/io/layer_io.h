// Layer weights and dumps in safetensors with the Hugging Face MoE names (docs/formats.md#weights).
// Loading reads every scheme of hf_scheme.h from an HfCheckpoint (one file or an
// index-sharded folder); writing uses the Qwen/DeepSeek names:
//   {prefix}gate.weight [E, H], {prefix}gate.e_score_correction_bias [E] (optional),
//   {prefix}experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H],
//   .down_proj.weight [H, I], {prefix}shared_experts.{gate,up,down}_proj.weight,
//   {prefix}shared_expert_gate.weight [1, H]; F32 or BF16.
#pragma once

#include <string>
#include <vector>

#include "moe/io/hf_checkpoint.h"
#include "moe/io/safetensors.h"
#include "moe/model/synthetic.h"
#include "moe/kernels/types.h"

namespace moe::io {

// Reads one layer of `shape` under `prefix`, in the scheme its names show.
// First checks every tensor of the layer from the headers, whatever `needed`
// says, so every rank of a job accepts or refuses a checkpoint alike: a missing
// tensor, a dtype other than F32/BF16, a shape that disagrees with the spec
// (naming the field: experts, hidden, ffn_hidden, shared_experts x
// shared_ffn_hidden), shared experts or a shared gate on one side only. Then
// reads the router, the bias, the shared experts and the experts with needed[e]
// (empty: every expert); the others stay zero. Throws moe::Error naming the
// checkpoint and the tensor or field.
model::LayerWeights load_layer_weights(HfCheckpoint& ckpt, const std::string& prefix, const model::LayerShape& shape,
                                       const std::vector<bool>& needed = {});

// Adds one layer's weights for `experts` under `prefix`, stored as `dtype`: the
// router, the bias and the skew term if present, and the shared experts and
// their gate if w has them (shape.shared_ffn_hidden wide).
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
