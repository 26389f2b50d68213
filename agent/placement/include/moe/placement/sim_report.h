// moe-placement-sim's computation: solve one workload with moed's solver and
// both EPLB policies and measure the maps. No I/O here; sim_main.cc reads the
// flags and files and prints.
//
// Trace mode (no loads given) measures window 0 of the pinned trace
// (trace.h). moed additionally gets a routing sample of `sample_tokens`
// tokens from window 1 of the same workload, so the fan-out it is judged on
// comes from tokens it has not seen. "Copies moved" compares each policy's
// map with the map the same policy produced one window earlier (window 2;
// --prev-zipf changes that window's alpha to model drift): moed gets that
// map as its current map, EPLB has no such input. The moed-from-scratch row
// is moed's map solved without the current map.
//
// Recorded mode (a serving job's routing trace, moe-placement-sim --trace)
// measures each layer's recorded tokens: their loads, and the fan-out of those
// very tokens; moed's routing sample is the first sample_tokens of them (all
// policies see the same loads; there is no previous window).
//
// Loads mode measures the given per-layer loads; fan-out needs per-token data
// and is reported as not available; copies moved needs prev_loads. moed then
// lowers the fan-out of its model of the loads if spec.top_k is set, else it
// only balances.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/placement/trace.h"

namespace moe::placement {

struct SimConfig {
  PlacementSpec spec;          // top_k / group_top_k double as the trace's routing
  int64_t num_tokens = 65536;  // trace mode
  double zipf_alpha = 1.2;
  uint64_t seed = 0;
  std::optional<double> prev_zipf_alpha;        // window 2's alpha; default zipf_alpha
  int64_t sample_tokens = 4096;                 // 0: moed gets no routing sample
  std::vector<std::vector<double>> loads;       // loads mode when not empty: [layer][E]
  std::vector<std::vector<double>> prev_loads;  // optional, same shape
  std::vector<Trace> recorded;                  // recorded mode when not empty: [layer]
  std::string recorded_source;                  // what it was read from, for the report

  // Throws moe::Error naming the bad value.
  void validate() const;
  bool loads_mode() const { return !loads.empty(); }
  bool recorded_mode() const { return !recorded.empty(); }
};

struct PolicyResult {
  std::string policy;     // moed, moed-from-scratch, eplb-hierarchical, eplb-global
  bool available = true;  // false: the policy does not apply (see note)
  std::string note;
  double balancedness = 0.0;
  std::optional<double> fanout;         // expected nodes per token
  std::optional<int64_t> copies_moved;  // vs the previous window's map
  double solve_seconds = 0.0;
  std::vector<int> lost_per_node;       // experts with every copy on node n (lost if it dies)
};

struct LayerResult {
  std::vector<PolicyResult> policies;
};

struct SimReport {
  SimConfig config;  // as run, without the loads
  bool loads_mode = false;
  bool recorded_mode = false;
  std::vector<int64_t> recorded_tokens;  // per layer
  bool has_prev_loads = false;
  int num_layers = 1;
  std::vector<LayerResult> layers;
};

SimReport run_simulation(const SimConfig& config);

// Human-readable table and JSON of a report.
std::string format_table(const SimReport& report);
std::string format_json(const SimReport& report);

// Parses a loads file's text: one line per layer, whitespace-separated
// non-negative finite numbers, the same count on every line; blank lines and
// lines starting with '#' are skipped. Throws moe::Error naming source,
// the line and the field.
std::vector<std::vector<double>> parse_loads(std::string_view text,
                                             std::string_view source = "loads");

}  // namespace moe::placement
