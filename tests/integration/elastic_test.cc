// Elastic jobs (docs/jobs.md#elastic-jobs) through moectl against real processes
// killed with SIGKILL: a job goes on on the surviving nodes from the step in
// flight, its lost experts taken from their replicas, and its loss curve is the
// uninterrupted job's; without a surviving copy it fails naming the experts.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>
#include <string>
#include <vector>

#include "local_cluster.h"
#include "process.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
using Args = std::vector<std::string>;

// A train job whose steps take long enough to kill a node mid-job on 2 cores.
const Args kTrain = {"--mode", "train", "--experts", "16", "--top-k", "4", "--hidden", "128", "--ffn-hidden", "128",
                     "--tokens-per-rank", "128", "--skew", "zipf:1.2", "--seed", "7", "--optimizer", "adam",
                     "--dead-node-timeout-ms", "1000"};

std::string submit(const Cluster& c, const Args& args) {
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, args));
  EXPECT_EQ(rc, 0) << out;
  return out.substr(0, out.find('\n'));
}

v1::JobResult run_to_end(const Cluster& c, const Args& args) {
  const auto [rc, out] = c.ctl(concat({"--output", "json", "job", "submit", "--wait"}, args), 180s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  return parse_result(out);
}

// Waits until job `id` completed `step` steps, then SIGKILLs `node`.
void kill_at_step(const Cluster& c, const std::string& id, int step, const std::string& node) {
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= step; }, 120s)) << c.logs();
  ASSERT_EQ(::kill(c.pid_of(node), SIGKILL), 0);
}

v1::JobResult wait_for(const Cluster& c, const std::string& id, int want_rc) {
  const auto [rc, out] = c.ctl({"--output", "json", "job", "wait", id}, 180s);
  EXPECT_EQ(rc, want_rc) << out << c.logs();
  return parse_result(out);
}

void expect_same_curve(const v1::JobResult& got, const v1::JobResult& want) {
  ASSERT_EQ(got.loss_size(), want.loss_size());
  for (int i = 0; i < got.loss_size(); ++i) EXPECT_NEAR(got.loss(i), want.loss(i), 1e-5 * want.loss(i)) << "step " << i;
}

// The first case: 2x2, E=16, K=4, zipf, Adam, every expert on both
// nodes, the global batch kept; node1 killed at step 30, restarted at step 40:
// the job goes on on node0, grows back to 2x2, and its curve is the
// uninterrupted job's.
TEST(Elastic, ATrainJobLosesANodeGrowsBackAndKeepsItsLossCurve) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "120", "--min-node-replicas", "2"});
  const v1::JobResult plain = run_to_end(c, job);
  const std::string id = submit(c, concat(job, {"--elastic"}));
  kill_at_step(c, id, 30, "node1");
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= 40; }, 60s)) << c.logs();
  const auto [restart_rc, restarted] = c.ctl({"node", "restart", "node1"}, 60s);
  ASSERT_EQ(restart_rc, 0) << restarted;
  const v1::JobResult r = wait_for(c, id, 0);
  EXPECT_EQ(r.state(), v1::JOB_STATE_SUCCEEDED) << r.message();
  EXPECT_EQ(r.steps_completed(), 120);
  expect_same_curve(r, plain);
  ASSERT_EQ(r.world_changes_size(), 2) << c.logs();
  const v1::WorldChange& w = r.world_changes(0);
  EXPECT_EQ(w.old_world(), 4);
  EXPECT_EQ(w.new_world(), 2);
  EXPECT_EQ(w.tokens_per_rank(), 256);  // the global batch kept
  ASSERT_EQ(w.lost_nodes_size(), 1);
  EXPECT_EQ(w.lost_nodes(0), "node1");
  EXPECT_GE(w.step(), 30);
  EXPECT_GT(w.experts_from_replicas(), 0);
  // A killed node is found by its peers' failed transfers or its closed
  // connection, not by the silence timeout (a SIGSTOPped node's cause, below);
  // how long that took is a figure, not asserted (it was 1.08 s on a loaded machine).
  EXPECT_NE(w.kind(), "node_dead") << w.cause();
  EXPECT_GE(w.detection_seconds(), 0.0);
  EXPECT_GT(w.recovery_seconds(), 0.0);
  EXPECT_LE(w.recovery_seconds(), 5.0);
  const v1::WorldChange& back = r.world_changes(1);
  EXPECT_EQ(back.kind(), "node_joined");
  EXPECT_EQ(back.new_world(), 4);
  EXPECT_EQ(back.tokens_per_rank(), 128);
  ASSERT_EQ(back.joined_nodes_size(), 1);
  EXPECT_EQ(back.joined_nodes(0), "node1");
  EXPECT_GT(back.experts_from_replicas(), 0);  // the joiner's slots, from node0
  // What the user reads, and what Prometheus scrapes.
  const auto [rc, text] = c.ctl({"job", "status", id});
  EXPECT_NE(text.find("world changes"), std::string::npos) << text;
  EXPECT_NE(text.find("node1"), std::string::npos) << text;
  const std::string kind = "moe_world_changes_total{cause=\"" + w.kind() + "\"}";
  ASSERT_TRUE(poll_until([&] { return series_value(scrape(c.status().agent_metrics_address()), kind) == 1; }, 10s))
      << kind << " in\n" << scrape(c.status().agent_metrics_address());
  EXPECT_TRUE(poll_until(  // the agent refreshes its metrics once a second
      [&] { return series_value(scrape(c.status().agent_metrics_address()), "moe_world_change_recovery_seconds_count") == 2; },
      10s))
      << scrape(c.status().agent_metrics_address());
}

