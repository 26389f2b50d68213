// Fuzz target: a safetensors file from an untrusted source. Opening it and reading
// every tensor it lists must either work or throw moe::Error.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "moe/io/safetensors.h"
#include "moe/base/check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/moe_st_fuzz_" + std::to_string(::getpid()) + ".safetensors";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    moe::io::SafetensorsReader r(path);
    for (const auto& name : r.names()) {
      const auto& info = r.info(name);
      if (info.dtype == moe::io::StDType::kI32) r.read_i32(name, info.shape);
      else r.read_f32(name, info.shape);
    }
  } catch (const moe::Error&) {
  }
  std::remove(path.c_str());
  return 0;
}

std::vector<std::string> fuzz_seeds() {
  const std::string path = "/tmp/moe_st_seed_" + std::to_string(::getpid()) + ".safetensors";
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> idx = {0, -1, 3};
  moe::io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.add_f32("gate.weight", {2, 3}, a.data());
  w.add_f32("experts.0.up_proj.weight", {3, 2}, a.data(), moe::io::StDType::kBF16);
  w.add_i32("topk_idx", {3}, idx.data());
  w.write(path);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::remove(path.c_str());
  const std::string header = R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})";
  std::string f16(8, '\0');
  f16[0] = static_cast<char>(header.size());
  return {bytes, f16 + header + std::string(4, '\0'), std::string(8, '\0'), ""};
}
