// Live placement as a user drives it (docs/placement.md#live-rebalance):
// real processes, a skewed job, `moectl placement rebalance` while it runs; the
// faults a rebalance must survive; and the placement commands with no job, twice
// in a job, dry runs, export/import and the loads file.
#include <gtest/gtest.h>

#include <google/protobuf/util/json_util.h>

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "local_cluster.h"
#include "moe/io/safetensors.h"
#include "process.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

const std::string kSim = std::string(MOE_BIN_DIR) + "/agent/placement/moe-placement-sim";

bool has(const std::string& out, const std::string& part) { return out.find(part) != std::string::npos; }

// Polls until the job completed `steps` steps (or ended).
// Until the running job `id` completed `steps` steps. False, with a failure that
// says why, when the job ended first (what follows would land after it) or at the
// 60 s deadline: callers ASSERT it, so a test never goes on against a finished job.
[[nodiscard]] bool wait_steps(const Cluster& c, const std::string& id, int steps) {
  const auto until = std::chrono::steady_clock::now() + 60s;
  v1::JobResult j;
  while (std::chrono::steady_clock::now() < until) {
    j = c.job(id);
    if (j.steps_completed() >= steps) return true;
    if (j.state() != v1::JOB_STATE_RUNNING && j.state() != v1::JOB_STATE_QUEUED) {
      ADD_FAILURE() << id << " ended (" << v1::JobState_Name(j.state()) << ", " << j.message() << ") after "
                    << j.steps_completed() << " steps, before step " << steps;
      return false;
    }
    std::this_thread::sleep_for(10ms);  // polling the agent for the job's progress
  }
  ADD_FAILURE() << id << " did not reach step " << steps << " within 60 s (at " << j.steps_completed() << ")";
  return false;
}

// The agent's value of one series, once it equals `want` (the agent refreshes its
// metrics once a second); fails naming the last value after 10 s.
void expect_agent_series(const Cluster& c, const std::string& series, double want) {
  const std::string address = c.status().agent_metrics_address();
  const auto until = std::chrono::steady_clock::now() + 10s;
  double got = -1;
  while (std::chrono::steady_clock::now() < until) {
    got = series_value(scrape(address), series);
    if (got == want) return;
    std::this_thread::sleep_for(100ms);  // polling the agent's next refresh
  }
  ADD_FAILURE() << series << " is " << got << ", expected " << want;
}

std::string submit(const Cluster& c, std::vector<std::string> args) {
  args.insert(args.begin(), {"job", "submit"});
  const auto [rc, out] = c.ctl(args);
  EXPECT_EQ(rc, 0) << out;
  return out.substr(0, out.find('\n'));
}

v1::JobResult wait_job(const Cluster& c, const std::string& id) {
  const auto [rc, out] = c.ctl({"--output", "json", "job", "wait", id}, 180s);
  return parse_result(out);
}

struct Variant {
  std::string name;
  std::vector<std::string> flags;
  double loss_rtol;  // fp32: the order of sums only; bf16: partial rows rounded to bf16 once more
  // Selections that may differ at step 75: none in fp32; in bf16 the weights
  // drift apart by bf16 roundings of differently ordered sums over 75 steps, so
  // near-ties may break the other way (at most this fraction of the pairs).
  double topk_mismatch;
  // Steps of the job: enough that the rebalance, asked for after step 4, lands
  // while it runs (80 tiny forward steps ended first on a fast CPU); train's loss
  // curve is held over every step, so it stays short.
  int steps = 80;
};

// The job of the variant: 2x2, zipf-skewed, checked at a step after the switch.
std::vector<std::string> job_args(const Variant& v, const fs::path& dump) {
  std::vector<std::string> a = {"--experts", "16", "--top-k", "4", "--hidden", "64", "--ffn-hidden", "32",
                                "--tokens-per-rank", "128", "--steps", std::to_string(v.steps), "--skew", "zipf:1.2", "--seed", "3",
                                "--lr", "0.01", "--verify", "--verify-step", "75", "--dump-dir", dump.string(),
                                "--dump-step", "75"};
  a.insert(a.end(), v.flags.begin(), v.flags.end());
  return a;
}

std::vector<int32_t> dumped_topk(const fs::path& dir, int rank) {
  io::SafetensorsReader f((dir / ("rank" + std::to_string(rank) + ".safetensors")).string());
  return f.read_i32("topk_idx", f.info("topk_idx").shape);
}

