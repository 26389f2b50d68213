// The agent remembers (docs/placement.md#agent-persistence, docs/jobs.md#agent-away):
// moe-agent SIGKILLed and started again on its state directory, as real processes
// on loopback. Between jobs it keeps the history and the maps and the daemons
// re-register; mid-job within the daemons' grace the job completes with every
// step; past the grace it ends FAILED ("agent restarted"); a damaged state file is
// refused naming the file.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "local_cluster.h"
#include "moe/rpc/client.h"
#include "process.h"

#ifndef MOE_BIN_DIR
#error "MOE_BIN_DIR must name the build directory"
#endif

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const std::string kAgent = std::string(MOE_BIN_DIR) + "/agent/moe-agent";

bool every_node_alive(const Cluster& c, int nodes) {
  const v1::ClusterStatus s = c.status();
  int alive = 0;
  for (const auto& n : s.nodes()) alive += n.state() == v1::NODE_STATE_ALIVE;
  return s.nodes_size() == nodes && alive == nodes;
}

std::string running_on(const Cluster& c, const std::string& daemon) {
  rpc::RpcClient d = c.client_of(daemon);
  v1::Envelope req;
  req.mutable_daemon_status();
  return d.call(req, 5s).daemon_status_reply().running_job();
}

const std::vector<std::string> kSmallJob = {"--experts", "4", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                                            "--tokens-per-rank", "32"};

std::vector<std::string> job(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), kSmallJob.begin(), kSmallJob.end());
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

TEST(AgentRestart, BetweenJobsItKeepsHistoryAndMapsAndTheDaemonsReRegister) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  auto [rc, out] = c.ctl(job({"job", "submit", "--wait"}, {"--steps", "3", "--mode", "train"}), 60s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  const auto [list_rc, history] = c.ctl({"--output", "json", "job", "list"});
  const auto [show_rc, maps] = c.ctl({"--output", "json", "placement", "show"});
  ASSERT_EQ(list_rc, 0);
  ASSERT_EQ(show_rc, 0);
  ASSERT_NE(maps.find("\"epoch\": 1"), std::string::npos) << maps;
  const std::string address = c.agent();
  int ephemeral_low = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  EXPECT_LT(rpc::split_address(address).second, ephemeral_low)
      << address << ": in the ephemeral range any connection may take it from a restarting agent";

  c.kill_agent();
  Process agent = c.start_agent_again();
  EXPECT_TRUE(poll_until([&] { return every_node_alive(c, 2); }, 20s)) << agent.output() << c.logs();
  EXPECT_EQ(c.status().agent_address(), address) << "daemons dial the address they know";
  EXPECT_EQ(c.ctl({"--output", "json", "job", "list"}).second, history);
  EXPECT_EQ(c.ctl({"--output", "json", "placement", "show"}).second, maps) << "the maps, epochs and windows";

  // The job counter goes on and the re-registered daemons run the next job.
  std::tie(rc, out) = c.ctl(job({"job", "submit", "--wait"}, {"--steps", "2"}), 60s);
  EXPECT_EQ(rc, 0) << out << agent.output() << c.logs();
  EXPECT_NE(out.find("job-2"), std::string::npos) << out;
}

