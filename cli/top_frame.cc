#include "top_frame.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "format.h"

namespace moe::ctl {
namespace {

constexpr int kGroup = 8;     // heat cells between spaces
constexpr int kMaxHot = 5;    // hottest experts named per layer
constexpr int kMaxBar = 40;   // columns of a rank's bar

// 0.0123 -> "12.3 ms"
std::string duration(double s) {
  char buf[32];
  if (s < 1) std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.2f s", s);
  return buf;
}

std::string percent(double share) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * share);
  return buf;
}

std::string shape_name(const v1::PlacementShape& s) {
  return std::to_string(s.experts()) + "x" + std::to_string(s.layers()) + "@" + std::to_string(s.nodes()) + "x" +
         std::to_string(s.devices_per_node());
}

int count(const v1::LiveLoad& l, const char* state) {
  const auto it = l.jobs().find(state);
  return it == l.jobs().end() ? 0 : it->second;
}

std::vector<std::string> header(const v1::LiveLoad& l, const FrameOptions& o) {
  std::string top = "moectl top   agent " + o.agent + "   " + std::to_string(l.nodes_alive()) + "/" +
                    std::to_string(l.nodes()) + " nodes alive, " + ranks_text(l.world_size(), l.alive_ranks());
  if (!o.clock.empty() && static_cast<int>(top.size() + o.clock.size()) + 2 <= o.width)
    top += std::string(o.width - top.size() - o.clock.size(), ' ') + o.clock;
  std::string jobs = "jobs: " + std::to_string(count(l, "running")) + " running, " +
                     std::to_string(count(l, "queued")) + " queued, " + std::to_string(count(l, "succeeded")) +
                     " succeeded, " + std::to_string(count(l, "failed")) + " failed, " +
                     std::to_string(count(l, "cancelled")) + " cancelled";
  return {top, jobs};
}

// "step 754/1000   eta 1m05s   3.3 ms/step   76.7k tokens/s"; a serving job (no last step)
// reports windows of its calls: "window 12   1.00 s/window   ...".
std::string progress(const v1::LiveJob& j) {
  const bool serving = j.mode() == v1::JobSpec::serve;
  std::string s = serving ? "window " + std::to_string(j.steps_completed()) + "   "
                          : "step " + std::to_string(j.steps_completed()) + "/" + std::to_string(j.steps()) + "   ";
  if (serving) {
    if (j.state() == v1::JOB_STATE_RUNNING && j.recent_steps() == 0) return s + "waiting for its first window of calls";
    return s + duration(j.step_seconds()) + "/window   " + human_count(j.tokens_per_second()) + " tokens/s";
  }
  if (j.state() == v1::JOB_STATE_RUNNING && j.recent_steps() == 0) return s + "waiting for its first complete step";
  // The ETA next to the step: at 80 columns the end of the line is cut.
  if (j.has_eta_seconds()) s += "eta " + human_seconds(j.eta_seconds()) + "   ";
  if (j.has_loss()) s += "loss " + fmt(j.loss()) + "   ";
  s += duration(j.step_seconds()) + "/step   " + human_count(j.tokens_per_second()) + " tokens/s";
  return s;
}

// The job's line, its kind and shape, and why it ended if it failed.
std::vector<std::string> job_lines(const v1::LiveLoad& l) {
  if (!l.has_job()) return {"no job has run yet: no load to show (moectl job submit ...)"};
  const v1::LiveJob& j = l.job();
  const bool running = j.state() == v1::JOB_STATE_RUNNING;
  const v1::PlacementShape& sh = l.shape();  // the last job's: this one's
  std::vector<std::string> out = {
      (running ? "" : "idle; last ") + j.job_id() + " " + state_name(j.state()) + "   " + progress(j),
      "  " + v1::JobSpec::Mode_Name(j.mode()) + " " + v1::JobSpec::DType_Name(j.dtype()) + " top-" +
          std::to_string(j.top_k()) + "   shape " + shape_name(sh) + " (experts x layers @ nodes x devices)"};
  if (!j.message().empty()) out.push_back("  " + j.message());
  return out;
}

// One cell per expert in groups of kGroup, as many groups a line as fit.
std::vector<std::string> heat_rows(const v1::LayerPlacement& lp, int width) {
  const int E = lp.expert_loads_size();
  const double max = E ? *std::max_element(lp.expert_loads().begin(), lp.expert_loads().end()) : 0;
  const int digits = static_cast<int>(std::to_string(std::max(0, E - 1)).size());
  const int prefix = 2 + digits + 1;
  const int groups = std::max(1, (width - prefix + 1) / (kGroup + 1));
  std::vector<std::string> rows;
  for (int first = 0; first < E; first += groups * kGroup) {
    char id[16];
    std::snprintf(id, sizeof id, "  %*d ", digits, first);
    std::string row = id;
    for (int e = first; e < std::min(E, first + groups * kGroup); ++e) {
      if (e > first && (e - first) % kGroup == 0) row += ' ';
      row += heat_cell(lp.expert_loads(e), max);
    }
    rows.push_back(row);
  }
  return rows;
}

