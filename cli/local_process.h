// The processes of a local cluster (docs/cli.md#local-clusters): its state
// directory's layout, and starting, finding and stopping the agent and the
// daemons as background processes of their own session.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <ostream>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "agent_call.h"
#include "moe/rpc/client.h"

namespace moe::ctl {

namespace fs = std::filesystem;

// The state directory of a local cluster.
struct StateDir {
  fs::path dir;
  fs::path pids() const { return dir / "pids"; }
  fs::path logs() const { return dir / "logs"; }
  fs::path token() const { return dir / "token"; }
  fs::path agent_address() const { return dir / "agent_address"; }
  fs::path scrape_targets() const { return dir / "prometheus" / "targets.json"; }
  fs::path agent_state() const { return dir / "agent"; }
  // The agent's command line, one argument a line: `cluster restart-agent` runs
  // it again on its state (without --forget-nodes).
  fs::path agent_argv() const { return dir / "agent.argv"; }
  // A daemon's command line and environment (NAME=VALUE lines, then its
  // arguments after a "--" line): `node restart NAME` runs it again.
  fs::path node_argv(const std::string& name) const { return dir / "nodes" / (name + ".argv"); }
  fs::path node_log(const std::string& name) const { return logs() / (name + ".log"); }
  fs::path node_pid(const std::string& name) const { return pids() / (name + ".pid"); }
  fs::path tls() const { return dir / "tls"; }
};


// A command line and the environment it runs with.
struct Command {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
};
// As StateDir::node_argv describes; read_command throws moe::Error naming the file.
void write_command(const fs::path& file, const Command& c);
Command read_command(const fs::path& file);

// Starting a process stops with this exit code and message.
struct UpFailure {
  int code;
  std::string message;
};
// The last non-empty lines of a log, joined with "; " (at most `n`).
std::string last_lines(const fs::path& log, size_t n);
// A child that stopped before it was ready: its own reason (its last ERROR
// line, else the log's last lines), and exit code 2 when it exited 2 (it
// refused its configuration), else 3.
UpFailure exited(const std::string& who, pid_t pid, const fs::path& log);
// Polls the agent until node `name` is registered and alive (with another
// control address than `before`, the one a restarted daemon had: the agent may
// not have noticed the old one's death yet); throws UpFailure when the daemon
// (pid) exits first, or at `until`.
void wait_registered(rpc::RpcClient& agent, const std::string& name, pid_t pid, const fs::path& log,
                     std::chrono::steady_clock::time_point until, const std::string& before = "");
// Node `name`'s control address as the agent has it ("" when unknown).
std::string control_address(rpc::RpcClient& agent, const std::string& name);

// Spawns the agent with argv (pid file agent.pid, log agent.log) and waits for
// its address file; returns its address. Throws UpFailure when it exits first,
// or at `until`.
std::string run_agent(const StateDir& s, const std::vector<std::string>& argv, std::chrono::steady_clock::time_point until);

// Runs a local-cluster command: fn()'s exit code, or its failure mapped to one
// (an UpFailure's own, an RPC error's, else 2) with "moectl: WHAT: message".
template <typename Fn>
int run_local(const char* what, std::ostream& err, Fn&& fn) {
  try {
    return fn();
  } catch (const UpFailure& f) {
    err << "moectl: " << what << ": " << f.message << "\n";
    return f.code;
  } catch (const rpc::RpcError& e) {
    err << "moectl: " << what << ": " << e.what() << "\n";
    return exit_code_of(e);
  } catch (const std::exception& e) {
    err << "moectl: " << what << ": " << e.what() << "\n";
    return kExitUsage;
  }
}

// moe-agent and moed next to moectl (installed), in the build tree, or on PATH.
std::string find_binary(const std::string& name, const std::string& build_subdir);
// Starts a background process in its own session, output appended to log, with
// `env` (NAME, VALUE) set on top of ours.
pid_t spawn(const std::vector<std::string>& argv, const fs::path& log,
            const std::vector<std::pair<std::string, std::string>>& env = {});
// Running, and not a zombie waiting for a parent (ours exited long ago) to reap it.
bool alive(pid_t pid);
// The pid in a pid file; -1 when there is none.
pid_t read_pid(const fs::path& p);
// Stops the processes of these pid files: SIGTERM, then SIGKILL after the grace;
// removes the files. Returns how many of them were running.
size_t stop_pids(const std::vector<fs::path>& files, std::chrono::milliseconds grace);

}  // namespace moe::ctl
