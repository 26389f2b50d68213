// An elastic job's world change decided from the survivors' reports
// (agent/jobs/world_change.cc, docs/jobs.md#elastic-jobs): the resume step, the new
// ranks and batch, and which survivor sends which expert.
#include <gtest/gtest.h>

#include "moe/jobs/world_change.h"
#include "moe/base/check.h"

namespace moe::agent {
namespace {

v1::RankHalted halted(int rank, int applied, bool pending, const std::vector<int>& experts) {
  v1::RankHalted h;
  h.set_rank(rank);
  h.set_applied_steps(applied);
  h.set_pending(pending);
  auto* layer = h.add_hosted();  // one layer
  for (int e : experts) layer->add_experts(e);
  return h;
}

// A one-layer map of `ranks` x `slots` from phy2log.
v1::PlacementMap map_of(int experts, int ranks, int slots, const std::vector<int>& phy2log) {
  v1::PlacementMap m;
  m.set_num_experts(experts);
  m.set_num_ranks(ranks);
  m.set_slots_per_rank(slots);
  for (int e : phy2log) m.add_phy2log(e);
  return m;
}

// Two nodes of two ranks; node 1 lost. Experts 0-3, each on both nodes.
WorldChangeInput two_by_two(v1::JobSpec::Mode mode) {
  WorldChangeInput in;
  in.spec.set_mode(mode);
  in.spec.set_experts(4);
  in.devices_per_node = 2;
  in.tokens_per_rank = 16;
  in.nodes = {0, 1};
  in.lost = {1};
  in.node_names = {"node0", "node1"};
  in.old_maps = {map_of(4, 4, 2, {0, 1, 2, 3, 2, 3, 0, 1})};
  return in;
}

TEST(WorldChange, TrainResumesAfterTheFurthestSurvivorAndKeepsTheGlobalBatch) {
  WorldChangeInput in = two_by_two(v1::JobSpec::train);
  in.halted[0] = halted(0, 30, false, {0, 1});
  in.halted[1] = halted(1, 29, true, {2, 3});  // reached the agreement of step 29: it applies it
  const WorldChangePlan p = plan_world(in);
  EXPECT_EQ(p.world.resume_step(), 30);
  EXPECT_EQ(p.world.world_size(), 2);
  EXPECT_EQ(p.world.tokens_per_rank(), 32);
  EXPECT_EQ(std::vector<int>(p.world.new_rank().begin(), p.world.new_rank().end()), (std::vector<int>{0, 1, -1, -1}));
  EXPECT_EQ(p.nodes, std::vector<int>{0});
  EXPECT_EQ(p.steps_recomputed, 0);
}

TEST(WorldChange, ASurvivorBehindWithoutTheGradientsIsAnError) {
  WorldChangeInput in = two_by_two(v1::JobSpec::train);
  in.halted[0] = halted(0, 30, false, {0, 1});
  in.halted[1] = halted(1, 29, false, {2, 3});
  EXPECT_THROW(plan_world(in), moe::Error);
  in.halted[1] = halted(1, 28, true, {2, 3});
  EXPECT_THROW(plan_world(in), moe::Error);  // two steps apart cannot happen
}

TEST(WorldChange, ForwardResumesAtTheLeastAndCountsTheRecomputedStep) {
  WorldChangeInput in = two_by_two(v1::JobSpec::forward);
  in.spec.set_elastic_batch(v1::JobSpec::per_rank);
  in.halted[0] = halted(0, 12, false, {0, 1});
  in.halted[1] = halted(1, 11, false, {2, 3});
  const WorldChangePlan p = plan_world(in);
  EXPECT_EQ(p.world.resume_step(), 11);
  EXPECT_EQ(p.steps_recomputed, 1);
  EXPECT_EQ(p.world.tokens_per_rank(), 16);  // per_rank keeps it
  EXPECT_TRUE(expert_moves(in, p, {map_of(4, 2, 2, {0, 1, 2, 3})}).empty());  // forward experts are the spec's
}

TEST(WorldChange, ABatchTheNewWorldCannotDivideIsRefused) {
  WorldChangeInput in;
  in.spec.set_mode(v1::JobSpec::train);
  in.devices_per_node = 1;
  in.tokens_per_rank = 5;
  in.nodes = {0, 1, 2};
  in.lost = {2};
  in.halted[0] = halted(0, 3, false, {0});
  in.halted[1] = halted(1, 3, false, {1});
  try {
    plan_world(in);
    FAIL() << "15 tokens over 2 ranks was accepted";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the global batch of 15 tokens does not divide over 2 ranks"),
              std::string::npos)
        << e.what();
  }
}

TEST(WorldChange, EachMissingExpertComesFromASurvivingReplicaSpreadOverTheSenders) {
  WorldChangeInput in = two_by_two(v1::JobSpec::train);
  in.halted[0] = halted(0, 5, false, {0, 1});
  in.halted[1] = halted(1, 5, false, {2, 3});
  const WorldChangePlan p = plan_world(in);
  // The new world: rank 0 holds 0, 1, 2, 3; rank 1 holds 2, 3, 0, 1.
  const auto moves = expert_moves(in, p, {map_of(4, 2, 4, {0, 1, 2, 3, 2, 3, 0, 1})});
  ASSERT_EQ(moves.size(), 4u);
  int from0 = 0, from1 = 0;
  for (const auto& m : moves) {
    EXPECT_NE(m.from_rank(), m.to_rank());
    const bool held = m.from_rank() == 0 ? m.expert() < 2 : m.expert() >= 2;
    EXPECT_TRUE(held) << "expert " << m.expert() << " from rank " << m.from_rank();
    (m.from_rank() == 0 ? from0 : from1)++;
  }
  EXPECT_EQ(from0, 2);
  EXPECT_EQ(from1, 2);
}

TEST(WorldChange, AnExpertWithNoSurvivingCopyIsNamedWithItsNode) {
  WorldChangeInput in = two_by_two(v1::JobSpec::train);
  in.old_maps = {map_of(4, 4, 1, {0, 1, 2, 3})};
  in.halted[0] = halted(0, 5, false, {0});
  in.halted[1] = halted(1, 5, false, {1});
  const WorldChangePlan p = plan_world(in);
  try {
    expert_moves(in, p, {map_of(4, 2, 2, {0, 1, 2, 3})});
    FAIL() << "experts 2 and 3 were lost with node1 and the move was accepted";
  } catch (const moe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("experts lost with no surviving copy: layer 0: expert(s) 2, 3 (only on node node1)"),
              std::string::npos)
        << e.what();
  }
}

TEST(WorldChange, NoSurvivorIsAnError) {
  WorldChangeInput in = two_by_two(v1::JobSpec::train);
  in.lost = {0, 1};
  EXPECT_THROW(plan_world(in), moe::Error);
}

}  // namespace
}  // namespace moe::agent
