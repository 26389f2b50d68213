#include "moe/io/layer_io.h"

#include "moe/base/check.h"

namespace moe::io {
namespace {

std::string expert_name(const std::string& prefix, int e, const char* proj) {
  return prefix + "experts." + std::to_string(e) + "." + proj + ".weight";
}

StDType st_dtype(kernels::DType t) { return t == kernels::DType::kF32 ? StDType::kF32 : StDType::kBF16; }

}  // namespace

model::LayerWeights load_layer_weights(const SafetensorsReader& f, const std::string& prefix,
                                       const model::LayerShape& s) {
  const int64_t H = s.hidden, I = s.ffn_hidden, E = s.num_experts;
  model::LayerWeights w;
  w.gate = f.read_f32(prefix + "gate.weight", {E, H});
  const std::string bias = prefix + "gate.e_score_correction_bias";
  if (f.has(bias)) w.selection_bias = f.read_f32(bias, {E});
  w.w13.resize(E * 2 * I * H);
  w.w2.resize(E * H * I);
  for (int e = 0; e < E; ++e) {
    const auto gate = f.read_f32(expert_name(prefix, e, "gate_proj"), {I, H});
    const auto up = f.read_f32(expert_name(prefix, e, "up_proj"), {I, H});
    const auto down = f.read_f32(expert_name(prefix, e, "down_proj"), {H, I});
    std::copy(gate.begin(), gate.end(), w.w13.begin() + e * 2 * I * H);
    std::copy(up.begin(), up.end(), w.w13.begin() + e * 2 * I * H + I * H);
    std::copy(down.begin(), down.end(), w.w2.begin() + e * H * I);
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
  if (!w.shared_w13.empty()) {  // DeepSeek's names; the gate is Qwen's [1, H]
    const int64_t Is = s.shared_ffn_hidden;
    out.add_f32(prefix + "shared_experts.gate_proj.weight", {Is, H}, w.shared_w13.data(), st);
    out.add_f32(prefix + "shared_experts.up_proj.weight", {Is, H}, w.shared_w13.data() + Is * H, st);
    out.add_f32(prefix + "shared_experts.down_proj.weight", {H, Is}, w.shared_w2.data(), st);
    if (!w.shared_gate.empty()) out.add_f32(prefix + "shared_expert_gate.weight", {1, H}, w.shared_gate.data(), st);
  }
  for (int e : experts) {
    MOE_CHECK(e >= 0 && e < E, "dump: expert ", e, " out of range [0, ", E, ")");
    const float* w13 = w.w13.data() + e * 2 * I * H;
    out.add_f32(expert_name(prefix, e, "gate_proj"), {I, H}, w13, st);
    out.add_f32(expert_name(prefix, e, "up_proj"), {I, H}, w13 + I * H, st);
    out.add_f32(expert_name(prefix, e, "down_proj"), {H, I}, w.w2.data() + e * H * I, st);
  }
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
