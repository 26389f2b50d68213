// The loaders on files they did not write (docs/formats.md#weights): a sharded
// checkpoint made by tests/fixtures/independent/make.py, an independent writer of the
// published safetensors format and Hugging Face index (header padded with spaces,
// tensors laid out in the reverse of header order, F32 and BF16 shards, an I64
// tensor), read through io::HfCheckpoint value for value.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moe/base/check.h"
#include "moe/io/hf_checkpoint.h"

#ifndef MOE_FIXTURES_DIR
#error "MOE_FIXTURES_DIR must name tests/fixtures"
#endif

namespace moe::test {
namespace {

const std::string kDir = std::string(MOE_FIXTURES_DIR) + "/independent";
const std::string kPrefix = "model.layers.0.block_sparse_moe.";
constexpr int E = 4, H = 8, I = 4;

// make.py's values: element i of the k-th tensor of its file.
std::vector<float> expected(size_t count, int k) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(static_cast<int>((7 * i + 13 * k) % 97) - 48) / 32.0f;
  return v;
}

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  int k;  // its place in its file
};

std::vector<Tensor> tensors() {
  std::vector<Tensor> t = {{kPrefix + "gate.weight", {E, H}, 0}};
  for (int e = 0; e < E; ++e) {
    const int first = e < 2 ? 1 + 3 * e : 3 * (e - 2);  // shard 1 starts with the router
    const std::string p = kPrefix + "experts." + std::to_string(e) + ".";
    t.push_back({p + "w1.weight", {I, H}, first});
    t.push_back({p + "w2.weight", {H, I}, first + 1});
    t.push_back({p + "w3.weight", {I, H}, first + 2});
  }
  return t;
}

TEST(IndependentCheckpoint, EveryTensorReadsAsWritten) {
  io::HfCheckpoint ck(kDir);
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.names_with_prefix(kPrefix + "experts.").size(), static_cast<size_t>(3 * E));
  for (const Tensor& t : tensors()) {
    ASSERT_TRUE(ck.has(t.name)) << t.name;
    EXPECT_EQ(ck.info(t.name).shape, t.shape) << t.name;
    EXPECT_EQ(ck.read_f32(t.name, t.shape), expected(static_cast<size_t>(t.shape[0] * t.shape[1]), t.k)) << t.name;
  }
  EXPECT_EQ(ck.opened_files().size(), 2u);
}

TEST(IndependentCheckpoint, AnI64TensorIsRefusedNamingItsDtype) {
  io::HfCheckpoint ck(kDir);
  try {
    ck.read_f32("model.layers.0.extra.position_ids", {1, 6});
    ADD_FAILURE() << "an I64 tensor was read as float";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("position_ids"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("I64"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe::test
