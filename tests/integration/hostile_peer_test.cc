// Strangers on the cluster's network (docs/control-plane.md#before-authentication):
// what a process that never authenticates can make a real agent do. It may cost
// the agent a few KiB and seconds per connection, never its memory or its clients.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "local_cluster.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;

// Under AddressSanitizer freed memory waits in its quarantine (256 MB by default)
// and RSS says nothing about what the agent holds: the bound is the Release build's.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeaningful = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssMeaningful = false;
#else
constexpr bool kRssMeaningful = true;
#endif
#else
constexpr bool kRssMeaningful = true;
#endif

// The resident set of a process, in KiB (VmRSS of /proc/PID/status).
long rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

// A TCP connection to 127.0.0.1:port, blocking; -1 when it could not be made.
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

// Issue 44's acceptance: 10,000 connections that announce a 16 MiB frame and
// never authenticate (before: each could make the agent allocate 16 MiB), and
// 1,000 that say nothing at all, held open while moectl works.
TEST(HostilePeer, TenThousandStrangersLeaveTheAgentItsMemoryAndItsClients) {
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = std::min<rlim_t>(files.rlim_max, 4096);
  ::setrlimit(RLIMIT_NOFILE, &files);
  ASSERT_GE(files.rlim_cur, 1100u) << "the test needs 1,100 open files";
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const pid_t agent = c.pid_of("agent");
  const int port = std::stoi(c.agent().substr(c.agent().rfind(':') + 1));
  ASSERT_EQ(c.ctl({"job", "list"}).first, 0);
  const long idle = rss_kib(agent);
  ASSERT_GT(idle, 0);
  const std::string prefix("\x01\x00\x00\x00", 4);  // a 16 MiB frame follows, it says
  int made = 0;
  for (int round = 0; round < 10; ++round) {
    std::vector<int> fds;
    for (int i = 0; i < 1000; ++i) {
      const int fd = connect_to(port);
      if (fd < 0) continue;
      ++made;
      (void)::send(fd, prefix.data(), prefix.size(), MSG_NOSIGNAL);
      fds.push_back(fd);
    }
    for (int fd : fds) ::close(fd);
  }
  EXPECT_GE(made, 9900) << "the agent's port refused connections";
  std::vector<int> silent;
  for (int i = 0; i < 1000; ++i)
    if (const int fd = connect_to(port); fd >= 0) silent.push_back(fd);
  // moectl is served while the strangers hold their connections.
  const auto [rc, out] = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "16",
                                "--ffn-hidden", "8", "--tokens-per-rank", "16", "--steps", "2"});
  EXPECT_EQ(rc, 0) << out << c.logs();
  const long peak = rss_kib(agent);
  for (int fd : silent) ::close(fd);
  if (kRssMeaningful) {
    EXPECT_LT(peak - idle, 64 * 1024) << "RSS " << idle << " KiB idle, " << peak << " KiB with the strangers";
  }
  std::cout << "agent RSS: " << idle << " KiB idle, " << peak << " KiB after " << made
            << " strangers and with 1000 silent ones open\n";
  EXPECT_TRUE(poll_until([&] { return c.ctl({"job", "list"}).first == 0; }, 10s));
}

}  // namespace
}  // namespace moe::test
