#include "moe/ctl/hf_config.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <climits>
#include <cmath>
#include <optional>
#include <vector>

#include "moe/rpc/frame.h"

namespace moe::ctl {
namespace {

using google::protobuf::Value;

constexpr const char* kMlpPrefix = "model.layers.{layer}.mlp.";
constexpr const char* kMixtralPrefix = "model.layers.{layer}.block_sparse_moe.";

// The keys of one config.json; an absent key and a null one are the same.
class Config {
 public:
  Config(google::protobuf::Struct s, std::string source, std::string type)
      : s_(std::move(s)), source_(std::move(source)), type_(std::move(type)) {}

  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    throw moe::InvalidArgument(source_ + ": '" + key + "' " + why);
  }
  // A count the family needs: an integer in [0, 2^31).
  int32_t count(const std::string& key) const {
    const auto v = optional_count(key);
    if (!v) bad(key, "is missing (needed for model_type '" + type_ + "')");
    return *v;
  }
  std::optional<int32_t> optional_count(const std::string& key) const {
    const Value* v = find(key);
    if (!v) return std::nullopt;
    const double d = v->number_value();
    if (v->kind_case() != Value::kNumberValue || d < 0 || d > INT32_MAX || std::floor(d) != d)
      bad(key, "must be a non-negative integer");
    return static_cast<int32_t>(d);
  }
  double number(const std::string& key, double fallback) const {
    const Value* v = find(key);
    if (!v) return fallback;
    if (v->kind_case() != Value::kNumberValue) bad(key, "must be a number");
    return v->number_value();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const Value* v = find(key);
    if (!v) return fallback;
    if (v->kind_case() != Value::kBoolValue) bad(key, "must be true or false");
    return v->bool_value();
  }
  std::string text(const std::string& key, const std::string& fallback) const {
    const Value* v = find(key);
    if (!v) return fallback;
    if (v->kind_case() != Value::kStringValue) bad(key, "must be a string");
    return v->string_value();
  }

 private:
  const Value* find(const std::string& key) const {
    const auto it = s_.fields().find(key);
    return it == s_.fields().end() || it->second.kind_case() == Value::kNullValue ? nullptr : &it->second;
  }
  google::protobuf::Struct s_;
  std::string source_, type_;
};

// The fields every family has, the expert width under its key.
HfModel common(const Config& c, const char* experts_key, const char* width_key, const char* prefix) {
  HfModel m;
  m.spec.set_experts(c.count(experts_key));
  m.spec.set_top_k(c.count("num_experts_per_tok"));
  m.spec.set_hidden(c.count("hidden_size"));
  m.spec.set_ffn_hidden(c.count(width_key));
  m.spec.set_score(v1::JobSpec::softmax);
  m.spec.set_routed_scaling_factor(1.0);
  m.weights_prefix = prefix;
  return m;
}

// Mixtral: softmax over all experts, the top-k renormalised.
HfModel mixtral(const Config& c) {
  HfModel m = common(c, "num_local_experts", "intermediate_size", kMixtralPrefix);
  m.spec.set_norm_topk_prob(true);
  return m;
}

// Qwen2-MoE / Qwen3-MoE: softmax; Qwen2-MoE adds one shared expert behind a sigmoid gate.
HfModel qwen(const Config& c, bool qwen2) {
  HfModel m = common(c, "num_experts", "moe_intermediate_size", kMlpPrefix);
  m.spec.set_norm_topk_prob(c.boolean("norm_topk_prob", false));
  if (!qwen2) return m;
  const int32_t shared = c.count("shared_expert_intermediate_size");
  if (shared == 0) return m;
  m.spec.set_shared_experts(1);
  m.spec.set_shared_ffn_hidden(shared);
  m.spec.set_shared_expert_gate(true);
  return m;
}

// DeepSeek's routing: "greedy" takes the top-k of all experts; "noaux_tc" (V3)
// keeps the topk_group best of n_group groups by their two best biased scores.
void deepseek_groups(const Config& c, bool v3, HfModel& m) {
  const std::string method = c.text("topk_method", v3 ? "noaux_tc" : "greedy");
  if (method == "greedy") return;
  if (method == "group_limited_greedy")
    c.bad("topk_method", "'group_limited_greedy' ranks a group by its best expert; moed's group-limited routing is "
                         "DeepSeek-V3's (a group's two best), so this routing is not reproduced");
  if (method != "noaux_tc") c.bad("topk_method", "must be greedy or noaux_tc, got '" + method + "'");
  const int32_t groups = c.count("n_group"), kept = c.count("topk_group");
  if (groups <= 1) return;
  m.spec.set_num_groups(groups);
  m.spec.set_group_top_k(kept);
}

HfModel deepseek(const Config& c, bool v3) {
  HfModel m = common(c, "n_routed_experts", "moe_intermediate_size", kMlpPrefix);
  const std::string score = c.text("scoring_func", v3 ? "sigmoid" : "softmax");
  // Hugging Face spells the score functions as the spec's enum values do.
  v1::JobSpec::Score parsed{};
  if (!v1::JobSpec::Score_Parse(score, &parsed) || parsed == v1::JobSpec::SCORE_UNSPECIFIED)
    c.bad("scoring_func", "must be softmax or sigmoid, got '" + score + "'");
  m.spec.set_score(parsed);
  deepseek_groups(c, v3, m);
  const bool norm = c.boolean("norm_topk_prob", v3);
  m.spec.set_norm_topk_prob(norm);
  // V2 scales only weights it does not renormalise; V3 scales them always.
  const bool scaled = v3 || !norm || m.spec.top_k() == 1;
  m.spec.set_routed_scaling_factor(scaled ? c.number("routed_scaling_factor", v3 ? 2.5 : 1.0) : 1.0);
  const int32_t shared = c.optional_count("n_shared_experts").value_or(v3 ? 1 : 0);
  if (shared > 0) {
    m.spec.set_shared_experts(shared);
    m.spec.set_shared_ffn_hidden(m.spec.ffn_hidden());
  }
  m.weights_first_layer = c.optional_count("first_k_dense_replace").value_or(0);
  return m;
}

}  // namespace

HfModel hf_model_from_config(const std::string& json, const std::string& source) {
  google::protobuf::Struct s;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &s);
  if (!st.ok())
    throw moe::InvalidArgument(
                        source + ": not a JSON object (" + st.message().as_string() + ")");
  const std::string type = Config(s, source, "").text("model_type", "");
  const Config c(std::move(s), source, type);
  if (type.empty()) c.bad("model_type", "is missing: moectl maps mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3");
  if (type == "mixtral") return mixtral(c);
  if (type == "qwen2_moe" || type == "qwen3_moe") return qwen(c, type == "qwen2_moe");
  if (type == "deepseek_v2" || type == "deepseek_v3") return deepseek(c, type == "deepseek_v3");
  c.bad("model_type", "'" + type + "' is not a family moectl maps (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)");
}

v1::JobSpec apply_hf_model(const HfModel& m, v1::JobSpec user, const std::set<std::string>& user_fields) {
  v1::JobSpec s = m.spec;
  if (!user.weights().empty()) {
    s.set_weights_prefix(m.weights_prefix);
    s.set_weights_first_layer(m.weights_first_layer);
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  for (const std::string& name : user_fields) {
    const auto* f = v1::JobSpec::descriptor()->FindFieldByName(name);
    if (!f) throw moe::Error("JobSpec has no field '" + name + "'");
    fields.push_back(f);
  }
  s.GetReflection()->SwapFields(&s, &user, fields);
  return s;
}

}  // namespace moe::ctl
