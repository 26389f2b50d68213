// The random-trace comparison of moed's solver with EPLB's global policy
// (the solver's goal: "on 100 random traces, never below EPLB global"), shared by the
// test and `moe-placement-sim --random-traces N`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"

namespace moe::placement {

struct RandomTraceCase {
  PlacementSpec spec;  // top_k / group_top_k are the trace's routing
  TraceConfig trace;
};

// count cases drawn with SplitMix64(seed): 1 to 8 nodes, up to 80 ranks,
// 1 to 8 groups of 2 to 64 experts, 0 to 2 spare slots per rank beyond the
// fewest that fit, top-k 1 to 8, group-limited routing on about half,
// alpha in [0.6, 1.4], 1,024 to 8,191 tokens.
std::vector<RandomTraceCase> random_trace_cases(int count, uint64_t seed);

struct RandomTraceResult {
  double eplb_global = 0.0;      // balancedness of each map
  double moed_loads_only = 0.0;  // moed given the loads only (what EPLB gets)
  double moed = 0.0;             // moed given the loads, hints and a routing sample
  double eplb_global_fanout = 0.0;
  double moed_fanout = 0.0;  // of the full moed map
};

// Solves each case both ways (sample: 2,048 tokens of window 1).
// with_sample = false skips the full moed solve (moed = moed_loads_only).
std::vector<RandomTraceResult> compare_random_traces(const std::vector<RandomTraceCase>& cases,
                                                     bool with_sample);

std::string format_random_comparison(const std::vector<RandomTraceCase>& cases,
                                     const std::vector<RandomTraceResult>& results, bool json);

}  // namespace moe::placement
