// The Hugging Face naming schemes of one MoE layer (docs/formats.md#hugging-face-schemes), recognised from
// the tensor names found under a prefix, and the list of tensors a layer of a
// given shape needs in that scheme, each with its expected shape and the spec
// field behind every dimension (so a mismatch can name the field).
//
//   router        {p}gate.weight [E, H]; {p}gate.e_score_correction_bias [E] (optional)
//   experts       {p}experts.{e}.gate_proj|up_proj|down_proj.weight (Qwen, DeepSeek)
//                 {p}experts.{e}.w1|w3|w2.weight (Mixtral: w1 = gate, w3 = up, w2 = down)
//                 gate and up [I, H], down [H, I]
//   shared        {p}shared_experts.gate_proj|up_proj|down_proj.weight (DeepSeek)
//                 {p}shared_expert.gate_proj|up_proj|down_proj.weight (Qwen2-MoE)
//                 gate and up [Is, H], down [H, Is], Is = shared_experts x shared_ffn_hidden
//   shared gate   {p}shared_expert_gate.weight [1, H] (Qwen2-MoE)
#pragma once

#include <string>
#include <vector>

#include "moe/io/hf_checkpoint.h"
#include "moe/model/synthetic.h"

namespace moe::io {

enum class ExpertNaming { kGateUpDown, kMixtral };  // gate_proj/up_proj/down_proj | w1/w3/w2
enum class SharedNaming { kNone, kDeepSeek, kQwen };  // none | shared_experts.* | shared_expert.*

struct LayerScheme {
  ExpertNaming experts = ExpertNaming::kGateUpDown;
  SharedNaming shared = SharedNaming::kNone;
  bool correction_bias = false;  // {p}gate.e_score_correction_bias is there
  bool shared_gate = false;      // {p}shared_expert_gate.weight is there
};

// Recognises the scheme from the names under `prefix` (expert 0's names decide
// the expert naming). Throws moe::Error naming the prefix when no expert tensor
// of either naming is there, or both shared namings are.
LayerScheme detect_scheme(const HfCheckpoint& ckpt, const std::string& prefix);
// "Mixtral (w1/w3/w2)", "Qwen/DeepSeek (gate_proj/up_proj/down_proj), DeepSeek shared experts", ...
std::string describe(const LayerScheme& scheme);

// What a tensor holds in LayerWeights.
enum class Role { kRouter, kBias, kGate, kUp, kDown, kSharedGate, kSharedUp, kSharedDown, kSharedExpertGate };

struct LayerTensor {
  Role role;
  int expert = -1;  // routed experts only
  std::string name;
  std::vector<int64_t> shape;
  std::vector<std::string> dims;  // the spec field each dimension comes from
};

// Every tensor of a layer of `shape` in `scheme`: router, bias if the scheme
// has it, all experts, shared experts if shape has them (named in the scheme's
// shared naming, DeepSeek's when it has none), the shared gate if shape has it.
std::vector<LayerTensor> layer_tensors(const LayerScheme& scheme, const std::string& prefix,
                                       const model::LayerShape& shape);

}  // namespace moe::io
