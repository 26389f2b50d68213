// moectl placement show / export / import / loads / rebalance (docs/cli.md#commands,
// docs/placement.md; the files in docs/formats.md#placement-export and #loads-file).
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <functional>
#include <iomanip>
#include <sstream>

#include "agent_call.h"
#include "format.h"
#include "moe/base/file.h"
#include "moe/spec/expert_map_codec.h"
#include "moe/spec/job_spec.h"

namespace moe::ctl {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;
using rpc::RpcError;

[[noreturn]] void usage(const std::string& what) { throw InvalidArgument(what); }

// "64x2@2x2" -> experts 64, layers 2, nodes 2, devices 2; "" -> unset.
v1::PlacementShape parse_shape(const std::string& text) {
  v1::PlacementShape s;
  if (text.empty()) return s;
  int e = 0, l = 0, n = 0, d = 0;
  char x1 = 0, at = 0, x2 = 0;
  std::istringstream in(text);
  if (!(in >> e >> x1 >> l >> at >> n >> x2 >> d) || x1 != 'x' || at != '@' || x2 != 'x' || !in.eof() || e < 1 ||
      l < 1 || n < 1 || d < 1)
    usage("shape: expects EXPERTSxLAYERS@NODESxDEVICES (e.g. 64x2@2x2), got '" + text + "'");
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

v1::PlacementReply fetch(rpc::RpcClient& c, const Globals& g, const PlacementTarget& t) {
  v1::Envelope req;
  *req.mutable_placement()->mutable_shape() = parse_shape(t.shape);
  if (t.layer) req.mutable_placement()->set_layer(*t.layer);
  return c.call(req, g.timeout).placement_reply();
}

// One layer: epoch and balancedness, each rank's load and slots, each expert's
// load and replicas.
void print_layer(std::ostream& out, const v1::LayerPlacement& lp) {
  const v1::PlacementMap& m = lp.map();
  out << "layer " << m.layer() << ": epoch " << m.epoch() << ", balancedness " << fmt(lp.balancedness(), 3)
      << " over " << lp.rank_window_steps() << " step(s), predicted " << fmt(lp.predicted_balancedness(), 3)
      << " from " << lp.window_steps() << " step(s) of expert load; " << m.num_ranks() << " ranks x "
      << m.slots_per_rank() << " slots\n";
  std::vector<std::vector<std::string>> rows = {{"  RANK", "LOAD", "SLOTS (logical experts)"}};
  for (int r = 0; r < m.num_ranks(); ++r) {
    std::string slots;
    for (int s = 0; s < m.slots_per_rank(); ++s) slots += (s ? " " : "") + std::to_string(m.phy2log(r * m.slots_per_rank() + s));
    rows.push_back({"  " + std::to_string(r), r < lp.rank_loads_size() ? fmt(lp.rank_loads(r), 8) : "-", slots});
  }
  print_table(out, rows);
  out << "  expert load x replicas:";
  for (int e = 0; e < m.num_experts(); ++e) {
    if (e % 8 == 0) out << "\n   ";
    std::ostringstream cell;
    cell << e << ":" << (e < lp.expert_loads_size() ? fmt(lp.expert_loads(e), 6) : "-") << "x" << m.logcnt(e);
    out << " " << std::left << std::setw(16) << cell.str();
  }
  out << "\n";
}

template <typename Range>
std::string json_list(const Range& values) {
  std::string out = "[";
  for (const auto& x : values) out += (out.size() > 1 ? ", " : "") + std::to_string(x);
  return out + "]";
}

// EPLB's tensors, one row per layer: phy2log [layers, slots], log2phy [layers,
// E, max replicas] (-1 padded), logcnt [layers, E]; plus the shape and each
// layer's epoch. Written in this order, so exports diff cleanly.
std::string eplb_json(const v1::PlacementReply& p) {
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

int as_int(const Value& v, const std::string& where) {
  if (v.kind_case() != Value::kNumberValue || v.number_value() != static_cast<int>(v.number_value()))
    usage(where + ": expects an integer");
  return static_cast<int>(v.number_value());
}

const ListValue& as_list(const Struct& s, const std::string& key, const std::string& file) {
  const auto it = s.fields().find(key);
  if (it == s.fields().end() || it->second.kind_case() != Value::kListValue) usage(file + ": no list '" + key + "'");
  return it->second.list_value();
}

// The import request of an export file: the shape and each layer's phy2log; its
// logcnt and log2phy must agree with phy2log.
v1::PlacementImport parse_eplb(const std::string& file) {
  Struct root;
  if (!google::protobuf::util::JsonStringToMessage(read_file(file), &root).ok()) usage(file + ": not JSON");
  v1::PlacementImport imp;
  const auto shape = root.fields().find("shape");
  if (shape == root.fields().end() || shape->second.kind_case() != Value::kStructValue) usage(file + ": no 'shape'");
  const auto& sf = shape->second.struct_value().fields();
  for (const char* k : {"experts", "layers", "nodes", "devices_per_node"})
    if (!sf.count(k)) usage(file + ": shape has no '" + k + "'");
  *imp.mutable_shape() = parse_shape(std::to_string(as_int(sf.at("experts"), "experts")) + "x" +
                                     std::to_string(as_int(sf.at("layers"), "layers")) + "@" +
                                     std::to_string(as_int(sf.at("nodes"), "nodes")) + "x" +
                                     std::to_string(as_int(sf.at("devices_per_node"), "devices_per_node")));
  const ListValue& phy = as_list(root, "phy2log", file);
  const ListValue& cnt = as_list(root, "logcnt", file);
  const int E = imp.shape().experts(), R = imp.shape().nodes() * imp.shape().devices_per_node();
  if (phy.values_size() != imp.shape().layers() || cnt.values_size() != imp.shape().layers())
    usage(file + ": phy2log and logcnt need one row per layer (" + std::to_string(imp.shape().layers()) + ")");
  for (int l = 0; l < phy.values_size(); ++l) {
    const std::string where = file + ": layer " + std::to_string(l);
    const ListValue& row = phy.values(l).list_value();
    if (row.values_size() % R != 0) usage(where + ": " + std::to_string(row.values_size()) + " slots do not divide over " + std::to_string(R) + " ranks");
    std::vector<int32_t> phy2log;
    for (int s = 0; s < row.values_size(); ++s) {
      const int e = as_int(row.values(s), where + " phy2log[" + std::to_string(s) + "]");
      if (e < 0 || e >= E) usage(where + ": phy2log[" + std::to_string(s) + "] = " + std::to_string(e) + " is not an expert");
      phy2log.push_back(e);
    }
    ExpertMap map;
    try {
      map = ExpertMap::make(E, R, row.values_size() / R, std::move(phy2log));
    } catch (const Error& e) {
      usage(where + ": " + e.what());
    }
    const ListValue& c = cnt.values(l).list_value();
    for (int e = 0; e < E; ++e) {
      const int given = e < c.values_size() ? as_int(c.values(e), where + " logcnt") : -1;
      if (given != map.logcnt[e])
        usage(where + ": logcnt[" + std::to_string(e) + "] = " + std::to_string(given) + ", phy2log places it " +
              std::to_string(map.logcnt[e]) + " time(s)");
    }
    *imp.add_maps() = spec::to_proto(map, l);
  }
  return imp;
}

std::string loads_text(const v1::PlacementLoads& l) {
  std::ostringstream os;
  os << "# (token, expert) pairs per logical expert over " << l.steps() << " step(s) of the shape "
     << shape_text(l.shape()) << ", one line per layer (moe-placement-sim --loads)\n";
  os << std::setprecision(17);
  for (const auto& layer : l.layers()) {
    for (int e = 0; e < layer.tokens_size(); ++e) os << (e ? " " : "") << layer.tokens(e);
    os << "\n";
  }
  return os.str();
}

}  // namespace

int placement_show(const Globals& g, const PlacementTarget& t, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    const v1::PlacementReply p = fetch(c, g, t);
    if (g.json) {
      out << spec::to_json(p) << "\n";
      return kExitOk;
    }
    if (p.maps_size() == 0) {
      out << "no placement yet (no job has run)\n";
      return kExitOk;
    }
    out << "shape " << shape_text(p.shape()) << " (experts x layers @ nodes x devices)";
    if (p.shapes_size() > 1) {
      out << "; other shapes:";
      for (const auto& s : p.shapes())
        if (shape_text(s) != shape_text(p.shape())) out << " " << shape_text(s);
    }
    out << "\n";
    for (const auto& lp : p.layers()) print_layer(out, lp);
    return kExitOk;
  });
}

