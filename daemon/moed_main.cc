// moed: the node daemon. Thin main: flags, signals, the Daemon.
#include <CLI/CLI.hpp>
#include <malloc.h>

#include <memory>

#include "moe/base/cli_checks.h"
#include "moe/base/version.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/node/daemon.h"
#include "moe/base/log.h"
#include "moe/rpc/tls_flags.h"

int main(int argc, char** argv) {
  using namespace moe;
  // Buffers of a few hundred kB come and go with every step and every served call:
  // glibc would map and trim them each time, and the page faults of refilling them
  // cost a served 512 kB call 2.4 ms here (docs/benchmarks.md#serving). Keep them.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  CLI::App app{"moed: the moed node daemon"};
  app.set_version_flag("--version", [] { return moe::version_line("moed") + "\n" + moe::kernels::cpu_backend_summary(); });
  node::DaemonOptions o;
  std::string token_file;
  rpc::TlsFlags tls;
  tls.add(app, true);
  app.add_option("--agent", o.agent, "HOST:PORT of moe-agent")->required()->envname("MOE_AGENT");
  app.add_option("--devices", o.devices, "devices (EP ranks) on this node; 0: one per GPU with the CUDA backend, 1 on CPU")
      ->check(moe::integer_in(0, 1024));
  app.add_option("--backend", o.backend, "auto, cpu or cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--metrics-port", o.metrics, "Prometheus metrics: PORT (loopback only) or HOST:PORT (0.0.0.0:PORT for a remote scraper; port 0: any free one)");
  app.add_option("--token-file", token_file, "file holding the cluster token")->check(CLI::ExistingFile);
  app.add_option("--listen", o.listen, "HOST:PORT for the agent's calls (port 0: ephemeral)");
  app.add_option("--name", o.name, "node name, stable across restarts (default: host:port)");
  app.add_option("--threads", o.threads, "cores this daemon uses (0: all)");
  double agent_grace_s = 30;
  app.add_option("--agent-grace", agent_grace_s,
                 "seconds a job runs on, its reports held, while the agent cannot be reached; then it stops")
      ->check(moe::number_in(0, 86400))
      ->capture_default_str();
  double stop_grace_s = 5;
  app.add_option("--stop-grace", stop_grace_s,
                 "seconds a stopping daemon waits for its job to reach a step boundary; then it aborts the "
                 "job's transfers")
      ->check(moe::number_in(0, 3600))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  log::init("moed", o.name.empty() ? "starting" : o.name);
  try {
    if (!token_file.empty()) o.token = rpc::read_token_file(token_file);
    o.tls = tls.for_server("moed");
    o.agent_grace = std::chrono::milliseconds(static_cast<int64_t>(agent_grace_s * 1000));
    o.stop_grace = std::chrono::milliseconds(static_cast<int64_t>(stop_grace_s * 1000));
    rpc::asio::io_context io;
    // Signals first: once the daemon registers, whoever sees it may stop it at
    // once (the handler runs inside io.run(), after the daemon exists).
    rpc::asio::signal_set signals(io, SIGTERM, SIGINT);
    std::unique_ptr<node::Daemon> daemon;
    signals.async_wait([&](const boost::system::error_code&, int sig) {
      log::info("signal ", sig, ": stopping");
      if (daemon) daemon->stop();
      io.stop();
    });
    daemon = std::make_unique<node::Daemon>(io, o);
    io.run();
    log::info("stopped");
    return 0;
  } catch (const InvalidArgument& e) {  // a flag or what it asks of this machine
    log::error(e.what());
    return 2;
  } catch (const std::exception& e) {
    log::error(e.what());
    return 1;
  }
}
