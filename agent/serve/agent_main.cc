// moe-agent: the coordinator process. Thin main: flags, signals, the Agent.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "moe/base/cli_checks.h"
#include "moe/base/version.h"
#include "moe/agent/agent.h"
#include "moe/agent/metrics_exposer.h"
#include "moe/base/file.h"
#include "moe/base/log.h"
#include "moe/rpc/tls_flags.h"

namespace {

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace

// The command line: flags into AgentOptions, plus what main itself needs.
struct Flags {
  moe::agent::AgentOptions opts;
  std::string token_file, address_file, metrics;
  moe::rpc::TlsFlags tls;
  int64_t hb_timeout_ms = 0, rebalance_timeout_ms = 0;
  double agent_grace_s = 30;

  void add(CLI::App& app) {
    opts.name = host_name();
    hb_timeout_ms = opts.heartbeat_timeout.count();
    rebalance_timeout_ms = opts.rebalance.timeout.count();
    app.add_option("--listen", opts.listen, "HOST:PORT to serve on (port 0: ephemeral)")->capture_default_str();
    app.add_option("--token-file", token_file, "file holding the cluster token")->check(CLI::ExistingFile);
    tls.add(app, true);
    app.add_option("--address-file", address_file, "write the bound HOST:PORT here once serving");
    app.add_option("--heartbeat-timeout-ms", hb_timeout_ms, "a node silent this long is dead")->capture_default_str();
    app.add_option("--metrics-port", metrics, "Prometheus metrics: PORT (loopback only) or HOST:PORT (0.0.0.0:PORT for a remote scraper); default off");
    app.add_option("--prometheus-sd-file", opts.prometheus_sd_file,
                   "keep a Prometheus file_sd file of every process's metrics address here (default none)");
    app.add_option("--name", opts.name, "the agent's node label in the file_sd file (default: host name)");
    add_placement(app);
    add_state(app);
  }

  void add_placement(CLI::App& app) {
    app.add_option("--load-window", opts.load_window, "steps of measured load kept per shape and layer")
        ->check(moe::integer_in(1, 100000))
        ->capture_default_str();
    app.add_option("--rebalance-timeout-ms", rebalance_timeout_ms,
                   "a live rebalance whose copies are not all READY by then aborts")
        ->check(moe::integer_in(1, 3600000))
        ->capture_default_str();
    app.add_option("--rebalance-every", opts.rebalance_every,
                   "auto-rebalance at most once every N steps of a job (0: off)")
        ->check(moe::integer_at_least(0))
        ->capture_default_str();
    app.add_option("--balancedness-threshold", opts.balancedness_threshold,
                   "auto-rebalance when the window's balancedness is below this")
        ->check(moe::number_in(0, 1))
        ->capture_default_str();
    app.add_option("--redundant-experts", opts.redundant_experts,
                   "redundant slots of an auto-rebalance (default: the shape's current count)")
        ->check(moe::integer_in(0, 1 << 20));
  }

  void add_state(CLI::App& app) {
    app.add_option("--state-dir", opts.state_dir,
                   "keep membership, the bound address, the maps and the job history here and read them back on "
                   "start (default: none)");
    app.add_flag("--forget-nodes", opts.forget_nodes,
                 "with --state-dir: keep the job history and maps but no nodes (a new cluster)");
    app.add_option("--agent-grace", agent_grace_s,
                   "seconds the daemons hold a job's reports while the agent is away (their --agent-grace): a job "
                   "restored as running fails when no rank reports within this plus the heartbeat timeout")
        ->check(moe::number_in(0, 86400))
        ->capture_default_str();
  }

  // Converts what needs converting; reads the token.
  moe::agent::AgentOptions resolve() {
    if (!token_file.empty()) opts.token = moe::rpc::read_token_file(token_file);
    opts.tls = tls.for_server("moe-agent");
    opts.heartbeat_timeout = std::chrono::milliseconds(hb_timeout_ms);
    opts.rebalance.timeout = std::chrono::milliseconds(rebalance_timeout_ms);
    opts.scheduler.heartbeat_interval = opts.heartbeat_interval;
    opts.scheduler.restored_job_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(agent_grace_s * 1000)) + opts.heartbeat_timeout;
    return opts;
  }
};

int main(int argc, char** argv) {
  using namespace moe;
  CLI::App app{"moe-agent: the moed cluster coordinator"};
  app.set_version_flag("--version", moe::version_line("moe-agent"));
  Flags f;
  f.add(app);
  bool check_flags = false;
  app.add_flag("--check-flags", check_flags, "check the flags and the files they name, print the problem, exit 0 or 2");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (check_flags) {  // moectl cluster up asks this before it starts anything
    try {
      f.resolve();
      return 0;
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";
      return 2;
    }
  }
  log::init("moe-agent", "agent");
  try {
    rpc::asio::io_context io;
    agent::Agent agent(io, f.resolve());
    std::unique_ptr<agent::MetricsExposer> exposer;
    if (!f.metrics.empty()) {
      exposer = std::make_unique<agent::MetricsExposer>(io, agent, f.metrics);
      agent.set_metrics_address(exposer->address());
      log::info("metrics on ", exposer->address());
    }
    // Signals first: whoever reads the address file may stop us at once.
    rpc::asio::signal_set signals(io, SIGTERM, SIGINT);
    signals.async_wait([&](const boost::system::error_code&, int sig) {
      log::info("signal ", sig, ": stopping");
      agent.stop();
      io.stop();
    });
    if (!f.address_file.empty()) write_file_atomically(f.address_file, agent.address() + "\n");
    io.run();
    log::info("stopped");
    return 0;
  } catch (const agent::StateFileError& e) {
    log::error(e.what());  // the operator must look at the file: a usage error, not a crash
    return 2;
  } catch (const InvalidArgument& e) {  // a flag, or a file a flag names
    log::error(e.what());
    return 2;
  } catch (const std::exception& e) {
    log::error(e.what());
    return 1;
  }
}
