// A local cluster as a user runs it, for integration tests: moectl, moe-agent
// and moed as real processes on loopback, in a state directory of its own,
// torn down by the destructor. And small helpers to read what they serve.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moe/rpc/client.h"
#include "process.h"
#include "moe/v1/rpc.pb.h"

namespace moe::test {

class Cluster {
 public:
  // Runs `moectl cluster up`; up() tells whether it succeeded.
  Cluster(int nodes, int devices, const std::vector<std::string>& extra_up_args = {});
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  bool up() const { return up_; }
  const std::filesystem::path& dir() const { return dir_; }
  std::string agent() const;
  std::string token() const;
  // The client files `cluster up` made in tls/ (none for a --plaintext cluster).
  rpc::TlsFiles tls() const;
  // moed's flags for this cluster's TLS: --tls-cert ... or --plaintext.
  std::vector<std::string> moed_tls_flags() const;

  // Runs moectl with this cluster's state dir; returns (exit code, output).
  std::pair<int, std::string> ctl(const std::vector<std::string>& args,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(60)) const;
  std::string logs() const;  // every process log, for failure messages
  rpc::RpcClient client() const;  // to the agent
  rpc::RpcClient client_of(const std::string& address) const;
  v1::JobResult job(const std::string& id) const;
  v1::ClusterStatus status() const;
  // Submits a job that runs until stopped and returns its id once `steps` steps
  // have completed (so what follows lands in the middle of it).
  std::string start_long_job(int steps) const;
  // The pid `cluster up` (or `node restart`) recorded for a process: "agent", "node1".
  pid_t pid_of(const std::string& process) const;
  // SIGKILLs the cluster's agent; returns once it is gone.
  void kill_agent() const;
  // Starts the agent again with the command line `cluster up` recorded (its
  // state dir, the same flags) and returns once it serves; `cluster down` stops it.
  Process start_agent_again() const;

 private:
  void start_reaper();

  static inline int counter_ = 0;
  std::filesystem::path dir_;
  bool up_ = false;
  pid_t reaper_pid_ = -1;
  int reaper_fd_ = -1;  // the reaper's pipe: closed when ~Cluster ran, or this process died
};

// Runs moectl with these arguments (give --state-dir: none is added); returns
// (exit code, output).
std::pair<int, std::string> moectl(const std::vector<std::string>& args,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Polls `done` every 20 ms until it holds or `timeout` passes; returns whether it held.
template <typename F>
bool poll_until(F done, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling another process's progress
  }
  return true;
}

// Running and not a zombie.
bool process_alive(pid_t pid);

// Sends bytes on a fresh TCP connection and returns all the server writes until
// it closes the connection (5 s receive timeout).
std::string exchange(const std::string& host, int port, const std::string& bytes);
// GET /metrics of HOST:PORT.
std::string scrape(const std::string& address);
// The value of one series in a Prometheus text exposition (-1 if absent).
double series_value(const std::string& text, const std::string& series);
// moectl's JSON output (docs/cli.md#json; text before the first '{' skipped) into m;
// a test failure naming the problem when it does not parse.
bool parse_output(const std::string& text, google::protobuf::Message& m);
// The JobResult in moectl's JSON output (text before the first '{' skipped).
v1::JobResult parse_result(const std::string& json);

// A job's flags small enough for any test cluster: E=4 K=2 H=16 I=8 T=16 (add --steps).
inline const std::vector<std::string> kTinyJob = {"--experts", "4",      "--top-k", "2", "--hidden", "16",
                                                  "--ffn-hidden", "8", "--tokens-per-rank", "16"};
// moectl's output, line by line (no line ends).
std::vector<std::string> output_lines(const std::string& text);

// a, then b: a command line from its parts.
inline std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace moe::test
