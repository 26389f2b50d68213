// The agent's rooms without processes: the result of a job from its step reports,
// and the scheduler's state machine driven by hand (membership, placement and a
// recorder of the actions it asks for).
#include <gtest/gtest.h>

#include "moe/rebalance/auto_rebalance.h"
#include "moe/base/latency_buckets.h"
#include "moe/jobs/job_result.h"
#include "moe/rebalance/rebalancer.h"
#include "moe/jobs/scheduler.h"
#include "moe/placement/placement_metrics.h"
#include "moe/spec/expert_map_codec.h"
#include "moe/rpc/frame.h"

namespace moe::agent {
namespace {

using namespace std::chrono_literals;

v1::StepStats step_stats(int step, double seconds, double pairs_l0, double pairs_l1) {
  v1::StepStats s;
  s.set_step(step);
  s.set_step_seconds(seconds);
  s.mutable_phase_seconds()->set_expert(seconds / 2);
  s.set_dispatch_bytes(100);
  s.set_naive_dispatch_bytes(300);
  s.set_combine_bytes(50);
  s.set_loss(0.25);
  s.set_received_rows(10);
  s.add_layer_pairs(pairs_l0);
  s.add_layer_pairs(pairs_l1);
  for (int l = 0; l < 2; ++l) {
    s.add_expert_tokens()->add_tokens(1.0);
    s.mutable_expert_tokens(l)->add_tokens(2.0);
  }
  return s;
}

JobReports two_rank_reports() {
  JobReports r;
  r.spec.set_experts(2);
  r.spec.set_layers(2);
  r.spec.set_tokens_per_rank(8);
  r.spec.set_mode(v1::JobSpec::train);
  r.spec.set_verify(true);
  r.world = 2;
  r.steps[0] = {step_stats(0, 1.0, 30, 10), step_stats(0, 3.0, 10, 10)};
  r.steps[1] = {step_stats(1, 2.0, 30, 10), step_stats(1, 2.0, 10, 10)};
  r.steps[2] = {step_stats(2, 9.0, 30, 10)};  // rank 1 never reported step 2
  v1::Verify ok, loose;
  ok.set_passed(true);
  ok.set_max_rel_error(1e-6);
  loose.set_passed(true);
  loose.set_max_rel_error(2e-6);
  r.verify = {ok, loose};
  return r;
}

TEST(JobResult, StepsEveryRankReportedMakeTheResult) {
  v1::JobResult rec;
  fill_result(two_rank_reports(), v1::JOB_STATE_SUCCEEDED, rec);
  EXPECT_EQ(rec.steps_completed(), 2);
  EXPECT_EQ(rec.step_seconds_p50(), 3.0);  // per step the slowest rank: 3, 2 -> median of two is the upper
  EXPECT_DOUBLE_EQ(rec.tokens_per_second(), 16 / 3.0);
  EXPECT_EQ(rec.slowest_rank_expert_seconds(), 1.5);
  EXPECT_EQ(rec.dispatch_bytes(), 4 * 100);
  EXPECT_EQ(rec.naive_dispatch_bytes(), 4 * 300);
  ASSERT_EQ(rec.loss_size(), 2);
  EXPECT_EQ(rec.loss(0), 0.5);  // ranks' shares summed
  ASSERT_EQ(rec.expert_tokens_size(), 2);
  EXPECT_EQ(rec.expert_tokens(0).tokens(1), 2.0 * 2 * 2);
}

TEST(JobResult, LoadIsPairsPerRankAndBalancednessIsPerLayer) {
  v1::JobResult rec;
  fill_result(two_rank_reports(), v1::JOB_STATE_SUCCEEDED, rec);
  ASSERT_EQ(rec.layer_rank_tokens_size(), 2);
  EXPECT_EQ(rec.layer_rank_tokens(0).tokens(0), 60);
  EXPECT_EQ(rec.layer_rank_tokens(0).tokens(1), 20);
  ASSERT_EQ(rec.rank_tokens_size(), 2);
  EXPECT_EQ(rec.rank_tokens(0), 80);
  EXPECT_EQ(rec.rank_tokens(1), 40);
  ASSERT_EQ(rec.layer_balancedness_size(), 2);
  EXPECT_DOUBLE_EQ(rec.layer_balancedness(0), 40.0 / 60.0);
  EXPECT_DOUBLE_EQ(rec.layer_balancedness(1), 1.0);
  EXPECT_DOUBLE_EQ(rec.balancedness(), (40.0 / 60.0 + 1.0) / 2);
  EXPECT_EQ(rec.rank_received_rows(0), 20);  // communication, kept apart from load
}

// An elastic job that lost rank 1 at step 2 ran balanced in both worlds: the
// one-rank world has no idle rank, and step 1, declared whole without rank 1's
// report, does not make rank 1 look idle either.
TEST(JobResult, BalancednessIsTakenPerWorldOfAnElasticJob) {
  JobReports r = two_rank_reports();
  r.steps.clear();
  auto with_epoch = [](v1::StepStats s, int64_t epoch) {
    s.add_layer_epoch(epoch);
    return s;
  };
  r.steps[0] = {with_epoch(step_stats(0, 1.0, 30, 30), 1), with_epoch(step_stats(0, 1.0, 30, 30), 1)};
  r.steps[1] = {with_epoch(step_stats(1, 1.0, 30, 30), 1), v1::StepStats{}};
  r.whole = {0, 1};  // what the world change declares (elastic_worlds.cc)
  r.steps[2] = {with_epoch(step_stats(2, 1.0, 60, 60), 2)};
  r.steps[3] = {with_epoch(step_stats(3, 1.0, 60, 60), 2)};
  r.world = 1;  // the world now
  v1::JobResult rec;
  fill_result(r, v1::JOB_STATE_SUCCEEDED, rec);
  EXPECT_EQ(rec.steps_completed(), 4);
  ASSERT_EQ(rec.layer_balancedness_size(), 2);
  EXPECT_DOUBLE_EQ(rec.layer_balancedness(0), 1.0);
  EXPECT_DOUBLE_EQ(rec.balancedness(), 1.0);
  ASSERT_EQ(rec.epochs_size(), 2);
  EXPECT_DOUBLE_EQ(rec.epochs(0).balancedness(), 1.0);
  EXPECT_DOUBLE_EQ(rec.epochs(1).balancedness(), 1.0);

  // Imbalance within a world still shows, weighted by the world's steps: here
  // the world grows to 3 ranks at step 2, and layer 0's loads are 60, 20, 40.
  for (int step : {2, 3})
    r.steps[step] = {with_epoch(step_stats(step, 1.0, 60, 60), 2), with_epoch(step_stats(step, 1.0, 20, 60), 2),
                     with_epoch(step_stats(step, 1.0, 40, 60), 2)};
  r.world = 3;
  fill_result(r, v1::JOB_STATE_SUCCEEDED, rec);
  EXPECT_DOUBLE_EQ(rec.layer_balancedness(0), (2 * 1.0 + 2 * (40.0 / 60.0)) / 4);
  EXPECT_DOUBLE_EQ(rec.layer_balancedness(1), 1.0);
  EXPECT_DOUBLE_EQ(rec.epochs(1).balancedness(), (40.0 / 60.0 + 1.0) / 2);

  // A world of the same size (a node lost and another joined) renumbers the
  // ranks: loads 60, 20 and then 20, 60 are imbalanced in each world, not
  // balanced on average.
  r.steps.clear();
  r.whole.clear();
  r.world = 2;
  for (int step : {0, 1, 2, 3}) {
    const bool second = step >= 2;
    v1::StepStats a = step_stats(step, 1.0, second ? 20 : 60, 60), b = step_stats(step, 1.0, second ? 60 : 20, 60);
    a.set_world_epoch(second);
    b.set_world_epoch(second);
    r.steps[step] = {a, b};
  }
  fill_result(r, v1::JOB_STATE_SUCCEEDED, rec);
  EXPECT_DOUBLE_EQ(rec.layer_balancedness(0), 40.0 / 60.0);
}

// Two nodes' windows of a serving job: callers by name, calls summed, latency
// quantiles from the merged buckets (docs/serving.md#statistics).
TEST(JobResult, AServingWindowMergesTheNodesCalls) {
  std::vector<v1::StepStats> by_rank(2);
  for (int r = 0; r < 2; ++r) {
    by_rank[r].set_step_seconds(r == 0 ? 0.5 : 1.0);  // the slowest rank's window counts
    v1::ServeWindow* w = by_rank[r].mutable_serve();
    w->set_steps(10);
    w->add_layer_rows(30 + r * 10);  // 30 and 40 rows computed in 10 steps: 7 a step
    w->add_callers("a");
    w->add_callers(r == 0 ? "b" : "c");
    w->set_queued_rows(3);
    v1::ServeLaneCalls* c = w->add_calls();
    c->set_layer(0);
    c->set_calls(50);
    c->set_rows(250);
    c->set_failed(r);
    for (int b = 0; b <= 100; ++b) c->add_latency_buckets(0);
    c->set_latency_buckets(r == 0 ? 80 : 100, 49);  // 0.01 x 2^10 ms = 10.24, 0.01 x 2^12.5
    c->set_latency_buckets(r == 0 ? 90 : 100, 1);
  }
  const v1::ServeProgress p = serve_progress(by_rank);
  EXPECT_EQ(p.window_seconds(), 1.0);
  EXPECT_EQ(p.clients(), 3);
  EXPECT_EQ(p.calls_per_second(), 100);
  EXPECT_EQ(p.failed_per_second(), 1);
  EXPECT_EQ(p.rows_per_second(), 500);
  EXPECT_EQ(p.step_rows(), 7);
  EXPECT_EQ(p.queued_rows(), 6);
  ASSERT_EQ(p.lanes_size(), 1);
  EXPECT_FALSE(p.lanes(0).backward());
  EXPECT_EQ(p.lanes(0).rows_per_call(), 5);
  EXPECT_DOUBLE_EQ(p.lanes(0).p50_ms(), latency_bucket_bound_ms(80));   // call 50 of 100
  EXPECT_DOUBLE_EQ(p.lanes(0).p99_ms(), latency_bucket_bound_ms(100));  // calls 51-100
  EXPECT_EQ(latency_bucket(latency_bucket_bound_ms(80)), 80);          // a bound is its own bucket's
  EXPECT_EQ(latency_bucket(latency_bucket_bound_ms(80) * 1.001), 81);
}

TEST(JobResult, VerifyPassesOnlyIfEveryRankAndTheJobDid) {
  JobReports r = two_rank_reports();
  v1::JobResult rec;
  fill_result(r, v1::JOB_STATE_SUCCEEDED, rec);
  EXPECT_TRUE(rec.verify().passed());
  EXPECT_EQ(rec.verify().max_rel_error(), 2e-6);
  fill_result(r, v1::JOB_STATE_FAILED, rec);
  EXPECT_FALSE(rec.verify().passed());
  r.verify[1].set_passed(false);
  fill_result(r, v1::JOB_STATE_SUCCEEDED, rec);
  EXPECT_FALSE(rec.verify().passed());
}

// ---------------------------------------------------------------------------

struct Recorder : SchedulerActions {
  std::vector<v1::StartJob> started;
  std::vector<std::pair<std::string, std::string>> cancelled;
  std::vector<bool> cancelled_failed;  // the job failed (ranks abort their transports)
  std::vector<v1::JobResult> ended;
  void start_job(const v1::StartJob& s) override { started.push_back(s); }
  void cancel_job(const std::string& id, const std::string& why, bool failed) override {
    cancelled.push_back({id, why});
    cancelled_failed.push_back(failed);
  }
  void job_ended(const v1::JobResult& r) override { ended.push_back(r); }
  void step_completed(const std::string&, int step) override { completed_steps.push_back(step); }
  void halt_world(const std::string&, int64_t epoch, const std::string&, const std::vector<int>& nodes) override {
    halted.push_back({epoch, nodes});
  }
  void new_world(const v1::NewWorld& w, const std::vector<int>&, const v1::StartJob& j,
                 const std::vector<int>& joining) override {
    worlds.push_back(w);
    if (!joining.empty()) joins.push_back(j);
  }
  std::vector<v1::StartJob> joins;
  void fence(const std::string&, int node, const std::string&) override { fenced.push_back(node); }
  std::vector<int> fenced;
  std::vector<int> completed_steps;
  std::vector<std::pair<int64_t, std::vector<int>>> halted;
  std::vector<v1::NewWorld> worlds;
};

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerTest() : members(3s), scheduler({.failed_job_grace = 45s, .stale_job_timeout = 600s}, members, placement, rec) {}