// Without a surviving copy the job cannot go on: it fails at once, naming the
// experts and where they lived.
TEST(Elastic, WithoutReplicasTheJobFailsNamingTheLostExperts) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const std::string id = submit(c, concat(kTrain, {"--steps", "1000000", "--elastic"}));
  kill_at_step(c, id, 5, "node1");
  const auto killed = std::chrono::steady_clock::now();
  const v1::JobResult r = wait_for(c, id, 1);
  // At once: from the lost node's detection, not after a transport timeout (30 s).
  // Not a speed figure: a shared 2-vCPU host took 2.1 s once, so the bound is loose.
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 10s);
  EXPECT_EQ(r.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(r.message().find("experts lost with no surviving copy: layer 0: expert(s) "), std::string::npos)
      << r.message();
  EXPECT_NE(r.message().find("(only on node node1)"), std::string::npos) << r.message();
}

// Without a surviving copy but with a checkpoint every 10 steps: every rank
// rolls back to the latest (a consistent cut) and goes on on the survivors;
// the steps since run again and the curve is the uninterrupted job's.
TEST(Elastic, WithoutReplicasTheJobRollsBackToItsCheckpoint) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "60", "--checkpoint-every", "10"});
  const v1::JobResult plain = run_to_end(c, concat(job, {"--checkpoint-dir", (c.dir() / "plain").string()}));
  const std::string id = submit(c, concat(job, {"--elastic", "--checkpoint-dir", (c.dir() / "elastic").string()}));
  kill_at_step(c, id, 35, "node1");
  const v1::JobResult r = wait_for(c, id, 0);
  EXPECT_EQ(r.steps_completed(), 60);
  expect_same_curve(r, plain);
  ASSERT_EQ(r.world_changes_size(), 1) << c.logs();
  const v1::WorldChange& w = r.world_changes(0);
  EXPECT_EQ(w.step() % 10, 0);
  EXPECT_GE(w.step(), 30);
  EXPECT_GT(w.experts_from_checkpoint(), 0);
  EXPECT_EQ(w.experts_from_replicas(), 0);
  // The latest complete checkpoint: at most the steps between two run again (none
  // when the kill lands just after one was written, 10 when it lands while the
  // next is being written; with steps this short the kill can land anywhere).
  EXPECT_LE(w.steps_recomputed(), 10);
  EXPECT_NE(w.checkpoint().find("step-0000"), std::string::npos) << w.checkpoint();
}

// 3x1 losing two nodes in turn: 3 ranks, then 2, then 1, the curve unchanged.
TEST(Elastic, ATrainJobLosesTwoNodesInTurn) {
  Cluster c(3, 1);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "60", "--min-node-replicas", "2", "--experts", "12", "--top-k", "2"});
  const v1::JobResult plain = run_to_end(c, job);
  const std::string id = submit(c, concat(job, {"--elastic"}));
  kill_at_step(c, id, 15, "node1");
  ASSERT_TRUE(poll_until([&] { return c.job(id).world_changes_size() == 1; }, 30s)) << c.logs();
  kill_at_step(c, id, 35, "node2");
  const v1::JobResult r = wait_for(c, id, 0);
  EXPECT_EQ(r.steps_completed(), 60);
  expect_same_curve(r, plain);
  ASSERT_EQ(r.world_changes_size(), 2) << c.logs();
  EXPECT_EQ(r.world_changes(0).new_world(), 2);
  EXPECT_EQ(r.world_changes(1).new_world(), 1);
  EXPECT_EQ(r.world_changes(1).tokens_per_rank(), 384);
}

// A forward job: the same protocol, no optimizer state (its experts are the
// spec's); the selection bias moves on every step and carries over. Its
// dispatch runs in 3 chunks over the fp8 wire, so the node dies with chunks in
// flight (docs/layer.md#overlap).
TEST(Elastic, AForwardJobLosesANode) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const Args job = {"--experts", "8", "--top-k", "2", "--hidden", "256", "--ffn-hidden", "256", "--tokens-per-rank",
                    "256", "--steps", "60", "--skew", "zipf:1.2", "--bias-update-rate", "0.001", "--elastic",
                    "--dead-node-timeout-ms", "1000", "--overlap-chunks", "3", "--dispatch-wire", "fp8"};
  const std::string id = submit(c, job);
  kill_at_step(c, id, 20, "node1");
  const v1::JobResult r = wait_for(c, id, 0);
  EXPECT_EQ(r.steps_completed(), 60);
  ASSERT_EQ(r.world_changes_size(), 1) << c.logs();
  EXPECT_EQ(r.world_changes(0).new_world(), 1);
  EXPECT_EQ(r.world_changes(0).experts_from_replicas(), 0);
}

