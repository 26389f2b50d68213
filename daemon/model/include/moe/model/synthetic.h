// The synthetic model of a job (docs/jobs.md#inputs-and-weights): inputs keyed by (seed, step, global
// token index), weights keyed by (seed, layer, expert, tensor, element), and the
// zipf skew term. Pure functions: every rank rebuilds exactly the same values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moe/kernels/types.h"

namespace moe::model {

// Host copy of one layer's weights, fp32, in the fused layout of kernels/api.h.
struct LayerWeights {
  std::vector<float> gate;            // [E, H]
  std::vector<float> selection_bias;  // [E] or empty (gate.e_score_correction_bias)
  std::vector<float> logit_bias;      // [E] or empty (skew; no gradient)
  std::vector<float> w13;             // [E, 2I, H]
  std::vector<float> w2;              // [E, H, I]
  // Shared experts (docs/layer.md#shared-experts), stored as one SwiGLU of width Is = shared
  // experts x shared_ffn_hidden; empty without them.
  std::vector<float> shared_w13;      // [2Is, H]: gate_proj rows, then up_proj rows
  std::vector<float> shared_w2;       // [H, Is]
  std::vector<float> shared_gate;     // [H] (shared_expert_gate.weight) or empty
};

struct LayerShape {
  int hidden = 0;
  int ffn_hidden = 0;
  int num_experts = 0;
  int shared_ffn_hidden = 0;  // Is, all shared experts together; 0: none
  bool shared_gate = false;
};

// Inputs: x[t, h] ~ N(0, 1) for global tokens [token_begin, token_begin + T);
// elements 2i and 2i+1 of a row are the two outputs of one Box-Muller draw keyed
// by (seed, step, token, i) (box_muller_f32).
void fill_inputs(uint64_t seed, int64_t step, int64_t token_begin, int64_t T, int hidden,
                 float* x);

// Weights: gate, gate_proj and up_proj ~ N(0, 1/H), down_proj ~ N(0, 1/I), values
// 2i and 2i+1 of a tensor one draw keyed by (seed, layer, expert, tensor, i). No
// selection bias. Every rank can build any expert's weights.
LayerWeights make_layer_weights(uint64_t seed, int layer, const LayerShape& shape);
// Runs body(i) once for every i in [0, n), in any order, possibly concurrently.
using ForEach = std::function<void(int64_t n, const std::function<void(int64_t)>& body)>;
// The same, but only the experts with needed[e] set are generated; the others
// stay zero (a rank builds the router and its own experts). for_each runs the
// experts (a rank's thread pool); the values do not depend on it.
LayerWeights make_layer_weights(uint64_t seed, int layer, const LayerShape& shape, const std::vector<bool>& needed,
                                const ForEach& for_each = {});
// Expert e's w13 [2I, H] and w2 [H, I] as make_layer_weights draws them.
void fill_expert_weights(uint64_t seed, int layer, const LayerShape& shape, int expert, float* w13, float* w2);

// Skew: "uniform" adds nothing (returns empty); "zipf:ALPHA" returns
// -ALPHA * ln(1 + p(e)) with p a seed-derived permutation of the experts.
// Throws moe::Error naming the value when the string is malformed.
std::vector<float> skew_logit_bias(const std::string& skew, uint64_t seed, int num_experts);

// Rounds every value to bf16 (storage precision of a bf16 job).
void round_to_bf16(std::vector<float>& v);

// Host tensors in a storage dtype: fp32 values -> bytes in `dtype` (bf16 rounds),
// and back. The byte buffer has one spare byte so an empty tensor has a pointer.
std::vector<uint8_t> to_storage(const std::vector<float>& v, kernels::DType dtype);
std::vector<float> from_storage(const void* data, size_t count, kernels::DType dtype);

}  // namespace moe::model
