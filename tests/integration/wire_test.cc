// What crosses loopback when a user submits a job (docs/control-plane.md#tls): a
// packet capture (an AF_PACKET socket on lo, what tcpdump uses) while `moectl job
// submit --wait` runs. On a default cluster (mutual TLS) the cluster token is
// nowhere in the bytes; on a --plaintext cluster it is, which shows the capture
// sees the control plane at all.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "ci_skip.h"
#include "local_cluster.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;

// Every packet on lo while it lives, appended to one buffer.
class LoopbackCapture {
 public:
  LoopbackCapture() {
    fd_ = ::socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
    if (fd_ < 0) return;
    const int rcvbuf = 64 << 20;  // no packet dropped while the job runs
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    sockaddr_ll at{};
    at.sll_family = AF_PACKET;
    at.sll_protocol = htons(ETH_P_ALL);
    at.sll_ifindex = static_cast<int>(::if_nametoindex("lo"));
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0) {
      ::close(fd_);
      fd_ = -1;
      return;
    }
    timeval tv{0, 100000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    thread_ = std::thread([this] {
      std::string packet(1 << 17, '\0');
      while (!stop_) {
        const ssize_t n = ::recv(fd_, packet.data(), packet.size(), 0);
        if (n > 0) bytes_.append(packet.data(), static_cast<size_t>(n));
      }
    });
  }
  ~LoopbackCapture() { stop(); }
  bool ok() const { return fd_ >= 0; }
  // Ends the capture; returns what it saw.
  const std::string& stop() {
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
      ::close(fd_);
    }
    return bytes_;
  }

 private:
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::string bytes_;
};

// The bytes on lo while a small training job runs to its end.
std::string capture_a_job(const Cluster& c) {
  LoopbackCapture capture;
  EXPECT_TRUE(capture.ok());
  const auto [rc, out] = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "32",
                                "--ffn-hidden", "16", "--tokens-per-rank", "32", "--steps", "3", "--mode", "train"},
                               120s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  return capture.stop();
}

TEST(OnTheWire, TheTokenNeverCrossesLoopbackInClearUnlessAskedFor) {
  if (::geteuid() != 0) MOE_SKIP_OR_FAIL_IN_CI("a packet capture needs root");
  if (!LoopbackCapture().ok()) MOE_SKIP_OR_FAIL_IN_CI("cannot open an AF_PACKET socket on lo");
  {
    Cluster c(2, 1);
    ASSERT_TRUE(c.up());
    const std::string token = c.token().substr(0, c.token().find('\n'));
    ASSERT_GE(token.size(), 16u);
    const std::string wire = capture_a_job(c);
    EXPECT_GT(wire.size(), 10000u) << "the capture saw nothing";
    EXPECT_EQ(wire.find(token), std::string::npos) << "the token crossed loopback in clear under TLS";
  }
  {
    Cluster c(2, 1, {"--plaintext"});
    ASSERT_TRUE(c.up());
    const std::string token = c.token().substr(0, c.token().find('\n'));
    const std::string wire = capture_a_job(c);
    EXPECT_NE(wire.find(token), std::string::npos) << "plain TCP, yet the capture did not see the token";
  }
}

}  // namespace
}  // namespace moe::test
