#include "local_cluster.h"

#include "moe/ctl/json.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <google/protobuf/util/json_util.h>

#include <signal.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "process.h"

#ifndef MOE_BIN_DIR
#error "MOE_BIN_DIR must name the build directory"
#endif

namespace moe::test {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {
const std::string kMoectl = std::string(MOE_BIN_DIR) + "/cli/moectl";
}

// If this test process dies without running ~Cluster (ctest kills it at its
// timeout), a reaper stops the cluster's processes and removes its folder: a
// shell in a session of its own (so a kill of the test's process group spares
// it) that waits for EOF on a pipe only this process holds open.
void Cluster::start_reaper() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;
  const std::string dir = dir_.string();
  const std::string script = "read -r _; for f in '" + dir + "'/pids/*.pid; do [ -f \"$f\" ] && kill -9 \"$(cat \"$f\")\" 2>/dev/null; done; rm -rf '" + dir + "'";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setsid();
    ::dup2(fds[0], 0);  // dup2 clears FD_CLOEXEC on the copy
    ::execl("/bin/sh", "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[0]);
  if (pid < 0) {
    ::close(fds[1]);
    return;
  }
  reaper_pid_ = pid;
  reaper_fd_ = fds[1];
}

Cluster::Cluster(int nodes, int devices, const std::vector<std::string>& extra)
    : dir_(fs::temp_directory_path() / ("moe_cluster_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++))) {
  fs::remove_all(dir_);
  start_reaper();
  std::vector<std::string> args = {"cluster", "up", "--nodes", std::to_string(nodes), "--devices-per-node",
                                   std::to_string(devices)};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto [rc, out] = ctl(args, 90s);
  up_ = rc == 0;
  EXPECT_EQ(rc, 0) << out << logs();
}

Cluster::~Cluster() {
  ctl({"cluster", "down"}, 60s);
  fs::remove_all(dir_);
  if (reaper_fd_ >= 0) {
    ::close(reaper_fd_);  // EOF: the reaper finds nothing left and exits
    ::waitpid(reaper_pid_, nullptr, 0);
  }
}

std::string Cluster::agent() const { return read_text_file(dir_ / "agent_address"); }
std::string Cluster::token() const { return read_text_file(dir_ / "token"); }

rpc::TlsFiles Cluster::tls() const {
  const fs::path t = dir_ / "tls";
  if (!fs::exists(t / "ca.pem")) return {};
  return {(t / "moectl.pem").string(), (t / "moectl.key").string(), (t / "ca.pem").string()};
}

std::vector<std::string> Cluster::moed_tls_flags() const {
  const fs::path t = dir_ / "tls";
  if (!fs::exists(t / "ca.pem")) return {"--plaintext"};
  return {"--tls-cert", (t / "node.pem").string(), "--tls-key", (t / "node.key").string(), "--tls-ca",
          (t / "ca.pem").string()};
}

std::pair<int, std::string> moectl(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  std::vector<std::string> argv = {kMoectl};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p = Process::spawn(argv);
  const int rc = p.wait(timeout);
  return {rc, p.output()};
}

std::pair<int, std::string> Cluster::ctl(const std::vector<std::string>& args, std::chrono::milliseconds timeout) const {
  std::vector<std::string> argv = {"--state-dir", dir_.string()};
  argv.insert(argv.end(), args.begin(), args.end());
  return moectl(argv, timeout);
}

std::string Cluster::logs() const {
  std::string s;
  if (fs::exists(dir_ / "logs"))
    for (const auto& f : fs::directory_iterator(dir_ / "logs"))
      s += "\n--- " + f.path().filename().string() + "\n" + read_text_file(f.path());
  return s;
}

rpc::RpcClient Cluster::client() const { return client_of(agent()); }

rpc::RpcClient Cluster::client_of(const std::string& address) const {
  return rpc::RpcClient(rpc::ClientOptions::make(address, token(), "test", "test", tls()));
}

v1::JobResult Cluster::job(const std::string& id) const {
  v1::Envelope req;
  req.mutable_get_job()->set_job_id(id);
  auto c = client();
  return c.call(req, 10s).job();
}

v1::ClusterStatus Cluster::status() const {
  v1::Envelope req;
  req.mutable_cluster_status();
  auto c = client();
  return c.call(req, 10s).cluster_status_reply();
}

std::string Cluster::start_long_job(int steps) const {
  const auto [rc, out] = ctl({"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "32", "--ffn-hidden",
                              "16", "--tokens-per-rank", "32", "--steps", "1000000"});
  EXPECT_EQ(rc, 0) << out;
  const std::string id = out.substr(0, out.find('\n'));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (job(id).steps_completed() < steps && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);  // polling the agent for the job's progress
  EXPECT_EQ(job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_GE(job(id).steps_completed(), steps);
  return id;
}

pid_t Cluster::pid_of(const std::string& process) const {
  return std::stoi(read_text_file(dir_ / "pids" / (process + ".pid")));
}

void Cluster::kill_agent() const {
  const pid_t pid = pid_of("agent");
  ::kill(pid, SIGKILL);
  EXPECT_TRUE(poll_until([&] { return !process_alive(pid); }, 10s)) << "the agent outlived SIGKILL";
}

Process Cluster::start_agent_again() const {
  std::vector<std::string> argv;
  std::istringstream lines(read_text_file(dir_ / "agent.argv"));
  for (std::string a; std::getline(lines, a);) argv.push_back(a);
  EXPECT_GT(argv.size(), 1u);
  Process agent = Process::spawn(argv);
  std::ofstream(dir_ / "pids" / "agent.pid") << agent.pid() << "\n";
  const bool serving = poll_until(
      [&] {
        try {
          status();
          return true;
        } catch (const std::exception&) {
          return false;
        }
      },
      20s);
  EXPECT_TRUE(serving) << agent.output();
  return agent;
}

bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::istringstream stat(read_text_file("/proc/" + std::to_string(pid) + "/stat"));
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}

std::string exchange(const std::string& host, int port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << host << ":" << port;
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) reply.append(buf, n);  // until the server closes
  ::close(fd);
  return reply;
}

std::string scrape(const std::string& address) {
  const auto colon = address.rfind(':');
  EXPECT_NE(colon, std::string::npos) << address;
  if (colon == std::string::npos) return "";
  return exchange(address.substr(0, colon), std::stoi(address.substr(colon + 1)),
                  "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n");
}

double series_value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

bool parse_output(const std::string& text, google::protobuf::Message& m) {
  const auto at = text.find('{');
  try {
    ctl::from_json(at == std::string::npos ? text : text.substr(at), m);
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what() << " in:\n" << text;
    return false;
  }
}

v1::JobResult parse_result(const std::string& json) {
  v1::JobResult r;
  parse_output(json, r);
  return r;
}

std::vector<std::string> output_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

}  // namespace moe::test