int placement_export(const Globals& g, const PlacementTarget& t, const std::string& file, std::ostream& out,
                     std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    const v1::PlacementReply p = fetch(c, g, PlacementTarget{t.shape, std::nullopt});
    if (p.maps_size() == 0) throw RpcError(v1::ERROR_CODE_NOT_FOUND, "no placement yet (no job has run)");
    write_file_atomically(file, eplb_json(p));
    if (!g.json) out << "exported " << p.maps_size() << " layer(s) of " << shape_text(p.shape()) << " to " << file << "\n";
    return kExitOk;
  });
}

int placement_import(const Globals& g, const std::string& file, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_placement_import() = parse_eplb(file);
    const v1::PlacementReply p = c.call(req, g.timeout).placement_reply();
    if (g.json) out << spec::to_json(p) << "\n";
    else out << "imported " << file << ": " << shape_text(p.shape()) << " now at epoch " << p.maps(0).epoch() << "\n";
    return kExitOk;
  });
}

int placement_loads(const Globals& g, const PlacementTarget& t, const std::string& file, std::ostream& out,
                    std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_placement_loads()->mutable_shape() = parse_shape(t.shape);
    const v1::PlacementLoads l = c.call(req, g.timeout).placement_loads_reply();
    write_file_atomically(file, loads_text(l));
    if (!g.json) out << "wrote " << l.layers_size() << " layer(s), " << l.steps() << " step(s) of load to " << file << "\n";
    return kExitOk;
  });
}

}  // namespace moe::ctl