// Faults during faults: a second node lost while the job moves to the world
// without the first; each ends in a recovered job.
TEST(ElasticFaults, ASecondNodeLostDuringARecovery) {
  Cluster c(3, 1);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "60", "--min-node-replicas", "3", "--experts", "12", "--top-k", "2"});
  const v1::JobResult plain = run_to_end(c, job);
  const std::string id = submit(c, concat(job, {"--elastic"}));
  kill_at_step(c, id, 20, "node1");
  std::this_thread::sleep_for(100ms);  // the world change is under way
  ASSERT_EQ(::kill(c.pid_of("node2"), SIGKILL), 0);
  const v1::JobResult r = wait_for(c, id, 0);
  EXPECT_EQ(r.steps_completed(), 60);
  expect_same_curve(r, plain);
  ASSERT_GE(r.world_changes_size(), 1) << c.logs();
  EXPECT_EQ(r.world_changes(r.world_changes_size() - 1).new_world(), 1);
}

// A node lost while a live rebalance stages its copies: the rebalance fails
// naming the world change, the job goes on without the node.
TEST(ElasticFaults, ANodeLostDuringALiveRebalance) {
  ScopedEnv fault("MOE_FAULT_INJECT", "node1:stall-copy");  // the rebalance stays staging
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "1000000", "--min-node-replicas", "2", "--elastic"});
  const std::string id = submit(c, job);
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= 10; }, 60s)) << c.logs();
  std::pair<int, std::string> rebalance;
  std::thread t([&] { rebalance = c.ctl({"placement", "rebalance", "--redundant-experts", "20"}, 60s); });
  std::this_thread::sleep_for(700ms);
  ASSERT_EQ(::kill(c.pid_of("node1"), SIGKILL), 0);
  t.join();
  EXPECT_NE(rebalance.first, 0) << rebalance.second;
  EXPECT_NE(rebalance.second.find("changes its world"), std::string::npos) << rebalance.second;
  ASSERT_TRUE(poll_until([&] { return c.job(id).world_changes_size() == 1; }, 30s)) << c.logs();
  const int at = c.job(id).progress().step();
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= at + 10; }, 60s)) << c.logs();
  EXPECT_EQ(c.job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
}

// A SIGSTOPped node (alive, silent) is lost after the job's dead-node timeout;
// when it wakes its old part is fenced (it must not rejoin the old world's
// collectives), and once idle it joins the job at a new world.
TEST(ElasticFaults, ASilentNodeIsLeftBehindFencedAndJoinsBack) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "200", "--min-node-replicas", "2"});
  const v1::JobResult plain = run_to_end(c, job);
  const std::string id = submit(c, concat(job, {"--elastic"}));
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= 20; }, 60s)) << c.logs();
  const pid_t node1 = c.pid_of("node1");
  ASSERT_EQ(::kill(node1, SIGSTOP), 0);
  const bool left = poll_until([&] { return c.job(id).world_changes_size() == 1; }, 30s);
  ::kill(node1, SIGCONT);
  ASSERT_TRUE(left) << c.logs();
  const v1::JobResult r = wait_for(c, id, 0);
  expect_same_curve(r, plain);
  ASSERT_EQ(r.world_changes_size(), 2) << c.logs();
  EXPECT_EQ(r.world_changes(0).kind(), "node_dead");
  EXPECT_GE(r.world_changes(0).detection_seconds(), 1.0);  // the job's --dead-node-timeout-ms of silence
  EXPECT_LE(r.world_changes(0).detection_seconds(), 1.5);
  EXPECT_EQ(r.world_changes(1).kind(), "node_joined");
  EXPECT_NE(read_text_file(c.dir() / "logs" / "agent.log").find("fencing node node1"), std::string::npos);
}

// The agent SIGKILLed with the node (before it decided the new world) and
// restarted on its state file: the survivors report again and the job recovers.
TEST(ElasticFaults, TheAgentKilledDuringARecovery) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const Args job = concat(kTrain, {"--steps", "60", "--min-node-replicas", "2"});
  const v1::JobResult plain = run_to_end(c, job);
  const std::string id = submit(c, concat(job, {"--elastic"}));
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= 20; }, 60s)) << c.logs();
  ASSERT_EQ(::kill(c.pid_of("agent"), SIGKILL), 0);
  ASSERT_EQ(::kill(c.pid_of("node1"), SIGKILL), 0);
  const auto [rc, out] = c.ctl({"cluster", "restart-agent"}, 60s);
  ASSERT_EQ(rc, 0) << out;
  const v1::JobResult r = wait_for(c, id, 0);
  EXPECT_EQ(r.steps_completed(), 60);
  expect_same_curve(r, plain);
  ASSERT_GE(r.world_changes_size(), 1) << c.logs();
  EXPECT_EQ(r.world_changes(r.world_changes_size() - 1).new_world(), 2);
}

}  // namespace
}  // namespace moe::test
