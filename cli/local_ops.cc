// Operating a local cluster's processes (docs/cli.md#local-clusters): restart one
// node or the agent from the command lines `cluster up` recorded, and read or
// follow their logs.
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <iostream>
#include <thread>

#include "agent_call.h"
#include "local_process.h"
#include "moe/base/check.h"
#include "moe/base/file.h"

namespace moe::ctl {
namespace {

using Clock = std::chrono::steady_clock;

// The names `logs` knows: the agent and every node cluster up started.
std::vector<std::string> process_names(const StateDir& s) {
  std::vector<std::string> out = {"agent"};
  if (fs::exists(s.dir / "nodes"))
    for (const auto& f : fs::directory_iterator(s.dir / "nodes"))
      if (f.path().extension() == ".argv") out.push_back(f.path().stem().string());
  std::sort(out.begin() + 1, out.end());
  return out;
}

// "agent, node0, node1" (or the nodes only): the names, for a message.
std::string names_text(const StateDir& s, bool with_agent = true) {
  std::string out;
  for (const std::string& n : process_names(s))
    if (with_agent || n != "agent") out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

int node_restart(const Globals& g, const std::string& name, std::ostream& out, std::ostream& err) {
  return run_local("node restart", err, [&] {
    const Resolved r = resolve(g);
    const StateDir s{r.state_dir};
    if (!fs::exists(s.node_argv(name))) {
      err << "moectl: no node '" << name << "' in " << s.dir.string() << " (its nodes: " << names_text(s, false)
          << (name == "agent" ? "; the agent restarts with moectl cluster restart-agent" : "") << ")\n";
      return kExitUsage;
    }
    const Command cmd = read_command(s.node_argv(name));
    auto agent = client(r);
    const std::string before = control_address(agent, name);
    stop_pids({s.node_pid(name)}, std::chrono::seconds(10));  // a stopped or hung daemon; none if it is dead
    const pid_t pid = spawn(cmd.argv, s.node_log(name), cmd.env);
    write_file_atomically(s.node_pid(name).string(), std::to_string(pid) + "\n");
    wait_registered(agent, name, pid, s.node_log(name), Clock::now() + std::chrono::seconds(60), before);
    if (!g.json) out << "node " << name << " restarted (pid " << pid << ") and registered\n";
    return kExitOk;
  });
}

int agent_restart(const Globals& g, std::ostream& out, std::ostream& err) {
  return run_local("cluster restart-agent", err, [&] {
    const Resolved r = resolve(g);
    const StateDir s{r.state_dir};
    if (!fs::exists(s.agent_argv())) {
      err << "moectl: no cluster was started in " << s.dir.string() << " (moectl cluster up)\n";
      return kExitUsage;
    }
    std::vector<std::string> argv;
    std::istringstream in(read_file(s.agent_argv().string()));
    for (std::string line; std::getline(in, line);) argv.push_back(line);
    stop_pids({s.pids() / "agent.pid"}, std::chrono::seconds(10));
    fs::remove(s.agent_address());
    const std::string address = run_agent(s, argv, Clock::now() + std::chrono::seconds(30));
    if (!g.json) out << "agent restarted on " << address << "\n";
    return kExitOk;
  });
}

int logs(const Globals& g, const LogsOptions& o, std::ostream& out, std::ostream& err) {
  const Resolved r = resolve(g);
  const StateDir s{r.state_dir};
  const fs::path file = o.name == "agent" ? s.logs() / "agent.log" : s.node_log(o.name);
  if (!fs::exists(file)) {
    err << "moectl: no log of '" << o.name << "' in " << s.logs().string()
        << (process_names(s).size() > 1 ? " (its processes: " + names_text(s) + ")"
                                        : " (logs are kept for clusters moectl cluster up started; under systemd: "
                                          "journalctl -u moed)")
        << "\n";
    return kExitUsage;
  }
  std::ifstream in(file);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(std::move(line));
    if (o.tail > 0 && static_cast<int>(lines.size()) > o.tail) lines.erase(lines.begin());
  }
  for (const std::string& l : lines) out << l << "\n";
  out.flush();
  if (!o.follow) return kExitOk;
  // -f: what is appended, until SIGINT/SIGTERM (the default action ends us).
  in.clear();
  for (;;) {
    std::string line;
    while (std::getline(in, line)) out << line << "\n";
    out.flush();
    in.clear();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // polling a file another process appends to
  }
}

}  // namespace moe::ctl