namespace moe::ctl {
namespace {

void print_rebalance(std::ostream& out, const v1::RebalanceReply& r) {
  const char* what = r.result() == v1::REBALANCE_RESULT_DRY_RUN    ? "dry run (nothing changed)"
                     : r.result() == v1::REBALANCE_RESULT_COMMITTED ? "committed"
                     : r.result() == v1::REBALANCE_RESULT_ABORTED   ? "ABORTED (the old map stays)"
                                                                    : "FAILED";
  out << "rebalance " << what << ": shape " << shape_text(r.shape());
  if (r.epoch() > 0) out << ", epoch " << r.epoch();
  if (!r.job_id().empty()) out << ", live in " << r.job_id();
  if (r.seconds() > 0) out << ", " << fmt(r.seconds(), 3) << " s";
  out << "\n";
  if (!r.message().empty()) out << "  " << r.message() << "\n";
  for (int i = 0; i < r.maps_size(); ++i) {
    const v1::PlacementMap& m = r.maps(i);
    out << "layer " << m.layer() << ": balancedness " << fmt(r.balancedness_before(i), 3) << " -> predicted "
        << fmt(r.predicted_balancedness(i), 3) << ", " << m.num_ranks() << " ranks x " << m.slots_per_rank()
        << " slots\n";
    for (int rank = 0; rank < m.num_ranks(); ++rank) {
      out << "  rank " << rank << ":";
      for (int s = 0; s < m.slots_per_rank(); ++s) out << " " << m.phy2log(rank * m.slots_per_rank() + s);
      out << "\n";
    }
  }
  out << r.copies_size() << " cop" << (r.copies_size() == 1 ? "y" : "ies") << ", " << fmt(r.copy_bytes() / 1e6, 4)
      << " MB";
  out << (r.copies_size() ? " (layer, expert: from rank -> to rank, bytes):\n" : "\n");
  for (const v1::ExpertCopy& c : r.copies())
    out << "  layer " << c.layer() << ", expert " << c.expert() << ": rank " << c.from_rank() << " -> rank "
        << c.to_rank() << " (slot " << c.to_slot() << "), " << fmt(c.bytes(), 8) << " B\n";
}

}  // namespace

int placement_rebalance(const Globals& g, const RebalanceOptions& o, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    v1::RebalanceRequest* r = req.mutable_rebalance();
    *r->mutable_shape() = parse_shape(o.target.shape);
    if (o.redundant_experts) r->set_redundant_experts(*o.redundant_experts);
    if (o.target.layer) r->set_layer(*o.target.layer);
    r->set_dry_run(o.dry_run);
    // A live rebalance waits for its copies (the agent's --rebalance-timeout).
    const v1::RebalanceReply reply = c.call(req, std::max(g.timeout, std::chrono::milliseconds(180000))).rebalance_reply();
    if (g.json) out << spec::to_json(reply) << "\n";
    else print_rebalance(out, reply);
    const bool ok = reply.result() == v1::REBALANCE_RESULT_COMMITTED || reply.result() == v1::REBALANCE_RESULT_DRY_RUN;
    if (!ok) err << "moectl: rebalance " << (reply.result() == v1::REBALANCE_RESULT_ABORTED ? "aborted" : "failed")
                 << ": " << reply.message() << "\n";
    return ok ? kExitOk : kExitJobFailed;
  });
}

}  // namespace moe::ctl
