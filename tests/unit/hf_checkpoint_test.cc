// Hugging Face checkpoints (docs/formats.md#hugging-face-schemes): every naming
// scheme, F32 and BF16, one file and index-sharded, load exactly what was written;
// a rank reads the bytes of the tensors it needs and no others; every bad
// checkpoint or disagreeing spec is an error naming the tensor or the field.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>

#include "hf_files.h"
#include "moe/base/check.h"
#include "moe/io/hf_checkpoint.h"
#include "moe/io/layer_io.h"
#include "moe/layer_spec/job_layers.h"

namespace moe::test {
namespace {

namespace fs = std::filesystem;
using io::ExpertNaming;
using io::SharedNaming;
using io::StDType;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moe_hf_" + std::to_string(::getpid())) / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "'" << (message) << "' lacks '" << (part) << "'"

// The prefix of checkpoint layer l in a scheme's usual spelling.
std::string prefix_of(ExpertNaming n, int layer) {
  return "model.layers." + std::to_string(layer) + (n == ExpertNaming::kMixtral ? ".block_sparse_moe." : ".mlp.");
}

void expect_equal(const model::LayerWeights& got, const model::LayerWeights& want) {
  EXPECT_EQ(got.gate, want.gate);
  EXPECT_EQ(got.selection_bias, want.selection_bias);
  EXPECT_EQ(got.w13, want.w13);
  EXPECT_EQ(got.w2, want.w2);
  EXPECT_EQ(got.shared_w13, want.shared_w13);
  EXPECT_EQ(got.shared_w2, want.shared_w2);
  EXPECT_EQ(got.shared_gate, want.shared_gate);
}

// (expert naming, shared naming, correction bias, dtype, shards)
using SchemeCase = std::tuple<ExpertNaming, SharedNaming, bool, StDType, int>;

class HfSchemes : public ::testing::TestWithParam<SchemeCase> {};

TEST_P(HfSchemes, LoadExactlyWhatWasWritten) {
  const auto [experts, shared, bias, dtype, shards] = GetParam();
  HfScheme scheme{experts, shared, bias, shared == SharedNaming::kQwen};
  model::LayerShape shape{16, 8, 4};
  if (shared != SharedNaming::kNone) shape.shared_ffn_hidden = shared == SharedNaming::kQwen ? 12 : 2 * 8;
  shape.shared_gate = scheme.shared_gate;
  // Two checkpoint layers with different values: the loader must pick layer 1.
  const model::LayerWeights w0 = hf_layer_values(10, shape, bias), w1 = hf_layer_values(11, shape, bias);
  std::vector<NamedTensor> all = hf_layer_tensors(prefix_of(experts, 0), shape, w0, scheme);
  for (auto& t : hf_layer_tensors(prefix_of(experts, 1), shape, w1, scheme)) all.push_back(t);
  const fs::path dir = fresh_dir("schemes");
  write_hf_checkpoint(dir.string(), split(all, shards), dtype);

  io::HfCheckpoint ckpt(dir.string());
  EXPECT_EQ(ckpt.sharded(), shards > 1);
  const model::LayerWeights want = as_stored(w1, dtype);
  expect_equal(io::load_layer_weights(ckpt, prefix_of(experts, 1), shape), want);

  // A rank hosting expert 2 only: the router and shared experts, expert 2, zeros.
  const model::LayerWeights part =
      io::load_layer_weights(ckpt, prefix_of(experts, 1), shape, {false, false, true, false});
  EXPECT_EQ(part.gate, want.gate);
  EXPECT_EQ(part.shared_w13, want.shared_w13);
  EXPECT_EQ(part.shared_gate, want.shared_gate);
  const size_t IH = 8 * 16;
  for (size_t i = 0; i < want.w13.size(); ++i)
    ASSERT_EQ(part.w13[i], i / (2 * IH) == 2 ? want.w13[i] : 0.0f) << "w13[" << i << "]";
  for (size_t i = 0; i < want.w2.size(); ++i)
    ASSERT_EQ(part.w2[i], i / IH == 2 ? want.w2[i] : 0.0f) << "w2[" << i << "]";
}

std::string scheme_case_name(const ::testing::TestParamInfo<SchemeCase>& info) {
  const auto [experts, shared, bias, dtype, shards] = info.param;
  const char* sh[] = {"NoShared", "DeepSeekShared", "QwenSharedGated"};
  return std::string(experts == ExpertNaming::kMixtral ? "Mixtral" : "GateUpDown") + sh[static_cast<int>(shared)] +
         (bias ? "Bias" : "") + (dtype == StDType::kBF16 ? "Bf16" : "F32") + (shards > 1 ? "Sharded" : "OneFile");
}

INSTANTIATE_TEST_SUITE_P(AllSchemes, HfSchemes,
                         ::testing::Combine(::testing::Values(ExpertNaming::kGateUpDown, ExpertNaming::kMixtral),
                                            ::testing::Values(SharedNaming::kNone, SharedNaming::kDeepSeek,
                                                              SharedNaming::kQwen),
                                            ::testing::Bool(), ::testing::Values(StDType::kF32, StDType::kBF16),
                                            ::testing::Values(1, 3)),
                         scheme_case_name);

class HfCheckpoint : public ::testing::Test {
 protected:
  const model::LayerShape shape{16, 8, 8};
  const std::string prefix = "model.layers.0.mlp.";
  const HfScheme scheme{};
  model::LayerWeights w = hf_layer_values(3, shape, false);