std::string hottest_line(const v1::LayerPlacement& lp, int width) {
  const double total = std::accumulate(lp.expert_loads().begin(), lp.expert_loads().end(), 0.0);
  std::string line = "  hottest:";
  for (int e : hottest_experts(lp, kMaxHot)) {
    const std::string item = std::string(line.back() == ':' ? " " : ", ") + std::to_string(e) + " " +
                             percent(lp.expert_loads(e) / total);
    if (static_cast<int>(line.size() + item.size()) > width) break;
    line += item;
  }
  return line;
}

std::vector<std::string> rank_rows(const v1::LayerPlacement& lp, int width) {
  const int R = lp.rank_loads_size();
  const double max = R ? *std::max_element(lp.rank_loads().begin(), lp.rank_loads().end()) : 0;
  const double total = std::accumulate(lp.rank_loads().begin(), lp.rank_loads().end(), 0.0);
  if (R == 0 || max <= 0)
    return {"  ranks: no step measured since epoch " + std::to_string(lp.map().epoch()) + " began"};
  const int digits = static_cast<int>(std::to_string(R - 1).size());
  const int bar = std::clamp(width - (2 + 5 + digits + 2 + 1 + 7), 1, kMaxBar);  // "  rank N [bar] 100.0%"
  std::vector<std::string> rows;
  for (int r = 0; r < R; ++r) {
    const int filled = static_cast<int>(std::lround(bar * lp.rank_loads(r) / max));
    char id[16];
    std::snprintf(id, sizeof id, "  rank %*d [", digits, r);
    rows.push_back(id + std::string(filled, '#') + std::string(bar - filled, '.') + "] " +
                   percent(lp.rank_loads(r) / total));
  }
  return rows;
}

std::vector<std::string> layer_lines(const v1::LayerPlacement& lp, int width) {
  const v1::PlacementMap& m = lp.map();
  std::vector<std::string> out = {"layer " + std::to_string(m.layer()) + "   epoch " + std::to_string(m.epoch()) +
                                  "   balancedness " + fmt(lp.balancedness(), 3) + " over " +
                                  std::to_string(lp.rank_window_steps()) + " step(s)   " +
                                  std::to_string(m.num_ranks()) + " ranks x " + std::to_string(m.slots_per_rank()) +
                                  " slots"};
  const bool loaded = std::any_of(lp.expert_loads().begin(), lp.expert_loads().end(), [](double v) { return v > 0; });
  if (!loaded) {
    out.push_back("  no expert load measured yet");
    return out;
  }
  for (auto& row : heat_rows(lp, width)) out.push_back(std::move(row));
  out.push_back(hottest_line(lp, width));
  for (auto& row : rank_rows(lp, width)) out.push_back(std::move(row));
  return out;
}

// Cuts the body to the height left by the footer, with a note of what is cut.
void fit_height(std::vector<std::string>& lines, int height, size_t footer) {
  if (height <= 0 || static_cast<int>(lines.size() + footer) <= height) return;
  const int keep = std::max(0, height - static_cast<int>(footer) - 1);
  const size_t cut = lines.size() - keep;
  lines.resize(keep);
  lines.push_back("... " + std::to_string(cut) + " more line(s): a taller terminal, or --layer L");
}

}  // namespace

char heat_cell(double load, double max) {
  if (load <= 0 || max <= 0) return kHeatRamp[0];
  const int level = static_cast<int>(std::ceil(9 * std::min(1.0, load / max)));
  return kHeatRamp[std::clamp(level, 1, 9)];
}

std::vector<int> hottest_experts(const v1::LayerPlacement& layer, int n) {
  std::vector<int> ids;
  for (int e = 0; e < layer.expert_loads_size(); ++e)
    if (layer.expert_loads(e) > 0) ids.push_back(e);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return layer.expert_loads(a) > layer.expert_loads(b); });
  if (static_cast<int>(ids.size()) > n) ids.resize(n);
  return ids;
}

std::vector<std::string> render_top(const v1::LiveLoad& l, const FrameOptions& o) {
  std::vector<std::string> lines = header(l, o);
  for (auto& s : job_lines(l)) lines.push_back(std::move(s));
  if (l.layers_size() > 0) {
    lines.push_back(std::string("heat: expert load / the hottest's, \"") + kHeatRamp + "\", over up to " +
                    std::to_string(l.window_capacity()) + " steps");
    for (const v1::LayerPlacement& lp : l.layers()) {
      if (o.layer && lp.map().layer() != *o.layer) continue;
      lines.emplace_back();
      for (auto& s : layer_lines(lp, o.width)) lines.push_back(std::move(s));
    }
    if (o.layer && (*o.layer < 0 || *o.layer >= l.layers_size()))
      lines.push_back("no layer " + std::to_string(*o.layer) + ": the shape has " + std::to_string(l.layers_size()));
  }
  const std::vector<std::string> footer =
      o.keys ? std::vector<std::string>{"", "q: quit   (refreshed every second)"} : std::vector<std::string>{};
  fit_height(lines, o.height, footer.size());
  lines.insert(lines.end(), footer.begin(), footer.end());
  for (auto& s : lines)
    if (static_cast<int>(s.size()) > o.width) s.resize(std::max(0, o.width));
  return lines;
}

}  // namespace moe::ctl
