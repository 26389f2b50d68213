// moectl top without processes: the agent's live-load reply from its rooms
// (membership, a scheduler fed step reports by hand, placement) and the frame
// moectl draws from it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>

#include "moe/agent/live_load.h"
#include "top_frame.h"

namespace moe::agent {
namespace {

using namespace std::chrono_literals;

struct NoActions : SchedulerActions {
  void start_job(const v1::StartJob&) override {}
  void cancel_job(const std::string&, const std::string&, bool) override {}
  void job_ended(const v1::JobResult&) override {}
  void step_completed(const std::string&, int) override {}
  void halt_world(const std::string&, int64_t, const std::string&, const std::vector<int>&) override {}
  void new_world(const v1::NewWorld&, const std::vector<int>&, const v1::StartJob&, const std::vector<int>&) override {}
  void fence(const std::string&, int, const std::string&) override {}
};

class LiveLoadTest : public ::testing::Test {
 protected:
  LiveLoadTest() : members(3s), scheduler({}, members, placement, actions) {}

  void add_nodes(int n, int devices) {
    for (int i = 0; i < n; ++i) {
      v1::RegisterNodeRequest r;
      r.set_name("node" + std::to_string(i));
      r.set_devices(devices);
      members.register_node(r, false, now);
    }
  }
  std::string start_job(int experts, int layers, int steps) {
    v1::JobSpec s;
    s.set_experts(experts);
    s.set_top_k(2);
    s.set_hidden(16);
    s.set_ffn_hidden(8);
    s.set_tokens_per_rank(100);
    s.set_steps(steps);
    s.set_layers(layers);
    const std::string id = scheduler.submit(s).job_id();
    scheduler.try_start(now);
    return id;
  }
  // Step `step` from every rank: expert e gets (e + 1) pairs from each rank
  // (expert E-1 the hottest), rank r computes 10 x (r + 1) pairs, and rank r
  // took seconds x (r + 1).
  void report_step(const std::string& id, int step, int world, int experts, int layers, double seconds) {
    for (int r = 0; r < world; ++r) {
      v1::StepReport sr;
      sr.set_job_id(id);
      sr.set_rank(r);
      v1::StepStats& s = *sr.mutable_stats();
      s.set_step(step);
      s.set_step_seconds(seconds * (r + 1));
      for (int l = 0; l < layers; ++l) {
        auto* t = s.add_expert_tokens();
        for (int e = 0; e < experts; ++e) t->add_tokens(e + 1);
        s.add_layer_pairs(10.0 * (r + 1));
        s.add_layer_epoch(1);
      }
      scheduler.on_step(sr, now);
    }
  }
  v1::LiveLoad reply() const { return live_load(members, scheduler, placement, 32); }