// A socket that holds the agent's old port for a moment (a client connected from
// that same ephemeral port, say) delays the restarted agent but does not stop it.
TEST(AgentRestart, ItWaitsForItsOldPortWhileAnotherSocketHoldsIt) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string address = c.agent();
  const int port = rpc::split_address(address).second;
  c.kill_agent();

  const int holder = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // not into the agent
  ASSERT_GE(holder, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int on = 1;  // the old agent's connections linger in TIME_WAIT
  ASSERT_EQ(::setsockopt(holder, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on), 0);
  // The killed agent's sockets may hold the port a moment longer (orphaned
  // connections closing): take it as soon as it is free.
  ASSERT_TRUE(poll_until([&] { return ::bind(holder, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0; }, 10s))
      << "port " << port << ": " << errno;
  ASSERT_EQ(::listen(holder, 1), 0);
  std::thread release([holder] {
    std::this_thread::sleep_for(2s);
    ::close(holder);
  });
  Process agent = c.start_agent_again();
  release.join();
  EXPECT_NE(agent.output().find("is in use; waiting"), std::string::npos) << agent.output();
  EXPECT_EQ(c.status().agent_address(), address);
  EXPECT_TRUE(poll_until([&] { return every_node_alive(c, 2); }, 20s)) << agent.output() << c.logs();
}

TEST(AgentRestart, MidJobWithinTheGraceTheJobCompletesWithEveryStep) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const int steps = 1500;
  auto [rc, out] = c.ctl(job({"job", "submit"}, {"--steps", std::to_string(steps), "--mode", "train"}));
  ASSERT_EQ(rc, 0) << out;
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= 5; }, 60s)) << c.logs();
  c.kill_agent();
  // The daemons notice and hold their reports while their steps go on.
  EXPECT_TRUE(poll_until([&] { return c.logs().find("holding its reports") != std::string::npos; }, 20s)) << c.logs();
  Process agent = c.start_agent_again();

  std::tie(rc, out) = c.ctl({"--output", "json", "job", "wait", id}, 120s);
  EXPECT_EQ(rc, 0) << out << agent.output() << c.logs();
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_SUCCEEDED) << r.message();
  EXPECT_EQ(r.steps_completed(), steps);
  ASSERT_EQ(r.loss_size(), steps) << "every step's loss, the ones reported to the first agent too";
  for (int s = 0; s < steps; ++s) ASSERT_GT(r.loss(s), 0) << "step " << s;
  EXPECT_LT(r.loss(steps - 1), r.loss(0)) << "it trained";
  EXPECT_NE(agent.output().find(id + " was running when the agent stopped"), std::string::npos)
      << "the agent died mid-job\n"
      << agent.output();
}

TEST(AgentRestart, PastTheGraceTheDaemonsStopAndTheJobFailsAgentRestarted) {
  Cluster c(2, 1, {"--agent-grace", "2"});
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  std::vector<std::string> daemons;
  const v1::ClusterStatus before = c.status();
  for (const auto& n : before.nodes()) daemons.push_back(n.control_address());

  c.kill_agent();
  const auto killed = Clock::now();
  for (const std::string& d : daemons)
    EXPECT_TRUE(poll_until([&] { return running_on(c, d).empty(); }, 30s)) << d << " still runs the job\n" << c.logs();
  EXPECT_GT(Clock::now() - killed, 2s) << "stopped before the grace";
  Process agent = c.start_agent_again();

  auto [rc, out] = c.ctl({"--output", "json", "job", "wait", id}, 60s);
  EXPECT_EQ(rc, 1) << out << agent.output() << c.logs();
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(r.message().rfind("agent restarted: ", 0), 0u) << r.message();
  EXPECT_NE(r.message().find("agent unreachable for"), std::string::npos) << r.message();
  EXPECT_GE(r.steps_completed(), 3);

  // The cluster takes the next job.
  std::tie(rc, out) = c.ctl(job({"job", "submit", "--wait"}, {"--steps", "2"}), 60s);
  EXPECT_EQ(rc, 0) << out << agent.output() << c.logs();
}

// The agent dies while a job's ranks are still swapping their transport
// addresses through it (node1 is held stopped, so node0's rank waits in the
// bootstrap): the job fails naming why, and the next job runs.
TEST(AgentRestart, DuringAJobsBootstrapTheJobFailsAndTheNextRuns) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const pid_t node1 = std::stoi(read_text_file(c.dir() / "pids" / "node1.pid"));
  ::kill(node1, SIGSTOP);
  auto [rc, out] = c.ctl(job({"job", "submit"}, {"--steps", "5"}));
  ASSERT_EQ(rc, 0) << out;
  const std::string id = out.substr(0, out.find('\n'));
  EXPECT_TRUE(poll_until([&] { return c.logs().find("starting " + id) != std::string::npos; }, 10s)) << c.logs();
  c.kill_agent();
  ::kill(node1, SIGCONT);
  Process agent = c.start_agent_again();
  std::tie(rc, out) = c.ctl({"--output", "json", "job", "wait", id}, 120s);
  EXPECT_EQ(rc, 1) << out << agent.output() << c.logs();
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_FAILED);
  // node0's rank waits out the agent's restart in its bootstrap call; node1,
  // stopped before its StartJob came, registers with the new agent running no
  // job, which fails the job naming it (or a bootstrap call names the agent).
  EXPECT_TRUE(r.message().find("node node1 (ranks 1-1) came back running no job") != std::string::npos ||
              r.message().find("transport bootstrap through the agent: ") != std::string::npos)
      << r.message();
  EXPECT_EQ(r.steps_completed(), 0);
  EXPECT_TRUE(poll_until([&] { return every_node_alive(c, 2); }, 30s)) << c.logs();
  std::tie(rc, out) = c.ctl(job({"job", "submit", "--wait"}, {"--steps", "2"}), 60s);
  EXPECT_EQ(rc, 0) << out << agent.output() << c.logs();
}