  std::vector<NamedTensor> layer() const { return hf_layer_tensors(prefix, shape, w, scheme); }
  // The error of loading `dir` as `s` (all experts needed).
  std::string load_error(const fs::path& dir, const model::LayerShape& s) const {
    return error_of([&] {
      io::HfCheckpoint ckpt(dir.string());
      io::load_layer_weights(ckpt, prefix, s);
    });
  }
  std::vector<NamedTensor> without(std::vector<NamedTensor> v, const std::string& name) const {
    std::erase_if(v, [&](const NamedTensor& t) { return t.name == name; });
    return v;
  }
};

TEST_F(HfCheckpoint, ARankReadsTheHeaderAndItsTensorsOnly) {
  const fs::path dir = fresh_dir("bytes");
  const std::string file = write_hf_checkpoint(dir.string(), {layer()}, StDType::kBF16).front();
  std::vector<bool> needed(8, false);
  needed[2] = needed[5] = true;
  io::HfCheckpoint ckpt(dir.string());
  io::load_layer_weights(ckpt, prefix, shape, needed);

  const io::SafetensorsReader r(file);
  uint64_t want = r.header_bytes();
  auto bytes = [&](const std::string& n) { return r.info(n).end - r.info(n).begin; };
  want += bytes(prefix + "gate.weight");
  for (int e : {2, 5})
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      want += bytes(prefix + "experts." + std::to_string(e) + "." + p + ".weight");
  EXPECT_EQ(ckpt.bytes_read(), want);
  const uint64_t data = fs::file_size(file) - r.header_bytes();
  EXPECT_LT(ckpt.bytes_read() - r.header_bytes(), data / 3) << "2 of 8 experts read";
}

TEST_F(HfCheckpoint, ShardedReadsOnlyTheShardsOfTheLayer) {
  // Shard 1: layer 0 of another prefix (and the embedding); shards 2-3: the layer.
  const model::LayerWeights other = hf_layer_values(4, shape, false);
  std::vector<NamedTensor> first = hf_layer_tensors("model.layers.9.mlp.", shape, other, scheme);
  first.push_back({"model.embed_tokens.weight", {4, 16}, std::vector<float>(64, 1.0f)});
  auto halves = split(layer(), 2);
  const fs::path dir = fresh_dir("sharded");
  const auto paths = write_hf_checkpoint(dir.string(), {first, halves[0], halves[1]}, StDType::kF32);
  fs::remove(paths[0]);  // never opened

  io::HfCheckpoint ckpt((dir / "model.safetensors.index.json").string());  // the index itself
  std::vector<bool> needed(8, false);
  needed[7] = true;  // in the last shard
  const model::LayerWeights got = io::load_layer_weights(ckpt, prefix, shape, needed);
  EXPECT_EQ(got.gate, w.gate);
  EXPECT_EQ(std::vector<float>(got.w2.end() - 8 * 16, got.w2.end()), std::vector<float>(w.w2.end() - 8 * 16, w.w2.end()));
  // Every tensor of the layer is checked from the headers (so every rank refuses
  // a bad layer alike), but only the needed tensors' bytes are read.
  EXPECT_EQ(ckpt.opened_files(), (std::vector<std::string>{paths[1], paths[2]}));
  const io::SafetensorsReader s1(paths[1]), s2(paths[2]);
  uint64_t want = s1.header_bytes() + s2.header_bytes();
  for (const std::string& n : {prefix + "gate.weight", prefix + "experts.7.gate_proj.weight",
                              prefix + "experts.7.up_proj.weight", prefix + "experts.7.down_proj.weight"})
    want += s1.has(n) ? s1.info(n).end - s1.info(n).begin : s2.info(n).end - s2.info(n).begin;
  EXPECT_EQ(ckpt.bytes_read(), want);
}

TEST_F(HfCheckpoint, MissingTensorsAreNamed) {
  const std::string down3 = prefix + "experts.3.down_proj.weight";
  const fs::path one = fresh_dir("missing1"), sharded = fresh_dir("missing3");
  write_hf_checkpoint(one.string(), {without(layer(), down3)}, StDType::kF32);
  EXPECT_ERROR_HAS(load_error(one, shape), "missing tensor '" + down3 + "'");
  write_hf_checkpoint(sharded.string(), split(without(layer(), prefix + "gate.weight"), 3), StDType::kF32);
  EXPECT_ERROR_HAS(load_error(sharded, shape), "missing tensor '" + prefix + "gate.weight' (not in the weight_map)");
  // Mixtral names: the expected Mixtral name is the one reported.
  const fs::path mixtral = fresh_dir("missing_w3");
  HfScheme m;
  m.experts = ExpertNaming::kMixtral;
  auto t = hf_layer_tensors(prefix, shape, w, m);
  write_hf_checkpoint(mixtral.string(), {without(t, prefix + "experts.5.w3.weight")}, StDType::kBF16);
  EXPECT_ERROR_HAS(load_error(mixtral, shape), "missing tensor '" + prefix + "experts.5.w3.weight'");
}

TEST_F(HfCheckpoint, ABrokenShardingIsNamed) {
  const fs::path dir = fresh_dir("shards");
  const auto paths = write_hf_checkpoint(dir.string(), split(layer(), 3), StDType::kF32);
  fs::remove(paths[2]);
  const std::string first_in_last = split(layer(), 3)[2].front().name;  // the first one checked there
  std::string e = load_error(dir, shape);
  EXPECT_ERROR_HAS(e, "cannot open");
  EXPECT_ERROR_HAS(e, "(the shard of tensor '" + first_in_last + "'");
  EXPECT_ERROR_HAS(e, paths[2]);

  // The index places a tensor in a shard that lacks it.
  const fs::path lie = fresh_dir("lie");
  auto shards = split(layer(), 2);
  const std::string moved = shards[1].front().name;
  write_hf_checkpoint(lie.string(), shards, StDType::kF32);
  const auto lying = write_hf_checkpoint(fresh_dir("lie_tmp").string(),
                                         {shards[0], std::vector<NamedTensor>(shards[1].begin() + 1, shards[1].end())},
                                         StDType::kF32);
  fs::copy_file(lying[1], lie / fs::path(lying[1]).filename(), fs::copy_options::overwrite_existing);
  e = load_error(lie, shape);
  EXPECT_ERROR_HAS(e, "missing tensor '" + moved + "', which");
  EXPECT_ERROR_HAS(e, "places in this shard");

  // Bad indexes and folders.
  const fs::path bad = fresh_dir("bad_index");
  std::ofstream(bad / "model.safetensors.index.json") << "{\"metadata\": {}}";
  EXPECT_ERROR_HAS(load_error(bad, shape), "no \"weight_map\" object");
  std::ofstream(bad / "model.safetensors.index.json") << "{\"weight_map\": {\"a\": 3}}";
  EXPECT_ERROR_HAS(load_error(bad, shape), "weight_map[\"a\"] is not a file name");
  // A shard outside the index's folder (a way to read any file the daemon can) is refused.
  for (const char* outside : {"../../etc/passwd", "/etc/passwd", ".."}) {
    std::ofstream(bad / "model.safetensors.index.json") << "{\"weight_map\": {\"a\": \"" << outside << "\"}}";
    EXPECT_ERROR_HAS(load_error(bad, shape), "weight_map[\"a\"] is '" + std::string(outside) +
                                                 "', not a file name in the index's folder");
  }
  std::ofstream(bad / "model.safetensors.index.json") << "[1, 2";
  EXPECT_ERROR_HAS(load_error(bad, shape), "bad index: not a JSON object");
  EXPECT_ERROR_HAS(load_error(fresh_dir("empty"), shape), "a folder without model.safetensors.index.json");
}

TEST_F(HfCheckpoint, ASpecThatDisagreesNamesTheField) {
  const fs::path dir = fresh_dir("disagree");
  write_hf_checkpoint(dir.string(), {layer()}, StDType::kF32);
  model::LayerShape s = shape;
  s.num_experts = 4;
  EXPECT_ERROR_HAS(load_error(dir, s), "tensor '" + prefix + "gate.weight' has shape [8, 16], the spec gives [4, 16]: experts is 4, the file's is 8");
  s = shape;
  s.hidden = 32;
  EXPECT_ERROR_HAS(load_error(dir, s), "hidden is 32, the file's is 16");
  s = shape;
  s.ffn_hidden = 12;
  EXPECT_ERROR_HAS(load_error(dir, s), "tensor '" + prefix + "experts.0.gate_proj.weight' has shape [8, 16], the spec gives [12, 16]: ffn_hidden is 12, the file's is 8");
  s = shape;
  s.shared_ffn_hidden = 16;
  EXPECT_ERROR_HAS(load_error(dir, s), "shared_experts: the spec has shared experts");

  // Shared experts of width 16 in the file.
  model::LayerShape sh = shape;
  sh.shared_ffn_hidden = 16;
  const fs::path ds = fresh_dir("deepseek");
  HfScheme d;
  d.shared = SharedNaming::kDeepSeek;
  write_hf_checkpoint(ds.string(), {hf_layer_tensors(prefix, sh, hf_layer_values(5, sh, false), d)}, StDType::kF32);
  EXPECT_ERROR_HAS(load_error(ds, shape), "shared_experts: the checkpoint has shared experts ('" + prefix + "shared_experts.");
  s = sh;
  s.shared_ffn_hidden = 24;  // e.g. shared_experts 3 x shared_ffn_hidden 8
  EXPECT_ERROR_HAS(load_error(ds, s), "tensor '" + prefix + "shared_experts.gate_proj.weight' has shape [16, 16], the spec gives [24, 16]: shared_experts x shared_ffn_hidden is 24, the file's is 16");
  s = sh;
  s.shared_gate = true;
  EXPECT_ERROR_HAS(load_error(ds, s), "missing tensor '" + prefix + "shared_expert_gate.weight'");

  // Qwen's shared expert with its gate, against a spec without the gate.
  const fs::path qw = fresh_dir("qwen");
  HfScheme q;
  q.shared = SharedNaming::kQwen;
  q.shared_gate = true;
  sh.shared_gate = true;
  write_hf_checkpoint(qw.string(), {hf_layer_tensors(prefix, sh, hf_layer_values(6, sh, false), q)}, StDType::kF32);
  s = sh;
  s.shared_gate = false;
  EXPECT_ERROR_HAS(load_error(qw, s), "shared_expert_gate: the checkpoint has '" + prefix + "shared_expert_gate.weight'");
  EXPECT_EQ(load_error(qw, sh), "");
}

TEST_F(HfCheckpoint, OnlyF32AndBf16AreRead) {
  // An F16 tensor of an expert no rank of this call needs is still refused:
  // every rank checks the whole layer.
  const fs::path dir = fresh_dir("f16");
  const std::string file = write_hf_checkpoint(dir.string(), {layer()}, StDType::kBF16).front();
  const std::string up6 = prefix + "experts.6.up_proj.weight";
  set_header_dtype(file, up6, "F16");
  const std::string e = error_of([&] {
    io::HfCheckpoint ckpt(dir.string());
    std::vector<bool> needed(8, false);
    needed[0] = true;
    io::load_layer_weights(ckpt, prefix, shape, needed);
  });
  EXPECT_ERROR_HAS(e, "tensor '" + up6 + "' has dtype F16; expected F32 or BF16");
}

TEST_F(HfCheckpoint, AWrongPrefixIsNamedWithAHint) {
  const fs::path dir = fresh_dir("prefix");
  write_hf_checkpoint(dir.string(), {layer()}, StDType::kF32);
  const std::string e = error_of([&] {
    io::HfCheckpoint ckpt(dir.string());
    io::load_layer_weights(ckpt, "model.layers.0.block_sparse_moe.", shape);
  });
  EXPECT_ERROR_HAS(e, "no expert tensors under the prefix 'model.layers.0.block_sparse_moe.'");
  EXPECT_ERROR_HAS(e, "no tensor name starts with it");
  EXPECT_ERROR_HAS(e, "the checkpoint has '" + prefix + "experts.0.");
}

// job layer l reads checkpoint layer weights_first_layer + l through {layer};
// without {layer} every layer reads the same tensors.
TEST_F(HfCheckpoint, JobLayersMapToCheckpointLayers) {
  model::LayerShape sh = shape;
  sh.shared_ffn_hidden = 2 * 4;
  HfScheme d;
  d.shared = SharedNaming::kDeepSeek;
  d.correction_bias = true;
  std::vector<model::LayerWeights> ws;
  std::vector<NamedTensor> all;
  for (int l = 0; l < 3; ++l) {
    ws.push_back(hf_layer_values(20 + l, sh, true));
    for (auto& t : hf_layer_tensors("model.layers." + std::to_string(l) + ".mlp.", sh, ws.back(), d)) all.push_back(t);
  }
  const fs::path dir = fresh_dir("layers");
  write_hf_checkpoint(dir.string(), split(all, 2), StDType::kBF16);

  v1::JobSpec spec;
  spec.set_experts(8);
  spec.set_hidden(16);
  spec.set_ffn_hidden(8);
  spec.set_shared_experts(2);
  spec.set_shared_ffn_hidden(4);
  spec.set_weights(dir.string());
  spec.set_weights_prefix("model.layers.{layer}.mlp.");
  spec.set_weights_first_layer(1);
  const std::vector<bool> all_experts(8, true);
  for (int l = 0; l < 2; ++l) expect_equal(layer_spec::layer_weights(spec, l, all_experts), as_stored(ws[1 + l], StDType::kBF16));
  spec.set_weights_prefix("model.layers.2.mlp.");
  spec.set_weights_first_layer(0);
  for (int l = 0; l < 2; ++l) expect_equal(layer_spec::layer_weights(spec, l, all_experts), as_stored(ws[2], StDType::kBF16));

  spec.set_weights_prefix("model.layers.{layer}.mlp.");
  spec.set_weights_first_layer(2);
  const std::string e = error_of([&] { layer_spec::layer_weights(spec, 1, all_experts); });
  EXPECT_ERROR_HAS(e, "weights of layer 1 (checkpoint layer 3): ");
  EXPECT_ERROR_HAS(e, "no expert tensors under the prefix 'model.layers.3.mlp.'");
}

}  // namespace
}  // namespace moe::test
