#include "moe/ctl/ctl.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "moe/rpc/rpc.h"
#include "moe/spec/job_spec.h"

namespace moe::ctl {

namespace fs = std::filesystem;
using rpc::RpcError;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kDefaultAgent = "127.0.0.1:7400";

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

std::string read_file_trimmed(const fs::path& p) {
  std::ifstream in(p);
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
  return rpc::RpcClient(rpc::ClientOptions::make(r.agent, r.token, "moectl", "moectl"));
}

// Runs fn(agent client) and maps errors to exit codes with a message on err.
template <typename Fn>
int with_agent(const Globals& g, std::ostream& err, Fn&& fn) {
  Resolved r;
  try {
    r = resolve(g);
    auto c = client(r);
    return fn(c, r);
  } catch (const RpcError& e) {
    err << "moectl: " << e.what() << "\n";
    return exit_code_of(e);
  } catch (const std::exception& e) {
    err << "moectl: " << e.what() << "\n";
    return kExitUsage;
  }
}

bool finished(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

std::string state_name(v1::JobState s) { return v1::JobState_Name(s).substr(10); }  // drop JOB_STATE_

std::string fmt(double v, int precision = 4) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
}

void print_rows(std::ostream& out, const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t w = 0;
  for (const auto& [k, v] : rows) w = std::max(w, k.size());
  for (const auto& [k, v] : rows) out << std::left << std::setw(static_cast<int>(w) + 2) << k << v << "\n";
}

void print_table(std::ostream& out, const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) {
      if (w.size() <= i) w.push_back(0);
      w[i] = std::max(w[i], r[i].size());
    }
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) out << std::left << std::setw(static_cast<int>(w[i]) + (i + 1 < r.size() ? 2 : 0)) << r[i];
    out << "\n";
  }
}

void print_job(std::ostream& out, const v1::JobResult& j, bool json) {
  if (json) {
    out << spec::to_json(j) << "\n";
    return;
  }
  std::vector<std::pair<std::string, std::string>> rows = {{"job", j.job_id()}, {"state", state_name(j.state())}};
  if (!j.message().empty()) rows.push_back({"message", j.message()});
  if (j.steps_completed() > 0) {
    const auto& p = j.phase_seconds();
    rows.push_back({"steps", fmt(j.steps_completed())});
    rows.push_back({"tokens/s", fmt(j.tokens_per_second(), 6)});
    rows.push_back({"step p50 (s)", fmt(j.step_seconds_p50())});
    rows.push_back({"phases (s)", "router " + fmt(p.router()) + ", dispatch " + fmt(p.dispatch()) + ", expert " +
                                      fmt(p.expert()) + ", combine " + fmt(p.combine())});
    const double ratio = j.naive_dispatch_bytes() > 0 ? j.dispatch_bytes() / j.naive_dispatch_bytes() : 0;
    rows.push_back({"dispatch bytes", fmt(j.dispatch_bytes(), 8) + " (" + fmt(100 * ratio, 3) + "% of naive)"});
    rows.push_back({"combine bytes", fmt(j.combine_bytes(), 8)});
    rows.push_back({"balancedness", fmt(j.balancedness())});
  }
  if (j.has_verify())
    rows.push_back({"verify", std::string(j.verify().passed() ? "passed" : "FAILED") + " (max abs " +
                                  fmt(j.verify().max_abs_error()) + ", max rel " + fmt(j.verify().max_rel_error()) + ")"});
  rows.push_back({"placement epoch", fmt(j.placement_epoch())});
  print_rows(out, rows);
}

int job_exit(const v1::JobResult& j) {
  if (j.state() == v1::JOB_STATE_SUCCEEDED) return kExitOk;
  return finished(j.state()) ? kExitJobFailed : kExitOk;
}

// Waits for a job, one agent-side wait at a time.
v1::JobResult wait_for(rpc::RpcClient& c, const std::string& id) {
  for (;;) {
    v1::Envelope req;
    req.mutable_wait_job()->set_job_id(id);
    const v1::Envelope reply = c.call(req, std::chrono::seconds(30));
    if (finished(reply.job().state())) return reply.job();
  }
}

