#include "hf_files.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "moe/base/check.h"
#include "moe/kernels/types.h"
#include "test_util.h"

namespace moe::test {
namespace {

namespace fs = std::filesystem;
using io::ExpertNaming;
using io::SharedNaming;

// N(0, stddev) values, none exactly zero (a zero would hide a value not read).
std::vector<float> values(size_t n, uint64_t seed, double stddev) {
  std::vector<float> v = normal_vector(n, seed, stddev);
  for (float& x : v)
    if (x == 0.0f) x = static_cast<float>(stddev);
  return v;
}

std::vector<float> slice(const std::vector<float>& v, size_t begin, size_t n) {
  return {v.begin() + begin, v.begin() + begin + n};
}

std::string proj(ExpertNaming n, int i) {
  static const char* names[] = {"gate_proj", "up_proj", "down_proj"};
  static const char* mixtral[] = {"w1", "w3", "w2"};
  return n == ExpertNaming::kMixtral ? mixtral[i] : names[i];
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

model::LayerWeights hf_layer_values(uint64_t seed, const model::LayerShape& s, bool correction_bias) {
  const size_t E = s.num_experts, H = s.hidden, I = s.ffn_hidden, Is = s.shared_ffn_hidden;
  const double in_std = 1.0 / std::sqrt(static_cast<double>(H));
  model::LayerWeights w;
  w.gate = values(E * H, seed * 16 + 1, in_std);
  w.w13 = values(E * 2 * I * H, seed * 16 + 2, in_std);
  w.w2 = values(E * H * I, seed * 16 + 3, 1.0 / std::sqrt(static_cast<double>(I)));
  if (correction_bias) w.selection_bias = values(E, seed * 16 + 4, 0.1);
  if (Is > 0) {
    w.shared_w13 = values(2 * Is * H, seed * 16 + 5, in_std);
    w.shared_w2 = values(H * Is, seed * 16 + 6, 1.0 / std::sqrt(static_cast<double>(Is)));
  }
  if (s.shared_gate) w.shared_gate = values(H, seed * 16 + 7, in_std);
  return w;
}

std::vector<NamedTensor> hf_layer_tensors(const std::string& p, const model::LayerShape& s,
                                          const model::LayerWeights& w, const HfScheme& scheme) {
  const int64_t E = s.num_experts, H = s.hidden, I = s.ffn_hidden, Is = s.shared_ffn_hidden;
  std::vector<NamedTensor> out;
  out.push_back({p + "gate.weight", {E, H}, w.gate});
  if (scheme.correction_bias) out.push_back({p + "gate.e_score_correction_bias", {E}, w.selection_bias, true});
  for (int64_t e = 0; e < E; ++e) {
    const std::string ex = p + "experts." + std::to_string(e) + ".";
    out.push_back({ex + proj(scheme.experts, 0) + ".weight", {I, H}, slice(w.w13, e * 2 * I * H, I * H)});
    out.push_back({ex + proj(scheme.experts, 1) + ".weight", {I, H}, slice(w.w13, e * 2 * I * H + I * H, I * H)});
    out.push_back({ex + proj(scheme.experts, 2) + ".weight", {H, I}, slice(w.w2, e * H * I, H * I)});
  }
  if (scheme.shared != SharedNaming::kNone) {
    const std::string sh = p + (scheme.shared == SharedNaming::kQwen ? "shared_expert." : "shared_experts.");
    out.push_back({sh + "gate_proj.weight", {Is, H}, slice(w.shared_w13, 0, Is * H)});
    out.push_back({sh + "up_proj.weight", {Is, H}, slice(w.shared_w13, Is * H, Is * H)});
    out.push_back({sh + "down_proj.weight", {H, Is}, w.shared_w2});
  }
  if (scheme.shared_gate) out.push_back({p + "shared_expert_gate.weight", {1, H}, w.shared_gate});
  return out;
}

std::vector<std::vector<NamedTensor>> split(const std::vector<NamedTensor>& tensors, int n) {
  std::vector<std::vector<NamedTensor>> shards(n);
  for (size_t i = 0; i < tensors.size(); ++i) shards[i * n / tensors.size()].push_back(tensors[i]);
  return shards;
}

std::vector<std::string> write_hf_checkpoint(const std::string& dir, const std::vector<std::vector<NamedTensor>>& shards,
                                             io::StDType dtype) {
  fs::create_directories(dir);
  const int n = static_cast<int>(shards.size());
  std::vector<std::string> paths;
  std::string weight_map;
  for (int i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", i + 1, n);
    const std::string file = n == 1 ? "model.safetensors" : name;
    io::SafetensorsWriter out;
    out.set_metadata("format", "pt");
    for (const NamedTensor& t : shards[i]) {
      out.add_f32(t.name, t.shape, t.values.data(), t.keep_f32 ? io::StDType::kF32 : dtype);
      weight_map += (weight_map.empty() ? "" : ",\n    ") + ("\"" + json_escape(t.name) + "\": \"" + file + "\"");
    }
    paths.push_back((fs::path(dir) / file).string());
    out.write(paths.back());
  }
  if (n > 1) {
    std::ofstream index(fs::path(dir) / "model.safetensors.index.json");
    index << "{\n  \"metadata\": {\"total_size\": 0},\n  \"weight_map\": {\n    " << weight_map << "\n  }\n}\n";
  }
  return paths;
}

model::LayerWeights as_stored(model::LayerWeights w, io::StDType dtype) {
  if (dtype != io::StDType::kBF16) return w;
  for (auto* v : {&w.gate, &w.w13, &w.w2, &w.shared_w13, &w.shared_w2, &w.shared_gate})
    for (float& x : *v) x = kernels::round_to_bf16(x);
  return w;
}

void set_header_dtype(const std::string& path, const std::string& tensor, const std::string& dtype) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  std::string head(1 << 16, '\0');
  f.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(f.gcount());
  const size_t entry = head.find("\"" + tensor + "\":");
  MOE_CHECK(entry != std::string::npos, path, ": no header entry for ", tensor);
  const size_t open = head.find("\"dtype\":\"", entry) + 9, close = head.find('"', open);
  MOE_CHECK(dtype.size() <= close - open, "set_header_dtype: '", dtype, "' is longer than the old dtype");
  const std::string patch = dtype + "\"" + std::string(close - open - dtype.size(), ' ');
  f.clear();
  f.seekp(static_cast<std::streamoff>(open));
  f.write(patch.data(), static_cast<std::streamsize>(patch.size()));
}

}  // namespace moe::test
