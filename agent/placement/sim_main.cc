// moe-placement-sim: solves a synthetic trace, measured loads or a serving job's
// recorded routing (--trace, docs/example-lm.md#routing-traces) with moed's
// placement solver and both EPLB policies, and prints balancedness, cross-node
// fan-out, copies moved and solve time (like Ceph's crushtool --test).
// Exit codes: 0 ok, 2 usage or invalid input (the message names it).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "moe/base/version.h"
#include "moe/base/check.h"
#include "moe/io/safetensors.h"
#include "moe/placement/random_traces.h"
#include "moe/placement/sim_report.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open loads file '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  MOE_CHECK(!in.bad(), "cannot read loads file '", path, "'");
  return text.str();
}

// The flags' values; defaults are the reference setting (agent/placement/README.md).
struct SimFlags {
  moe::placement::SimConfig config;
  std::string loads_path, prev_loads_path, output = "table";
  std::vector<std::string> trace_paths;
  double prev_zipf = 0.0;
  CLI::Option* prev_zipf_opt = nullptr;  // set: --prev-zipf was given
  int random_traces = 0;                 // 0: one simulation
};

// Defines moe-placement-sim's flags on app (in --help order), each writing
// into flags.
void add_flags(CLI::App& app, SimFlags& flags) {
  moe::placement::SimConfig& config = flags.config;
  config.spec = {256, 32, 4, 32, 8, 8, 0};
  app.add_option("--experts", config.spec.num_experts, "logical experts E")->capture_default_str();
  app.add_option("--ranks", config.spec.num_ranks, "EP ranks R")->capture_default_str();
  app.add_option("--nodes", config.spec.num_nodes, "nodes N (R % N == 0)")->capture_default_str();
  app.add_option("--groups", config.spec.num_groups, "expert groups (0: none)")
      ->capture_default_str();
  app.add_option("--group-top-k", config.spec.group_top_k,
                 "groups a token may use (0: routing not group-limited)")
      ->capture_default_str();
  app.add_option("--redundant-experts", config.spec.num_redundant,
                 "redundant slots ((E + redundant) % R == 0)")
      ->capture_default_str();
  app.add_option("--min-node-replicas", config.spec.min_node_replicas,
                 "every expert's copies on at least this many nodes (moed's solver)")
      ->capture_default_str();
  app.add_option("--top-k", config.spec.top_k,
                 "experts per token (with --loads: a hint for moed's fan-out model)")
      ->capture_default_str();
  app.add_option("--tokens", config.num_tokens, "trace tokens")->capture_default_str();
  app.add_option("--zipf", config.zipf_alpha, "popularity 1/rank^ALPHA")->capture_default_str();
  app.add_option("--seed", config.seed, "trace seed")->capture_default_str();
  app.add_option("--sample-tokens", config.sample_tokens,
                 "routing sample moed gets (another window; 0: none)")
      ->capture_default_str();
  flags.prev_zipf_opt = app.add_option("--prev-zipf", flags.prev_zipf,
                                       "alpha of the previous window (default --zipf)");
  app.add_option("--loads", flags.loads_path,
                 "per-layer loads: one line per layer, whitespace-separated per-expert loads");
  app.add_option("--trace", flags.trace_paths,
                 "a serving job's routing-rank{r}.safetensors (repeatable: the ranks' files, merged per layer)");
  app.add_option("--prev-loads", flags.prev_loads_path,
                 "loads of the previous window (copies moved)");
  app.add_option("--random-traces", flags.random_traces,
                 "instead: compare with EPLB global on N random traces (from --seed)");
  app.add_option("--output", flags.output, "table or json")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
}

// --random-traces N: moed against EPLB global on N random traces from --seed.
void print_random_traces(const SimFlags& flags) {
  MOE_CHECK(flags.random_traces > 0 && flags.random_traces <= 10000, "random traces (",
            flags.random_traces, ") must be in [1, 10000]");
  const auto cases = moe::placement::random_trace_cases(flags.random_traces, flags.config.seed);
  const auto results = moe::placement::compare_random_traces(cases, true);
  std::cout << moe::placement::format_random_comparison(cases, results, flags.output == "json");
}

// --loads (and --prev-loads) into config: loads mode, experts from the file
// (an explicit --experts must agree), no top-k hint unless --top-k is given.
// A loads file written by `moectl placement loads` records its shape in a line
// "# moe-placement-sim: --ranks R --nodes N --redundant-experts X --groups G
// --group-top-k GK --top-k K": those values, for the flags not given.
void apply_header(const CLI::App& app, const std::string& text, moe::placement::PlacementSpec& spec) {
  const std::string tag = "# moe-placement-sim:";
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(tag, 0) != 0) continue;
    std::istringstream words(line.substr(tag.size()));
    std::string flag;
    int value = 0;
    while (words >> flag >> value) {
      if (app.count(flag) != 0) continue;  // the command line wins
      if (flag == "--ranks") spec.num_ranks = value;
      else if (flag == "--nodes") spec.num_nodes = value;
      else if (flag == "--redundant-experts") spec.num_redundant = value;
      else if (flag == "--groups") spec.num_groups = value;
      else if (flag == "--group-top-k") spec.group_top_k = value;
      else if (flag == "--top-k") spec.top_k = value;
    }
  }
}