// --- local cluster -----------------------------------------------------------

fs::path self_dir() { return fs::read_symlink("/proc/self/exe").parent_path(); }

// moe-agent and moed next to moectl (installed), in the build tree, or on PATH.
std::string find_binary(const std::string& name, const std::string& build_subdir) {
  for (const fs::path& p : {self_dir() / name, self_dir().parent_path() / build_subdir / name})
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  const std::string path = env_or("PATH", "");
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && ::access((fs::path(dir) / name).c_str(), X_OK) == 0) return (fs::path(dir) / name).string();
  throw std::runtime_error("cannot find " + name + " next to moectl or on PATH");
}

// Starts a background process in its own session, output appended to log.
pid_t spawn(const std::vector<std::string>& argv, const fs::path& log) {
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::setsid();
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const int null = ::open("/dev/null", O_RDONLY);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    if (null >= 0) ::dup2(null, 0);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  return pid;
}

// Running, and not a zombie waiting for a parent (ours exited long ago) to reap it.
bool alive(pid_t pid) {
  if (pid <= 0 || ::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}

pid_t read_pid(const fs::path& p) {
  const std::string s = read_file_trimmed(p);
  return s.empty() ? -1 : static_cast<pid_t>(std::stol(s));
}

std::string random_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char b[24];
  in.read(reinterpret_cast<char*>(b), sizeof b);
  std::ostringstream os;
  for (unsigned char c : b) os << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(c);
  return os.str();
}

// Stops the processes of these pid files: SIGTERM, then SIGKILL after the grace.
void stop_pids(const std::vector<fs::path>& files, std::chrono::milliseconds grace) {
  std::vector<pid_t> pids;
  for (const auto& f : files) {
    const pid_t pid = read_pid(f);
    if (alive(pid)) {
      ::kill(pid, SIGTERM);
      pids.push_back(pid);
    }
    fs::remove(f);
  }
  const auto until = Clock::now() + grace;
  for (pid_t pid : pids) {
    while (alive(pid) && Clock::now() < until) {
      ::waitpid(pid, nullptr, WNOHANG);  // reap if it is our child
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling another process's exit
    }
    if (alive(pid)) ::kill(pid, SIGKILL);
  }
}

}  // namespace

Resolved resolve(const Globals& g) {
  Resolved r;
  const char* home = std::getenv("HOME");
  r.state_dir = !g.state_dir.empty() ? g.state_dir : std::string(home ? home : ".") + "/.local/state/moed";
  r.agent = g.agent;
  if (r.agent.empty() && fs::exists(fs::path(r.state_dir) / "agent_address"))
    r.agent = read_file_trimmed(fs::path(r.state_dir) / "agent_address");
  if (r.agent.empty()) r.agent = kDefaultAgent;
  std::string token_file = g.token_file;
  if (token_file.empty() && fs::exists(fs::path(r.state_dir) / "token")) token_file = (fs::path(r.state_dir) / "token").string();
  if (!token_file.empty()) r.token = rpc::read_token_file(token_file);
  return r;
}

