// moectl checkpoint show: a training checkpoint as its manifest describes it,
// read from disk (no agent needed).
#include <filesystem>
#include <iostream>

#include "moe/ctl/json.h"
#include "format.h"
#include "moe/base/check.h"
#include "moe/ctl/ctl.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/job_spec.h"

namespace moe::ctl {
namespace {

std::string map_line(const v1::PlacementMap& m) {
  std::string s = "epoch " + std::to_string(m.epoch()) + ":";
  for (int r = 0; r < m.num_ranks(); ++r) {
    s += " r" + std::to_string(r) + "[";
    for (int i = 0; i < m.slots_per_rank(); ++i)
      s += (i ? " " : "") + std::to_string(m.phy2log(r * m.slots_per_rank() + i));
    s += "]";
  }
  return s;
}

void print_manifest(std::ostream& out, const std::string& folder, const v1::CheckpointManifest& m) {
  const v1::JobSpec& s = m.spec();
  std::vector<std::pair<std::string, std::string>> rows = {
      {"checkpoint", folder},
      {"job", m.job_id()},
      {"step", std::to_string(m.step()) + " of " + std::to_string(s.steps()) + " (resumes at step " +
                   std::to_string(m.step()) + ")"},
      {"cluster", counted(m.world_size(), "rank") + " (" +
                      std::to_string(m.world_size() / std::max(1, m.devices_per_node())) + "x" +
                      std::to_string(m.devices_per_node()) + ")"},
      {"spec", v1::JobSpec::Mode_Name(s.mode()) + " " + v1::JobSpec::DType_Name(s.dtype()) + " E=" +
                   std::to_string(s.experts()) + " K=" + std::to_string(s.top_k()) + " H=" + std::to_string(s.hidden()) +
                   " I=" + std::to_string(s.ffn_hidden()) + " layers=" + std::to_string(s.layers()) +
                   " T/rank=" + std::to_string(s.tokens_per_rank()) + " " + v1::JobSpec::Optimizer_Name(s.optimizer())}};
  for (const v1::CheckpointFile& f : m.files()) rows.push_back({f.name(), fmt(f.bytes(), 12) + " bytes"});
  for (const v1::PlacementMap& map : m.maps()) rows.push_back({"layer " + std::to_string(map.layer()), map_line(map)});
  print_rows(out, rows);
}

}  // namespace

int checkpoint_show(const Globals& g, const std::string& dir, std::ostream& out, std::ostream& err) {
  try {
    const std::string folder = spec::resolve_checkpoint(dir);
    const v1::CheckpointManifest m = spec::read_manifest(folder);
    spec::check_files(folder, m);
    if (g.json) out << to_json(m) << "\n";
    else print_manifest(out, std::filesystem::absolute(folder).string(), m);
    return kExitOk;
  } catch (const moe::Error& e) {
    err << "moectl: " << e.what() << "\n";
    return kExitUsage;
  }
}

}  // namespace moe::ctl