// A user's `job wait` attached to a running job rides out the agent's restart:
// it says the agent is away, then that it answers again, and ends with the job.
TEST(AgentRestart, AWaitRidesOutTheAgentsRestart) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  Process waiter = Process::spawn({std::string(MOE_BIN_DIR) + "/cli/moectl", "--state-dir", c.dir().string(), "job",
                                   "wait", id});
  std::this_thread::sleep_for(2s);  // attached: only a wait that reached the agent once rides it out
  c.kill_agent();
  Process agent = c.start_agent_again();
  const double steps = c.job(id).steps_completed();
  ASSERT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= steps + 3; }, 30s)) << c.logs();
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  EXPECT_EQ(waiter.wait(60s), 1) << waiter.output();  // the job was cancelled
  EXPECT_NE(waiter.output().find("waiting up to 60 s for the agent"), std::string::npos) << waiter.output();
  EXPECT_NE(waiter.output().find("the agent answers again"), std::string::npos) << waiter.output();
  EXPECT_NE(waiter.output().find("CANCELLED"), std::string::npos) << waiter.output();
}

// The agent dies while a live rebalance has copies staged (node1 holds its copy):
// the rebalance is lost (moectl says the agent went away), the job trains on on
// the map in force, the daemons drop what they staged when they meet the new
// agent, and the maps stay at epoch 1.
TEST(AgentRestart, DuringALiveRebalanceTheJobGoesOnAndTheStagingIsDropped) {
  ::setenv("MOE_FAULT_INJECT", "node1:stall-copy", 1);
  Cluster c(2, 1);
  ::unsetenv("MOE_FAULT_INJECT");
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  Process rebalance = Process::spawn({std::string(MOE_BIN_DIR) + "/cli/moectl", "--state-dir", c.dir().string(),
                                      "placement", "rebalance", "--redundant-experts", "2"});
  EXPECT_TRUE(poll_until([&] { return c.logs().find("staging epoch") != std::string::npos; }, 30s)) << c.logs();
  c.kill_agent();
  EXPECT_EQ(rebalance.wait(60s), 3) << rebalance.output();
  EXPECT_NE(rebalance.output().find("the connection closed mid-call"), std::string::npos) << rebalance.output();
  Process agent = c.start_agent_again();
  EXPECT_TRUE(poll_until([&] { return c.logs().find("the agent restarted; dropping what epoch") != std::string::npos; },
                         30s))
      << c.logs();
  const double steps = c.job(id).steps_completed();
  EXPECT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= steps + 5; }, 30s)) << "the job stopped";
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  auto [rc, out] = c.ctl({"--output", "json", "job", "wait", id}, 60s);
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_CANCELLED) << r.message() << c.logs();
  EXPECT_EQ(r.epochs_size(), 1);
  const auto [show_rc, maps] = c.ctl({"--output", "json", "placement", "show"});
  EXPECT_NE(maps.find("\"epoch\": 1"), std::string::npos) << maps;
  std::tie(rc, out) = c.ctl(job({"job", "submit", "--wait"}, {"--steps", "2"}), 60s);
  EXPECT_EQ(rc, 0) << out << agent.output() << c.logs();
}

// A rebalance after the agent came back mid-job commits in that job: the ranks'
// READY went out on their connection to the old agent, failed, and was lost, so
// the rebalance waited until the job ended (fixed: READY is sent again when the
// call finds the agent unreachable).
TEST(AgentRestart, AfterARestartMidJobALiveRebalanceCommits) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  c.kill_agent();
  Process agent = c.start_agent_again();
  ASSERT_TRUE(poll_until([&] { return every_node_alive(c, 2); }, 30s)) << c.logs();
  const double steps = c.job(id).steps_completed();
  ASSERT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= steps + 3; }, 30s)) << "the job stopped";
  const auto [rc, out] = c.ctl({"placement", "rebalance", "--redundant-experts", "2"}, 60s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  EXPECT_NE(out.find("rebalance committed"), std::string::npos) << out;
  EXPECT_EQ(c.job(id).state(), v1::JOB_STATE_RUNNING) << "it committed only because the job ended";
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  EXPECT_EQ(parse_result(c.ctl({"--output", "json", "job", "wait", id}, 60s).second).state(),
            v1::JOB_STATE_CANCELLED);
}