  void add_nodes(int n, int devices) {
    for (int i = 0; i < n; ++i) {
      v1::RegisterNodeRequest r;
      r.set_name("node" + std::to_string(i));
      r.set_devices(devices);
      members.register_node(r, false, now);
    }
  }
  v1::JobSpec spec(int experts = 8) {
    v1::JobSpec s;
    s.set_experts(experts);
    s.set_top_k(2);
    s.set_hidden(16);
    s.set_ffn_hidden(8);
    s.set_tokens_per_rank(4);
    s.set_steps(2);
    s.set_layers(2);
    return s;
  }
  v1::RankDone done(const std::string& id, int rank, bool ok = true) {
    v1::RankDone d;
    d.set_job_id(id);
    d.set_rank(rank);
    d.set_ok(ok);
    return d;
  }
  void report_steps(const std::string& id, int world, int steps) {
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < world; ++r) {
        v1::StepReport sr;
        sr.set_job_id(id);
        sr.set_rank(r);
        sr.mutable_stats()->set_step(s);
        sr.mutable_stats()->set_step_seconds(0.1);
        for (int l = 0; l < 2; ++l) sr.mutable_stats()->add_layer_epoch(1);
        scheduler.on_step(sr, now);
      }
  }
  // Every rank reports done, through the membership as the agent does.
  void finish_ranks(const std::string& id, int world) {
    for (int r = 0; r < world; ++r) {
      members.rank_done(id, r);
      scheduler.on_rank_done(done(id, r), now);
    }
  }

