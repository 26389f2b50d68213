// Small Hugging Face checkpoints in every scheme moed reads
// (docs/formats.md#hugging-face-schemes), written by the tests themselves (not
// through moed's writer, so they check the loader against an independent spelling
// of the names): one layer's tensors named in a chosen scheme, saved as one file
// or sharded behind model.safetensors.index.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/io/hf_scheme.h"
#include "moe/io/safetensors.h"
#include "moe/model/synthetic.h"

namespace moe::test {

struct HfScheme {
  io::ExpertNaming experts = io::ExpertNaming::kGateUpDown;
  io::SharedNaming shared = io::SharedNaming::kNone;
  bool correction_bias = false;
  bool shared_gate = false;  // shared_expert_gate.weight (Qwen2-MoE)
};

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  bool keep_f32 = false;  // stored F32 whatever the checkpoint's dtype (DeepSeek-V3's bias)
};

// Seeded weights of one layer of shape s: router, experts, the correction bias
// when asked, shared experts when s.shared_ffn_hidden > 0 and their gate when
// s.shared_gate. No value is zero.
model::LayerWeights hf_layer_values(uint64_t seed, const model::LayerShape& s, bool correction_bias);

// The tensors of one layer under `prefix`, named in `scheme`.
std::vector<NamedTensor> hf_layer_tensors(const std::string& prefix, const model::LayerShape& s,
                                          const model::LayerWeights& w, const HfScheme& scheme);

// Splits tensors into n contiguous runs (n shards), in order.
std::vector<std::vector<NamedTensor>> split(const std::vector<NamedTensor>& tensors, int n);

// One shard: dir/model.safetensors. Several: dir/model-0000i-of-0000n.safetensors
// and dir/model.safetensors.index.json naming each tensor's shard. Returns the
// shard paths. Values are stored as `dtype` (F32 or BF16).
std::vector<std::string> write_hf_checkpoint(const std::string& dir, const std::vector<std::vector<NamedTensor>>& shards,
                                             io::StDType dtype);

// w as a checkpoint of `dtype` stores it (BF16 rounds every value but the bias).
model::LayerWeights as_stored(model::LayerWeights w, io::StDType dtype);

// Rewrites the dtype string of `tensor` in a file's header to `dtype` (same
// length or shorter, padded with JSON whitespace): "BF16" -> "F16".
void set_header_dtype(const std::string& path, const std::string& tensor, const std::string& dtype);

}  // namespace moe::test