class LiveRebalance : public ::testing::TestWithParam<Variant> {};

TEST_P(LiveRebalance, MidJobTheLossCurveStaysAndTheLoadEvensOut) {
  const Variant v = GetParam();
  const fs::path dumps = fs::temp_directory_path() / ("moe_rebalance_" + v.name + std::to_string(::getpid()));
  fs::remove_all(dumps);
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const v1::JobResult plain = wait_job(c, submit(c, job_args(v, dumps / "plain")));
  ASSERT_EQ(plain.state(), v1::JOB_STATE_SUCCEEDED) << plain.message() << c.logs();

  const std::string id = submit(c, job_args(v, dumps / "moved"));
  ASSERT_TRUE(wait_steps(c, id, 4));
  const auto [rc, out] = c.ctl({"placement", "rebalance", "--redundant-experts", "4"}, 120s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  EXPECT_TRUE(has(out, "rebalance committed")) << out;
  const v1::JobResult moved = wait_job(c, id);
  ASSERT_EQ(moved.state(), v1::JOB_STATE_SUCCEEDED) << moved.message() << c.logs();

  // Two epochs, every step once, the second epoch better balanced.
  ASSERT_EQ(moved.epochs_size(), 2) << out;
  EXPECT_EQ(moved.epochs(1).epoch(), moved.epochs(0).epoch() + 1);
  EXPECT_EQ(moved.epochs(0).steps() + moved.epochs(1).steps(), v.steps);
  EXPECT_EQ(moved.epochs(1).first_step(), moved.epochs(0).steps());
  EXPECT_GT(moved.epochs(1).balancedness(), moved.epochs(0).balancedness() + 0.1);
  // The job computed what it would have without the rebalance.
  ASSERT_EQ(moved.loss_size(), plain.loss_size());
  for (int s = 0; s < plain.loss_size(); ++s)
    EXPECT_NEAR(moved.loss(s), plain.loss(s), v.loss_rtol * std::fabs(plain.loss(s))) << "step " << s;
  EXPECT_TRUE(moved.verify().passed()) << "verify at step 75, after the switch";
  size_t differ = 0, pairs = 0;
  for (int r = 0; r < 4; ++r) {
    const auto a = dumped_topk(dumps / "moved", r), b = dumped_topk(dumps / "plain", r);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    pairs += a.size();
  }
  EXPECT_LE(static_cast<double>(differ), v.topk_mismatch * pairs) << differ << " of " << pairs << " pairs differ";

  // Replicas of an expert are bitwise identical after the switch: every rank
  // dumped the weights of the experts it hosts at step 75.
  for (int e = 0; e < 16; ++e) {
    std::vector<std::vector<float>> copies;
    for (int r = 0; r < 4; ++r) {
      io::SafetensorsReader f((dumps / "moved" / ("rank" + std::to_string(r) + ".safetensors")).string());
      const std::string name = "experts." + std::to_string(e) + ".gate_proj.weight";
      if (f.has(name)) copies.push_back(f.read_f32(name, f.info(name).shape));
    }
    for (size_t i = 1; i < copies.size(); ++i) EXPECT_EQ(copies[i], copies[0]) << "expert " << e;
  }
  fs::remove_all(dumps);
}

INSTANTIATE_TEST_SUITE_P(
    Jobs, LiveRebalance,
    ::testing::Values(Variant{"train_fp32", {"--mode", "train"}, 1e-5, 0.0},
                      Variant{"train_bf16", {"--mode", "train", "--dtype", "bf16"}, 1.0 / 64, 0.02},
                      Variant{"forward_fp32", {"--mode", "forward"}, 1e-5, 0.0, 240}),
    [](const auto& info) { return info.param.name; });

// The small training job of the fault tests, and its loss curve: a rebalance
// that does not commit must leave the job computing exactly what it computes
// without one (a stale staged slot, or a shadow replica's Adam step leaking into
// the live weights, changes the loss bitwise).
std::vector<std::string> fault_job(const std::string& steps) {
  return {"--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16", "--tokens-per-rank", "64",
          "--steps", steps, "--skew", "zipf:1.5", "--mode", "train", "--lr", "0.01", "--seed", "5"};
}

void expect_same_losses(const v1::JobResult& faulted, const v1::JobResult& plain, int steps) {
  ASSERT_GE(faulted.loss_size(), steps);
  ASSERT_GE(plain.loss_size(), steps);
  for (int s = 0; s < steps; ++s)
    ASSERT_EQ(faulted.loss(s), plain.loss(s)) << "step " << s << ": the rebalance that did not commit changed the job";
}

// A daemon refuses its copy: the rebalance aborts naming it, the old map stays,
// and the job goes on to the end exactly as it would have without the attempt.
TEST(RebalanceFaults, ARefusedCopyAbortsAndTheJobGoesOnUnchanged) {
  ScopedEnv fault("MOE_FAULT_INJECT", "node1:refuse-copy");
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  std::vector<std::string> job = fault_job("400");
  job.insert(job.end(), {"--verify", "--verify-step", "399"});
  const v1::JobResult plain = wait_job(c, submit(c, job));
  ASSERT_EQ(plain.state(), v1::JOB_STATE_SUCCEEDED) << plain.message() << c.logs();
  const std::string id = submit(c, job);
  ASSERT_TRUE(wait_steps(c, id, 3));
  const auto [rc, out] = c.ctl({"placement", "rebalance", "--redundant-experts", "2"}, 120s);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_TRUE(has(out, "node node1 refused: rank 1 refuses the copy of layer 0 expert")) << out;
  const v1::JobResult j = wait_job(c, id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.message();
  EXPECT_EQ(j.steps_completed(), 400);
  EXPECT_EQ(j.epochs_size(), 1);
  EXPECT_TRUE(j.verify().passed()) << "verify at the last step, after the abort";
  expect_same_losses(j, plain, 400);
  EXPECT_TRUE(has(c.ctl({"placement", "show"}).second, "epoch 1,"));
  // What the alert rules read (deploy/prometheus/rules.yml).
  expect_agent_series(c, "moe_rebalances_total{result=\"aborted\"}", 1);
  expect_agent_series(c, "moe_rebalance_seconds_count", 1);
}

// Copies that never complete: the agent's timeout aborts the rebalance, and the
// job, which trained on while they were staged, computed what a job without the
// attempt computes.
TEST(RebalanceFaults, ACopyThatTimesOutAbortsAndTheJobGoesOnUnchanged) {
  ScopedEnv fault("MOE_FAULT_INJECT", "node1:stall-copy");
  Cluster c(2, 1, {"--rebalance-timeout-ms", "1500"});
  ASSERT_TRUE(c.up());
  const std::string id = submit(c, fault_job("1000000"));
  ASSERT_TRUE(wait_steps(c, id, 3));
  const auto [rc, out] = c.ctl({"placement", "rebalance", "--redundant-experts", "2"}, 120s);
  EXPECT_EQ(rc, 1) << out;
  // node1 stalls; node0, on a loaded machine, may not have finished its copies
  // within the 1.5 s either, so the list may name it as well.
  const std::string waiting = out.substr(0, out.find(" (layer "));
  EXPECT_TRUE(has(waiting, "did not complete within 1.5 s on node(s) ") && has(waiting, "node1")) << out;
  EXPECT_TRUE(has(out, "(layer 0 expert")) << out;
  const int before = c.job(id).steps_completed();
  ASSERT_TRUE(wait_steps(c, id, before + 3));  // it still runs, on the old map
  c.ctl({"job", "cancel", id});
  const v1::JobResult j = wait_job(c, id);
  EXPECT_EQ(j.epochs_size(), 1);
  expect_agent_series(c, "moe_rebalances_total{result=\"aborted\"}", 1);
  // The same job without the attempt, as many steps.
  const int steps = j.loss_size();
  ASSERT_GT(steps, before);
  const v1::JobResult plain = wait_job(c, submit(c, fault_job(std::to_string(steps))));
  ASSERT_EQ(plain.state(), v1::JOB_STATE_SUCCEEDED) << plain.message();
  expect_same_losses(j, plain, steps);
}

// A daemon killed while its copies are staged fails the job naming its node;
// the steps before it are those of a job without the attempt, and the old map
// stays in force for the next job.
TEST(RebalanceFaults, ADaemonKilledDuringPrepareFailsTheJobAndTheOldMapStays) {
  ScopedEnv fault("MOE_FAULT_INJECT", "node1:stall-copy");
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const v1::JobResult plain = wait_job(c, submit(c, fault_job("60")));
  ASSERT_EQ(plain.state(), v1::JOB_STATE_SUCCEEDED) << plain.message() << c.logs();
  const std::string id = submit(c, fault_job("1000000"));
  ASSERT_TRUE(wait_steps(c, id, 3));
  Process rebalance = Process::spawn({std::string(MOE_BIN_DIR) + "/cli/moectl", "--state-dir", c.dir().string(),
                                      "placement", "rebalance", "--redundant-experts", "2"});
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (!has(read_text_file(c.dir() / "logs" / "node1.log"), "staging epoch") &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(10ms);  // polling the daemon's log for the PREPARE
  ::kill(std::stoi(read_text_file(c.dir() / "pids" / "node1.pid")), SIGKILL);
  EXPECT_EQ(rebalance.wait(60s), 1) << rebalance.output();
  EXPECT_TRUE(has(rebalance.output(), "rebalance failed")) << rebalance.output();
  const v1::JobResult j = wait_job(c, id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(has(j.message(), "node1")) << j.message();
  expect_same_losses(j, plain, std::min(j.loss_size(), plain.loss_size()));
  EXPECT_TRUE(has(c.ctl({"placement", "show"}).second, "epoch 1,"));
  expect_agent_series(c, "moe_rebalances_total{result=\"failed\"}", 1);
}

// A daemon that dies the moment its COMMIT arrives: the job fails naming the
// node, the new epoch (every rank had staged it) stays in force, and a restarted
// node runs the next job on it.
TEST(RebalanceFaults, ADaemonDeadDuringCommitFailsTheJobAndTheNewEpochStays) {
  ScopedEnv fault("MOE_FAULT_INJECT", "node1:die-on-commit");
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string id = submit(c, fault_job("1000000"));
  ASSERT_TRUE(wait_steps(c, id, 3));
  const pid_t node1 = std::stoi(read_text_file(c.dir() / "pids" / "node1.pid"));
  const std::vector<std::string> node1_argv = [&] {
    std::vector<std::string> argv;
    std::istringstream in(read_text_file("/proc/" + std::to_string(node1) + "/cmdline"));
    for (std::string a; std::getline(in, a, '\0');) argv.push_back(a);
    return argv;
  }();
  const std::string old_address = c.status().nodes(1).control_address();
  const auto [rc, out] = c.ctl({"placement", "rebalance", "--redundant-experts", "2"}, 120s);
  EXPECT_TRUE(has(out, "rebalance committed")) << out << c.logs();
  const v1::JobResult j = wait_job(c, id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(has(j.message(), "node1")) << j.message();
  EXPECT_TRUE(has(read_text_file(c.dir() / "logs" / "node1.log"), "die-on-commit: exiting on COMMIT"));
  EXPECT_TRUE(has(c.ctl({"placement", "show"}).second, "epoch 2,")) << c.ctl({"placement", "show"}).second;
  expect_agent_series(c, "moe_rebalances_total{result=\"committed\"}", 1);
  // node1 again, without the fault: the next job runs on epoch 2.
  ::unsetenv("MOE_FAULT_INJECT");
  Process restarted = Process::spawn(node1_argv);
  ASSERT_TRUE(poll_until(
      [&] {
        const v1::ClusterStatus s = c.status();
        return s.nodes_size() == 2 && s.nodes(1).state() == v1::NODE_STATE_ALIVE &&
               s.nodes(1).control_address() != old_address;  // the new registration
      },
      30s));
  const v1::JobResult next = wait_job(c, submit(c, fault_job("5")));
  EXPECT_EQ(next.state(), v1::JOB_STATE_SUCCEEDED) << next.message() << restarted.output();
  ASSERT_GE(next.epochs_size(), 1);
  EXPECT_EQ(next.epochs(0).epoch(), 2);
}

// The agent's own trigger (agent flags): a skewed job is rebalanced without a
// command (docs/placement.md#auto-rebalance), and the metrics of
// docs/metrics.md#agent-metrics show it.
TEST(AutoRebalance, TheAgentRebalancesASkewedJobAndTheMetricsShowIt) {
  Cluster c(2, 1, {"--rebalance-every", "5", "--balancedness-threshold", "0.95", "--redundant-experts", "2"});
  ASSERT_TRUE(c.up());
  // A job that runs until the agent's own rebalance committed (a fixed step count
  // would race it on a loaded machine), then a few steps more on the new map.
  const std::string id = submit(c, {"--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                                    "--tokens-per-rank", "128", "--steps", "1000000", "--skew", "zipf:1.5"});
  ASSERT_TRUE(poll_until(
      [&] {
        const std::string shown = c.ctl({"placement", "show"}).second;
        return has(shown, "layer 0: epoch") && !has(shown, "layer 0: epoch 1,");  // committed (maybe again)
      },
      60s))
      << "no automatic rebalance committed within 60 s" << c.logs();
  ASSERT_TRUE(wait_steps(c, id, static_cast<int>(c.job(id).steps_completed()) + 10));
  c.ctl({"job", "cancel", id});
  const v1::JobResult j = wait_job(c, id);
  ASSERT_EQ(j.state(), v1::JOB_STATE_CANCELLED) << j.message() << c.logs();
  ASSERT_GE(j.epochs_size(), 2) << j.DebugString();
  EXPECT_GT(j.epochs(1).balancedness(), j.epochs(0).balancedness());
  const v1::ClusterStatus st = c.status();
  const auto until = std::chrono::steady_clock::now() + 10s;
  std::string agent;
  // The agent refreshes its gauges once a second; balancedness is absent while the
  // new epoch's load window is empty (a refresh between the commit and the next step).
  while (std::chrono::steady_clock::now() < until) {
    agent = scrape(st.agent_metrics_address());
    if (series_value(agent, "moe_placement_epoch{layer=\"0\"}") == j.placement_epoch() &&
        series_value(agent, "moe_placement_balancedness{layer=\"0\"}") >= 0)
      break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(series_value(agent, "moe_placement_epoch{layer=\"0\"}"), j.placement_epoch()) << agent;
  EXPECT_GE(series_value(agent, "moe_rebalances_total{result=\"committed\"}"), j.epochs_size() - 1) << agent;
  EXPECT_EQ(series_value(agent, "moe_rebalances_total{result=\"aborted\"}"), 0) << agent;
  EXPECT_GT(series_value(agent, "moe_placement_balancedness{layer=\"0\"}"), 0) << agent;
  double replicas = 0, load = 0;
  for (int e = 0; e < 8; ++e) {
    const std::string l = "{expert=\"" + std::to_string(e) + "\",layer=\"0\"}";
    replicas += series_value(agent, "moe_expert_replicas" + l);
    load += series_value(agent, "moe_expert_load" + l);
  }
  EXPECT_EQ(replicas, 8 + 2) << agent;
  EXPECT_GT(load, 0) << agent;
  double copied = 0;
  for (const v1::NodeInfo& n : st.nodes()) copied += series_value(scrape(n.metrics_address()), "moe_rebalance_copy_bytes_total");
  EXPECT_GT(copied, 0);
}

// Rebalance with no job, twice in one job, a dry run, export/import and loads.
TEST(PlacementCommands, WithoutAJobTwiceInAJobDryRunExportImportAndLoads) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::vector<std::string> spec = {"--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                                         "--tokens-per-rank", "64", "--skew", "zipf:1.5"};
  std::vector<std::string> first = spec;
  first.insert(first.end(), {"--steps", "5"});
  ASSERT_EQ(wait_job(c, submit(c, first)).state(), v1::JOB_STATE_SUCCEEDED);
  // A dry run changes nothing.
  const std::string before = c.ctl({"--output", "json", "placement", "show"}).second;
  const auto [drc, dry] = c.ctl({"placement", "rebalance", "--redundant-experts", "2", "--dry-run"});
  EXPECT_EQ(drc, 0) << dry;
  EXPECT_TRUE(has(dry, "dry run")) << dry;
  // With no job nothing would be copied: no copies of "0 B" listed.
  EXPECT_TRUE(has(dry, "0 copies, 0 MB")) << dry;
  EXPECT_TRUE(has(dry, "nothing is copied")) << dry;
  EXPECT_EQ(c.ctl({"--output", "json", "placement", "show"}).second, before);
  // The slot rule.
  const auto [brc, bad] = c.ctl({"placement", "rebalance", "--redundant-experts", "3"});
  EXPECT_EQ(brc, 2) << bad;
  EXPECT_TRUE(has(bad, "experts + redundant (8 + 3) must be divisible by the ranks (2)")) << bad;
  // No job runs: the maps are installed for the next job.
  const auto [nrc, none] = c.ctl({"placement", "rebalance", "--redundant-experts", "2"});
  EXPECT_EQ(nrc, 0) << none;
  EXPECT_TRUE(has(c.ctl({"placement", "show"}).second, "epoch 2,"));
  // Two rebalances in one job (the second keeps the slot count).
  std::vector<std::string> long_job = spec;
  long_job.insert(long_job.end(), {"--steps", "1000000"});
  const std::string id = submit(c, long_job);
  ASSERT_TRUE(wait_steps(c, id, 3));
  EXPECT_EQ(c.ctl({"placement", "rebalance", "--redundant-experts", "4"}, 120s).first, 0);
  ASSERT_TRUE(wait_steps(c, id, static_cast<int>(c.job(id).steps_completed()) + 3));
  EXPECT_EQ(c.ctl({"placement", "rebalance"}, 120s).first, 0);
  ASSERT_TRUE(wait_steps(c, id, static_cast<int>(c.job(id).steps_completed()) + 3));
  c.ctl({"job", "cancel", id});
  const v1::JobResult j = wait_job(c, id);
  ASSERT_EQ(j.epochs_size(), 3) << j.DebugString();
  EXPECT_EQ(j.epochs(0).epoch(), 2);
  EXPECT_EQ(j.epochs(2).epoch(), 4);
  // Export, import: a new epoch with the same maps.
  const fs::path file = c.dir() / "maps.json", loads = c.dir() / "loads.txt";
  EXPECT_EQ(c.ctl({"placement", "export", file.string()}).first, 0);
  const auto [irc, imported] = c.ctl({"placement", "import", file.string()});
  EXPECT_EQ(irc, 0) << imported;
  EXPECT_TRUE(has(imported, "now at epoch 5")) << imported;
  EXPECT_EQ(c.ctl({"placement", "export", (c.dir() / "again.json").string()}).first, 0);
  const std::string a = read_text_file(file), b = read_text_file(c.dir() / "again.json");
  EXPECT_EQ(a.substr(0, a.find("\"epoch\"")), b.substr(0, b.find("\"epoch\"")));
  // show narrows to a layer and picks a shape; a shape never placed is not found.
  const auto [src, shown] = c.ctl({"placement", "show", "--layer", "0", "--shape", "8x1@2x1"});
  EXPECT_EQ(src, 0) << shown;
  EXPECT_TRUE(has(shown, "layer 0: epoch 5, balancedness")) << shown;
  EXPECT_EQ(c.ctl({"placement", "show", "--shape", "9x1@2x1"}).first, 2);
  EXPECT_EQ(c.ctl({"placement", "show", "--layer", "3"}).first, 2);
  // The loads file reads back in moe-placement-sim.
  EXPECT_EQ(c.ctl({"placement", "loads", loads.string()}).first, 0);
  Process sim = Process::spawn({kSim, "--loads", loads.string(), "--experts", "8", "--ranks", "2", "--nodes", "2",
                                "--groups", "0", "--redundant-experts", "2"});
  EXPECT_EQ(sim.wait(60s), 0) << sim.output();
}

// --layer narrows a rebalance to one layer: the plan holds that layer alone, and
// installing it moves that layer's epoch only; a layer the shape lacks is refused.
TEST(PlacementCommands, ARebalanceOfOneLayerMovesThatLayerOnly) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  ASSERT_EQ(wait_job(c, submit(c, {"--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                                   "--tokens-per-rank", "64", "--layers", "2", "--skew", "zipf:1.5", "--steps", "5"}))
                .state(),
            v1::JOB_STATE_SUCCEEDED);
  const auto [drc, dry] = c.ctl({"--output", "json", "placement", "rebalance", "--layer", "1", "--dry-run"});
  ASSERT_EQ(drc, 0) << dry;
  v1::RebalanceReply plan;
  ASSERT_TRUE(parse_output(dry, plan));
  ASSERT_EQ(plan.maps_size(), 1) << dry;
  EXPECT_EQ(plan.maps(0).layer(), 1);
  const auto [rc, out] = c.ctl({"placement", "rebalance", "--layer", "1"});
  ASSERT_EQ(rc, 0) << out;
  const std::string shown = c.ctl({"placement", "show"}).second;
  EXPECT_TRUE(has(shown, "layer 0: epoch 1,")) << shown;
  EXPECT_TRUE(has(shown, "layer 1: epoch 2,")) << shown;
  const auto [brc, bad] = c.ctl({"placement", "rebalance", "--layer", "2"});
  EXPECT_EQ(brc, 2) << bad;
  EXPECT_TRUE(has(bad, "layer: must be in [0, 2), got 2")) << bad;
}

}  // namespace
}  // namespace moe::test