  Clock::time_point now = Clock::now();
  Membership members;
  PlacementService placement;
  Recorder rec;
  Scheduler scheduler;
};

// The agent stood still for 10 s: a node last heard before the stall is not
// dead for it, one whose heartbeat the agent read after the stall keeps its
// time (no credit into the future), and a dead node stays dead.
TEST(MembershipTest, TheAgentsOwnStallIsNotANodesSilence) {
  Membership members(3s);
  const Clock::time_point t0 = Clock::now();
  auto add = [&](const char* name, Clock::time_point at) {
    v1::RegisterNodeRequest r;
    r.set_name(name);
    r.set_devices(1);
    members.register_node(r, false, at);
  };
  add("gone", t0 - 10s);  // node 0: dead before the stall
  add("quiet", t0);       // node 1: last heard just before it
  add("fresh", t0);       // node 2: its heartbeat is read after it
  ASSERT_EQ(members.expire(t0), std::vector<int>({0}));
  const Clock::time_point from = t0 + 1s, to = t0 + 11s;  // the agent did not run
  v1::HeartbeatRequest hb;
  hb.set_name("fresh");
  hb.set_node_index(2);
  ASSERT_TRUE(members.heartbeat(hb, to));  // read from its socket before the watchdog's tick
  members.forgive_stall(from, to);
  EXPECT_TRUE(members.expire(to + 1s).empty()) << "quiet: 2 s of the agent's running time, not 12";
  EXPECT_EQ(members.expire(to + 3500ms), std::vector<int>({1, 2})) << "no credit past the stall's end";
  members.forgive_stall(to + 3500ms, to + 20s);
  EXPECT_TRUE(members.expire(to + 20s).empty());
  for (const auto& n : members.nodes()) EXPECT_EQ(n.state, v1::NODE_STATE_DEAD) << n.name << " came back";
}

