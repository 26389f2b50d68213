#include "moe/io/layer_io.h"

#include <algorithm>
#include <cctype>

#include "moe/base/check.h"
#include "moe/io/hf_scheme.h"

namespace moe::io {
namespace {

std::string expert_name(const std::string& prefix, int e, const char* proj) {
  return prefix + "experts." + std::to_string(e) + "." + proj + ".weight";
}

StDType st_dtype(kernels::DType t) { return t == kernels::DType::kF32 ? StDType::kF32 : StDType::kBF16; }

// Shared experts or their gate on one side only (spec or checkpoint).
void check_shared(const HfCheckpoint& ckpt, const std::string& p, const LayerScheme& s, const model::LayerShape& shape) {
  if (shape.shared_ffn_hidden > 0)
    MOE_CHECK(s.shared != SharedNaming::kNone, ckpt.path(), ": shared_experts: the spec has shared experts (",
              "shared_experts x shared_ffn_hidden = ", shape.shared_ffn_hidden, ") but there is no '", p,
              "shared_experts.gate_proj.weight' (DeepSeek) or '", p, "shared_expert.gate_proj.weight' (Qwen)");
  if (shape.shared_ffn_hidden == 0 && s.shared != SharedNaming::kNone) {
    const auto names = ckpt.names_with_prefix(p + (s.shared == SharedNaming::kQwen ? "shared_expert." : "shared_experts."));
    detail::fail(ckpt.path(), ": shared_experts: the checkpoint has shared experts ('", names.front(),
                 "') but the spec has none; set shared_experts and shared_ffn_hidden (or use --hf-config)");
  }
  MOE_CHECK(shape.shared_gate || !s.shared_gate, ckpt.path(), ": shared_expert_gate: the checkpoint has '", p,
            "shared_expert_gate.weight' but the spec's shared_expert_gate is false");
}

// Why `got` differs from the spec's `t.shape`, naming the field of the first
// dimension that does.
std::string shape_mismatch(const LayerTensor& t, const std::vector<int64_t>& got) {
  if (got.size() != t.shape.size())
    return std::to_string(got.size()) + " dimensions, expected " + std::to_string(t.shape.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == t.shape[i]) continue;
    const std::string& field = t.dims[i];
    const bool fixed = !field.empty() && std::isdigit(static_cast<unsigned char>(field[0]));
    return (fixed ? "dimension " + std::to_string(i) + " must be " + field : field + " is " + std::to_string(t.shape[i])) +
           ", the file's is " + std::to_string(got[i]);
  }
  return "";
}

// The header facts of one tensor against the spec: there, the shape, the dtype.
void check_tensor(HfCheckpoint& ckpt, const LayerTensor& t) {
  MOE_CHECK(ckpt.has(t.name), ckpt.path(), ": missing tensor '", t.name, "'",
            ckpt.sharded() ? " (not in the weight_map)" : "");
  const TensorInfo& info = ckpt.info(t.name);
  MOE_CHECK(info.shape == t.shape, ckpt.path(), ": tensor '", t.name, "' has shape ", shape_str(info.shape),
            ", the spec gives ", shape_str(t.shape), ": ", shape_mismatch(t, info.shape));
  MOE_CHECK(info.dtype == StDType::kF32 || info.dtype == StDType::kBF16, ckpt.path(), ": tensor '", t.name,
            "' has dtype ", info.dtype_name, "; expected F32 or BF16");
}

// Copies one tensor's values to where LayerWeights keeps them.
void place(model::LayerWeights& w, const LayerTensor& t, std::vector<float> v, const model::LayerShape& s) {
  const size_t IH = static_cast<size_t>(s.ffn_hidden) * s.hidden;
  const size_t IsH = static_cast<size_t>(s.shared_ffn_hidden) * s.hidden;
  const size_t e = t.expert < 0 ? 0 : static_cast<size_t>(t.expert);
  switch (t.role) {
    case Role::kRouter: w.gate = std::move(v); return;
    case Role::kBias: w.selection_bias = std::move(v); return;
    case Role::kGate: std::copy(v.begin(), v.end(), w.w13.begin() + e * 2 * IH); return;
    case Role::kUp: std::copy(v.begin(), v.end(), w.w13.begin() + e * 2 * IH + IH); return;
    case Role::kDown: std::copy(v.begin(), v.end(), w.w2.begin() + e * IH); return;
    case Role::kSharedGate: std::copy(v.begin(), v.end(), w.shared_w13.begin()); return;
    case Role::kSharedUp: std::copy(v.begin(), v.end(), w.shared_w13.begin() + IsH); return;
    case Role::kSharedDown: w.shared_w2 = std::move(v); return;
    case Role::kSharedExpertGate: w.shared_gate = std::move(v); return;  // [1, H] as [H]
  }
}

}  // namespace

