#include "moe/io/hf_scheme.h"

#include "moe/base/check.h"

namespace moe::io {
namespace {

std::string expert_name(const std::string& p, ExpertNaming n, int e, Role role) {
  static const char* gate_up_down[] = {"gate_proj", "up_proj", "down_proj"};
  static const char* mixtral[] = {"w1", "w3", "w2"};
  const int i = role == Role::kGate ? 0 : role == Role::kUp ? 1 : 2;
  return p + "experts." + std::to_string(e) + "." + (n == ExpertNaming::kMixtral ? mixtral : gate_up_down)[i] +
         ".weight";
}

std::string shared_name(const std::string& p, SharedNaming n, Role role) {
  const char* proj = role == Role::kSharedGate ? "gate_proj" : role == Role::kSharedUp ? "up_proj" : "down_proj";
  return p + (n == SharedNaming::kQwen ? "shared_expert." : "shared_experts.") + proj + ".weight";
}

// A name elsewhere in the checkpoint that looks like expert 0 of some layer, to
// hint at the right prefix ("" if none).
std::string expert_hint(const HfCheckpoint& ckpt) {
  for (const std::string& n : ckpt.names_with_prefix(""))
    if (n.rfind("experts.0.", 0) == 0 || n.find(".experts.0.") != std::string::npos) return n;
  return "";
}

[[noreturn]] void no_experts(const HfCheckpoint& ckpt, const std::string& p) {
  const std::string hint = expert_hint(ckpt);
  detail::fail(ckpt.path(), ": no expert tensors under the prefix '", p, "': expected '", p,
               "experts.0.gate_proj.weight' (Qwen/DeepSeek) or '", p, "experts.0.w1.weight' (Mixtral)",
               ckpt.names_with_prefix(p).empty() ? "; no tensor name starts with it" : "",
               hint.empty() ? "" : "; the checkpoint has '" + hint + "'");
}

}  // namespace

LayerScheme detect_scheme(const HfCheckpoint& ckpt, const std::string& p) {
  LayerScheme s;
  const bool gate_up_down = ckpt.has(p + "experts.0.gate_proj.weight");
  const bool mixtral = ckpt.has(p + "experts.0.w1.weight");
  if (!gate_up_down && !mixtral) no_experts(ckpt, p);
  MOE_CHECK(!(gate_up_down && mixtral), ckpt.path(), ": expert 0 under '", p,
            "' has both gate_proj/up_proj/down_proj and Mixtral w1/w3/w2 tensors; a layer uses one naming");
  s.experts = mixtral ? ExpertNaming::kMixtral : ExpertNaming::kGateUpDown;
  const bool deepseek = !ckpt.names_with_prefix(p + "shared_experts.").empty();
  const bool qwen = !ckpt.names_with_prefix(p + "shared_expert.").empty();
  MOE_CHECK(!(deepseek && qwen), ckpt.path(), ": both '", p, "shared_experts.*' (DeepSeek) and '", p,
            "shared_expert.*' (Qwen) tensors; a layer uses one naming");
  s.shared = deepseek ? SharedNaming::kDeepSeek : qwen ? SharedNaming::kQwen : SharedNaming::kNone;
  s.correction_bias = ckpt.has(p + "gate.e_score_correction_bias");
  s.shared_gate = ckpt.has(p + "shared_expert_gate.weight");
  return s;
}

std::string describe(const LayerScheme& s) {
  std::string out = s.experts == ExpertNaming::kMixtral ? "Mixtral (w1/w3/w2)" : "Qwen/DeepSeek (gate_proj/up_proj/down_proj)";
  if (s.correction_bias) out += ", correction bias";
  if (s.shared == SharedNaming::kDeepSeek) out += ", DeepSeek shared_experts";
  if (s.shared == SharedNaming::kQwen) out += ", Qwen shared_expert";
  if (s.shared_gate) out += ", shared_expert_gate";
  return out;
}

std::vector<LayerTensor> layer_tensors(const LayerScheme& s, const std::string& p, const model::LayerShape& shape) {
  const int64_t E = shape.num_experts, H = shape.hidden, I = shape.ffn_hidden, Is = shape.shared_ffn_hidden;
  const std::string shared_width = "shared_experts x shared_ffn_hidden";
  std::vector<LayerTensor> out;
  out.push_back({Role::kRouter, -1, p + "gate.weight", {E, H}, {"experts", "hidden"}});
  if (s.correction_bias) out.push_back({Role::kBias, -1, p + "gate.e_score_correction_bias", {E}, {"experts"}});
  for (int e = 0; e < E; ++e) {
    out.push_back({Role::kGate, e, expert_name(p, s.experts, e, Role::kGate), {I, H}, {"ffn_hidden", "hidden"}});
    out.push_back({Role::kUp, e, expert_name(p, s.experts, e, Role::kUp), {I, H}, {"ffn_hidden", "hidden"}});
    out.push_back({Role::kDown, e, expert_name(p, s.experts, e, Role::kDown), {H, I}, {"hidden", "ffn_hidden"}});
  }
  if (Is > 0) {
    for (Role r : {Role::kSharedGate, Role::kSharedUp})
      out.push_back({r, -1, shared_name(p, s.shared, r), {Is, H}, {shared_width, "hidden"}});
    out.push_back({Role::kSharedDown, -1, shared_name(p, s.shared, Role::kSharedDown), {H, Is}, {"hidden", shared_width}});
  }
  if (shape.shared_gate)
    out.push_back({Role::kSharedExpertGate, -1, p + "shared_expert_gate.weight", {1, H}, {"1", "hidden"}});
  return out;
}

}  // namespace moe::io