TEST_F(SchedulerTest, AJobWaitsForNodesThenRunsOnEveryRankAndSucceeds) {
  const std::string id = scheduler.submit(spec()).job_id();
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_QUEUED);
  scheduler.try_start(now);
  EXPECT_TRUE(rec.started.empty()) << "no node has registered";
  add_nodes(2, 2);
  scheduler.try_start(now);
  ASSERT_EQ(rec.started.size(), 1u);
  EXPECT_EQ(rec.started[0].world_size(), 4);
  EXPECT_EQ(rec.started[0].maps_size(), 2);  // one map per layer
  EXPECT_EQ(rec.started[0].spec().layers(), 2);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_FALSE(members.ready_for_job()) << "nodes are busy with the job";
  report_steps(id, 4, 2);
  EXPECT_EQ(scheduler.record(id).steps_completed(), 2) << "progress shows while it runs";
  EXPECT_EQ(rec.completed_steps, (std::vector<int>{0, 1}));
  finish_ranks(id, 4);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_EQ(scheduler.record(id).epochs_size(), 1);
  EXPECT_EQ(scheduler.record(id).epochs(0).steps(), 2);
  ASSERT_EQ(rec.ended.size(), 1u);
  EXPECT_EQ(rec.ended[0].job_id(), id);
  EXPECT_TRUE(members.ready_for_job());
  EXPECT_EQ(scheduler.record(id).placement_epoch(), 1);
}

// docs/placement.md#node-redundancy: a job asking for min_node_replicas 2 starts on
// maps that keep every expert on two nodes, with the redundant slots that need
// (16 experts on 2x2: 32 slots, 8 per rank); more nodes than the cluster has is refused.
TEST_F(SchedulerTest, NodeRedundancyGivesEveryExpertCopiesOnTwoNodes) {
  add_nodes(2, 2);
  v1::JobSpec s = spec(16);
  s.set_min_node_replicas(3);
  EXPECT_THROW(scheduler.submit(s), moe::InvalidArgument) << "2 nodes cannot hold copies on 3";
  s.set_min_node_replicas(2);
  scheduler.submit(s);
  scheduler.try_start(now);
  ASSERT_EQ(rec.started.size(), 1u);
  for (const v1::PlacementMap& pm : rec.started[0].maps()) {
    const ExpertMap map = spec::from_proto(pm);
    EXPECT_EQ(map.slots_per_rank, 8);
    EXPECT_EQ(placement::experts_lost_per_node(map, 2), (std::vector<int>{0, 0}));
  }
}

// docs/jobs.md#a-node-restarts: a node of the running job that registers again
// without it ended its part: the job fails at once naming it, its ranks count as
// done, and once the survivors report the job has ended.
TEST_F(SchedulerTest, ANodeRestartedDuringTheJobFailsItAtOnce) {
  add_nodes(2, 1);
  const std::string id = scheduler.submit(spec()).job_id();
  scheduler.try_start(now);
  report_steps(id, 2, 1);
  v1::RegisterNodeRequest again;
  again.set_name("node1");
  again.set_devices(1);
  const NodeRecord& n = members.register_node(again, true, now);
  scheduler.on_node_registered(n, "", now);
  ASSERT_EQ(rec.cancelled.size(), 1u);
  EXPECT_NE(rec.cancelled[0].second.find("node node1 (ranks 1-1) restarted during the job"), std::string::npos)
      << rec.cancelled[0].second;
  EXPECT_TRUE(rec.cancelled_failed[0]) << "the survivors abort their transports";
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_RUNNING) << "node0 has not reported yet";
  members.rank_done(id, 0);
  scheduler.on_rank_done(done(id, 0, false), now);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(members.ready_for_job()) << "the restarted node is idle, the survivor done";
}

TEST_F(SchedulerTest, ASpecTheClusterCannotRunIsRefusedNamingTheField) {
  add_nodes(3, 1);
  try {
    scheduler.submit(spec(8));
    FAIL() << "8 experts over 3 ranks";
  } catch (const moe::InvalidArgument& e) {  // the RPC server answers it with INVALID_ARGUMENT
    EXPECT_NE(std::string(e.what()).find("experts: 8 experts do not divide over the 3 ranks"), std::string::npos)
        << e.what();
  }
}