model::LayerWeights load_layer_weights(HfCheckpoint& ckpt, const std::string& prefix, const model::LayerShape& s,
                                       const std::vector<bool>& needed) {
  MOE_CHECK(needed.empty() || static_cast<int>(needed.size()) == s.num_experts, "load_layer_weights: needed has ",
            needed.size(), " entries for ", s.num_experts, " experts");
  const LayerScheme scheme = detect_scheme(ckpt, prefix);
  check_shared(ckpt, prefix, scheme, s);
  const std::vector<LayerTensor> tensors = layer_tensors(scheme, prefix, s);
  for (const LayerTensor& t : tensors) check_tensor(ckpt, t);

  const size_t E = s.num_experts, IH = static_cast<size_t>(s.ffn_hidden) * s.hidden;
  const size_t IsH = static_cast<size_t>(s.shared_ffn_hidden) * s.hidden;
  model::LayerWeights w;
  w.w13.assign(E * 2 * IH, 0.0f);
  w.w2.assign(E * IH, 0.0f);
  w.shared_w13.assign(2 * IsH, 0.0f);
  for (const LayerTensor& t : tensors) {
    if (t.expert >= 0 && !needed.empty() && !needed[t.expert]) continue;
    place(w, t, ckpt.read_f32(t.name, t.shape), s);
  }
  return w;
}

void add_layer_weights(SafetensorsWriter& out, const std::string& prefix, const model::LayerShape& s,
                       const model::LayerWeights& w, const std::vector<int>& experts,
                       kernels::DType dtype) {
  const int64_t H = s.hidden, I = s.ffn_hidden, E = s.num_experts;
  const StDType st = st_dtype(dtype);
  out.add_f32(prefix + "gate.weight", {E, H}, w.gate.data(), st);
  if (!w.selection_bias.empty())
    out.add_f32(prefix + "gate.e_score_correction_bias", {E}, w.selection_bias.data());
  if (!w.logit_bias.empty()) out.add_f32(prefix + "gate.logit_bias", {E}, w.logit_bias.data());
  for (int e : experts) {
    MOE_CHECK(e >= 0 && e < E, "dump: expert ", e, " out of range [0, ", E, ")");
    const float* w13 = w.w13.data() + e * 2 * I * H;
    out.add_f32(expert_name(prefix, e, "gate_proj"), {I, H}, w13, st);
    out.add_f32(expert_name(prefix, e, "up_proj"), {I, H}, w13 + I * H, st);
    out.add_f32(expert_name(prefix, e, "down_proj"), {H, I}, w.w2.data() + e * H * I, st);
  }
  if (w.shared_w13.empty()) return;  // DeepSeek's names; the gate is Qwen's [1, H]
  const int64_t Is = s.shared_ffn_hidden;
  MOE_CHECK(static_cast<int64_t>(w.shared_w13.size()) == 2 * Is * H && static_cast<int64_t>(w.shared_w2.size()) == H * Is,
            "dump: shared expert weights of ", w.shared_w13.size(), " and ", w.shared_w2.size(),
            " values do not fit shared width ", Is, " and hidden ", H);
  out.add_f32(prefix + "shared_experts.gate_proj.weight", {Is, H}, w.shared_w13.data(), st);
  out.add_f32(prefix + "shared_experts.up_proj.weight", {Is, H}, w.shared_w13.data() + Is * H, st);
  out.add_f32(prefix + "shared_experts.down_proj.weight", {H, Is}, w.shared_w2.data(), st);
  if (!w.shared_gate.empty()) out.add_f32(prefix + "shared_expert_gate.weight", {1, H}, w.shared_gate.data(), st);
}

void write_layer_dump(const std::string& path, const LayerDump& d) {
  const int64_t T = d.num_tokens, H = d.shape.hidden, I = d.shape.ffn_hidden, E = d.shape.num_experts;
  const StDType st = st_dtype(d.dtype);
  SafetensorsWriter out;
  out.set_metadata("format", "pt");
  out.add_raw("x", st, {T, H}, d.x);
  out.add_raw("out", st, {T, H}, d.out);
  out.add_i32("topk_idx", {T, d.top_k}, d.topk_idx);
  out.add_f32("topk_weight", {T, d.top_k}, d.topk_weight);
  if (d.grad_out) {
    MOE_CHECK(d.grad_x && d.grad_gate && d.grad_w13 && d.grad_w2, "dump: train mode needs every gradient");
    out.add_raw("grad_out", st, {T, H}, d.grad_out);
    out.add_raw("grad_x", st, {T, H}, d.grad_x);
    out.add_f32("grad.gate.weight", {E, H}, d.grad_gate);
    for (int e : d.experts) {
      const float* g13 = d.grad_w13 + e * 2 * I * H;
      out.add_f32("grad.experts." + std::to_string(e) + ".gate_proj.weight", {I, H}, g13);
      out.add_f32("grad.experts." + std::to_string(e) + ".up_proj.weight", {I, H}, g13 + I * H);
      out.add_f32("grad.experts." + std::to_string(e) + ".down_proj.weight", {H, I}, d.grad_w2 + e * H * I);
    }
    if (d.grad_shared_w13) {
      const int64_t Is = d.shape.shared_ffn_hidden;
      out.add_f32("grad.shared_experts.gate_proj.weight", {Is, H}, d.grad_shared_w13);
      out.add_f32("grad.shared_experts.up_proj.weight", {Is, H}, d.grad_shared_w13 + Is * H);
      out.add_f32("grad.shared_experts.down_proj.weight", {H, Is}, d.grad_shared_w2);
    }
    if (d.grad_shared_gate) out.add_f32("grad.shared_expert_gate.weight", {1, H}, d.grad_shared_gate);
  }
  add_layer_weights(out, "", d.shape, *d.weights, d.experts, d.dtype);
  out.write(path);
}

}  // namespace moe::io
