#include "local_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "agent_call.h"
#include "moe/base/check.h"
#include "moe/base/file.h"

namespace moe::ctl {

using Clock = std::chrono::steady_clock;

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

fs::path self_dir() { return fs::read_symlink("/proc/self/exe").parent_path(); }

}  // namespace

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

// Starts a background process in its own session, output appended to log, with
// `env` (NAME, VALUE) set on top of ours.
pid_t spawn(const std::vector<std::string>& argv, const fs::path& log,
            const std::vector<std::pair<std::string, std::string>>& env) {
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
    for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
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
  const std::string s = read_trimmed(p.string());
  return s.empty() ? -1 : static_cast<pid_t>(std::stol(s));
}


// The text of the last ERROR line of a process log ("" if none).
std::string last_error_line(const fs::path& log) {
  std::istringstream in(fs::exists(log) ? read_file(log.string()) : "");
  std::string last;
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find(" ERROR ");
    if (at != std::string::npos) last = line.substr(at + 7);
  }
  return last;
}

// The last non-empty lines of a log, joined with "; " (at most `n`).
std::string last_lines(const fs::path& log, size_t n) {
  std::istringstream in(fs::exists(log) ? read_file(log.string()) : "");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line.rfind("Run with --help", 0) != 0) lines.push_back(line);
  std::string out;
  for (size_t i = lines.size() > n ? lines.size() - n : 0; i < lines.size(); ++i) out += (out.empty() ? "" : "; ") + lines[i];
  return out;
}

// A child that stopped before it was ready: its own reason, and exit code 2 when
// it exited 2 (it refused its configuration), else 3.
UpFailure exited(const std::string& who, pid_t pid, const fs::path& log) {
  int status = 0;
  const bool reaped = ::waitpid(pid, &status, WNOHANG) == pid;
  const int code = reaped && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::string why = last_error_line(log);
  if (why.empty()) why = last_lines(log, 2);  // a flag parser's message has no log prefix
  why += (why.empty() ? "see " : " (") + log.string() + (why.empty() ? "" : ")");
  const std::string how = code >= 0 ? "exited with status " + std::to_string(code) : "stopped";
  return {code == kExitUsage ? kExitUsage : kExitUnreachable, who + " " + how + ": " + why};
}

std::string control_address(rpc::RpcClient& agent, const std::string& name) {
  v1::Envelope req;
  req.mutable_cluster_status();
  try {
    const v1::Envelope reply = agent.call(req, std::chrono::seconds(5));
    for (const auto& n : reply.cluster_status_reply().nodes())
      if (n.name() == name) return n.control_address();
  } catch (const rpc::RpcError&) {
  }
  return "";
}

void wait_registered(rpc::RpcClient& agent, const std::string& name, pid_t pid, const fs::path& log,
                     Clock::time_point until, const std::string& before) {
  for (;;) {
    v1::Envelope req;
    req.mutable_cluster_status();
    try {
      const v1::Envelope reply = agent.call(req, std::chrono::seconds(5));
      for (const auto& n : reply.cluster_status_reply().nodes())
        if (n.name() == name && n.state() == v1::NODE_STATE_ALIVE && (before.empty() || n.control_address() != before))
          return;
    } catch (const rpc::RpcError&) {
    }
    if (!alive(pid)) throw exited(name + " (moed)", pid, log);
    if (Clock::now() > until) throw UpFailure{kExitUnreachable, name + " did not register in time; see " + log.string()};
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling for the registration
  }
}

std::string run_agent(const StateDir& s, const std::vector<std::string>& argv, Clock::time_point until) {
  const fs::path log = s.logs() / "agent.log";
  const pid_t pid = spawn(argv, log);
  write_file_atomically((s.pids() / "agent.pid").string(), std::to_string(pid) + "\n");
  while (!fs::exists(s.agent_address())) {
    if (!alive(pid)) throw exited("moe-agent", pid, log);
    if (Clock::now() > until) throw UpFailure{kExitUnreachable, "moe-agent did not start; see " + log.string()};
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling for the address file
  }
  return read_trimmed(s.agent_address().string());
}

void write_command(const fs::path& file, const Command& c) {
  std::string text;
  for (const auto& [name, value] : c.env) text += name + "=" + value + "\n";
  text += "--\n";
  for (const std::string& a : c.argv) text += a + "\n";
  fs::create_directories(file.parent_path());
  write_file_atomically(file.string(), text);
}

Command read_command(const fs::path& file) {
  MOE_CHECK(fs::exists(file), file.string(), " is missing: the process was not started by moectl cluster up");
  std::istringstream in(read_file(file.string()));
  Command c;
  bool args = false;
  for (std::string line; std::getline(in, line);) {
    if (!args && line == "--") {
      args = true;
    } else if (args) {
      c.argv.push_back(line);
    } else {
      const size_t eq = line.find('=');
      MOE_CHECK(eq != std::string::npos, file.string(), ": '", line, "' is not NAME=VALUE");
      c.env.emplace_back(line.substr(0, eq), line.substr(eq + 1));
    }
  }
  MOE_CHECK(!c.argv.empty(), file.string(), " holds no command line");
  return c;
}

// Stops the processes of these pid files: SIGTERM, then SIGKILL after the grace.
size_t stop_pids(const std::vector<fs::path>& files, std::chrono::milliseconds grace) {
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
  return pids.size();
}


}  // namespace moe::ctl
