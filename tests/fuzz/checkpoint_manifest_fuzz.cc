// Fuzz target: a checkpoint's checkpoint.json from an untrusted folder. It must
// either be a manifest whose maps decode and whose files stay inside the folder,
// or throw moe::Error.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "moe/base/check.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/expert_map_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::CheckpointManifest m;
  try {
    m = moe::spec::manifest_from_json(std::string(reinterpret_cast<const char*>(data), size), "checkpoint.json");
  } catch (const moe::Error&) {
    return 0;
  }
  for (const auto& f : m.files())
    if (f.name().find('/') != std::string::npos || f.name() == "..") std::abort();  // leaves the folder
  for (const auto& map : m.maps()) (void)moe::spec::from_proto(map);  // accepted, so it must decode
  return 0;
}

std::vector<std::string> fuzz_seeds() {
  return {R"({"format": 1, "job_id": "job-1", "spec": {"experts": 4, "top_k": 2, "hidden": 8, "ffn_hidden": 4,
  "layers": 1, "steps": 4}, "step": 2, "world_size": 2, "devices_per_node": 1,
  "maps": [{"layer": 0, "epoch": "1", "num_experts": 4, "num_ranks": 2, "slots_per_rank": 2,
            "phy2log": [0, 1, 2, 3], "logcnt": [1, 1, 1, 1]}],
  "files": [{"name": "rank0.safetensors", "bytes": 100}, {"name": "router.safetensors", "bytes": 10}]})",
          R"({"format": 1, "spec": {"layers": 0}, "files": [{"name": "../x"}]})",
          R"({"format": 2})", "{}", "[]"};
}
