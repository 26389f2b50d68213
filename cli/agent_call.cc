#include "agent_call.h"

#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moe/rpc/local_access.h"

namespace moe::ctl {

namespace fs = std::filesystem;
using rpc::RpcError;

namespace {

constexpr const char* kDefaultAgent = "127.0.0.1:7400";

}  // namespace

std::string read_trimmed(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

int exit_code_of(const RpcError& e) {
  switch (e.code()) {
    case v1::ERROR_CODE_UNAVAILABLE:
    case v1::ERROR_CODE_DEADLINE_EXCEEDED:
      return kExitUnreachable;
    case v1::ERROR_CODE_INTERNAL:
      return kExitJobFailed;
    default:
      return kExitUsage;
  }
}

rpc::RpcClient client(const Resolved& r) {
  if (!r.tls.enabled() && !r.plaintext_ok && !r.token.empty())
    throw InvalidArgument("no TLS files for the agent at " + r.agent +
                          ": give --tls-ca, --tls-cert and --tls-key (moectl tls create makes them), or --plaintext "
                          "for an agent started with --plaintext (the token then goes in clear)");
  return rpc::RpcClient(rpc::ClientOptions::make(r.agent, r.token, "moectl", "moectl", r.tls));
}

std::string unreachable_reason(const Globals& g) {
  if (!g.agent.empty()) return "";  // --agent / MOE_AGENT: the plain error names it
  const Resolved r = resolve(g);
  const fs::path dir = r.state_dir;
  if (!fs::exists(dir / "agent_address"))
    return "no cluster is up in " + dir.string() + " (moectl cluster up; or --agent HOST:PORT for another cluster)";
  const std::string pid = read_trimmed((dir / "pids" / "agent.pid").string());
  if (!pid.empty() && ::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0)
    return "the agent of the cluster in " + dir.string() + " is not running (moectl logs agent; moectl cluster "
           "restart-agent, or cluster down)";
  return "";
}

Resolved resolve(const Globals& g) {
  Resolved r;
  r.state_dir = !g.state_dir.empty() ? g.state_dir : rpc::default_state_dir();
  const rpc::LocalAccess local = rpc::local_access(r.state_dir);
  // The state directory's token and certificates belong to its own cluster: they
  // go with its agent (no --agent, or that address), never with whatever other
  // agent --agent names, and not at all once that cluster is down (no
  // agent_address): a stale token is of no use to the default address.
  const bool own_cluster = g.agent.empty() || g.agent == local.agent;
  r.agent = !g.agent.empty() ? g.agent : !local.agent.empty() ? local.agent : kDefaultAgent;
  r.token = !g.token_file.empty()              ? rpc::read_token_file(g.token_file)
            : own_cluster && !local.agent.empty() ? local.token
                                                  : "";
  if (g.plaintext && g.tls.enabled()) throw InvalidArgument("give --plaintext or the --tls-* files, not both");
  if (!g.plaintext) r.tls = g.tls.enabled() ? g.tls : own_cluster ? local.tls : rpc::TlsFiles{};
  // No silent plaintext: the token goes in clear only to an agent the user said
  // speaks it (--plaintext) or to the state directory's own plaintext cluster
  // (`cluster up --plaintext` leaves no tls/ there).
  r.plaintext_ok = g.plaintext || (own_cluster && !local.agent.empty() && !local.tls.enabled());
  return r;
}

}  // namespace moe::ctl
