// The files moectl and moed read from users and from disk (docs/formats.md):
// the placement export file survives export and import, and each refusal names
// the file and the field; a checkpoint.json naming files outside its folder or
// holding a broken map is refused.
#include <gtest/gtest.h>

#include <string>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "moe/base/check.h"
#include "moe/base/text.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/job_spec.h"
#include "moe/spec/placement_file.h"
#include "moe/spec/strict_json.h"
#include "moe/spec/weights_check.h"

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

// The strict JSON reader (spec files): what protobuf's parser let through is
// refused with its line and column; escapes, nesting and numbers are read as JSON says.
// What `f` throws as moe::InvalidArgument, or "accepted".
template <typename F>
std::string refusal_of(F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "accepted";
}

std::string refusal(const std::string& text) {
  return refusal_of([&] { spec::strict_json_object(text); });
}

TEST(StrictJson, RefusesWhatRfc8259RefusesNamingLineAndColumn) {
  EXPECT_EQ(refusal(R"({"a": 1,})"), "line 1, column 9: a trailing comma before '}'");
  EXPECT_EQ(refusal(R"({"a": [1, 2,]})"), "line 1, column 13: a trailing comma before ']'");
  EXPECT_EQ(refusal("{\"a\": 1,\n \"a\": 2}"), "line 2, column 2: duplicate key \"a\" (each field once)");
  EXPECT_EQ(refusal(R"({"a": {"b": 1, "b": 2}})"), "line 1, column 16: duplicate key \"b\" (each field once)");
  EXPECT_EQ(refusal(R"({"a": 01})"), "line 1, column 8: a number with a leading zero");
  EXPECT_EQ(refusal(R"({"a": 'x'})"),
            "line 1, column 7: expected a value (string, number, true, false, null, object or array), found '''");
  EXPECT_EQ(refusal(R"({"a": 1} x)"), "line 1, column 10: text after the end of the object, found 'x'");
  EXPECT_EQ(refusal("[1]"), "line 1, column 1: a spec is a JSON object: expected '{', found '['");
  EXPECT_EQ(refusal(R"({"a": "x)"), "line 1, column 9: a string without its closing '\"'");
  EXPECT_EQ(refusal("{/* c */}"), "line 1, column 2: JSON has no comments");
  EXPECT_EQ(refusal(""), "line 1, column 1: a spec is a JSON object: expected '{', found the end of the text");
  std::string deep = R"({"a": )";
  for (int i = 0; i < 100; ++i) deep += "[";
  EXPECT_NE(refusal(deep).find("nested deeper than 64"), std::string::npos) << refusal(deep);
}

TEST(StrictJson, ReadsMembersWithTheirKindsValuesAndPlaces) {
  const auto m = spec::strict_json_object("{\n  \"s\": \"a\\\"b\\u00e9\\ud83d\\ude00\",\n  \"n\": -1.5e3, \"b\": true, "
                                          "\"z\": null, \"o\": {\"k\": [1, {}]}, \"a\": []}");
  ASSERT_EQ(m.size(), 6u);
  EXPECT_EQ(m[0].key, "s");
  EXPECT_EQ(m[0].kind, 's');
  EXPECT_EQ(m[0].value, "a\"b\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(m[0].key_at.text(), "line 2, column 3");
  EXPECT_EQ(m[1].kind, 'n');
  EXPECT_EQ(m[1].value, "-1.5e3");
  EXPECT_EQ(m[1].value_at.text(), "line 3, column 8");
  EXPECT_EQ(m[2].kind, 'b');
  EXPECT_EQ(m[2].value, "true");
  EXPECT_EQ(m[3].kind, 'z');
  EXPECT_EQ(m[4].kind, 'o');
  EXPECT_EQ(m[5].kind, 'a');
}

std::string spec_refusal(const std::string& json) {
  return refusal_of([&] { spec::spec_from_json(json); });
}

TEST(StrictJson, SpecFilesNameTheFieldAndItsValidValues) {
  EXPECT_EQ(spec_refusal(R"({"mode": "TRAIN"})"), "line 1, column 10: mode: expects forward | train | serve, got \"TRAIN\"");
  EXPECT_EQ(spec_refusal(R"({"hidden": 1.5})"), "line 1, column 12: hidden: expects an integer, got 1.5");
  EXPECT_EQ(spec_refusal(R"({"verify": "yes"})"), "line 1, column 12: verify: expects true or false, got \"yes\"");
  EXPECT_EQ(spec_refusal(R"({"labels": [1]})"),
            "line 1, column 12: labels: expects an object of \"KEY\": \"VALUE\", got an array");
  EXPECT_EQ(spec_refusal(R"({"topk": 2})"), "line 1, column 2: unknown field 'topk' (did you mean 'top_k'?)");
  const v1::JobSpec s = spec::spec_from_json(R"({"experts": "8", "topK": 2, "mode": "train", "seed": null})");
  EXPECT_EQ(s.experts(), 8);
  EXPECT_EQ(s.top_k(), 2);
  EXPECT_EQ(s.mode(), v1::JobSpec::train);
}

TEST(NearestWord, SuggestsWithinAThirdOfTheWordOrAPrefix) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(nearest_word("stats", {"submit", "status", "wait"}), "status");
  EXPECT_EQ(nearest_word("--topk", {"--experts", "--top-k", "--steps"}), "--top-k");
  EXPECT_EQ(nearest_word("rebal", {"show", "rebalance"}), "rebalance");
  EXPECT_EQ(nearest_word("frobnicate", {"submit", "status"}), "");
}

std::string weights_refusal(const v1::JobSpec& spec) {
  return refusal_of([&] { spec::check_weights(spec); });
}

// The agent's check of a weights file at submit (docs/jobs.md#weights).
TEST(WeightsCheck, NamesTheMissingFileLayerOrShape) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moe_weights_check_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"m.0.gate.weight":{"dtype":"F32","shape":[4,8],"data_offsets":[0,128]},)"
      R"("m.1.gate.weight":{"dtype":"F32","shape":[4,8],"data_offsets":[128,256]}})";
  std::string size(8, '\0');
  for (int i = 0; i < 8; ++i) size[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(dir / "m.safetensors", std::ios::binary) << size << header << std::string(256, '\0');
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map": {"m.0.gate.weight": "m.safetensors"}})";
  std::ofstream(dir / "short.safetensors") << "abc";
  v1::JobSpec s;
  s.set_experts(4);
  s.set_hidden(8);
  s.set_layers(2);
  s.set_weights((dir / "m.safetensors").string());
  s.set_weights_prefix("m.{layer}.");
  EXPECT_EQ(weights_refusal(s), "accepted");
  s.set_layers(3);
  EXPECT_EQ(weights_refusal(s), "weights: job layer 2 reads m.2.gate.weight, which " + (dir / "m.safetensors").string() +
                                    " does not hold (it has the routers of checkpoint layers 0-1); check --layers, "
                                    "--weights-prefix and --weights-first-layer");
  s.set_layers(1);
  s.set_hidden(16);
  EXPECT_NE(weights_refusal(s).find("has shape [4, 8], the spec gives [4, 16]: experts is 4, hidden is 16"),
            std::string::npos)
      << weights_refusal(s);
  s.set_hidden(8);
  s.set_weights(dir.string());  // the folder: its index, which lists layer 0 only
  EXPECT_EQ(weights_refusal(s), "accepted");
  s.set_weights_first_layer(1);
  EXPECT_NE(weights_refusal(s).find("reads m.1.gate.weight, which " + (dir / "model.safetensors.index.json").string() +
                                    " does not hold"),
            std::string::npos)
      << weights_refusal(s);
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map": {"m.0.gate.weight": "../m.safetensors"}})";
  s.set_weights(dir.string());
  EXPECT_NE(weights_refusal(s).find("weight_map[\"m.0.gate.weight\"] is not a file name in the index's folder"),
            std::string::npos)
      << weights_refusal(s);
  s.set_weights((dir / "nope.safetensors").string());
  EXPECT_NE(weights_refusal(s).find("nope.safetensors does not exist"), std::string::npos) << weights_refusal(s);
  s.set_weights((dir / "short.safetensors").string());
  EXPECT_NE(weights_refusal(s).find("is not a safetensors file (shorter than 8 bytes)"), std::string::npos)
      << weights_refusal(s);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe::test
