// An elastic job's change of world (docs/jobs.md#elastic-jobs), decided from
// what its surviving ranks reported when they halted: which step the new world
// resumes at, each survivor's new rank, the tokens per rank, and which rank
// sends which expert state to which. Pure functions, tested without processes.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "moe/v1/job.pb.h"
#include "moe/v1/job_run.pb.h"
#include "moe/v1/placement.pb.h"

namespace moe::agent {

struct WorldChangeInput {
  v1::JobSpec spec;  // as the job started (tokens_per_rank: the first world's)
  int devices_per_node = 1;
  int tokens_per_rank = 0;                 // the old world's
  std::vector<int> nodes;                  // the old world's node indices, in rank order
  std::set<int> lost;                      // node indices that leave it
  std::set<int> joining;                   // node indices that join it (no state; not in `nodes`)
  std::map<int, v1::RankHalted> halted;    // by old rank: every surviving rank's report
  std::vector<v1::PlacementMap> old_maps;  // the old world's maps, one per layer
  std::vector<std::string> node_names;     // by node index, for messages
};

struct WorldChangePlan {
  std::vector<int> nodes;  // the new world's node indices in rank order: the survivors and joiners by index
  v1::NewWorld world;      // new_rank, world_size, tokens_per_rank, resume_step (maps, moves, key, epoch, nodes: the caller's)
  int steps_recomputed = 0;
};

// Throws moe::Error naming what cannot go on: no survivor, reports that do not
// fit together, a global batch the new world cannot divide. A joining rank gets
// every expert of its slots from a survivor.
WorldChangePlan plan_world(const WorldChangeInput& in);

// The expert states the new world's ranks need from another survivor, for
// `maps` (the new world's). A train job's experts carry state, so an expert no
// survivor holds cannot be rebuilt: throws moe::Error naming those experts and
// where they lived. Forward jobs build their experts from the spec: no moves.
// Each source sends as few states as it can (the least-loaded holder first).
std::vector<v1::ExpertMove> expert_moves(const WorldChangeInput& in, const WorldChangePlan& plan,
                                         const std::vector<v1::PlacementMap>& maps);

// The (layer, expert) states no survivor holds, for `maps`' experts; empty for
// forward jobs (their experts are the spec's).
int lost_experts(const WorldChangeInput& in, const WorldChangePlan& plan);

}  // namespace moe::agent
