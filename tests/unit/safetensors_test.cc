// safetensors: round trips, Hugging Face layer names, dumps, and a clear error for
// every kind of bad file (including every truncation and random header damage).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "moe/io/layer_io.h"
#include "moe/io/safetensors.h"
#include "moe/base/check.h"
#include "test_util.h"

namespace moe::test {
namespace {

namespace fs = std::filesystem;
using io::SafetensorsReader;
using io::SafetensorsWriter;
using io::StDType;

class Safetensors : public ::testing::Test {
 protected:
  fs::path dir = fs::temp_directory_path() / ("moe_st_" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }

  static std::string read_all(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  static void write_all(const std::string& p, const std::string& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  // The error message of opening p (and reading `tensor` as [dims] if given).
  static std::string error_of(const std::string& p, const std::string& tensor = "",
                              std::vector<int64_t> dims = {}) {
    try {
      SafetensorsReader r(p);
      if (!tensor.empty()) r.read_f32(tensor, dims);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(Safetensors, RoundTripsEveryDtype) {
  const std::vector<float> a = normal_vector(6, 1);
  const std::vector<int32_t> idx = {3, -1, 7, 0};
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.add_f32("a", {2, 3}, a.data());
  w.add_f32("a_bf16", {2, 3}, a.data(), StDType::kBF16);
  w.add_i32("idx", {4}, idx.data());
  w.add_f32("empty", {0, 5}, nullptr);
  w.write(path("x.safetensors"));

  SafetensorsReader r(path("x.safetensors"));
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.read_f32("a", {2, 3}), a);
  const std::vector<float> b = r.read_f32("a_bf16", {2, 3});
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(b[i], kernels::round_to_bf16(a[i]));
  EXPECT_EQ(r.read_i32("idx", {4}), idx);
  EXPECT_TRUE(r.read_f32("empty", {0, 5}).empty());
  EXPECT_EQ(r.info("a_bf16").dtype_name, "BF16");
  // The data section starts 8-byte aligned, as the format asks.
  const std::string bytes = read_all(path("x.safetensors"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
}

TEST_F(Safetensors, ErrorsNameTheProblem) {
  const std::vector<float> a = normal_vector(6, 1);
  SafetensorsWriter w;
  w.add_f32("a", {2, 3}, a.data());
  w.write(path("ok.safetensors"));
  const std::string good = read_all(path("ok.safetensors"));

  EXPECT_NE(error_of(path("nope.safetensors")).find("cannot open"), std::string::npos);
  write_all(path("short.safetensors"), good.substr(0, 5));
  EXPECT_NE(error_of(path("short.safetensors")).find("truncated"), std::string::npos);
  write_all(path("cut.safetensors"), good.substr(0, good.size() - 4));
  EXPECT_NE(error_of(path("cut.safetensors")).find("truncated: tensor 'a'"), std::string::npos);
  std::string bad = good;
  bad[9] = '[';  // header no longer an object
  write_all(path("bad.safetensors"), bad);
  EXPECT_NE(error_of(path("bad.safetensors")).find("bad header"), std::string::npos);
  std::string huge = good;
  huge[6] = 0x7f;  // header length far past the file
  write_all(path("huge.safetensors"), huge);
  EXPECT_NE(error_of(path("huge.safetensors")).find("bad header: length"), std::string::npos);
  EXPECT_NE(error_of(path("ok.safetensors"), "b", {2, 3}).find("missing tensor 'b'"), std::string::npos);
  EXPECT_NE(error_of(path("ok.safetensors"), "a", {3, 2}).find("has shape [2, 3], expected [3, 2]"),
            std::string::npos);

  // A dtype we do not read is reported when read, not when opened.
  const std::string header = R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})";
  std::string f16(8, '\0');
  f16[0] = static_cast<char>(header.size());
  write_all(path("f16.safetensors"), f16 + header + std::string(4, '\0'));
  EXPECT_EQ(error_of(path("f16.safetensors")), "");
  EXPECT_NE(error_of(path("f16.safetensors"), "h", {2}).find("dtype F16"), std::string::npos);
  // Offsets that disagree with shape x dtype.
  const std::string lie = R"({"h":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})";
  std::string l(8, '\0');
  l[0] = static_cast<char>(lie.size());
  write_all(path("lie.safetensors"), l + lie + std::string(4, '\0'));
  EXPECT_NE(error_of(path("lie.safetensors")).find("needs 8 bytes"), std::string::npos);
}

TEST_F(Safetensors, NoDamageCrashesTheReader) {
  const std::vector<float> a = normal_vector(64, 1);
  SafetensorsWriter w;
  w.add_f32("gate.weight", {8, 8}, a.data());
  w.add_f32("experts.0.up_proj.weight", {4, 4}, a.data(), StDType::kBF16);
  w.write(path("ok.safetensors"));
  const std::string good = read_all(path("ok.safetensors"));
  // Every truncation, and 2000 random single-byte changes in the first 200 bytes:
  // each either opens or throws moe::Error (never anything else).
  int errors = 0;
  auto probe = [&](const std::string& bytes) {
    write_all(path("d.safetensors"), bytes);
    try {
      SafetensorsReader r(path("d.safetensors"));
      for (const auto& name : r.names())
        if (r.info(name).dtype != StDType::kOther) r.read_f32(name, r.info(name).shape);
    } catch (const Error&) {
      ++errors;
    }
  };
  for (size_t len = 0; len < good.size(); ++len) probe(good.substr(0, len));
  EXPECT_EQ(errors, static_cast<int>(good.size()));  // every truncation is an error
  for (uint64_t i = 0; i < 2000; ++i) {
    std::string d = good;
    const uint64_t h = model::key_hash({99, i});
    d[h % std::min<size_t>(200, d.size())] = static_cast<char>(h >> 32);
    probe(d);
  }
}

TEST_F(Safetensors, LayerWeightsUseHuggingFaceNames) {
  const model::LayerShape shape{16, 8, 4};
  model::LayerWeights w = model::make_layer_weights(3, 0, shape);
  w.selection_bias = normal_vector(4, 5, 0.1);
  SafetensorsWriter out;
  io::add_layer_weights(out, "model.layers.3.mlp.", shape, w, {0, 1, 2, 3}, kernels::DType::kF32);
  out.write(path("layer.safetensors"));
  SafetensorsReader r(path("layer.safetensors"));
  EXPECT_TRUE(r.has("model.layers.3.mlp.gate.weight"));
  EXPECT_TRUE(r.has("model.layers.3.mlp.gate.e_score_correction_bias"));
  EXPECT_EQ(r.info("model.layers.3.mlp.experts.2.down_proj.weight").shape, (std::vector<int64_t>{16, 8}));
  io::HfCheckpoint ckpt(path("layer.safetensors"));
  const model::LayerWeights back = io::load_layer_weights(ckpt, "model.layers.3.mlp.", shape);
  EXPECT_EQ(back.gate, w.gate);
  EXPECT_EQ(back.selection_bias, w.selection_bias);
  EXPECT_EQ(back.w13, w.w13);
  EXPECT_EQ(back.w2, w.w2);
  // A layer file missing an expert names the tensor.
  SafetensorsWriter partial;
  io::add_layer_weights(partial, "", shape, w, {0, 1, 3}, kernels::DType::kF32);
  partial.write(path("partial.safetensors"));
  io::HfCheckpoint pr(path("partial.safetensors"));
  try {
    io::load_layer_weights(pr, "", shape);
    FAIL() << "missing expert accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("experts.2.gate_proj.weight"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe::test
