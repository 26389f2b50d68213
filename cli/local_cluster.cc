// moectl cluster up / down: a local cluster on loopback
// (docs/control-plane.md#finding-the-cluster), the agent and one moed per node as
// background processes of their own session, with their logs, pids, token and the
// agent's address in the state directory.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>
#include <thread>

#include "agent_call.h"
#include "local_process.h"
#include "moe/base/file.h"
#include "moe/base/random.h"
#include "moe/rpc/certs.h"

namespace moe::ctl {

namespace fs = std::filesystem;
using rpc::RpcError;
using Clock = std::chrono::steady_clock;

namespace {

std::string random_token() {
  std::ostringstream os;
  for (unsigned char c : random_bytes(24)) os << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(c);
  return os.str();
}

// The local cluster's TLS: a CA kept in <state-dir>/tls (made once), and fresh
// certificates for the agent, the daemons and moectl naming this machine.
void make_local_certs(const StateDir& s) {
  const rpc::CertAuthority ca =
      rpc::CertAuthority::in_folder(s.tls().string(), "moed local cluster CA (" + s.dir.string() + ")", 3650);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::vector<std::string> hosts = {"127.0.0.1", "localhost", host};
  for (const char* who : {"agent", "node", "moectl"}) rpc::write_pem(s.tls().string(), who, ca.issue(who, hosts, 365));
}

// The flags that give process `who` (agent, node) its TLS, or --plaintext.
std::vector<std::string> tls_flags(const StateDir& s, const ClusterUpOptions& o, const std::string& who) {
  if (o.plaintext) return {"--plaintext"};
  return {"--tls-cert", (s.tls() / (who + ".pem")).string(), "--tls-key", (s.tls() / (who + ".key")).string(),
          "--tls-ca", (s.tls() / "ca.pem").string()};
}

void write_token(const StateDir& s, const std::string& token) {
  write_file_atomically(s.token().string(), token + "\n", 0600);  // never readable by others, not even briefly
}

// The local agent's port: free, and below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), so that while a restarted agent wants
// it back no outgoing connection and no port-0 listener of another process can
// have taken it. "0" (any port) when the range leaves no room below it.
std::string pick_agent_port() {
  int lo = 32768, hi = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> lo >> hi;
  const int first = std::max(1024, lo - 16384);
  if (lo <= first) return "0";
  std::mt19937 pick(static_cast<unsigned>(::getpid()) ^ static_cast<unsigned>(Clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int port = first + static_cast<int>(pick() % static_cast<unsigned>(lo - first));
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
    ::close(fd);
    if (free) return std::to_string(port);
  }
  return "0";
}

// Runs `moe-agent ... --check-flags` and waits for it: a flag the agent refuses
// stops cluster up (exit 2) with the agent's own words, before anything started.
void check_agent_flags(std::vector<std::string> argv, const fs::path& log) {
  argv.push_back("--check-flags");
  fs::remove(log);
  const pid_t pid = spawn(argv, log);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 0) return;
  std::string why = last_lines(log, 2);
  throw UpFailure{kExitUsage, "moe-agent refused its flags: " + (why.empty() ? "exit " + std::to_string(code) : why)};
}

// Starts the agent and waits for its address file; returns its address. The
// agent keeps its history and maps in <state-dir>/agent; a new cluster forgets
// the previous one's nodes (agent.argv restarts it without forgetting).
std::string start_agent(const StateDir& s, const ClusterUpOptions& o, Clock::time_point until) {
  fs::create_directories(s.scrape_targets().parent_path());
  std::vector<std::string> argv = {find_binary("moe-agent", "agent"), "--listen", "127.0.0.1:" + pick_agent_port(), "--token-file",
                                   s.token().string(), "--address-file", s.agent_address().string(), "--metrics-port",
                                   "127.0.0.1:0", "--prometheus-sd-file", s.scrape_targets().string(), "--state-dir",
                                   s.agent_state().string(), "--agent-grace", std::to_string(o.agent_grace)};
  const std::vector<std::string> tls = tls_flags(s, o, "agent");
  argv.insert(argv.end(), tls.begin(), tls.end());
  argv.insert(argv.end(), o.agent_args.begin(), o.agent_args.end());
  check_agent_flags(argv, s.logs() / "agent-flags.log");
  std::string lines;
  for (const std::string& a : argv) lines += a + "\n";
  write_file_atomically(s.agent_argv().string(), lines);
  argv.push_back("--forget-nodes");
  return run_agent(s, argv, until);
}


// The GPUs node i of a local cluster may use: GPUs i*D .. i*D+D-1 of this machine,
// so the daemons on one machine never share a GPU (NCCL refuses that). Nothing
// for a CPU cluster, or when CUDA_VISIBLE_DEVICES already chose for us.
std::vector<std::pair<std::string, std::string>> gpu_slice(const ClusterUpOptions& o, int i) {
  if (o.backend == "cpu" || std::getenv("CUDA_VISIBLE_DEVICES")) return {};
  std::string ids;
  for (int d = 0; d < o.devices_per_node; ++d) ids += (d ? "," : "") + std::to_string(i * o.devices_per_node + d);
  return {{"CUDA_VISIBLE_DEVICES", ids}};
}

// Starts node i's daemon and waits until it registered: one at a time, so node i
// gets node index i (and ranks i*D .. i*D+D-1).
void start_daemon(const StateDir& s, const ClusterUpOptions& o, int i, const Resolved& r, Clock::time_point until) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::string name = "node" + std::to_string(i);
  const fs::path log = s.logs() / (name + ".log");
  std::vector<std::string> argv = {find_binary("moed", "daemon"), "--agent", r.agent, "--devices",
                                   std::to_string(o.devices_per_node), "--backend", o.backend, "--token-file",
                                   s.token().string(), "--name", name, "--listen", "127.0.0.1:0", "--metrics-port",
                                   "127.0.0.1:0", "--threads", std::to_string(std::max(1, cores / o.nodes)),
                                   "--agent-grace", std::to_string(o.agent_grace), "--stop-grace",
                                   std::to_string(o.stop_grace)};
  const std::vector<std::string> tls = tls_flags(s, o, "node");
  argv.insert(argv.end(), tls.begin(), tls.end());
  const Command cmd{argv, gpu_slice(o, i)};
  write_command(s.node_argv(name), cmd);
  const pid_t pid = spawn(cmd.argv, log, cmd.env);
  write_file_atomically(s.node_pid(name).string(), std::to_string(pid) + "\n");
  auto agent = client(r);
  wait_registered(agent, name, pid, log, until);
}

}  // namespace

