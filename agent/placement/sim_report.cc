#include "moe/placement/sim_report.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "moe/placement/eplb.h"
#include "moe/base/check.h"
#include "moe/placement/placement_metrics.h"
#include "moe/placement/placement_solver.h"
#include "moe/placement/trace.h"

namespace moe::placement {

namespace {

constexpr uint64_t kSampleWindow = 1, kPrevWindow = 2, kPrevSampleWindow = 3;

TraceConfig trace_config(const SimConfig& config, uint64_t window, int64_t tokens, double alpha) {
  TraceConfig t;
  t.num_experts = config.spec.num_experts;
  t.top_k = config.spec.top_k;
  t.num_tokens = tokens;
  t.zipf_alpha = alpha;
  t.seed = config.seed;
  t.window = window;
  t.num_groups = config.spec.num_groups;
  t.group_top_k = config.spec.group_top_k;
  return t;
}

template <typename F>
auto timed(double* seconds, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  auto result = f();
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

PolicyResult policy_result(std::string name) {
  PolicyResult r;
  r.policy = std::move(name);
  return r;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// What a simulation measures. Loads mode: the config's loads and previous
// loads. Trace mode: window 0 of the pinned trace, its loads, the previous
// window's loads and, with sample_tokens, moed's routing samples of both.
struct Workload {
  std::vector<std::vector<double>> loads, prev_loads;  // [layer][E]
  Trace trace, sample, prev_sample;
  std::vector<Trace> recorded, recorded_samples;  // recorded mode: [layer]
  bool trace_mode = false;
  bool has_samples = false;

  // The tokens a layer's fan-out is measured on (null: loads mode).
  const Trace* measured(size_t layer) const {
    if (!recorded.empty()) return &recorded[layer];
    return trace_mode ? &trace : nullptr;
  }
  // moed's routing samples for this window and the previous one, or null.
  const Trace* routing_sample(size_t layer) const {
    if (!recorded_samples.empty()) return &recorded_samples[layer];
    return has_samples ? &sample : nullptr;
  }
  const Trace* prev_routing_sample() const { return has_samples ? &prev_sample : nullptr; }
};

// The first n tokens of a trace.
Trace first_tokens(const Trace& t, int64_t n) {
  Trace out = t;
  out.topk_idx.resize(static_cast<size_t>(std::min(n, t.num_tokens()) * t.top_k));
  return out;
}

Workload make_workload(const SimConfig& config) {
  Workload w;
  w.loads = config.loads;
  w.prev_loads = config.prev_loads;
  if (config.recorded_mode()) {
    w.recorded = config.recorded;
    for (const Trace& t : config.recorded) {
      w.loads.push_back(t.expert_loads());
      if (config.sample_tokens > 0) w.recorded_samples.push_back(first_tokens(t, config.sample_tokens));
    }
    return w;
  }
  w.trace_mode = !config.loads_mode();
  w.has_samples = w.trace_mode && config.sample_tokens > 0;
  if (!w.trace_mode) return w;
  w.trace = generate_trace(trace_config(config, 0, config.num_tokens, config.zipf_alpha));
  w.loads = {w.trace.expert_loads()};
  const double prev_alpha = config.prev_zipf_alpha.value_or(config.zipf_alpha);
  w.prev_loads = {generate_trace(trace_config(config, kPrevWindow, config.num_tokens, prev_alpha))
                      .expert_loads()};
  if (config.sample_tokens > 0) {
    w.sample = generate_trace(
        trace_config(config, kSampleWindow, config.sample_tokens, config.zipf_alpha));
    w.prev_sample =
        generate_trace(trace_config(config, kPrevSampleWindow, config.sample_tokens, prev_alpha));
  }
  return w;
}

// One layer's rows: each policy's map solved (and timed) and measured.
class LayerRun {
 public:
  LayerRun(const PlacementSpec& spec, const Workload& workload, size_t layer)
      : layer_(layer),
        spec_(spec),
        loads_(workload.loads[layer]),
        prev_loads_(workload.prev_loads.empty() ? nullptr : &workload.prev_loads[layer]),
        workload_(workload) {}

  // moed given its map for the previous loads (when there are any) as the
  // current map, then moed-from-scratch (only with previous loads).
  void add_moed(LayerResult* layer) const;
  // EPLB hierarchical (n/a unless groups are a positive multiple of nodes),
  // then EPLB global.
  void add_eplb(LayerResult* layer) const;

 private:
  // Balancedness; fan-out in trace mode; copies moved from prev when given.
  void measure(PolicyResult& r, const ExpertMap& map, const ExpertMap* prev) const {
    r.balancedness = balancedness(map, loads_);
    r.lost_per_node = experts_lost_per_node(map, spec_.num_nodes);
    if (const Trace* t = workload_.measured(layer_)) r.fanout = expected_fanout(map, spec_.num_nodes, *t);
    if (prev) r.copies_moved = copies_moved(*prev, map);
  }

  size_t layer_;
  const PlacementSpec& spec_;
  const std::vector<double>& loads_;
  const std::vector<double>* prev_loads_;  // null without previous loads
  const Workload& workload_;
};

void LayerRun::add_moed(LayerResult* layer) const {
  std::optional<ExpertMap> moed_prev;
  if (prev_loads_)
    moed_prev = solve_layer(spec_, *prev_loads_, {nullptr, workload_.prev_routing_sample()});
  PolicyResult moed = policy_result("moed");
  const ExpertMap moed_map = timed(&moed.solve_seconds, [&] {
    return solve_layer(spec_, loads_,
                       {moed_prev ? &*moed_prev : nullptr, workload_.routing_sample(layer_)});
  });
  measure(moed, moed_map, moed_prev ? &*moed_prev : nullptr);
  layer->policies.push_back(moed);
  if (!prev_loads_) return;
  PolicyResult scratch = policy_result("moed-from-scratch");
  const ExpertMap map = timed(&scratch.solve_seconds, [&] {
    return solve_layer(spec_, loads_, {nullptr, workload_.routing_sample(layer_)});
  });
  measure(scratch, map, &*moed_prev);
  layer->policies.push_back(scratch);
}

void LayerRun::add_eplb(LayerResult* layer) const {
  const bool hierarchical = eplb_hierarchical_applicable(spec_);
  for (EplbPolicy policy : {EplbPolicy::kHierarchical, EplbPolicy::kGlobal}) {
    PolicyResult r = policy_result(eplb_policy_name(policy));
    if (policy == EplbPolicy::kHierarchical && !hierarchical) {
      r.available = false;
      r.note = "needs groups (" + std::to_string(spec_.num_groups) +
               ") to be a positive multiple of nodes (" + std::to_string(spec_.num_nodes) + ")";
      layer->policies.push_back(r);
      continue;
    }
    std::optional<ExpertMap> prev;
    if (prev_loads_) prev = eplb_rebalance(spec_, *prev_loads_, policy);
    const ExpertMap map =
        timed(&r.solve_seconds, [&] { return eplb_rebalance(spec_, loads_, policy); });
    measure(r, map, prev ? &*prev : nullptr);
    layer->policies.push_back(r);
  }
}

}  // namespace

void SimConfig::validate() const {
  spec.validate();
  if (recorded_mode()) {
    MOE_CHECK(!loads_mode() && prev_loads.empty(), "a recorded trace is its own loads: give no loads with it");
    for (size_t l = 0; l < recorded.size(); ++l) {
      MOE_CHECK(recorded[l].num_experts == spec.num_experts && recorded[l].top_k == spec.top_k, "trace layer ", l,
                " has ", recorded[l].num_experts, " experts, top-", recorded[l].top_k, "; expected ", spec.num_experts,
                ", top-", spec.top_k);
      MOE_CHECK(recorded[l].num_tokens() > 0, "trace layer ", l, " has no tokens");
    }
    return;
  }
  if (loads_mode()) {
    for (size_t l = 0; l < loads.size(); ++l)
      MOE_CHECK(loads[l].size() == static_cast<size_t>(spec.num_experts), "loads layer ",
                          l, " has ", loads[l].size(), " experts, expected ", spec.num_experts);
    MOE_CHECK(prev_loads.empty() || prev_loads.size() == loads.size(),
                        "previous loads have ", prev_loads.size(), " layers, loads ", loads.size());
    for (size_t l = 0; l < prev_loads.size(); ++l)
      MOE_CHECK(prev_loads[l].size() == static_cast<size_t>(spec.num_experts),
                          "previous loads layer ", l, " has ", prev_loads[l].size(),
                          " experts, expected ", spec.num_experts);
    return;
  }
  MOE_CHECK(spec.top_k >= 1, "top_k (", spec.top_k, ") must be at least 1 for a trace");
  MOE_CHECK(sample_tokens >= 0 && sample_tokens <= (int64_t{1} << 20), "sample tokens (",
                      sample_tokens, ") must be in [0, 1048576]");
  trace_config(*this, 0, num_tokens, zipf_alpha).validate();
  if (prev_zipf_alpha) trace_config(*this, kPrevWindow, num_tokens, *prev_zipf_alpha).validate();
}

SimReport run_simulation(const SimConfig& config) {
  config.validate();
  SimReport report;
  report.config = config;
  report.loads_mode = config.loads_mode();
  report.recorded_mode = config.recorded_mode();
  for (const Trace& t : config.recorded) report.recorded_tokens.push_back(t.num_tokens());
  report.config.recorded.clear();
  report.config.loads.clear();
  report.has_prev_loads = !config.prev_loads.empty();
  report.config.prev_loads.clear();

  const Workload workload = make_workload(config);
  report.num_layers = static_cast<int>(workload.loads.size());
  for (size_t l = 0; l < workload.loads.size(); ++l) {
    const LayerRun run(config.spec, workload, l);
    LayerResult layer;
    run.add_moed(&layer);
    run.add_eplb(&layer);
    report.layers.push_back(std::move(layer));
  }
  return report;
}

std::string format_table(const SimReport& report) {
  const SimConfig& c = report.config;
  const PlacementSpec& s = c.spec;
  std::ostringstream os;
  os << "placement: " << s.num_experts << " experts + " << s.num_redundant << " redundant on "
     << s.num_ranks << " ranks, " << s.num_nodes << " nodes (" << s.slots_per_rank()
     << " slots per rank)";
  if (s.grouped()) os << ", " << s.num_groups << " groups";
  os << "\n";
  if (report.recorded_mode) {
    os << "recorded trace: " << c.recorded_source << ", " << report.num_layers << " layer(s), top-" << s.top_k
       << ", tokens per layer:";
    for (int64_t n : report.recorded_tokens) os << " " << n;
    os << "; fan-out of those tokens; moed routing sample: their first " << c.sample_tokens
       << "; copies moved: n/a\n";
  } else if (report.loads_mode) {
    os << "loads: " << report.num_layers << " layer(s); fan-out: n/a (needs per-token data); "
       << "copies moved: "
       << (report.has_prev_loads ? "vs each policy's map for the previous loads" : "n/a")
       << "\nmoed: "
       << (s.top_k > 0 && s.num_nodes > 1
               ? "lowers the fan-out of a model of the loads (top-k hint)"
               : "balances only (no top-k hint)")
       << "\n";
  } else {
    os << "trace: " << c.num_tokens << " tokens, top-" << s.top_k;
    if (s.group_limited()) os << " in " << s.group_top_k << " of " << s.num_groups << " groups";
    os << ", zipf " << c.zipf_alpha << ", seed " << c.seed
       << "; moed routing sample: " << c.sample_tokens
       << " tokens (window 1); copies moved: vs each policy's map for window 2";
    if (c.prev_zipf_alpha) os << " (zipf " << *c.prev_zipf_alpha << ")";
    os << "\n";
  }
  for (size_t l = 0; l < report.layers.size(); ++l) {
    if (report.layers.size() > 1) os << "\nlayer " << l << "\n";
    os << "\npolicy              balancedness  fan-out  copies moved  solve ms  node loss\n";
    for (const PolicyResult& r : report.layers[l].policies) {
      char line[200];
      if (!r.available) {
        std::snprintf(line, sizeof(line), "%-18s  n/a: %s\n", r.policy.c_str(), r.note.c_str());
      } else {
        const int worst = r.lost_per_node.empty() ? 0 : *std::max_element(r.lost_per_node.begin(), r.lost_per_node.end());
        std::snprintf(line, sizeof(line), "%-18s  %12s  %7s  %12s  %8s  %9d\n", r.policy.c_str(),
                      fixed(r.balancedness, 4).c_str(),
                      r.fanout ? fixed(*r.fanout, 3).c_str() : "n/a",
                      r.copies_moved ? std::to_string(*r.copies_moved).c_str() : "n/a",
                      fixed(r.solve_seconds * 1e3, 1).c_str(), worst);
      }
      os << line;
    }
    // node loss: the most experts one node's death loses; per node below.
    os << "experts lost if node n dies (n = 0.." << report.config.spec.num_nodes - 1 << "):\n";
    for (const PolicyResult& r : report.layers[l].policies) {
      if (!r.available) continue;
      os << "  " << r.policy << ":";
      for (int lost : r.lost_per_node) os << " " << lost;
      os << "\n";
    }
  }
  return os.str();
}

std::string format_json(const SimReport& report) {
  const SimConfig& c = report.config;
  const PlacementSpec& s = c.spec;
  std::ostringstream os;
  os << "{\"config\": {\"experts\": " << s.num_experts << ", \"ranks\": " << s.num_ranks
     << ", \"nodes\": " << s.num_nodes << ", \"redundant_experts\": " << s.num_redundant
     << ", \"slots_per_rank\": " << s.slots_per_rank() << ", \"groups\": " << s.num_groups
     << ", \"group_top_k\": " << s.group_top_k << ", \"top_k\": " << s.top_k
     << ", \"min_node_replicas\": " << s.min_node_replicas;
  if (report.recorded_mode) {
    os << ", \"source\": \"recorded\", \"recorded_source\": " << json_string(c.recorded_source)
       << ", \"sample_tokens\": " << c.sample_tokens << ", \"tokens_per_layer\": [";
    for (size_t l = 0; l < report.recorded_tokens.size(); ++l) os << (l ? ", " : "") << report.recorded_tokens[l];
    os << "]";
  } else if (report.loads_mode) {
    os << ", \"source\": \"loads\"";
  } else {
    os << ", \"source\": \"trace\", \"tokens\": " << c.num_tokens << ", \"zipf\": " << c.zipf_alpha
       << ", \"seed\": " << c.seed << ", \"sample_tokens\": " << c.sample_tokens;
    if (c.prev_zipf_alpha) os << ", \"prev_zipf\": " << *c.prev_zipf_alpha;
  }
  os << "}, \"layers\": [";
  for (size_t l = 0; l < report.layers.size(); ++l) {
    os << (l ? ", " : "") << "{\"layer\": " << l << ", \"policies\": [";
    const auto& policies = report.layers[l].policies;
    for (size_t i = 0; i < policies.size(); ++i) {
      const PolicyResult& r = policies[i];
      os << (i ? ", " : "") << "{\"policy\": " << json_string(r.policy)
         << ", \"available\": " << (r.available ? "true" : "false");
      if (!r.available) {
        os << ", \"note\": " << json_string(r.note) << "}";
        continue;
      }
      os << ", \"balancedness\": " << fixed(r.balancedness, 6)
         << ", \"fanout\": " << (r.fanout ? fixed(*r.fanout, 6) : "null")
         << ", \"copies_moved\": " << (r.copies_moved ? std::to_string(*r.copies_moved) : "null")
         << ", \"solve_seconds\": " << fixed(r.solve_seconds, 6) << ", \"experts_lost_if_node_dies\": [";
      for (size_t n = 0; n < r.lost_per_node.size(); ++n) os << (n ? ", " : "") << r.lost_per_node[n];
      os << "]}";
    }
    os << "]}";
  }
  os << "]}\n";
  return os.str();
}

std::vector<std::vector<double>> parse_loads(std::string_view text, std::string_view source) {
  std::vector<std::vector<double>> out;
  size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    std::vector<double> row;
    size_t field = 0;
    for (size_t i = 0; i < line.size();) {
      if (std::isspace(static_cast<unsigned char>(line[i]))) {
        ++i;
        continue;
      }
      if (field == 0 && line[i] == '#') break;
      size_t j = i;
      while (j < line.size() && !std::isspace(static_cast<unsigned char>(line[j]))) ++j;
      const std::string_view token = line.substr(i, j - i);
      ++field;
      double v = 0.0;
      const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), v);
      MOE_CHECK(ec == std::errc() && ptr == token.data() + token.size(), source,
                          " line ", line_no, ", field ", field, ": '", token, "' is not a number");
      MOE_CHECK(std::isfinite(v) && v >= 0.0, source, " line ", line_no, ", field ",
                          field, ": ", token, " must be finite and non-negative");
      row.push_back(v);
      i = j;
    }
    if (row.empty()) continue;
    MOE_CHECK(out.empty() || row.size() == out.front().size(), source, " line ", line_no,
                        " has ", row.size(), " loads, the first layer ", out.front().size());
    out.push_back(std::move(row));
  }
  MOE_CHECK(!out.empty(), source, ": no layer (every line is blank or a comment)");
  return out;
}

}  // namespace moe::placement