TEST_F(SchedulerTest, NodesOnDifferentBackendsRefuseAJobNamingThem) {
  for (int i = 0; i < 2; ++i) {
    v1::RegisterNodeRequest r;
    r.set_name("node" + std::to_string(i));
    r.set_devices(1);
    r.set_backend(i == 0 ? v1::BACKEND_CUDA : v1::BACKEND_CPU);
    members.register_node(r, false, now);
  }
  const std::string id = scheduler.submit(spec(8)).job_id();
  scheduler.try_start(now);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(scheduler.record(id).message(),
            "the nodes run different backends (node0: BACKEND_CUDA, node1: BACKEND_CPU); a job's ranks must all run one");
  EXPECT_EQ(scheduler.running(), nullptr);
}

TEST_F(SchedulerTest, ARankFailureFailsTheJobBlamingThePeerAndStopsTheOthers) {
  add_nodes(2, 1);
  const std::string id = scheduler.submit(spec()).job_id();
  scheduler.try_start(now);
  v1::RankDone d = done(id, 0, false);
  d.set_message("all_to_all_v: receive from rank 1 failed");
  d.set_failed_peer(1);
  scheduler.on_rank_done(d, now);
  ASSERT_EQ(rec.cancelled.size(), 1u);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_RUNNING) << "waits for rank 1's report";
  scheduler.on_rank_done(done(id, 1, false), now);
  const v1::JobResult& r = scheduler.record(id);
  EXPECT_EQ(r.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(r.message(), "rank 1 (node node1) failed (reported by rank 0 (node node0)): all_to_all_v: receive from "
                         "rank 1 failed");
}

TEST_F(SchedulerTest, ADeadNodeEndsTheJobAtOnce) {
  add_nodes(2, 1);
  const std::string id = scheduler.submit(spec()).job_id();
  scheduler.try_start(now);
  EXPECT_EQ(members.expire(now + 4s).size(), 2u);
  scheduler.on_node_dead("node node1 (ranks 1-1) stopped responding", now + 4s);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(scheduler.record(id).message(),
            "node node1 (ranks 1-1) stopped responding after 0 complete steps; a job that is not elastic fails with "
            "its node (--elastic with --min-node-replicas 2 goes on without it: docs/jobs.md#elastic-jobs)");
}

