// `moectl job submit --hf-config config.json`: the model fields of a JobSpec
// from a Hugging Face config (docs/formats.md#hugging-face-schemes). moectl reads
// the file; daemons only see the spec. Families, by "model_type":
//   mixtral                 num_local_experts, num_experts_per_tok, hidden_size,
//                           intermediate_size (the expert width); softmax, top-k renormalised
//   qwen2_moe, qwen3_moe    num_experts, num_experts_per_tok, hidden_size,
//                           moe_intermediate_size, norm_topk_prob (false if absent);
//                           qwen2_moe: shared_expert_intermediate_size -> one gated shared expert
//   deepseek_v2, deepseek_v3  n_routed_experts, num_experts_per_tok, hidden_size,
//                           moe_intermediate_size, scoring_func, topk_method, n_group,
//                           topk_group, norm_topk_prob, routed_scaling_factor,
//                           n_shared_experts, first_k_dense_replace
// Keys a family needs must be there; optional keys take the defaults of the
// family's Hugging Face config class. Errors name the file and the key.
#pragma once

#include <set>
#include <string>

#include "moe/v1/job.pb.h"

namespace moe::ctl {

struct HfModel {
  // experts, top_k, hidden, ffn_hidden, score, num_groups, group_top_k,
  // norm_topk_prob, routed_scaling_factor, shared_experts, shared_ffn_hidden,
  // shared_expert_gate.
  v1::JobSpec spec;
  // Where the family keeps a layer's MoE tensors ("model.layers.{layer}.mlp."),
  // and the first MoE layer (DeepSeek's first_k_dense_replace); for specs
  // with weights only.
  std::string weights_prefix;
  int weights_first_layer = 0;
};

// Parses config.json text (`source` names the file in errors). Throws
// moe::InvalidArgument "SOURCE: ..." naming the key.
HfModel hf_model_from_config(const std::string& json, const std::string& source);

// The spec a submit with --hf-config sends: m's fields (with its weights_prefix
// and weights_first_layer when `user` has weights), then every field named in
// user_fields (set by -f spec.json or a flag) taken from `user`.
v1::JobSpec apply_hf_model(const HfModel& m, v1::JobSpec user, const std::set<std::string>& user_fields);

}  // namespace moe::ctl
