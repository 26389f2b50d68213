// The placement export file (docs/formats.md#placement-export).
#include "moe/spec/placement_file.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <vector>

#include "moe/base/check.h"
#include "moe/map/expert_map.h"
#include "moe/spec/expert_map_codec.h"

namespace moe::spec {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

// Bounds on what an import may ask the agent to hold: far above any real model
// (DeepSeek-V3: 256 experts, 61 layers), low enough that a hostile file cannot
// make moectl allocate gigabytes before the agent refuses it.
constexpr int kMaxExperts = 1 << 16;
constexpr int kMaxLayers = 1 << 12;
constexpr int kMaxRanks = 1 << 16;

[[noreturn]] void refuse(const std::string& what) { throw InvalidArgument(what); }

int as_int(const Value& v, const std::string& where) {
  const double x = v.number_value();
  if (v.kind_case() != Value::kNumberValue || !(std::fabs(x) < 2147483647.0) || x != std::trunc(x))
    refuse(where + ": expects an integer");
  return static_cast<int>(x);
}

const ListValue& as_list(const Value& v, const std::string& where) {
  if (v.kind_case() != Value::kListValue) refuse(where + ": expects a list");
  return v.list_value();
}

const ListValue& list_field(const Struct& s, const std::string& key, const std::string& file) {
  const auto it = s.fields().find(key);
  if (it == s.fields().end() || it->second.kind_case() != Value::kListValue) refuse(file + ": no list '" + key + "'");
  return it->second.list_value();
}

v1::PlacementShape shape_field(const Struct& root, const std::string& file) {
  const auto shape = root.fields().find("shape");
  if (shape == root.fields().end() || shape->second.kind_case() != Value::kStructValue) refuse(file + ": no 'shape'");
  const auto& f = shape->second.struct_value().fields();
  int v[4];
  const char* keys[4] = {"experts", "layers", "nodes", "devices_per_node"};
  for (int i = 0; i < 4; ++i) {
    if (!f.count(keys[i])) refuse(file + ": shape has no '" + keys[i] + "'");
    v[i] = as_int(f.at(keys[i]), file + ": shape." + keys[i]);
    if (v[i] < 1) refuse(file + ": shape." + keys[i] + " must be >= 1, got " + std::to_string(v[i]));
  }
  if (v[0] > kMaxExperts || v[1] > kMaxLayers || static_cast<int64_t>(v[2]) * v[3] > kMaxRanks)
    refuse(file + ": shape " + std::to_string(v[0]) + "x" + std::to_string(v[1]) + "@" + std::to_string(v[2]) + "x" +
           std::to_string(v[3]) + " is beyond what moed supports");
  v1::PlacementShape s;
  s.set_experts(v[0]);
  s.set_layers(v[1]);
  s.set_nodes(v[2]);
  s.set_devices_per_node(v[3]);
  return s;
}

// One layer's map: phy2log row checked against its logcnt row.
v1::PlacementMap layer_map(const ListValue& row, const ListValue& cnt, int E, int R, int layer, const std::string& file) {
  const std::string where = file + ": layer " + std::to_string(layer);
  if (row.values_size() % R != 0 || row.values_size() == 0 || row.values_size() / R > E)
    refuse(where + ": " + std::to_string(row.values_size()) + " slots do not divide over " + std::to_string(R) +
           " ranks (1 to " + std::to_string(E) + " a rank)");
  std::vector<int32_t> phy2log;
  for (int s = 0; s < row.values_size(); ++s) {
    const int e = as_int(row.values(s), where + " phy2log[" + std::to_string(s) + "]");
    if (e < 0 || e >= E) refuse(where + ": phy2log[" + std::to_string(s) + "] = " + std::to_string(e) + " is not an expert");
    phy2log.push_back(e);
  }
  ExpertMap map;
  try {
    map = ExpertMap::make(E, R, row.values_size() / R, std::move(phy2log));
  } catch (const Error& e) {
    refuse(where + ": " + e.what());
  }
  for (int e = 0; e < E; ++e) {
    const int given = e < cnt.values_size() ? as_int(cnt.values(e), where + " logcnt") : -1;
    if (given != map.logcnt[e])
      refuse(where + ": logcnt[" + std::to_string(e) + "] = " + std::to_string(given) + ", phy2log places it " +
             std::to_string(map.logcnt[e]) + " time(s)");
  }
  return to_proto(map, layer);
}

template <typename Range>
std::string json_list(const Range& values) {
  std::string out = "[";
  for (const auto& x : values) out += (out.size() > 1 ? ", " : "") + std::to_string(x);
  return out + "]";
}

}  // namespace