TEST_F(SchedulerTest, CancelEndsAQueuedJobAtOnceAndARunningOneThroughItsRanks) {
  add_nodes(1, 1);
  const std::string first = scheduler.submit(spec()).job_id();
  const std::string second = scheduler.submit(spec()).job_id();
  scheduler.try_start(now);
  scheduler.cancel(second, now);
  EXPECT_EQ(scheduler.record(second).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(scheduler.record(second).message(), "cancelled before it started");
  scheduler.cancel(first, now);
  ASSERT_EQ(rec.cancelled.size(), 1u);
  EXPECT_EQ(rec.cancelled[0].first, first);
  EXPECT_FALSE(rec.cancelled_failed[0]) << "a requested cancel lets the ranks finish their step";
  v1::RankDone d = done(first, 0, false);
  d.set_cancelled(true);
  d.set_cancel_requested_here(true);
  d.set_message("cancelled at step 1 (cancelled by request)");
  members.rank_done(first, 0);
  scheduler.on_rank_done(d, now);
  EXPECT_EQ(scheduler.record(first).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(scheduler.queued(), 0);
  EXPECT_EQ(scheduler.running(), nullptr);
}

TEST_F(SchedulerTest, SilenceAndAnUnansweredFailureHaveDeadlines) {
  add_nodes(2, 1);
  const std::string id = scheduler.submit(spec()).job_id();
  scheduler.try_start(now);
  scheduler.tick(now + 601s);
  ASSERT_EQ(rec.cancelled.size(), 1u) << "no rank reported for the stale timeout";
  EXPECT_EQ(rec.cancelled[0].second, "no rank reported for 600 s");
  EXPECT_TRUE(rec.cancelled_failed[0]) << "a failing job's ranks abort their transports";
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_RUNNING);
  scheduler.tick(now + 601s + 46s);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(scheduler.record(id).message(), "no rank reported for 600 s (not every rank reported back)");
}

// The rebalancer's state machine driven by hand (docs/placement.md#live-rebalance):
// a running 2x1 job, a recorder of the messages it sends.
struct RebalanceRecorder : RebalanceActions {
  std::vector<v1::PrepareRebalance> prepared;
  std::vector<v1::CommitRebalance> committed;
  std::vector<v1::AbortRebalance> aborted;
  std::vector<v1::RebalanceReply> done;
  void prepare(const v1::PrepareRebalance& p) override { prepared.push_back(p); }
  void commit(const v1::CommitRebalance& c) override { committed.push_back(c); }
  void abort(const v1::AbortRebalance& a) override { aborted.push_back(a); }
  void rebalance_done(const v1::RebalanceReply& r) override { done.push_back(r); }
};

class RebalancerTest : public SchedulerTest {
 protected:
  RebalancerTest() : rebalancer({.timeout = 5s}, placement, scheduler, members, actions) {
    add_nodes(2, 1);
    job = scheduler.submit(spec()).job_id();
    scheduler.try_start(now);
  }
  v1::RebalanceRequest request(int redundant) {
    v1::RebalanceRequest r;
    r.set_redundant_experts(redundant);
    return r;
  }
  v1::RebalanceReady ready(const std::string& node, bool ok = true) {
    v1::RebalanceReady r;
    r.set_job_id(job);
    r.set_epoch(actions.prepared.back().epoch());
    r.set_node(node);
    r.set_ok(ok);
    if (!ok) r.set_reason("no room");
    return r;
  }
  v1::RebalanceResult result_of(uint64_t id) {
    const v1::RebalanceReply* r = rebalancer.result(id);
    return r ? r->result() : v1::REBALANCE_RESULT_UNSPECIFIED;
  }

  RebalanceRecorder actions;
  Rebalancer rebalancer;
  std::string job;
};

TEST_F(RebalancerTest, EveryNodeReadyCommitsOnceAndInstallsTheEpoch) {
  const uint64_t id = rebalancer.start(request(2), now);
  ASSERT_EQ(actions.prepared.size(), 1u);
  const int64_t epoch = actions.prepared[0].epoch();
  EXPECT_EQ(actions.prepared[0].maps_size(), 2);  // every layer
  EXPECT_TRUE(rebalancer.in_flight());
  EXPECT_THROW(rebalancer.start(request(2), now), rpc::RpcError) << "one at a time";
  rebalancer.on_ready(ready("node0"), now);
  EXPECT_TRUE(actions.committed.empty()) << "node1 has not answered";
  rebalancer.on_ready(ready("node1"), now + 1s);
  ASSERT_EQ(actions.committed.size(), 1u);
  EXPECT_EQ(actions.committed[0].epoch(), epoch);
  EXPECT_EQ(result_of(id), v1::REBALANCE_RESULT_COMMITTED);
  EXPECT_EQ(placement.epoch(), epoch);
  rebalancer.tick(now + 60s);  // a committed epoch is never aborted
  rebalancer.on_ready(ready("node1", false), now + 61s);
  EXPECT_TRUE(actions.aborted.empty());
  EXPECT_EQ(rebalancer.counts().at(v1::REBALANCE_RESULT_COMMITTED), 1);
  ASSERT_EQ(rebalancer.durations().size(), 1u);
  EXPECT_DOUBLE_EQ(rebalancer.durations()[0], 1.0);
}

TEST_F(RebalancerTest, ANoAbortsNamingTheNodeAndTheMapStays) {
  const int64_t before = placement.epoch();
  const uint64_t id = rebalancer.start(request(2), now);
  rebalancer.on_ready(ready("node0"), now);
  rebalancer.on_ready(ready("node1", false), now);
  ASSERT_EQ(actions.aborted.size(), 1u);
  EXPECT_EQ(actions.aborted[0].epoch(), actions.prepared[0].epoch());
  EXPECT_TRUE(actions.committed.empty());
  EXPECT_EQ(result_of(id), v1::REBALANCE_RESULT_ABORTED);
  EXPECT_NE(rebalancer.result(id)->message().find("node node1 refused: no room"), std::string::npos);
  EXPECT_EQ(placement.epoch(), before + 1) << "the aborted epoch is a gap; no map was installed";
  EXPECT_FALSE(rebalancer.in_flight());
  EXPECT_NO_THROW(rebalancer.start(request(2), now)) << "the next one may start";
}

TEST_F(RebalancerTest, TheTimeoutAbortsNamingTheNodesStillCopying) {
  const uint64_t id = rebalancer.start(request(2), now);
  rebalancer.on_ready(ready("node0"), now);
  rebalancer.tick(now + 4s);
  EXPECT_TRUE(rebalancer.in_flight()) << "not yet";
  rebalancer.tick(now + 5s);
  ASSERT_EQ(actions.aborted.size(), 1u);
  EXPECT_EQ(result_of(id), v1::REBALANCE_RESULT_ABORTED);
  EXPECT_NE(rebalancer.result(id)->message().find("did not complete within 5 s on node(s) node1"), std::string::npos)
      << rebalancer.result(id)->message();
  rebalancer.on_ready(ready("node1"), now + 6s);  // too late: nothing commits
  EXPECT_TRUE(actions.committed.empty());
}

TEST_F(RebalancerTest, TheJobEndingFailsItWithoutAnAbort) {
  const uint64_t id = rebalancer.start(request(2), now);
  rebalancer.on_job_ended(job, "node node1 stopped responding", now);
  EXPECT_EQ(result_of(id), v1::REBALANCE_RESULT_FAILED);
  EXPECT_TRUE(actions.aborted.empty()) << "nobody is left to abort";
  EXPECT_EQ(rebalancer.counts().at(v1::REBALANCE_RESULT_FAILED), 1);
}

TEST_F(RebalancerTest, ADryRunAndARequestBreakingTheSlotRuleChangeNothing) {
  v1::RebalanceRequest dry = request(2);
  dry.set_dry_run(true);
  const uint64_t id = rebalancer.start(dry, now);
  EXPECT_EQ(result_of(id), v1::REBALANCE_RESULT_DRY_RUN);
  EXPECT_TRUE(actions.prepared.empty());
  EXPECT_THROW(rebalancer.start(request(3), now), moe::InvalidArgument);  // 8 + 3 over 2 ranks
  EXPECT_FALSE(rebalancer.in_flight());
}

// The auto-rebalance gates, each alone: the step count per job, the threshold,
// the predicted gain and a plan that moves nothing.
TEST(AutoRebalanceGate, AtMostOnceEveryNStepsOfAJob) {
  AutoRebalanceGate gate({.every = 5, .threshold = 0.9});
  std::vector<int> looks;
  for (int step = 0; step < 23; ++step)
    if (gate.due("job-1", step)) looks.push_back(step);
  EXPECT_EQ(looks, (std::vector<int>{4, 9, 14, 19}));
  // A new job counts from its own first step.
  EXPECT_FALSE(gate.due("job-2", 0));
  EXPECT_FALSE(gate.due("job-2", 3));
  EXPECT_TRUE(gate.due("job-2", 4));
  AutoRebalanceGate off({.every = 0});
  for (int step = 0; step < 100; ++step) EXPECT_FALSE(off.due("job-1", step));
}

TEST(AutoRebalanceGate, OnlyBelowTheThresholdForAGainOfAtLeastMinGainWithSomethingToCopy) {
  AutoRebalanceGate gate({.every = 5, .threshold = 0.9, .min_gain = 0.05});
  EXPECT_TRUE(gate.worth(0.60, 0.80, 3));
  EXPECT_FALSE(gate.worth(0.90, 0.99, 3)) << "at the threshold";
  EXPECT_FALSE(gate.worth(0.60, 0.64, 3)) << "a gain under 0.05";
  EXPECT_TRUE(gate.worth(0.60, 0.65, 3)) << "a gain of exactly 0.05";
  EXPECT_FALSE(gate.worth(0.60, 0.80, 0)) << "the plan moves nothing";
}

}  // namespace
}  // namespace moe::agent

