// moectl: the command line of a moed cluster (docs/cli.md#commands). Thin main:
// each command group registers its subcommands with the function that runs them
// (the calls of ctl.h, whose return value is the exit code).
#include <CLI/CLI.hpp>

#include <functional>
#include <iostream>
#include <memory>
#include <optional>

#include "moe/base/cli_checks.h"
#include "moe/base/version.h"
#include "completion.h"
#include "moe/ctl/ctl.h"
#include "moe/ctl/job_flags.h"
#include "moe/rpc/tls_flags.h"
#include "usage_errors.h"

namespace {

using namespace moe;

// Subcommands and what each runs once parsed.
struct Commands {
  ctl::Globals g;
  std::vector<std::pair<CLI::App*, std::function<int()>>> run;
  void add(CLI::App* cmd, std::function<int()> fn) { run.emplace_back(cmd, std::move(fn)); }
};

void add_cluster(CLI::App& app, Commands& c) {
  CLI::App* cluster = app.add_subcommand("cluster", "a local cluster on loopback")->require_subcommand(1);
  auto up = std::make_shared<ctl::ClusterUpOptions>();
  CLI::App* cup = cluster->add_subcommand("up", "start an agent and daemons in the background");
  cup->add_option("--nodes", up->nodes, "daemons to start")->check(moe::integer_in(1, 64))->capture_default_str();
  cup->add_option("--devices-per-node", up->devices_per_node, "EP ranks per daemon")
      ->check(moe::integer_in(1, 64))
      ->capture_default_str();
  cup->add_option("--backend", up->backend, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cup->add_option("--agent-grace", up->agent_grace,
                  "seconds a job runs on while the agent is away (moed and moe-agent --agent-grace)")
      ->check(moe::number_in(0, 86400))
      ->capture_default_str();
  cup->add_option("--stop-grace", up->stop_grace,
                  "seconds a stopping daemon waits for its job's step boundary (moed --stop-grace)")
      ->check(moe::number_in(0, 3600))
      ->capture_default_str();
  cup->add_flag("--plaintext", up->plaintext,
                "plain TCP, no TLS (default: a CA and certificates in the state directory's tls/)");
  // moe-agent's placement flags, passed through when given.
  auto agent_flags = std::make_shared<std::vector<std::pair<std::string, std::string>>>();
  agent_flags->reserve(8);  // CLI11 keeps references to the values: no reallocation
  for (const auto& [flag, help] : std::vector<std::pair<std::string, std::string>>{
           {"--load-window", "steps of measured load the agent keeps (default 32)"},
           {"--rebalance-timeout-ms", "a live rebalance not READY by then aborts (default 60000)"},
           {"--rebalance-every", "auto-rebalance at most once every N steps of a job (default 0: off)"},
           {"--balancedness-threshold", "auto-rebalance below this balancedness (default 0.9)"},
           {"--redundant-experts", "redundant slots of an auto-rebalance (default: the shape's count)"}}) {
    agent_flags->emplace_back(flag, "");
    cup->add_option(flag, agent_flags->back().second, help);
  }
  c.add(cup, [&c, up, agent_flags] {
    up->plaintext = up->plaintext || c.g.plaintext;  // the global flag before the verb means the same
    for (const auto& [flag, value] : *agent_flags)
      if (!value.empty()) up->agent_args.insert(up->agent_args.end(), {flag, value});
    return ctl::cluster_up(c.g, *up, std::cout, std::cerr);
  });
  c.add(cluster->add_subcommand("down", "stop the local cluster"),
        [&c] { return ctl::cluster_down(c.g, std::cout, std::cerr); });
  c.add(cluster->add_subcommand("status", "nodes, ranks and metrics addresses"),
        [&c] { return ctl::cluster_status(c.g, std::cout, std::cerr); });
  c.add(cluster->add_subcommand("restart-agent", "restart the local cluster's agent on its state"),
        [&c] { return ctl::agent_restart(c.g, std::cout, std::cerr); });
}

void add_node(CLI::App& app, Commands& c) {
  CLI::App* node = app.add_subcommand("node", "a node of a local cluster")->require_subcommand(1);
  auto name = std::make_shared<std::string>();
  CLI::App* restart = node->add_subcommand("restart", "restart a node's daemon (dead, stopped or alive) and wait until it registered");
  restart->add_option("NAME", *name, "node0, node1, ...")->required();
  c.add(restart, [&c, name] { return ctl::node_restart(c.g, *name, std::cout, std::cerr); });
}

void add_completion(CLI::App& app, Commands& c) {
  CLI::App* completion = app.add_subcommand("completion", "print a shell completion script")->require_subcommand(1);
  c.add(completion->add_subcommand("bash", "bash: moectl completion bash > /etc/bash_completion.d/moectl"), [&app] {
    std::cout << moe::ctl::bash_completion(app, "moectl");
    return ctl::kExitOk;
  });
}

void add_logs(CLI::App& app, Commands& c) {
  auto o = std::make_shared<ctl::LogsOptions>();
  CLI::App* logs = app.add_subcommand("logs", "a local cluster's process log: agent or a node's name");
  logs->add_option("NAME", o->name, "agent, node0, node1, ...")->required();
  logs->add_flag("-f,--follow", o->follow, "keep printing what is appended (Ctrl-C stops)");
  logs->add_option("--tail", o->tail, "only the last N lines")->check(moe::integer_at_least(0));
  c.add(logs, [&c, o] { return ctl::logs(c.g, *o, std::cout, std::cerr); });
}

void add_timeout(CLI::App* cmd, std::optional<double>& timeout) {
  cmd->add_option("--timeout", timeout, "seconds to wait; then exit 4 (the job keeps running)")
      ->check(moe::number_above(0));
}

void add_job(CLI::App& app, Commands& c) {
  CLI::App* job = app.add_subcommand("job", "jobs")->require_subcommand(1);
  auto flags = std::make_shared<ctl::JobFlags>();
  auto wait = std::make_shared<ctl::WaitOptions>();
  CLI::App* submit = job->add_subcommand("submit", "submit a job (flags are JobSpec fields in kebab-case)");
  flags->add(submit);
  submit->add_flag("--wait", wait->wait, "wait for the result (exit 1 if it fails); Ctrl-C stops waiting only");
  add_timeout(submit, wait->timeout_s);
  c.add(submit, [&c, flags, wait] {
    v1::JobSpec spec;
    try {
      spec = flags->build();
    } catch (const std::exception& e) {
      std::cerr << "moectl: invalid spec: " << e.what() << "\n";
      return ctl::kExitUsage;
    }
    return ctl::job_submit(c.g, spec, *wait, std::cout, std::cerr);
  });
  auto id = std::make_shared<std::string>();
  auto watch = std::make_shared<bool>(false);
  CLI::App* status = job->add_subcommand("status", "a job's record: progress while it runs, the result after");
  status->add_option("id", *id)->required();
  status->add_flag("-w,--watch", *watch, "a line per step until the job ends, then the record");
  c.add(status, [&c, id, watch] { return ctl::job_status(c.g, *id, *watch, std::cout, std::cerr); });
  CLI::App* wait_cmd = job->add_subcommand("wait", "wait for a job to end, print its result");
  wait_cmd->add_option("id", *id)->required();
  add_timeout(wait_cmd, wait->timeout_s);
  c.add(wait_cmd, [&c, id, wait] { return ctl::job_wait(c.g, *id, *wait, std::cout, std::cerr); });
  CLI::App* cancel = job->add_subcommand("cancel", "cancel a queued or running job");
  cancel->add_option("id", *id)->required();
  c.add(cancel, [&c, id] { return ctl::job_cancel(c.g, *id, std::cout, std::cerr); });
  auto list = std::make_shared<ctl::ListOptions>();
  CLI::App* ls = job->add_subcommand("list", "every job, in submit order");
  ls->add_option("--state", list->states, "only these states: queued,running,succeeded,failed,cancelled");
  ls->add_option("-l,--selector", list->selector, "only jobs with this label, KEY=VALUE (repeatable)");
  c.add(ls, [&c, list] { return ctl::job_list(c.g, *list, std::cout, std::cerr); });
}

// --shape and --layer of a placement command.
void add_target(CLI::App* cmd, ctl::PlacementTarget& t, bool layer) {
  cmd->add_option("--shape", t.shape, "EXPERTSxLAYERS@NODESxDEVICES, e.g. 64x2@2x2 (default: the last job's)");
  if (layer) cmd->add_option("--layer", t.layer, "only this layer");
}

void add_checkpoint(CLI::App& app, Commands& c) {
  CLI::App* ck = app.add_subcommand("checkpoint", "training checkpoints")->require_subcommand(1);
  CLI::App* show = ck->add_subcommand("show", "step, spec, maps and bytes per rank of a checkpoint");
  auto dir = std::make_shared<std::string>();
  show->add_option("DIR", *dir, "a step folder, or a checkpoint_dir (its latest complete step)")->required();
  c.add(show, [&c, dir] { return ctl::checkpoint_show(c.g, *dir, std::cout, std::cerr); });
}

void add_placement(CLI::App& app, Commands& c) {
  CLI::App* placement = app.add_subcommand("placement", "expert placement")->require_subcommand(1);
  auto t = std::make_shared<ctl::PlacementTarget>();
  auto file = std::make_shared<std::string>();
  CLI::App* show = placement->add_subcommand("show", "per layer: epoch, balancedness, rank and expert loads, the map");
  add_target(show, *t, true);
  c.add(show, [&c, t] { return ctl::placement_show(c.g, *t, std::cout, std::cerr); });
  CLI::App* exp = placement->add_subcommand("export", "write the maps as EPLB's phy2log/log2phy/logcnt JSON");
  exp->add_option("file", *file)->required();
  add_target(exp, *t, false);
  c.add(exp, [&c, t, file] { return ctl::placement_export(c.g, *t, *file, std::cout, std::cerr); });
  CLI::App* imp = placement->add_subcommand("import", "install maps from an export file as a new epoch");
  imp->add_option("file", *file)->required()->check(CLI::ExistingFile);
  c.add(imp, [&c, file] { return ctl::placement_import(c.g, *file, std::cout, std::cerr); });
  CLI::App* loads = placement->add_subcommand("loads", "write the load window as a moe-placement-sim --loads file");
  loads->add_option("file", *file)->required();
  add_target(loads, *t, false);
  c.add(loads, [&c, t, file] { return ctl::placement_loads(c.g, *t, *file, std::cout, std::cerr); });
  auto reset_target = std::make_shared<ctl::PlacementTarget>();
  CLI::App* reset = placement->add_subcommand("reset", "forget a shape's maps and load: its next job starts afresh");
  add_target(reset, *reset_target, false);
  c.add(reset, [&c, reset_target] { return ctl::placement_reset(c.g, *reset_target, std::cout, std::cerr); });
  auto r = std::make_shared<ctl::RebalanceOptions>();
  CLI::App* reb = placement->add_subcommand("rebalance", "new maps from the measured load, applied live");
  reb->add_option("--redundant-experts", r->redundant_experts,
                  "redundant slots (default: the shape's current count); experts + N must divide over the ranks")
      ->check(moe::integer_in(0, 1 << 20));
  reb->add_flag("--dry-run", r->dry_run, "print the new maps, the predicted balancedness and the copies only");
  add_target(reb, r->target, true);
  c.add(reb, [&c, r] { return ctl::placement_rebalance(c.g, *r, std::cout, std::cerr); });
}

void add_tls(CLI::App& app, Commands& c) {
  CLI::App* tls = app.add_subcommand("tls", "certificates for the control plane's TLS")->require_subcommand(1);
  auto o = std::make_shared<ctl::TlsCreateOptions>();
  CLI::App* create = tls->add_subcommand("create", "a CA in DIR (made once) and a certificate and key per --name");
  create->add_option("dir", o->dir, "folder of ca.pem, ca.key, NAME.pem, NAME.key")->required();
  create->add_option("--name", o->names, "who the certificate is for: agent, node0, moectl, ... (repeatable)")->required();
  create->add_option("--host", o->hosts, "host name or IP address the certificate names (repeatable; servers need it)");
  create->add_option("--days", o->days, "validity")->capture_default_str();
  c.add(create, [o] { return ctl::tls_create(*o, std::cout, std::cerr); });
}

void add_top(CLI::App& app, Commands& c) {
  auto o = std::make_shared<ctl::TopOptions>();
  CLI::App* top = app.add_subcommand("top", "live load: per layer expert heat, rank bars, balancedness; q quits");
  top->add_flag("--once", o->once, "print one frame and exit");
  top->add_option("--layer", o->layer, "only this layer");
  c.add(top, [&c, o] { return ctl::top(c.g, *o, std::cout, std::cerr); });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moectl: run and inspect a moed cluster"};
  app.set_version_flag("--version", moe::version_line("moectl"));
  app.require_subcommand(1);
  app.fallthrough();  // global options anywhere on the line (subcommands inherit it)
  Commands c;
  std::string output = "table";
  app.add_option("--agent", c.g.agent, "HOST:PORT of moe-agent")->envname("MOE_AGENT");
  app.add_option("--token-file", c.g.token_file, "cluster token file")->envname("MOE_TOKEN_FILE");
  app.add_option("--state-dir", c.g.state_dir, "local cluster state")->envname("MOE_STATE_DIR");
  app.add_option("-o,--output", output, "table or json (anywhere on the line)")->check(CLI::IsMember({"table", "json"}));
  moe::rpc::TlsFlags tls;
  tls.add(app, false);
  app.add_flag("--plaintext", c.g.plaintext, "plain TCP to the agent, no TLS (an agent started with --plaintext)");
  try {
    add_cluster(app, c);
    add_node(app, c);
    add_logs(app, c);
    add_completion(app, c);
    add_job(app, c);
    add_placement(app, c);
    add_checkpoint(app, c);
    add_top(app, c);
    add_tls(app, c);
    app.parse(argc, argv);
    c.g.tls = tls.files;
    if (c.g.plaintext && c.g.tls.enabled()) throw moe::InvalidArgument("give --plaintext or the --tls-* files, not both");
    c.g.tls.check();
  } catch (const CLI::ParseError& e) {
    return ctl::report_parse_error(app, e, std::vector<std::string>(argv + 1, argv + argc), std::cerr);
  } catch (const std::exception& e) {
    std::cerr << "moectl: " << e.what() << "\n";
    return ctl::kExitUsage;
  }
  c.g.json = output == "json";
  for (const auto& [cmd, fn] : c.run)
    if (*cmd) return fn();
  return ctl::kExitUsage;
}
