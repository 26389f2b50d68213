// moectl: the command line of a moed cluster (DESIGN 9). Thin main: flags into
// the calls of ctl.h, whose return value is the exit code.
#include <CLI/CLI.hpp>

#include <iostream>

#include "moe/ctl/ctl.h"
#include "moe/ctl/job_flags.h"

int main(int argc, char** argv) {
  using namespace moe;
  CLI::App app{"moectl: run and inspect a moed cluster"};
  app.require_subcommand(1);
  ctl::Globals g;
  std::string output = "table";
  app.add_option("--agent", g.agent, "HOST:PORT of moe-agent")->envname("MOE_AGENT");
  app.add_option("--token-file", g.token_file, "cluster token file")->envname("MOE_TOKEN_FILE");
  app.add_option("--state-dir", g.state_dir, "local cluster state")->envname("MOE_STATE_DIR");
  app.add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));

  CLI::App* cluster = app.add_subcommand("cluster", "a local cluster on loopback")->require_subcommand(1);
  ctl::ClusterUpOptions up;
  CLI::App* cup = cluster->add_subcommand("up", "start an agent and daemons in the background");
  cup->add_option("--nodes", up.nodes, "daemons to start")->check(CLI::Range(1, 64))->capture_default_str();
  cup->add_option("--devices-per-node", up.devices_per_node, "EP ranks per daemon")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cup->add_option("--backend", up.backend, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  CLI::App* cdown = cluster->add_subcommand("down", "stop the local cluster");
  CLI::App* cstatus = cluster->add_subcommand("status", "nodes, ranks and metrics addresses");

  CLI::App* job = app.add_subcommand("job", "jobs")->require_subcommand(1);
  ctl::JobFlags jf;
  bool wait = false;
  CLI::App* jsubmit = job->add_subcommand("submit", "submit a job (flags are JobSpec fields in kebab-case)");
  try {
    jf.add(jsubmit);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return ctl::kExitUsage;
  }
  jsubmit->add_flag("--wait", wait, "wait for the result (exit 1 if it fails)");
  std::string job_id;
  CLI::App* jstatus = job->add_subcommand("status", "a job's record");
  jstatus->add_option("id", job_id)->required();
  CLI::App* jwait = job->add_subcommand("wait", "wait for a job to end");
  jwait->add_option("id", job_id)->required();
  CLI::App* jlist = job->add_subcommand("list", "all jobs");
  CLI::App* jcancel = job->add_subcommand("cancel", "cancel a queued or running job");
  jcancel->add_option("id", job_id)->required();

  CLI::App* placement = app.add_subcommand("placement", "expert placement")->require_subcommand(1);
  CLI::App* pshow = placement->add_subcommand("show", "the map in force");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : ctl::kExitUsage;
  }
  g.json = output == "json";
  std::ostream& out = std::cout;
  std::ostream& err = std::cerr;
  if (*cup) return ctl::cluster_up(g, up, out, err);
  if (*cdown) return ctl::cluster_down(g, out, err);
  if (*cstatus) return ctl::cluster_status(g, out, err);
  if (*jsubmit) {
    v1::JobSpec spec;
    try {
      spec = jf.build();
    } catch (const std::exception& e) {
      err << "moectl: invalid spec: " << e.what() << "\n";
      return ctl::kExitUsage;
    }
    return ctl::job_submit(g, spec, wait, out, err);
  }
  if (*jstatus) return ctl::job_status(g, job_id, out, err);
  if (*jwait) return ctl::job_wait(g, job_id, out, err);
  if (*jlist) return ctl::job_list(g, out, err);
  if (*jcancel) return ctl::job_cancel(g, job_id, out, err);
  if (*pshow) return ctl::placement_show(g, out, err);
  return ctl::kExitUsage;
}
