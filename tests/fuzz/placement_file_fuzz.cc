// Fuzz target: a placement export file as `moectl placement import` reads it.
// It must either turn into an import request or throw moe::Error; one it accepts
// must survive export and import again unchanged.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "moe/base/check.h"
#include "moe/spec/placement_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::PlacementImport imp;
  try {
    imp = moe::spec::placement_import_from_json(std::string(reinterpret_cast<const char*>(data), size), "f.json");
  } catch (const moe::Error&) {
    return 0;
  }
  moe::v1::PlacementReply reply;
  *reply.mutable_shape() = imp.shape();
  *reply.mutable_maps() = imp.maps();
  const moe::v1::PlacementImport again =
      moe::spec::placement_import_from_json(moe::spec::placement_export_json(reply), "again.json");
  if (again.SerializeAsString() != imp.SerializeAsString()) std::abort();  // export and import disagree
  return 0;
}

std::vector<std::string> fuzz_seeds() {
  return {R"({"shape": {"experts": 4, "layers": 1, "nodes": 1, "devices_per_node": 2},
  "epoch": [3], "phy2log": [[0, 1, 2, 3, 0, 1]], "log2phy": [[[0, 4], [1, 5], [2, -1], [3, -1]]],
  "logcnt": [[2, 2, 1, 1]]})",
          R"({"shape": {"experts": 2, "layers": 2, "nodes": 2, "devices_per_node": 1},
  "phy2log": [[0, 1], [1, 0]], "logcnt": [[1, 1], [1, 1]]})",
          R"({"shape": {"experts": 1e9, "layers": 1, "nodes": 1, "devices_per_node": 1}, "phy2log": [[0]], "logcnt": [[1]]})",
          "{}", "[]", "null"};
}