int cluster_up(const Globals& g, const ClusterUpOptions& o, std::ostream& out, std::ostream& err) {
  if (o.nodes < 1 || o.devices_per_node < 1) {
    err << "moectl: --nodes and --devices-per-node must be >= 1\n";
    return kExitUsage;
  }
  Resolved r;
  try {
    r = resolve(g);
    const fs::path dir = r.state_dir, pids = dir / "pids", logs = dir / "logs";
    if (alive(fs::exists(pids / "agent.pid") ? read_pid(pids / "agent.pid") : -1)) {
      err << "moectl: a cluster is already up in " << dir.string() << " (moectl cluster down first)\n";
      return kExitUsage;
    }
    fs::create_directories(pids);
    fs::create_directories(logs);
    fs::remove(dir / "agent_address");
    const std::string token = random_token();
    {
      const std::string tmp = (dir / "token.tmp").string();
      std::ofstream(tmp) << token << "\n";
      ::chmod(tmp.c_str(), 0600);
      fs::rename(tmp, dir / "token");
    }
    const std::string agent_bin = find_binary("moe-agent", "agent"), moed_bin = find_binary("moed", "daemon");
    const pid_t agent_pid = spawn({agent_bin, "--listen", "127.0.0.1:0", "--token-file", (dir / "token").string(),
                                   "--address-file", (dir / "agent_address").string(), "--metrics-port", "127.0.0.1:0"},
                                  logs / "agent.log");
    std::ofstream(pids / "agent.pid") << agent_pid << "\n";
    const auto until = Clock::now() + o.ready_timeout;
    while (!fs::exists(dir / "agent_address")) {
      if (!alive(agent_pid) || Clock::now() > until) {
        ::waitpid(agent_pid, nullptr, WNOHANG);
        err << "moectl: moe-agent did not start; see " << (logs / "agent.log").string() << "\n";
        return kExitUnreachable;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling for the address file
    }
    r.agent = read_file_trimmed(dir / "agent_address");
    r.token = token;
    // One daemon at a time, each registered before the next starts, so node i gets
    // node index i (and ranks i*D .. i*D+D-1).
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    auto c = client(r);
    for (int i = 0; i < o.nodes; ++i) {
      const std::string name = "node" + std::to_string(i);
      const pid_t pid = spawn({moed_bin, "--agent", r.agent, "--devices", std::to_string(o.devices_per_node), "--backend",
                               o.backend, "--token-file", (dir / "token").string(), "--name", name, "--listen",
                               "127.0.0.1:0", "--metrics-port", "127.0.0.1:0", "--threads",
                               std::to_string(std::max(1, cores / o.nodes))},
                              logs / (name + ".log"));
      std::ofstream(pids / (name + ".pid")) << pid << "\n";
      for (;;) {
        v1::Envelope req;
        req.mutable_cluster_status();
        v1::ClusterStatus st;
        try {
          st = c.call(req, std::chrono::seconds(5)).cluster_status_reply();
        } catch (const RpcError&) {
        }
        int ready = 0;
        for (const auto& n : st.nodes()) ready += n.state() == v1::NODE_STATE_ALIVE;
        if (ready == i + 1) break;
        if (Clock::now() > until || !alive(pid)) {
          err << "moectl: " << name << " did not register within " << o.ready_timeout.count() / 1000
              << " s; see " << (logs / (name + ".log")).string() << "\n";
          return kExitUnreachable;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling for the registration
      }
    }
    if (!g.json)
      out << "cluster up: " << o.nodes << " node(s) x " << o.devices_per_node << " device(s), agent " << r.agent
          << ", state " << dir.string() << "\n";
    Globals gs = g;
    gs.agent = r.agent;
    gs.state_dir = r.state_dir;
    return cluster_status(gs, out, err);
  } catch (const std::exception& e) {
    err << "moectl: cluster up: " << e.what() << "\n";
    return kExitUsage;
  }
}

int cluster_down(const Globals& g, std::ostream& out, std::ostream& err) {
  try {
    const Resolved r = resolve(g);
    const fs::path dir = r.state_dir;
    // Daemons first (they stop their job at a step boundary), then the agent.
    std::vector<fs::path> daemons, agent;
    if (fs::exists(dir / "pids"))
      for (const auto& f : fs::directory_iterator(dir / "pids"))
        (f.path().filename() == "agent.pid" ? agent : daemons).push_back(f.path());
    stop_pids(daemons, std::chrono::seconds(10));
    stop_pids(agent, std::chrono::seconds(10));
    fs::remove(dir / "agent_address");
    if (!g.json) out << "cluster down: " << dir.string() << "\n";
    return kExitOk;
  } catch (const std::exception& e) {
    err << "moectl: cluster down: " << e.what() << "\n";
    return kExitUsage;
  }
}

int cluster_status(const Globals& g, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved& r) {
    v1::Envelope req;
    req.mutable_cluster_status();
    const v1::ClusterStatus st = c.call(req, g.timeout).cluster_status_reply();
    if (g.json) {
      out << spec::to_json(st) << "\n";
      return kExitOk;
    }
    out << "agent " << r.agent << ", world " << st.world_size() << " ranks, "
        << (st.running_job().empty() ? "idle" : "running " + st.running_job()) << ", " << st.queued_jobs()
        << " queued\n";
    std::vector<std::vector<std::string>> rows = {{"NODE", "NAME", "STATE", "RANKS", "CONTROL", "HEARTBEAT"}};
    for (const auto& n : st.nodes())
      rows.push_back({std::to_string(n.node_index()), n.name(), v1::NodeState_Name(n.state()).substr(11),
                      std::to_string(n.rank_base()) + "-" + std::to_string(n.rank_base() + n.devices() - 1),
                      n.control_address(), fmt(n.last_heartbeat_age_seconds(), 2) + "s ago"});
    print_table(out, rows);
    return kExitOk;
  });
}