  Clock::time_point now = Clock::now();
  Membership members;
  PlacementService placement;
  NoActions actions;
  Scheduler scheduler;
};

// A frame of `width` columns (and `height` lines with the keys' footer; 0: any).
ctl::FrameOptions frame(int width, int height = 0) {
  ctl::FrameOptions o;
  o.width = width;
  o.height = height;
  o.keys = height > 0;
  o.agent = "127.0.0.1:7400";
  o.clock = "12:00:00";
  return o;
}

void expect_fits(const std::vector<std::string>& lines, int width) {
  for (const auto& l : lines) EXPECT_LE(static_cast<int>(l.size()), width) << "'" << l << "'";
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

TEST_F(LiveLoadTest, BeforeAnyJobTheReplySaysSo) {
  add_nodes(2, 1);
  const v1::LiveLoad l = reply();
  EXPECT_FALSE(l.has_job());
  EXPECT_EQ(l.layers_size(), 0);
  EXPECT_EQ(l.shape().experts(), 0);
  EXPECT_EQ(l.nodes(), 2);
  EXPECT_EQ(l.nodes_alive(), 2);
  EXPECT_EQ(l.world_size(), 2);
  EXPECT_EQ(l.jobs().size(), 5u);  // every state, at 0
  for (const auto& [state, n] : l.jobs()) EXPECT_EQ(n, 0) << state;
  const auto lines = ctl::render_top(l, frame(80));
  EXPECT_NE(joined(lines).find("no job has run yet"), std::string::npos) << joined(lines);
  expect_fits(lines, 80);
}

// A job's first step carries its warm-up: shown while it is the only one, then
// left out of the pace and the ETA (it took 8 s where the next took 1.3 s).
TEST_F(LiveLoadTest, TheFirstStepsWarmUpLeavesThePaceOnceAnotherStepIsIn) {
  add_nodes(1, 1);
  const std::string id = start_job(16, 1, 10);
  report_step(id, 0, 1, 16, 1, 8.0);
  v1::LiveLoad l = reply();
  EXPECT_EQ(l.job().recent_steps(), 1);
  EXPECT_NEAR(l.job().step_seconds(), 8.0, 1e-12);
  report_step(id, 1, 1, 16, 1, 1.25);
  l = reply();
  EXPECT_EQ(l.job().recent_steps(), 1);
  EXPECT_NEAR(l.job().step_seconds(), 1.25, 1e-12);
  EXPECT_NEAR(l.job().eta_seconds(), 8 * 1.25, 1e-9);
  report_step(id, 2, 1, 16, 1, 1.5);
  l = reply();
  EXPECT_EQ(l.job().recent_steps(), 2);
  EXPECT_NEAR(l.job().step_seconds(), 1.5, 1e-12);  // the upper median of {1.25, 1.5}
}

TEST_F(LiveLoadTest, TheRunningJobShowsItsRecentStepTimeAndTheWindowLoad) {
  add_nodes(2, 2);
  const std::string id = start_job(16, 2, 100);
  ASSERT_NE(scheduler.running(), nullptr);
  // 10 steps; the last 8 take 1..8 x 0.01 s on rank 0, so the slowest rank (3) 4x that.
  for (int s = 0; s < 10; ++s) report_step(id, s, 4, 16, 2, 0.01 * std::max(1, s - 1));
  const v1::LiveLoad l = reply();
  ASSERT_TRUE(l.has_job());
  EXPECT_EQ(l.job().job_id(), id);
  EXPECT_EQ(l.job().state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(l.job().steps_completed(), 10);
  EXPECT_EQ(l.job().steps(), 100);
  EXPECT_EQ(l.job().recent_steps(), 8);
  // Steps 2..9 took 0.01 x (1..8) x 4 at the slowest rank: the median (upper) is 0.01 x 5 x 4.
  EXPECT_NEAR(l.job().step_seconds(), 0.2, 1e-12);
  EXPECT_NEAR(l.job().tokens_per_second(), 2000, 1e-6);
  EXPECT_EQ(l.jobs().at("running"), 1);
  ASSERT_EQ(l.layers_size(), 2);
  const v1::LayerPlacement& lp = l.layers(0);
  EXPECT_EQ(lp.map().epoch(), 1);
  ASSERT_EQ(lp.expert_loads_size(), 16);
  EXPECT_EQ(lp.expert_loads(15), 10 * 4 * 16);  // 10 steps x 4 ranks x 16 pairs
  ASSERT_EQ(lp.rank_loads_size(), 4);
  EXPECT_DOUBLE_EQ(lp.balancedness(), 25.0 / 40);  // mean 25 / max 40

  const auto lines = ctl::render_top(l, frame(80));
  const std::string text = joined(lines);
  EXPECT_NE(text.find(id + " RUNNING   step 10/100   eta 18s   200.0 ms/step   2.00k tokens/s"), std::string::npos) << text;
  EXPECT_NE(text.find("layer 0   epoch 1   balancedness 0.625"), std::string::npos) << text;
  EXPECT_NE(text.find("hottest: 15 11.8%, 14 11.0%"), std::string::npos) << text;  // 16/136, 15/136
  EXPECT_NE(text.find("  rank 3 [########################################] 40.0%"), std::string::npos) << text;
  expect_fits(lines, 80);
  // A serving job has no last step: its reports are windows of calls.
  v1::LiveLoad serving = l;
  serving.mutable_job()->set_mode(v1::JobSpec::serve);
  serving.mutable_job()->set_steps(0);
  const std::string served = joined(ctl::render_top(serving, frame(80)));
  EXPECT_NE(served.find(id + " RUNNING   window 10   200.0 ms/window   2.00k tokens/s"), std::string::npos) << served;
}

TEST_F(LiveLoadTest, AnEndedJobIsTheLastJob) {
  add_nodes(1, 1);
  const std::string id = start_job(4, 1, 2);
  report_step(id, 0, 1, 4, 1, 0.5);
  report_step(id, 1, 1, 4, 1, 0.5);
  v1::RankDone d;
  d.set_job_id(id);
  d.set_rank(0);
  d.set_ok(true);
  members.rank_done(id, 0);
  scheduler.on_rank_done(d, now);
  const v1::LiveLoad l = reply();
  ASSERT_TRUE(l.has_job());
  EXPECT_EQ(l.job().state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(l.job().steps_completed(), 2);
  EXPECT_DOUBLE_EQ(l.job().step_seconds(), 0.5);
  EXPECT_DOUBLE_EQ(l.job().tokens_per_second(), 200);
  const std::string text = joined(ctl::render_top(l, frame(80)));
  EXPECT_NE(text.find("idle; last " + id + " SUCCEEDED   step 2/2   500.0 ms/step   200 tokens/s"), std::string::npos)
      << text;
}

// 256 experts fit an 80-column terminal: 64 cells a row in groups of 8, every
// expert once, the hottest at the ramp's top.
TEST(TopFrame, ManyExpertsWrapWithinTheWidthAndTheHeight) {
  v1::LiveLoad l;
  l.mutable_shape()->set_experts(256);
  l.mutable_shape()->set_layers(2);
  for (int layer = 0; layer < 2; ++layer) {
    v1::LayerPlacement* lp = l.add_layers();
    lp->mutable_map()->set_layer(layer);
    lp->mutable_map()->set_num_ranks(64);
    for (int e = 0; e < 256; ++e) lp->add_expert_loads(e == 77 ? 1000 : e % 10);
    for (int r = 0; r < 64; ++r) lp->add_rank_loads(r + 1);
  }
  for (int width : {80, 120, 40}) {
    const auto lines = ctl::render_top(l, frame(width));
    expect_fits(lines, width);
    if (width != 80) continue;
    std::vector<std::string> heat;
    for (const auto& s : lines)
      if (s.rfind("  ", 0) == 0 && s.size() > 6 && std::isdigit(static_cast<unsigned char>(s[4]))) heat.push_back(s);
    ASSERT_EQ(heat.size(), 8u) << joined(lines);  // 4 rows per layer
    EXPECT_EQ(heat[0].substr(0, 6), "    0 ");
    EXPECT_EQ(heat[1].substr(0, 6), "   64 ");
    EXPECT_EQ(heat[0].size(), 6u + 64 + 7);
    EXPECT_EQ(heat[1][6 + 13 + 1], '@') << "expert 77: 13 cells and a group gap into row 64";
    EXPECT_NE(joined(lines).find("hottest: 77 "), std::string::npos);
  }
  const auto cut = ctl::render_top(l, frame(80, 24));
  ASSERT_EQ(cut.size(), 24u);
  EXPECT_EQ(cut[21].rfind("... ", 0), 0u) << joined(cut);
  EXPECT_EQ(cut[23], "q: quit   (refreshed every second)");
}

TEST(TopFrame, HeatCellsShadeByTheShareOfTheHottest) {
  EXPECT_EQ(ctl::heat_cell(0, 10), ' ');
  EXPECT_EQ(ctl::heat_cell(0.001, 10), '.');
  EXPECT_EQ(ctl::heat_cell(5, 10), '+');  // ceil(4.5) = 5
  EXPECT_EQ(ctl::heat_cell(10, 10), '@');
  EXPECT_EQ(ctl::heat_cell(3, 0), ' ');
}

}  // namespace
}  // namespace moe::agent
