// The agent's state across restarts, without processes: the state file's round
// trip (membership, placement, job history, the running job) and its refusal of
// damaged files, and how a restored running job resumes from re-sent reports or
// fails ("agent restarted").
#include <gtest/gtest.h>

#include <google/protobuf/util/message_differencer.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "moe/jobs/scheduler.h"
#include "moe/agent/state_store.h"

namespace moe::agent {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using google::protobuf::util::MessageDifferencer;

struct Recorder : SchedulerActions {
  std::vector<v1::StartJob> started;
  std::vector<std::pair<std::string, std::string>> cancelled;
  std::vector<v1::JobResult> ended;
  std::vector<int> completed_steps;
  void start_job(const v1::StartJob& s) override { started.push_back(s); }
  void cancel_job(const std::string& id, const std::string& why, bool) override { cancelled.push_back({id, why}); }
  void job_ended(const v1::JobResult& r) override { ended.push_back(r); }
  void step_completed(const std::string&, int step) override { completed_steps.push_back(step); }
  void halt_world(const std::string&, int64_t, const std::string&, const std::vector<int>&) override {}
  void new_world(const v1::NewWorld&, const std::vector<int>&, const v1::StartJob&, const std::vector<int>&) override {}
  void fence(const std::string&, int, const std::string&) override {}
};

// One agent's rooms, as the Agent wires them.
struct Rooms {
  explicit Rooms(SchedulerOptions o = {.failed_job_grace = 45s, .stale_job_timeout = 600s, .restored_job_timeout = 33s})
      : members(3s), scheduler(o, members, placement, rec) {}
  v1::AgentState snapshot() const {
    v1::AgentState s;
    s.set_address("127.0.0.1:4242");
    s.set_incarnation(7);
    *s.mutable_membership() = members.state();
    *s.mutable_placement() = placement.state();
    *s.mutable_scheduler() = scheduler.state();
    return s;
  }
  void restore(const v1::AgentState& s, Clock::time_point now) {
    members.restore(s.membership(), now);
    placement.restore(s.placement());
    scheduler.restore(s.scheduler(), now);
  }
  Membership members;
  PlacementService placement;
  Recorder rec;
  Scheduler scheduler;
};

v1::RegisterNodeRequest node(int i, int devices, const std::string& running_job = "") {
  v1::RegisterNodeRequest r;
  r.set_name("node" + std::to_string(i));
  r.set_devices(devices);
  r.set_control_address("127.0.0.1:" + std::to_string(7000 + i));
  r.set_metrics_address("127.0.0.1:" + std::to_string(9000 + i));
  r.set_backend(v1::BACKEND_CPU);
  r.set_gemm_engine("fp32:openblas");
  r.set_running_job(running_job);
  return r;
}

v1::JobSpec spec(int steps) {
  v1::JobSpec s;
  s.set_experts(8);
  s.set_top_k(2);
  s.set_hidden(16);
  s.set_ffn_hidden(8);
  s.set_tokens_per_rank(4);
  s.set_steps(steps);
  s.set_layers(2);
  s.set_mode(v1::JobSpec::train);
  return s;
}

// Rank-stamped: rank r computed 10 + r pairs per layer, expert e got e + 1 pairs.
v1::StepReport step_report(const std::string& id, int rank, int step) {
  v1::StepReport sr;
  sr.set_job_id(id);
  sr.set_rank(rank);
  v1::StepStats& s = *sr.mutable_stats();
  s.set_step(step);
  s.set_step_seconds(0.1);
  s.set_loss(1.0 / (step + 1) + rank);
  for (int l = 0; l < 2; ++l) {
    s.add_layer_epoch(1);
    s.add_layer_pairs(10 + rank);
    v1::ExpertTokens* t = s.add_expert_tokens();
    for (int e = 0; e < 8; ++e) t->add_tokens(e + 1);
  }
  return sr;
}

void report_steps(Scheduler& s, const std::string& id, int world, int from, int to, Clock::time_point now) {
  for (int step = from; step < to; ++step)
    for (int r = 0; r < world; ++r) s.on_step(step_report(id, r, step), now);
}

v1::RankDone done(const std::string& id, int rank) {
  v1::RankDone d;
  d.set_job_id(id);
  d.set_rank(rank);
  d.set_ok(true);
  return d;
}

// Two nodes of 2 ranks; job-1 succeeded (3 steps), job-2 runs (2 of 5 steps
// reported), job-3 is queued.
void run_history(Rooms& a, Clock::time_point now) {
  a.members.register_node(node(0, 2), false, now);
  a.members.register_node(node(1, 2), false, now);
  const std::string first = a.scheduler.submit(spec(3)).job_id();
  a.scheduler.try_start(now);
  report_steps(a.scheduler, first, 4, 0, 3, now);
  for (int r = 0; r < 4; ++r) {
    a.members.rank_done(first, r);
    a.scheduler.on_rank_done(done(first, r), now);
  }
  ASSERT_EQ(a.scheduler.record(first).state(), v1::JOB_STATE_SUCCEEDED);
  const std::string second = a.scheduler.submit(spec(5)).job_id();
  a.scheduler.try_start(now);
  report_steps(a.scheduler, second, 4, 0, 2, now);
  a.scheduler.submit(spec(1));
  ASSERT_EQ(a.scheduler.record(second).state(), v1::JOB_STATE_RUNNING);
}

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moe_agent_state_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

TEST(AgentState, SavedAndReadBackUnchanged) {
  const auto now = Clock::now();
  Rooms before;
  run_history(before, now);
  const v1::AgentState saved = before.snapshot();
  ASSERT_EQ(saved.membership().nodes_size(), 2);
  ASSERT_EQ(saved.scheduler().jobs_size(), 3);
  ASSERT_GT(saved.placement().shapes(0).windows(0).expert_steps_size(), 0) << "the window moved";

  const fs::path dir = temp_dir("roundtrip");
  StateStore store(dir);
  EXPECT_FALSE(store.load().has_value()) << "a missing file is a fresh agent";
  store.save(saved);
  const std::optional<v1::AgentState> loaded = store.load();
  ASSERT_TRUE(loaded.has_value());
  EXPECT_TRUE(MessageDifferencer::Equals(*loaded, saved));

  Rooms after;
  after.restore(*loaded, now);
  std::string diff;
  MessageDifferencer d;
  d.ReportDifferencesToString(&diff);
  EXPECT_TRUE(d.Compare(saved, after.snapshot())) << diff;
  EXPECT_EQ(after.placement.epoch(), before.placement.epoch());
  EXPECT_EQ(after.scheduler.queued(), 1);
  ASSERT_NE(after.scheduler.running(), nullptr);
  EXPECT_EQ(after.scheduler.running()->id, "job-2");
  EXPECT_EQ(after.scheduler.running()->steps_recorded, 2);
  EXPECT_FALSE(after.scheduler.running()->next_step_warms_up) << "its first step is past";
  // The job counter goes on.
  EXPECT_EQ(after.scheduler.submit(spec(1)).job_id(), "job-4");
  fs::remove_all(dir);
}

TEST(AgentState, RestoredNodesMustReRegisterAndKeepTheirIndex) {
  const auto now = Clock::now();
  Rooms before;
  run_history(before, now);
  Rooms after;
  after.restore(before.snapshot(), now);
  ASSERT_EQ(after.members.num_nodes(), 2);
  for (const NodeRecord& n : after.members.nodes()) EXPECT_EQ(n.state, v1::NODE_STATE_UNHEARD) << n.name;
  EXPECT_FALSE(after.members.ready_for_job());
  v1::HeartbeatRequest hb;
  hb.set_node_index(1);
  hb.set_name("node1");
  EXPECT_FALSE(after.members.heartbeat(hb, now)) << "a restored node must register again";
  // node1 comes back first and keeps index 1; node0 never does and is dead
  // after the heartbeat timeout.
  EXPECT_EQ(after.members.register_node(node(1, 2), true, now).index, 1);
  EXPECT_TRUE(after.members.heartbeat(hb, now + 1s));
  EXPECT_TRUE(after.members.expire(now + 2s).empty());
  EXPECT_EQ(after.members.expire(now + 4s), std::vector<int>{0});
  EXPECT_EQ(after.members.nodes()[0].state, v1::NODE_STATE_DEAD);
  EXPECT_EQ(after.members.nodes()[0].control_address, "127.0.0.1:7000");
}

TEST(AgentState, DamagedFilesAreRefusedNamingTheFile) {
  Rooms a;
  run_history(a, Clock::now());
  const std::string good = StateStore::encode(a.snapshot());
  const std::string file = "/x/agent_state.pb";
  auto refused = [&](const std::string& bytes, const std::string& why) {
    try {
      StateStore::decode(bytes, file);
      ADD_FAILURE() << "accepted: " << why << " (" << bytes.size() << " bytes)";
    } catch (const StateFileError& e) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  };
  for (size_t n = 0; n < good.size(); ++n) refused(good.substr(0, n), "truncated");
  refused(good + "x", "padded");
  for (size_t at : {size_t{0}, size_t{20}, good.size() / 2, good.size() - 1}) {
    std::string bad = good;
    bad[at] = static_cast<char>(bad[at] ^ 0x5a);
    refused(bad, "a byte flipped at " + std::to_string(at));
  }
  refused("garbage that is no state file at all", "foreign");
  EXPECT_NO_THROW(StateStore::decode(good, file));

  // And from disk: the load names the file.
  const fs::path dir = temp_dir("damaged");
  StateStore store(dir);
  std::ofstream(store.file(), std::ios::binary) << good.substr(0, good.size() / 2);
  try {
    store.load();
    ADD_FAILURE() << "a truncated file was read";
  } catch (const StateFileError& e) {
    EXPECT_NE(std::string(e.what()).find(store.file().string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(AgentState, AnInconsistentStateIsRefusedNamingTheField) {
  Rooms a;
  run_history(a, Clock::now());
  v1::AgentState s = a.snapshot();
  s.mutable_scheduler()->mutable_running()->set_job_id("job-1");  // a finished job
  Rooms b;
  b.members.restore(s.membership(), Clock::now());
  try {
    b.scheduler.restore(s.scheduler(), Clock::now());
    FAIL() << "restored a finished job as running";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("scheduler.running"), std::string::npos) << e.what();
  }
  v1::AgentState m = a.snapshot();
  m.mutable_membership()->mutable_nodes(1)->set_node_index(5);
  try {
    b.members.restore(m.membership(), Clock::now());
    FAIL() << "restored a gap in the node indices";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("membership.nodes[1].node_index"), std::string::npos) << e.what();
  }
}

// The restored running job (job-2: 2 of 5 steps recorded before the restart).
class RestoredJob : public ::testing::Test {
 protected:
  RestoredJob() {
    run_history(before, now);
    window_before = before.placement.loads(ShapeKey{8, 2, 2, 2}).steps();
    after.restore(before.snapshot(), now);
  }
  void come_back(Clock::time_point t) {
    for (int i = 0; i < 2; ++i) {
      const NodeRecord& n = after.members.register_node(node(i, 2, "job-2"), true, t);
      after.scheduler.on_node_registered(n, "job-2", t);
    }
  }
  Clock::time_point now = Clock::now();
  Rooms before, after;
  int window_before = 0;
};

TEST_F(RestoredJob, ReSentReportsCompleteItWithEveryStepCountedOnce) {
  come_back(now + 500ms);
  // Every rank re-sends all its steps, then the rest of the job follows.
  report_steps(after.scheduler, "job-2", 4, 0, 5, now + 1s);
  report_steps(after.scheduler, "job-2", 4, 3, 5, now + 1s);  // a second copy after a failed call
  EXPECT_EQ(after.rec.completed_steps, (std::vector<int>{2, 3, 4})) << "steps 0-1 are in the window already";
  EXPECT_EQ(after.placement.loads(ShapeKey{8, 2, 2, 2}).steps(), window_before + 3);
  for (int r = 0; r < 4; ++r) {
    after.members.rank_done("job-2", r);
    after.members.rank_done("job-2", r);  // twice: counts once
    after.scheduler.on_rank_done(done("job-2", r), now + 2s);
  }
  const v1::JobResult& rec = after.scheduler.record("job-2");
  EXPECT_EQ(rec.state(), v1::JOB_STATE_SUCCEEDED) << rec.message();
  EXPECT_EQ(rec.steps_completed(), 5);
  ASSERT_EQ(rec.loss_size(), 5) << "the loss of every step, the ones before the restart too";
  EXPECT_DOUBLE_EQ(rec.loss(0), 4 * 1.0 + 0 + 1 + 2 + 3);  // summed over the ranks
  EXPECT_DOUBLE_EQ(rec.loss(4), 4 * 0.2 + 0 + 1 + 2 + 3);
  EXPECT_TRUE(after.members.ready_for_job()) << "job-3 may start";
}

TEST_F(RestoredJob, ANodeBackWithoutItFailsItAgentRestarted) {
  const NodeRecord& n = after.members.register_node(node(0, 2), true, now + 500ms);
  after.scheduler.on_node_registered(n, "", now + 500ms);
  const v1::JobResult& rec = after.scheduler.record("job-2");
  EXPECT_EQ(rec.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(rec.message().rfind("agent restarted: node node0", 0), 0u) << rec.message();
}

TEST_F(RestoredJob, ARankStoppedPastTheGraceFailsItAgentRestarted) {
  come_back(now + 500ms);
  report_steps(after.scheduler, "job-2", 4, 0, 3, now + 1s);
  // node0 stopped because node1's daemon did; its report may come first.
  for (int r : {0, 2, 1, 3}) {
    v1::RankDone d = done("job-2", r);
    d.set_ok(false);
    d.set_cancelled(true);
    d.set_agent_unreachable(r >= 2);
    d.set_message(r >= 2 ? "cancelled at step 3 (agent unreachable for 2.1 s)"
                         : "cancelled at step 3 (cancelled by another rank)");
    after.scheduler.on_rank_done(d, now + 1s);
  }
  const v1::JobResult& rec = after.scheduler.record("job-2");
  EXPECT_EQ(rec.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(rec.message(), "agent restarted: rank 2 (node node1): cancelled at step 3 (agent unreachable for 2.1 s)");
  EXPECT_EQ(rec.steps_completed(), 3);
}

TEST_F(RestoredJob, SilenceAfterTheRestartFailsItAgentRestarted) {
  come_back(now + 500ms);
  report_steps(after.scheduler, "job-2", 2, 0, 1, now + 1s);  // ranks 0-1 re-sent a step, ranks 2-3 nothing
  after.scheduler.tick(now + 30s);
  EXPECT_EQ(after.scheduler.record("job-2").state(), v1::JOB_STATE_RUNNING);
  after.scheduler.tick(now + 34s);
  ASSERT_EQ(after.rec.cancelled.size(), 1u);
  EXPECT_EQ(after.rec.cancelled[0].second, "agent restarted: rank 2 (node node1) did not report within 33 s");
}

TEST_F(RestoredJob, ANodeThatNeverComesBackFailsItAgentRestarted) {
  const NodeRecord& n = after.members.register_node(node(0, 2, "job-2"), true, now + 500ms);
  after.scheduler.on_node_registered(n, "job-2", now + 500ms);
  for (const int index : after.members.expire(now + 3200ms))  // node0 was heard 2.7 s ago
    after.scheduler.on_node_dead(after.members.describe_node(after.members.nodes()[index]) + " did not re-register",
                                 now + 3200ms);
  const v1::JobResult& rec = after.scheduler.record("job-2");
  EXPECT_EQ(rec.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(rec.message().rfind("agent restarted: node node1 (ranks 2-3) did not re-register after ", 0), 0u)
      << rec.message();
}

}  // namespace
}  // namespace moe::agent
