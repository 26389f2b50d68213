// moectl placement show / export / import / loads / rebalance (docs/cli.md#commands,
// docs/placement.md; the files in docs/formats.md#placement-export and #loads-file).
#include <algorithm>
#include <functional>
#include <iomanip>
#include <sstream>

#include "moe/ctl/json.h"
#include "agent_call.h"
#include "format.h"
#include "moe/base/file.h"
#include "moe/spec/expert_map_codec.h"
#include "moe/spec/job_spec.h"
#include "moe/spec/placement_file.h"

namespace moe::ctl {
namespace {

using spec::parse_shape;
using spec::shape_text;
using rpc::RpcError;

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

// The loads file (docs/formats.md#loads-file); its second line gives
// moe-placement-sim the shape's ranks, nodes and redundant slots.
std::string loads_text(const v1::PlacementLoads& l, int redundant) {
  std::ostringstream os;
  os << "# (token, expert) pairs per logical expert over " << l.steps() << " step(s) of the shape "
     << shape_text(l.shape()) << ", one line per layer (moe-placement-sim --loads)\n";
  const v1::PlacementShape& s = l.shape();
  os << "# moe-placement-sim: --ranks " << s.nodes() * s.devices_per_node() << " --nodes " << s.nodes()
     << " --redundant-experts " << redundant << " --groups " << l.num_groups() << " --group-top-k "
     << l.group_top_k() << " --top-k " << l.top_k() << "\n";
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
      out << to_json(p) << "\n";
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
    write_file_atomically(file, spec::placement_export_json(p));
    if (!g.json) out << "exported " << p.maps_size() << " layer(s) of " << shape_text(p.shape()) << " to " << file << "\n";
    return kExitOk;
  });
}

int placement_import(const Globals& g, const std::string& file, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_placement_import() = spec::placement_import_from_json(read_file(file), file);
    const v1::PlacementReply p = c.call(req, g.timeout).placement_reply();
    if (g.json) out << to_json(p) << "\n";
    else out << "imported " << file << ": " << shape_text(p.shape()) << " now at epoch " << p.maps(0).epoch() << "\n";
    return kExitOk;
  });
}

int placement_reset(const Globals& g, const PlacementTarget& t, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_placement_reset()->mutable_shape() = parse_shape(t.shape);
    const v1::PlacementReply p = c.call(req, g.timeout).placement_reply();
    if (g.json) out << to_json(p) << "\n";
    else out << "reset " << shape_text(p.shape()) << ": its next job starts on the solver's maps for uniform load\n";
    return kExitOk;
  });
}

int placement_loads(const Globals& g, const PlacementTarget& t, const std::string& file, std::ostream& out,
                    std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_placement_loads()->mutable_shape() = parse_shape(t.shape);
    const v1::PlacementLoads l = c.call(req, g.timeout).placement_loads_reply();
    v1::Envelope show;
    *show.mutable_placement()->mutable_shape() = l.shape();
    const v1::PlacementReply p = c.call(show, g.timeout).placement_reply();
    const int redundant = p.maps_size() > 0 ? p.maps(0).num_ranks() * p.maps(0).slots_per_rank() - p.maps(0).num_experts() : 0;
    write_file_atomically(file, loads_text(l, redundant));
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
    if (g.json) out << to_json(reply) << "\n";
    else print_rebalance(out, reply);
    const bool ok = reply.result() == v1::REBALANCE_RESULT_COMMITTED || reply.result() == v1::REBALANCE_RESULT_DRY_RUN;
    if (!ok) err << "moectl: rebalance " << (reply.result() == v1::REBALANCE_RESULT_ABORTED ? "aborted" : "failed")
                 << ": " << reply.message() << "\n";
    return ok ? kExitOk : kExitJobFailed;
  });
}

}  // namespace moe::ctl