int job_submit(const Globals& g, const v1::JobSpec& given, bool wait, std::ostream& out, std::ostream& err) {
  v1::JobSpec spec = given;
  try {
    spec = spec::with_defaults(spec);
    spec::validate(spec);
  } catch (const RpcError& e) {
    err << "moectl: invalid spec: " << e.what() << "\n";
    return kExitUsage;
  }
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_submit_job()->mutable_spec() = spec;
    v1::JobResult job = c.call(req, g.timeout).job();
    if (!wait) {
      if (g.json) out << spec::to_json(job) << "\n";
      else out << job.job_id() << "\n";
      return kExitOk;
    }
    if (!g.json) out << job.job_id() << " submitted\n";
    job = wait_for(c, job.job_id());
    print_job(out, job, g.json);
    return job_exit(job);
  });
}

int job_status(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_get_job()->set_job_id(id);
    print_job(out, c.call(req, g.timeout).job(), g.json);
    return kExitOk;
  });
}

int job_wait(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    const v1::JobResult job = wait_for(c, id);
    print_job(out, job, g.json);
    return job_exit(job);
  });
}

int job_list(const Globals& g, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_list_jobs();
    const v1::ListJobsReply list = c.call(req, g.timeout).list_jobs_reply();
    if (g.json) {
      out << spec::to_json(list) << "\n";
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows = {{"JOB", "STATE", "MODE", "EXPERTS", "TOP-K", "STEPS", "TOKENS/S", "MESSAGE"}};
    for (const auto& j : list.jobs())
      rows.push_back({j.job_id(), state_name(j.state()), v1::JobSpec::Mode_Name(j.spec().mode()),
                      std::to_string(j.spec().experts()), std::to_string(j.spec().top_k()),
                      fmt(j.steps_completed()) + "/" + std::to_string(j.spec().steps()), fmt(j.tokens_per_second(), 6),
                      j.message()});
    print_table(out, rows);
    return kExitOk;
  });
}

int job_cancel(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_cancel_job_request()->set_job_id(id);
    const v1::JobResult job = c.call(req, g.timeout).job();
    if (g.json) out << spec::to_json(job) << "\n";
    else out << job.job_id() << " " << state_name(job.state()) << (job.state() == v1::JOB_STATE_RUNNING ? " (cancelling)" : "") << "\n";
    return kExitOk;
  });
}

int placement_show(const Globals& g, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_placement();
    const v1::PlacementReply p = c.call(req, g.timeout).placement_reply();
    if (g.json) {
      out << spec::to_json(p) << "\n";
      return kExitOk;
    }
    if (p.maps_size() == 0) out << "no placement yet (no job has run)\n";
    for (const auto& m : p.maps()) {
      out << "layer " << m.layer() << ", epoch " << m.epoch() << ", " << m.num_ranks() << " ranks x "
          << m.slots_per_rank() << " slots\n";
      for (int r = 0; r < m.num_ranks(); ++r) {
        out << "  rank " << r << ":";
        for (int s = 0; s < m.slots_per_rank(); ++s) out << " " << m.phy2log(r * m.slots_per_rank() + s);
        out << "\n";
      }
    }
    return kExitOk;
  });
}

}  // namespace moe::ctl