// The agent SIGSTOPped past the heartbeat timeout (3 s) but within the daemons'
// grace: the nodes heartbeat all along, so the job goes on and no node is dead
// (the agent used to count its own stall as the nodes' silence and failed the
// job with "node node0 stopped responding").
TEST(AgentRestart, AnAgentThatStoodStillBlamesNoNode) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  const pid_t agent = std::stoi(read_text_file(c.dir() / "pids" / "agent.pid"));
  ASSERT_EQ(::kill(agent, SIGSTOP), 0);
  std::this_thread::sleep_for(4500ms);
  ASSERT_EQ(::kill(agent, SIGCONT), 0);
  EXPECT_TRUE(poll_until([&] { return c.logs().find("the agent did not run for") != std::string::npos; }, 10s))
      << c.logs();
  const double steps = c.job(id).steps_completed();
  EXPECT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= steps + 3; }, 30s)) << c.logs();
  EXPECT_EQ(c.job(id).state(), v1::JOB_STATE_RUNNING) << c.job(id).message();
  EXPECT_TRUE(every_node_alive(c, 2)) << c.logs();
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
}

// The state file cannot be written (here a folder sits where its new copy goes,
// as a full disk would refuse it): the agent goes on, cluster status and the
// metrics say so, and once the way is clear it writes again without any change.
TEST(AgentRestart, AStateDirThatRefusesWritesIsShownUntilItTakesThemAgain) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const fs::path blocker = c.dir() / "agent" / "agent_state.pb.tmp";
  fs::create_directories(blocker / "x");
  auto [rc, out] = c.ctl(job({"job", "submit", "--wait"}, {"--steps", "2"}), 60s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  std::tie(rc, out) = c.ctl({"cluster", "status"});
  EXPECT_NE(out.find("WARNING: the agent cannot write its state directory since"), std::string::npos) << out;
  EXPECT_NE(out.find("agent_state.pb.tmp"), std::string::npos) << out;
  const std::string metrics = c.status().agent_metrics_address();
  ASSERT_TRUE(poll_until([&] { return scrape(metrics).find("moe_agent_state_saved 0") != std::string::npos; }, 5s))
      << scrape(metrics);
  fs::remove_all(blocker);
  ASSERT_TRUE(poll_until([&] { return c.ctl({"cluster", "status"}).second.find("WARNING") == std::string::npos; }, 10s))
      << c.ctl({"cluster", "status"}).second;
  EXPECT_TRUE(poll_until([&] { return scrape(metrics).find("moe_agent_state_saved 1") != std::string::npos; }, 5s));
  EXPECT_NE(c.logs().find("state dir: written again"), std::string::npos) << c.logs();
  // What the job changed is on disk: a restarted agent still knows the job.
  c.kill_agent();
  Process agent = c.start_agent_again();
  std::tie(rc, out) = c.ctl({"job", "list"});
  EXPECT_NE(out.find("SUCCEEDED"), std::string::npos) << out << agent.output();
}

TEST(AgentRestart, ADamagedStateFileIsRefusedNamingTheFile) {
  const fs::path dir = fs::temp_directory_path() / ("moe_agent_state_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const fs::path address = dir / "address", file = dir / "state" / "agent_state.pb";
  const std::vector<std::string> argv = {kAgent, "--plaintext", "--listen", "127.0.0.1:0", "--state-dir", (dir / "state").string(),
                                         "--address-file", address.string()};
  {  // A fresh state dir: the agent writes its state and serves.
    Process agent = Process::spawn(argv);
    ASSERT_TRUE(poll_until([&] { return fs::exists(address); }, 20s)) << agent.output();
    agent.kill(SIGTERM);
    ASSERT_EQ(agent.wait(20s), 0) << agent.output();
  }
  ASSERT_TRUE(fs::exists(file));
  const std::string good = read_text_file(file);
  for (const auto& [bytes, why] : std::vector<std::pair<std::string, std::string>>{
           {good.substr(0, good.size() / 2), "truncated"}, {"not a state file\n", "not an agent state file"}}) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    Process agent = Process::spawn(argv);
    EXPECT_EQ(agent.wait(20s), 2) << agent.output();
    EXPECT_NE(agent.output().find(file.string()), std::string::npos) << agent.output();
    EXPECT_NE(agent.output().find(why), std::string::npos) << agent.output();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe::test
