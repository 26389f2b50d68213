// The files moectl and moed read from users and from disk (docs/formats.md):
// the placement export file survives export and import, and each refusal names
// the file and the field; a checkpoint.json naming files outside its folder or
// holding a broken map is refused.
#include <gtest/gtest.h>

#include <string>

#include "moe/base/check.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/placement_file.h"

namespace moe::test {
namespace {

const std::string kExport = R"({"shape": {"experts": 4, "layers": 1, "nodes": 1, "devices_per_node": 2},
  "epoch": [3], "phy2log": [[0, 1, 2, 3, 0, 1]], "logcnt": [[2, 2, 1, 1]]})";

void expect_refused(const std::string& text, const std::string& why) {
  try {
    spec::placement_import_from_json(text, "f.json");
    ADD_FAILURE() << "accepted: " << text;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("f.json", 0), 0u) << e.what();
  }
}

std::string with(std::string text, const std::string& from, const std::string& to) {
  return text.replace(text.find(from), from.size(), to);
}

TEST(PlacementFile, AnExportImportsAgainUnchanged) {
  const v1::PlacementImport imp = spec::placement_import_from_json(kExport, "f.json");
  ASSERT_EQ(imp.maps_size(), 1);
  EXPECT_EQ(spec::shape_text(imp.shape()), "4x1@1x2");
  EXPECT_EQ(imp.maps(0).slots_per_rank(), 3);
  v1::PlacementReply reply;
  *reply.mutable_shape() = imp.shape();
  *reply.mutable_maps() = imp.maps();
  const std::string exported = spec::placement_export_json(reply);
  EXPECT_NE(exported.find("\"log2phy\": [\n    [[0, 4], [1, 5], [2, -1], [3, -1]]"), std::string::npos) << exported;
  EXPECT_EQ(spec::placement_import_from_json(exported, "g.json").SerializeAsString(), imp.SerializeAsString());
}

TEST(PlacementFile, EachRefusalNamesTheFileAndTheField) {
  expect_refused("{", "not JSON");
  expect_refused("{}", "no 'shape'");
  expect_refused(with(kExport, "\"layers\": 1, ", ""), "shape has no 'layers'");
  expect_refused(with(kExport, "\"experts\": 4", "\"experts\": 4.5"), "shape.experts: expects an integer");
  expect_refused(with(kExport, "\"experts\": 4", "\"experts\": 1e300"), "shape.experts: expects an integer");
  expect_refused(with(kExport, "\"experts\": 4", "\"experts\": 1000000000"), "beyond what moed supports");
  expect_refused(with(kExport, "\"nodes\": 1", "\"nodes\": 0"), "shape.nodes must be >= 1");
  expect_refused(with(kExport, "[[0, 1, 2, 3, 0, 1]]", "[[0, 1, 2, 3, 0]]"), "5 slots do not divide over 2 ranks");
  expect_refused(with(kExport, "[[0, 1, 2, 3, 0, 1]]", "[[0, 1, 2, 3, 0, 7]]"), "phy2log[5] = 7 is not an expert");
  expect_refused(with(kExport, "[[0, 1, 2, 3, 0, 1]]", "[7]"), "layer 0 phy2log: expects a list");
  expect_refused(with(kExport, "[[2, 2, 1, 1]]", "[[2, 1, 1, 1]]"), "logcnt[1] = 1, phy2log places it 2 time(s)");
  expect_refused(with(kExport, "[[2, 2, 1, 1]]", "[[2, 2, 1, 1], [1]]"), "one row per layer (1)");
}

TEST(PlacementFile, ShapeText) {
  EXPECT_EQ(spec::shape_text(spec::parse_shape("64x2@2x4")), "64x2@2x4");
  EXPECT_EQ(spec::parse_shape("").experts(), 0);
  for (const char* bad : {"64x2", "64x2@2", "0x1@1x1", "64x2@2x4x", "ax2@2x4"})
    EXPECT_THROW(spec::parse_shape(bad), InvalidArgument) << bad;
}

const std::string kManifest = R"({"format": 1, "spec": {"experts": 4, "layers": 1},
  "maps": [{"layer": 0, "epoch": "1", "num_experts": 4, "num_ranks": 2, "slots_per_rank": 2,
            "phy2log": [0, 1, 2, 3], "logcnt": [1, 1, 1, 1]}],
  "files": [{"name": "rank0.safetensors", "bytes": 100}]})";

void expect_manifest_refused(const std::string& text, const std::string& why) {
  try {
    spec::manifest_from_json(text, "/ck/checkpoint.json");
    ADD_FAILURE() << "accepted: " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("/ck/checkpoint.json"), std::string::npos) << e.what();
  }
}

TEST(CheckpointManifestFile, FilesOutsideTheFolderAndBrokenMapsAreRefused) {
  EXPECT_EQ(spec::manifest_from_json(kManifest, "/ck/checkpoint.json").maps_size(), 1);
  for (const char* name : {"../rank0.safetensors", "/etc/passwd", "a/b", "..", ".", ""})
    expect_manifest_refused(with(kManifest, "\"rank0.safetensors\"", "\"" + std::string(name) + "\""),
                            "not a file name in its folder");
  expect_manifest_refused(with(kManifest, "\"phy2log\": [0, 1, 2, 3]", "\"phy2log\": [0, 1, 2, 9]"), "layer 0");
  expect_manifest_refused(with(kManifest, "\"layer\": 0", "\"layer\": 3"), "the map of layer 3 at 0");
  expect_manifest_refused(with(kManifest, "\"format\": 1", "\"format\": 2"), "has format 2");
  expect_manifest_refused("{", "is malformed");
}

}  // namespace
}  // namespace moe::test