int cluster_up(const Globals& g, const ClusterUpOptions& o, std::ostream& out, std::ostream& err) {
  if (o.nodes < 1 || o.devices_per_node < 1) {
    err << "moectl: --nodes and --devices-per-node must be >= 1\n";
    return kExitUsage;
  }
  return run_local("cluster up", err, [&] {
    Resolved r = resolve(g);
    const StateDir s{r.state_dir};
    if (alive(fs::exists(s.pids() / "agent.pid") ? read_pid(s.pids() / "agent.pid") : -1)) {
      err << "moectl: a cluster is already up in " << s.dir.string() << " (moectl cluster down first)\n";
      return kExitUsage;
    }
    fs::create_directories(s.pids());
    fs::create_directories(s.logs());
    fs::remove(s.agent_address());
    r.token = random_token();
    write_token(s, r.token);
    if (o.plaintext) {
      fs::remove_all(s.tls());  // moectl would otherwise speak TLS to this cluster
    } else {
      make_local_certs(s);
    }
    r.tls = g.tls.enabled() ? g.tls : resolve(Globals{.state_dir = r.state_dir}).tls;
    r.plaintext_ok = o.plaintext;
    const auto until = Clock::now() + o.ready_timeout;
    r.agent = start_agent(s, o, until);
    for (int i = 0; i < o.nodes; ++i) start_daemon(s, o, i, r, until);
    if (!g.json)
      out << "cluster up: " << o.nodes << " node(s) x " << o.devices_per_node << " device(s), agent " << r.agent
          << ", state " << s.dir.string() << "\n";
    Globals gs = g;
    gs.agent = r.agent;
    gs.state_dir = r.state_dir;
    return cluster_status(gs, out, err);
  });
}

int cluster_down(const Globals& g, std::ostream& out, std::ostream& err) {
  return run_local("cluster down", err, [&] {
    const Resolved r = resolve(g);
    const fs::path dir = r.state_dir;
    // Daemons first (they stop their job at a step boundary), then the agent.
    std::vector<fs::path> daemons, agent;
    if (fs::exists(dir / "pids"))
      for (const auto& f : fs::directory_iterator(dir / "pids"))
        (f.path().filename() == "agent.pid" ? agent : daemons).push_back(f.path());
    const bool had_address = fs::remove(dir / "agent_address");
    if (daemons.empty() && agent.empty() && !had_address) {
      err << "moectl: cluster down: no cluster is up in " << dir.string() << ": nothing to stop\n";
      return kExitUnreachable;
    }
    const size_t stopped = stop_pids(daemons, std::chrono::seconds(10)) + stop_pids(agent, std::chrono::seconds(10));
    if (!g.json)
      out << "cluster down: " << dir.string() << " (stopped " << stopped << " of " << daemons.size() + agent.size()
          << " processes" << (stopped < daemons.size() + agent.size() ? "; the others had already exited" : "") << ")\n";
    return kExitOk;
  });
}

}  // namespace moe::ctl