namespace moe::agent {
namespace {

// docs/jobs.md#elastic-jobs: a dead node of an elastic job halts its world; once
// every surviving rank said what it applied the agent sends the new world (the
// ranks renumbered, the batch kept, the moves from replicas), steps go on under
// its epoch, a late report of the old world's last step completes it, and the
// job ends on the new world's ranks, recording the change.
TEST_F(SchedulerTest, AnElasticJobMovesToTheSurvivorsWhenANodeDies) {
  add_nodes(2, 2);
  v1::JobSpec s = spec(8);
  s.set_mode(v1::JobSpec::train);
  s.set_elastic(true);
  s.set_min_node_replicas(2);
  s.set_steps(6);
  const std::string id = scheduler.submit(s).job_id();
  scheduler.try_start(now);
  ASSERT_EQ(rec.started.size(), 1u);
  report_steps(id, 4, 3);
  scheduler.on_node_dead("node node1 (ranks 2-3) stopped responding", now, 1);
  ASSERT_EQ(rec.halted.size(), 1u);
  EXPECT_EQ(rec.halted[0], (std::pair<int64_t, std::vector<int>>{0, {0}}));
  EXPECT_TRUE(rec.worlds.empty()) << "no survivor has reported yet";
  for (int r = 0; r < 2; ++r) {
    v1::RankHalted h;
    h.set_job_id(id);
    h.set_rank(r);
    h.set_applied_steps(r == 0 ? 4 : 3);  // rank 1 reached step 3's agreement: it applies it
    h.set_pending(r == 1);
    for (int l = 0; l < 2; ++l) {
      auto* layer = h.add_hosted();
      const std::vector<bool> on = spec::from_proto(rec.started[0].maps(l)).hosted(r);
      for (size_t e = 0; e < on.size(); ++e)
        if (on[e]) layer->add_experts(static_cast<int>(e));
    }
    scheduler.on_rank_halted(h, now);
  }
  ASSERT_EQ(rec.worlds.size(), 1u);
  const v1::NewWorld& w = rec.worlds[0];
  EXPECT_EQ(w.world_epoch(), 1);
  EXPECT_EQ(w.world_size(), 2);
  EXPECT_EQ(w.resume_step(), 4);
  EXPECT_EQ(w.tokens_per_rank(), 8);
  EXPECT_EQ(std::vector<int>(w.new_rank().begin(), w.new_rank().end()), (std::vector<int>{0, 1, -1, -1}));
  EXPECT_EQ(w.maps_size(), 2);
  // Rank 0's report of step 3 came before the change; rank 1's comes from the
  // old world after it (it applied the step on its way), node1's never.
  v1::StepReport late;
  late.set_job_id(id);
  late.set_rank(1);
  late.mutable_stats()->set_step(3);
  late.mutable_stats()->set_step_seconds(0.1);
  scheduler.on_step(late, now);
  for (int step = 4; step < 6; ++step)
    for (int r = 0; r < 2; ++r) {
      v1::StepReport sr;
      sr.set_job_id(id);
      sr.set_rank(r);
      sr.mutable_stats()->set_step(step);
      sr.mutable_stats()->set_step_seconds(0.1);
      sr.mutable_stats()->set_world_epoch(1);
      scheduler.on_step(sr, now + 1s);
    }
  for (int r = 0; r < 2; ++r) {
    v1::RankDone d = done(id, r);
    d.set_world_epoch(1);
    members.rank_done(id, scheduler.home_rank(r, 1));
    scheduler.on_rank_done(d, now + 1s);
  }
  const v1::JobResult& j = scheduler.record(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.message();
  EXPECT_EQ(j.steps_completed(), 6);
  ASSERT_EQ(j.world_changes_size(), 1);
  EXPECT_EQ(j.world_changes(0).lost_nodes(0), "node1");
  EXPECT_EQ(j.world_changes(0).kind(), "node_dead");
  EXPECT_DOUBLE_EQ(j.world_changes(0).recovery_seconds(), 1.0);
  EXPECT_EQ(scheduler.world_changes().at("node_dead"), 1);
}

// A node lost after the job's last step completed changes nothing: its ranks
// count as done and the job succeeds with the others' (thrash: a SIGSTOP at the
// very end made the survivors' finished daemons look lost too).
TEST_F(SchedulerTest, AnElasticJobThatLosesANodeAfterItsLastStepSucceeds) {
  add_nodes(2, 2);
  v1::JobSpec s = spec(8);
  s.set_elastic(true);
  const std::string id = scheduler.submit(s).job_id();
  scheduler.try_start(now);
  report_steps(id, 4, 2);
  for (int r = 0; r < 2; ++r) scheduler.on_rank_done(done(id, r), now);
  scheduler.on_node_dead("node node1 (ranks 2-3) stopped responding", now, 1);
  EXPECT_TRUE(rec.halted.empty()) << "no world change after the last step";
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_SUCCEEDED) << scheduler.record(id).message();
}

// A node is lost while the job's last step runs: the survivor's ranks finish it
// (their collectives of every step completed, so the lost node computed every
// step too) and its daemon answers the halt that its part has ended. The lost
// node's last reports never come; the job succeeds with the survivor's RankDones,
// in either order (thrash: a SIGKILL at the very end failed the job "every node
// of the job was lost").
class SurvivorRanTheLastStep : public SchedulerTest {
 protected:
  void run(bool dones_first) {
    add_nodes(2, 2);
    v1::JobSpec s = spec(8);
    s.set_elastic(true);
    const std::string id = scheduler.submit(s).job_id();
    scheduler.try_start(now);
    report_steps(id, 4, 1);
    for (int r = 0; r < 2; ++r) {  // node0's ranks report the last step; node1's never will
      v1::StepReport sr;
      sr.set_job_id(id);
      sr.set_rank(r);
      sr.mutable_stats()->set_step(1);
      sr.mutable_stats()->set_step_seconds(0.1);
      scheduler.on_step(sr, now);
    }
    scheduler.on_node_dead("node node1 (ranks 2-3) stopped responding", now, 1);
    ASSERT_EQ(rec.halted.size(), 1u) << "the last step is not complete: a world change";
    if (dones_first)
      for (int r = 0; r < 2; ++r) scheduler.on_rank_done(done(id, r), now);
    scheduler.on_halt_found_ended(id, 0, 0, now);
    if (!dones_first) {
      EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_RUNNING) << "the survivor's RankDones decide";
      for (int r = 0; r < 2; ++r) scheduler.on_rank_done(done(id, r), now);
    }
    EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_SUCCEEDED) << scheduler.record(id).message();
    EXPECT_TRUE(rec.worlds.empty());
  }
};

