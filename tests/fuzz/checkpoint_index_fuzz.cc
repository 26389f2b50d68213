// Fuzz target: a checkpoint index (model.safetensors.index.json) from an
// untrusted source, next to one good shard. Opening the checkpoint and reading
// every tensor the index lists must either work or throw moe::Error.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "moe/base/check.h"
#include "moe/io/hf_checkpoint.h"

namespace {

namespace fs = std::filesystem;

// A folder holding shard.safetensors (tensor "t", F32 [2, 3]); made once,
// removed at exit.
struct Folder {
  fs::path dir = fs::temp_directory_path() / ("moe_ckpt_fuzz_" + std::to_string(::getpid()));
  Folder() {
    fs::create_directories(dir);
    const std::vector<float> v = {1, 2, 3, 4, 5, 6};
    moe::io::SafetensorsWriter w;
    w.add_f32("t", {2, 3}, v.data());
    w.write((dir / "shard.safetensors").string());
  }
  ~Folder() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const fs::path& folder() {
  static const Folder f;
  return f.dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path index = folder() / "model.safetensors.index.json";
  {
    std::ofstream out(index, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    moe::io::HfCheckpoint ckpt(folder().string());
    for (const std::string& name : ckpt.names_with_prefix("")) {
      const moe::io::TensorInfo& info = ckpt.info(name);
      ckpt.read_f32(name, info.shape);
    }
  } catch (const moe::Error&) {
  }
  return 0;
}

std::vector<std::string> fuzz_seeds() {
  return {R"({"metadata": {"total_size": 24}, "weight_map": {"t": "shard.safetensors"}})",
          R"({"weight_map": {"t": "shard.safetensors", "u": "shard.safetensors", "v": "other.safetensors"}})",
          R"({"weight_map": {"t": "."}})", R"({"weight_map": []})", "", "{}"};
}