v1::PlacementShape parse_shape(const std::string& text) {
  v1::PlacementShape s;
  if (text.empty()) return s;
  int e = 0, l = 0, n = 0, d = 0;
  char x1 = 0, at = 0, x2 = 0;
  std::istringstream in(text);
  if (!(in >> e >> x1 >> l >> at >> n >> x2 >> d) || x1 != 'x' || at != '@' || x2 != 'x' || !in.eof() || e < 1 ||
      l < 1 || n < 1 || d < 1)
    refuse("shape: expects EXPERTSxLAYERS@NODESxDEVICES (e.g. 64x2@2x2), got '" + text + "'");
  s.set_experts(e);
  s.set_layers(l);
  s.set_nodes(n);
  s.set_devices_per_node(d);
  return s;
}

std::string shape_text(const v1::PlacementShape& s) {
  return std::to_string(s.experts()) + "x" + std::to_string(s.layers()) + "@" + std::to_string(s.nodes()) + "x" +
         std::to_string(s.devices_per_node());
}

std::string placement_export_json(const v1::PlacementReply& p) {
  std::ostringstream os;
  const v1::PlacementShape& s = p.shape();
  os << "{\n  \"shape\": {\"experts\": " << s.experts() << ", \"layers\": " << s.layers() << ", \"nodes\": " << s.nodes()
     << ", \"devices_per_node\": " << s.devices_per_node() << "},\n";
  std::vector<int64_t> epochs;
  for (const auto& m : p.maps()) epochs.push_back(m.epoch());
  os << "  \"epoch\": " << json_list(epochs) << ",\n";
  auto rows = [&](const char* name, const std::function<std::string(const v1::PlacementMap&)>& row) {
    os << "  \"" << name << "\": [";
    for (int l = 0; l < p.maps_size(); ++l) os << (l ? ",\n    " : "\n    ") << row(p.maps(l));
    os << "\n  ]";
  };
  rows("phy2log", [](const v1::PlacementMap& m) { return json_list(m.phy2log()); });
  os << ",\n";
  rows("log2phy", [](const v1::PlacementMap& m) {
    const int X = *std::max_element(m.logcnt().begin(), m.logcnt().end());
    std::string layer = "[";
    for (int e = 0; e < m.num_experts(); ++e) {
      std::vector<int> slots;
      for (int s = 0; s < m.phy2log_size(); ++s)
        if (m.phy2log(s) == e) slots.push_back(s);
      slots.resize(X, -1);
      layer += (e ? ", " : "") + json_list(slots);
    }
    return layer + "]";
  });
  os << ",\n";
  rows("logcnt", [](const v1::PlacementMap& m) { return json_list(m.logcnt()); });
  os << "\n}\n";
  return os.str();
}

v1::PlacementImport placement_import_from_json(const std::string& text, const std::string& file) {
  Struct root;
  if (!google::protobuf::util::JsonStringToMessage(text, &root).ok()) refuse(file + ": not JSON");
  v1::PlacementImport imp;
  *imp.mutable_shape() = shape_field(root, file);
  const ListValue& phy = list_field(root, "phy2log", file);
  const ListValue& cnt = list_field(root, "logcnt", file);
  const int E = imp.shape().experts(), R = imp.shape().nodes() * imp.shape().devices_per_node();
  if (phy.values_size() != imp.shape().layers() || cnt.values_size() != imp.shape().layers())
    refuse(file + ": phy2log and logcnt need one row per layer (" + std::to_string(imp.shape().layers()) + ")");
  for (int l = 0; l < phy.values_size(); ++l) {
    const std::string where = file + ": layer " + std::to_string(l);
    *imp.add_maps() = layer_map(as_list(phy.values(l), where + " phy2log"), as_list(cnt.values(l), where + " logcnt"),
                                E, R, l, file);
  }
  return imp;
}

}  // namespace moe::spec
