#include "moe/placement/random_traces.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "moe/placement/eplb.h"
#include "moe/placement/placement_metrics.h"
#include "moe/placement/placement_solver.h"
#include "moe/placement/rng.h"

namespace moe::placement {

std::vector<RandomTraceCase> random_trace_cases(int count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<RandomTraceCase> cases;
  for (int i = 0; i < count; ++i) {
    RandomTraceCase c;
    PlacementSpec& s = c.spec;
    s.num_nodes = 1 << rng.next_below(4);
    s.num_ranks = s.num_nodes * (1 + static_cast<int>(rng.next_below(16 / s.num_nodes + 8)));
    s.num_groups = 1 << rng.next_below(4);
    s.num_experts = s.num_groups * (2 + static_cast<int>(rng.next_below(63)));
    const int slots =
        (s.num_experts + s.num_ranks - 1) / s.num_ranks + static_cast<int>(rng.next_below(3));
    s.num_redundant = slots * s.num_ranks - s.num_experts;
    s.top_k = std::min(s.num_experts, 1 + static_cast<int>(rng.next_below(8)));
    if (s.num_groups > 1 && rng.next_below(2) == 1) {
      const int group_size = s.num_experts / s.num_groups;
      const int min_groups = (s.top_k + group_size - 1) / group_size;
      s.group_top_k = min_groups + static_cast<int>(rng.next_below(s.num_groups - min_groups + 1));
    }
    TraceConfig& t = c.trace;
    t.num_experts = s.num_experts;
    t.top_k = s.top_k;
    t.num_tokens = 1024 + static_cast<int64_t>(rng.next_below(7168));
    t.zipf_alpha = 0.6 + 0.8 * rng.next_open01();
    t.seed = seed + i;
    t.num_groups = s.num_groups;
    t.group_top_k = s.group_top_k;
    cases.push_back(c);
  }
  return cases;
}

std::vector<RandomTraceResult> compare_random_traces(const std::vector<RandomTraceCase>& cases,
                                                     bool with_sample) {
  std::vector<RandomTraceResult> results;
  for (const RandomTraceCase& c : cases) {
    const Trace trace = generate_trace(c.trace);
    const std::vector<double> loads = trace.expert_loads();
    PlacementSpec loads_only = c.spec;
    loads_only.top_k = 0;
    loads_only.group_top_k = 0;
    RandomTraceResult r;
    const ExpertMap global = eplb_rebalance(c.spec, loads, EplbPolicy::kGlobal);
    r.eplb_global = balancedness(global, loads);
    r.eplb_global_fanout = expected_fanout(global, c.spec.num_nodes, trace);
    const ExpertMap plain = solve_layer(loads_only, loads);
    r.moed_loads_only = balancedness(plain, loads);
    r.moed = r.moed_loads_only;
    r.moed_fanout = expected_fanout(plain, c.spec.num_nodes, trace);
    if (with_sample) {
      TraceConfig sample_config = c.trace;
      sample_config.window = 1;
      sample_config.num_tokens = 2048;
      const Trace sample = generate_trace(sample_config);
      const ExpertMap full = solve_layer(c.spec, loads, {nullptr, &sample});
      r.moed = balancedness(full, loads);
      r.moed_fanout = expected_fanout(full, c.spec.num_nodes, trace);
    }
    results.push_back(r);
  }
  return results;
}

namespace {

// Balancedness of one moed variant minus EPLB global's over all traces
// (differences under 1e-12 count as 0).
struct Summary {
  int not_below = 0, above = 0;
  double min_diff = 1e9, mean_diff = 0.0, max_diff = -1e9;
};

// field(result): the moed variant's balancedness.
template <typename Field>
Summary summarize(const std::vector<RandomTraceResult>& results, Field field) {
  Summary s;
  for (const RandomTraceResult& r : results) {
    double d = field(r) - r.eplb_global;
    if (std::abs(d) < 1e-12) d = 0.0;
    s.not_below += d >= -1e-12;
    s.above += d > 1e-9;
    s.min_diff = std::min(s.min_diff, d);
    s.max_diff = std::max(s.max_diff, d);
    s.mean_diff += d / results.size();
  }
  return s;
}

// moed's fan-out over EPLB global's, mean over the multi-node traces (0
// without any).
struct FanoutRatio {
  double mean = 0.0;
  int multi_node = 0;
};

FanoutRatio fanout_ratio(const std::vector<RandomTraceCase>& cases,
                         const std::vector<RandomTraceResult>& results) {
  FanoutRatio ratio;
  for (size_t i = 0; i < results.size(); ++i) {
    if (cases[i].spec.num_nodes == 1) continue;
    ++ratio.multi_node;
    ratio.mean += results[i].moed_fanout / results[i].eplb_global_fanout;
  }
  if (ratio.multi_node) ratio.mean /= ratio.multi_node;
  return ratio;
}

std::string comparison_json(int n, const Summary& loads_only, const Summary& full,
                            const FanoutRatio& ratio) {
  char buf[1024];
  std::snprintf(buf, sizeof(buf),
                "{\"traces\": %d, \"loads_only\": {\"not_below_eplb_global\": %d, \"above\": %d, "
                "\"min_diff\": %.6f, \"mean_diff\": %.6f, \"max_diff\": %.6f}, "
                "\"with_sample\": {\"not_below_eplb_global\": %d, \"above\": %d, "
                "\"min_diff\": %.6f, \"mean_diff\": %.6f, \"max_diff\": %.6f, "
                "\"mean_fanout_vs_eplb_global\": %.6f, \"multi_node_traces\": %d}}\n",
                n, loads_only.not_below, loads_only.above, loads_only.min_diff,
                loads_only.mean_diff, loads_only.max_diff, full.not_below, full.above,
                full.min_diff, full.mean_diff, full.max_diff, ratio.mean, ratio.multi_node);
  return buf;
}

std::string comparison_text(const std::vector<RandomTraceCase>& cases,
                            const std::vector<RandomTraceResult>& results,
                            const Summary& loads_only, const Summary& full,
                            const FanoutRatio& ratio) {
  const int n = static_cast<int>(results.size());
  double min_global = 1.0;
  for (const RandomTraceResult& r : results) min_global = std::min(min_global, r.eplb_global);
  int max_ranks = 0, max_experts = 0, min_experts = 1 << 30, max_nodes = 0;
  for (const RandomTraceCase& c : cases) {
    max_ranks = std::max(max_ranks, c.spec.num_ranks);
    max_nodes = std::max(max_nodes, c.spec.num_nodes);
    max_experts = std::max(max_experts, c.spec.num_experts);
    min_experts = std::min(min_experts, c.spec.num_experts);
  }
  std::ostringstream os;
  os << n << " random traces (alpha 0.6-1.4, 1-" << max_nodes << " nodes, up to " << max_ranks
     << " ranks, " << min_experts << "-" << max_experts
     << " experts); balancedness of moed minus EPLB global (lowest EPLB global: " << min_global
     << "):\n";
  char buf[1024];
  std::snprintf(buf, sizeof(buf),
                "  moed, loads only:          not below on %d/%d, above on %d; min %+.4f mean "
                "%+.4f max %+.4f\n"
                "  moed, sample + top-k hint: not below on %d/%d, above on %d; min %+.4f mean "
                "%+.4f max %+.4f;\n"
                "                             fan-out %.3f x EPLB global's (mean over %d "
                "multi-node traces)\n",
                loads_only.not_below, n, loads_only.above, loads_only.min_diff,
                loads_only.mean_diff, loads_only.max_diff, full.not_below, n, full.above,
                full.min_diff, full.mean_diff, full.max_diff, ratio.mean, ratio.multi_node);
  os << buf;
  return os.str();
}

}  // namespace

std::string format_random_comparison(const std::vector<RandomTraceCase>& cases,
                                     const std::vector<RandomTraceResult>& results, bool json) {
  const Summary loads_only =
      summarize(results, [](const RandomTraceResult& r) { return r.moed_loads_only; });
  const Summary full = summarize(results, [](const RandomTraceResult& r) { return r.moed; });
  const FanoutRatio ratio = fanout_ratio(cases, results);
  if (json) return comparison_json(static_cast<int>(results.size()), loads_only, full, ratio);
  return comparison_text(cases, results, loads_only, full, ratio);
}

}  // namespace moe::placement
