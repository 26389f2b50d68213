// Several hosts on one machine: the agent and each daemon in a network namespace of
// its own, joined by veth pairs to a bridge, with their own addresses, so the
// control plane (mutual TLS, a certificate per host from `moectl tls create`) and UCX
// cross a real network stack. Skipped, with the reason, where
// namespaces cannot be made (not root, no iproute2).
#include <gtest/gtest.h>
#include <unistd.h>

#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "ci_skip.h"
#include "process.h"
#include "moe/rpc/client.h"

#ifndef MOE_BIN_DIR
#error "MOE_BIN_DIR must name the build directory"
#endif

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

int sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

// Namespaces "host0" (agent), "host1", "host2" (daemons) on 10.X.Y.0/24, joined
// by a bridge in a namespace of its own ("switch"): nothing is added to the test
// machine's own namespace, whose UCX workers (other tests running beside this
// one) would pick up a new interface and lose their connections when it goes.
class Hosts {
 public:
  explicit Hosts(int n) {
    const int id = ::getpid() % 100000;
    prefix_ = "moe" + std::to_string(id) + "h";
    bridge_ = "mbr" + std::to_string(id);
    switch_ = prefix_ + "switch";
    subnet_ = "10." + std::to_string(200 + id % 50) + "." + std::to_string((id / 50) % 250);
    ok_ = sh("ip netns add " + switch_) == 0 && sh("ip -n " + switch_ + " link add " + bridge_ + " type bridge") == 0 &&
          sh("ip -n " + switch_ + " link set " + bridge_ + " up") == 0;
    for (int i = 0; ok_ && i < n; ++i) {
      const std::string ns = name(i), switch_end = "mv" + std::to_string(id) + "a" + std::to_string(i),
                        ns_end = "mv" + std::to_string(id) + "b" + std::to_string(i);
      ok_ = sh("ip netns add " + ns) == 0 &&
            sh("ip -n " + switch_ + " link add " + switch_end + " type veth peer name " + ns_end + " netns " + ns) == 0 &&
            sh("ip -n " + switch_ + " link set " + switch_end + " master " + bridge_) == 0 &&
            sh("ip -n " + switch_ + " link set " + switch_end + " up") == 0 &&
            sh("ip -n " + ns + " addr add " + address(i) + "/24 dev " + ns_end) == 0 &&
            sh("ip -n " + ns + " link set " + ns_end + " up") == 0 && sh("ip -n " + ns + " link set lo up") == 0;
      if (ok_) count_ = i + 1;
    }
  }
  ~Hosts() {
    for (int i = 0; i < count_; ++i) sh("ip netns del " + name(i));
    sh("ip netns del " + switch_);  // its bridge and veth ends go with it
  }
  bool ok() const { return ok_; }
  std::string name(int i) const { return prefix_ + std::to_string(i); }
  std::string address(int i) const { return subnet_ + "." + std::to_string(i + 2); }
  // argv that runs `argv` inside host i.
  std::vector<std::string> in(int i, std::vector<std::string> argv) const {
    std::vector<std::string> a = {"/usr/sbin/ip", "netns", "exec", name(i)};
    a.insert(a.end(), argv.begin(), argv.end());
    return a;
  }

 private:
  std::string prefix_, bridge_, switch_, subnet_;
  int count_ = 0;
  bool ok_ = false;
};

TEST(SeveralHosts, ForwardJobAcrossNetworkNamespaces) {
  if (::geteuid() != 0 || sh("command -v ip") != 0) MOE_SKIP_OR_FAIL_IN_CI("network namespaces need root and iproute2");
  Hosts hosts(3);
  if (!hosts.ok()) MOE_SKIP_OR_FAIL_IN_CI("cannot create network namespaces, veth pairs and a bridge here");
  if (sh("ip netns exec " + hosts.name(1) + " ping -c 1 -W 2 " + hosts.address(0)) != 0 &&
      sh("command -v ping") == 0)
    MOE_SKIP_OR_FAIL_IN_CI("namespaces made, but they cannot reach each other over the bridge (filtered?)");

  const fs::path dir = fs::temp_directory_path() / ("moe_netns_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "token") << "netns-token\n";
  const std::string bin = MOE_BIN_DIR;
  // Mutual TLS as on a real cluster: one certificate per host, naming its address.
  const fs::path tls = dir / "tls";
  for (int i = 0; i <= 2; ++i) {
    Process make = Process::spawn({bin + "/cli/moectl", "tls", "create", tls.string(), "--name",
                                   "host" + std::to_string(i), "--host", hosts.address(i)});
    ASSERT_EQ(make.wait(30s), 0) << make.output();
  }
  auto tls_of = [&](int i) {
    const std::string h = (tls / ("host" + std::to_string(i))).string();
    return std::vector<std::string>{"--tls-cert", h + ".pem", "--tls-key", h + ".key", "--tls-ca", (tls / "ca.pem").string()};
  };
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  Process agent = Process::spawn(hosts.in(0, with({bin + "/agent/moe-agent", "--listen", hosts.address(0) + ":0",
                                                   "--token-file", (dir / "token").string(), "--address-file",
                                                   (dir / "agent_address").string()},
                                                  tls_of(0))));
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (!fs::exists(dir / "agent_address")) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << agent.output();
    std::this_thread::sleep_for(20ms);  // polling for the agent's address file
  }
  const std::string address = read_text_file(dir / "agent_address");
  EXPECT_EQ(address.rfind(hosts.address(0) + ":", 0), 0u) << address;
  std::vector<Process> daemons;
  for (int i = 1; i <= 2; ++i)
    daemons.push_back(Process::spawn(hosts.in(i, with({bin + "/daemon/moed", "--agent", address, "--devices", "2",
                                                       "--listen", hosts.address(i) + ":0", "--token-file",
                                                       (dir / "token").string(), "--name", "host" + std::to_string(i),
                                                       "--threads", "1"},
                                                      tls_of(i)))));
  auto ctl = [&](std::vector<std::string> args, std::chrono::milliseconds timeout) {
    std::vector<std::string> argv =
        with({bin + "/cli/moectl", "--agent", address, "--token-file", (dir / "token").string()}, tls_of(0));
    argv.insert(argv.end(), args.begin(), args.end());
    Process p = Process::spawn(hosts.in(0, argv));
    const int rc = p.wait(timeout);
    return std::make_pair(rc, p.output());
  };
  for (;;) {
    const auto [rc, out] = ctl({"--output", "json", "cluster", "status"}, 10s);
    if (rc == 0 && out.find("\"world_size\": 4") != std::string::npos) break;
    ASSERT_LT(std::chrono::steady_clock::now(), until) << out << agent.output() << daemons[0].output();
    std::this_thread::sleep_for(50ms);  // polling for the registrations
  }
  const auto [rc, out] = ctl({"--output", "json", "job", "submit", "--wait", "--experts", "8", "--top-k", "3",
                              "--hidden", "64", "--ffn-hidden", "32", "--tokens-per-rank", "48", "--steps", "3",
                              "--layers", "2", "--verify"},
                             120s);
  EXPECT_EQ(rc, 0) << out << agent.output() << daemons[0].output() << daemons[1].output();
  EXPECT_NE(out.find("\"passed\": true"), std::string::npos) << out;
  EXPECT_NE(out.find("\"steps_completed\": 3"), std::string::npos) << out;
  for (auto& d : daemons) d.kill(SIGTERM);
  agent.kill(SIGTERM);
  for (auto& d : daemons) EXPECT_EQ(d.wait(30s), 0) << d.output();
  EXPECT_EQ(agent.wait(30s), 0) << agent.output();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe::test