TEST_F(SurvivorRanTheLastStep, TheHaltsAnswerFirst) { run(false); }
TEST_F(SurvivorRanTheLastStep, TheRankDonesFirst) { run(true); }

// A rank of a world the job left (a node that woke after it was declared lost)
// is fenced: its RankDone and halts change nothing.
TEST_F(SchedulerTest, AnElasticJobIgnoresTheOldWorldsRanks) {
  add_nodes(2, 1);
  v1::JobSpec s = spec(8);
  s.set_elastic(true);
  const std::string id = scheduler.submit(s).job_id();
  scheduler.try_start(now);
  scheduler.on_node_dead("node node1 stopped responding", now, 1);
  v1::RankHalted h;
  h.set_job_id(id);
  h.set_rank(0);
  h.set_applied_steps(0);
  h.add_hosted()->add_experts(0);
  h.add_hosted()->add_experts(0);
  scheduler.on_rank_halted(h, now);
  ASSERT_EQ(rec.worlds.size(), 1u);
  v1::RankDone stale = done(id, 1, false);  // node1's rank 1 of world 0
  stale.set_message("all_to_all_v: rank 0 failed");
  scheduler.on_rank_done(stale, now);
  EXPECT_EQ(scheduler.record(id).state(), v1::JOB_STATE_RUNNING);
  h.set_rank(1);
  scheduler.on_rank_halted(h, now);
  EXPECT_EQ(rec.halted.size(), 1u);
}

}  // namespace
}  // namespace moe::agent
