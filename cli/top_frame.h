// The frame of `moectl top` (docs/metrics.md#live-load, docs/cli.md#output): a
// pure function of the agent's live-load reply. ASCII only, so a line's bytes are
// its columns.
//
//   header    agent, nodes alive / registered, ranks, the time
//   jobs      counts by state
//   job       the running job: step / steps, step time and tokens/s over its
//             last complete steps; else the last job that ran; else "no job";
//             then its mode, dtype, top-k and shape
//   per layer epoch, window balancedness; a heat row of one cell per expert
//             (shade = its window load / the layer's hottest, kHeatRamp; blank:
//             none), wrapped in groups of 8; the hottest experts with their
//             share of the layer's load; a bar per rank (load / the busiest
//             rank) with its share
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "moe/v1/live_load.pb.h"
#include "moe/v1/placement.pb.h"

namespace moe::ctl {

// From no load to the layer's hottest expert.
inline constexpr const char* kHeatRamp = " .:-=+*#%@";

struct FrameOptions {
  int width = 80;   // columns; every line is at most this wide (at least 20 used)
  int height = 0;   // lines; 0: no limit, else the frame is cut to fit with a note
  std::string agent;  // HOST:PORT, for the header
  std::string clock;  // "HH:MM:SS", for the header ("" leaves it out)
  std::optional<int> layer;  // only this layer
  bool keys = false;  // a footer naming the keys (interactive)
};

std::vector<std::string> render_top(const v1::LiveLoad& load, const FrameOptions& o);

// The experts of a layer by window load, hottest first (ties: the lower id),
// those with load only, at most n.
std::vector<int> hottest_experts(const v1::LayerPlacement& layer, int n);

// The heat cell of a load against the layer's hottest: ' ' for none, else
// kHeatRamp[1..9] by ceil(9 x load / max).
char heat_cell(double load, double max);

}  // namespace moe::ctl