void read_loads(const CLI::App& app, SimFlags& flags) {
  moe::placement::SimConfig& config = flags.config;
  const std::string& path = flags.loads_path;
  const std::string text = read_file(path);
  config.loads = moe::placement::parse_loads(text, "loads file '" + path + "'");
  const int experts = static_cast<int>(config.loads.front().size());
  MOE_CHECK(app.count("--experts") == 0 || experts == config.spec.num_experts, "loads file has ",
            experts, " experts per line, --experts says ", config.spec.num_experts);
  config.spec.num_experts = experts;
  // Routing hints only when given (a flag or the file's header): loads alone carry no top-k.
  if (app.count("--top-k") == 0) config.spec.top_k = 0;
  apply_header(app, text, config.spec);
  if (!flags.prev_loads_path.empty())
    config.prev_loads = moe::placement::parse_loads(
        read_file(flags.prev_loads_path), "previous loads file '" + flags.prev_loads_path + "'");
}

// --trace: every file's layer{l}.topk_ids, merged per layer; the files say the
// experts and top-k (and must agree).
void read_traces(const CLI::App& app, SimFlags& flags) {
  moe::placement::SimConfig& config = flags.config;
  MOE_CHECK(flags.loads_path.empty() && flags.prev_loads_path.empty(), "--trace is its own loads: no --loads with it");
  for (const std::string& path : flags.trace_paths) {
    const moe::io::SafetensorsReader file(path);
    auto number = [&](const char* key) {
      const auto it = file.metadata().find(key);
      MOE_CHECK(it != file.metadata().end(), "trace '", path, "': no \"", key, "\" in its metadata (not a routing trace?)");
      return std::stoi(it->second);
    };
    const int layers = number("layers"), experts = number("experts"), top_k = number("top_k");
    if (config.recorded.empty()) {
      MOE_CHECK(app.count("--experts") == 0 || experts == config.spec.num_experts, "trace '", path, "' has ", experts,
                " experts, --experts says ", config.spec.num_experts);
      config.spec.num_experts = experts;
      config.spec.top_k = top_k;
      config.recorded.resize(layers, moe::placement::Trace{experts, top_k, {}});
    }
    MOE_CHECK(layers == static_cast<int>(config.recorded.size()) && experts == config.recorded[0].num_experts &&
                  top_k == config.recorded[0].top_k,
              "trace '", path, "' is of ", layers, " layers, ", experts, " experts, top-", top_k, "; the first file's of ",
              config.recorded.size(), ", ", config.recorded[0].num_experts, ", top-", config.recorded[0].top_k);
    for (int l = 0; l < layers; ++l) {
      const std::string name = "layer" + std::to_string(l) + ".topk_ids";
      const int64_t tokens = file.info(name).shape.empty() ? 0 : file.info(name).shape[0];
      std::vector<int32_t> ids = file.read_i32(name, {tokens, top_k});
      for (int64_t t = 0; t < tokens; ++t) {
        auto* row = ids.data() + t * top_k;
        for (int k = 0; k < top_k; ++k)
          MOE_CHECK(row[k] >= 0 && row[k] < experts, "trace '", path, "' layer ", l, " token ", t, ": expert ", row[k],
                    " is not in [0, ", experts, ")");
        std::sort(row, row + top_k);
      }
      auto& all = config.recorded[l].topk_idx;
      all.insert(all.end(), ids.begin(), ids.end());
    }
  }
  config.recorded_source = std::to_string(flags.trace_paths.size()) + " file(s)";
}

// One simulation of the flags, printed as a table or JSON.
void print_simulation(const CLI::App& app, SimFlags& flags) {
  if (*flags.prev_zipf_opt) flags.config.prev_zipf_alpha = flags.prev_zipf;
  if (!flags.trace_paths.empty()) {
    read_traces(app, flags);
  } else if (!flags.loads_path.empty()) {
    read_loads(app, flags);
  } else {
    MOE_CHECK(flags.prev_loads_path.empty(), "--prev-loads needs --loads");
  }
  const auto report = moe::placement::run_simulation(flags.config);
  std::cout << (flags.output == "json" ? format_json(report) : format_table(report));
}

// Runs what the parsed flags ask for; returns the exit code (0 ok, 2 invalid
// input, 1 internal error), the message on stderr.
int dispatch(const CLI::App& app, SimFlags& flags) {
  try {
    if (flags.random_traces != 0) {
      print_random_traces(flags);
    } else {
      print_simulation(app, flags);
    }
    return 0;
  } catch (const moe::Error& e) {
    std::cerr << "moe-placement-sim: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe-placement-sim: internal error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe-placement-sim: compare moed's expert placement with deepseek-ai/EPLB"};
  app.set_version_flag("--version", moe::version_line("moe-placement-sim"));
  SimFlags flags;
  add_flags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "moe-placement-sim: " << e.what() << "\n";
    return 2;
  }
  return dispatch(app, flags);
}
