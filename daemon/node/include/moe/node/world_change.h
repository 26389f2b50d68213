// An elastic job's state moving onto a new world (docs/jobs.md#elastic-jobs): each
// rank of the new world takes the state it lacks from the stacks it holds (the
// world it leaves and the worlds it retired) or from the rank the agent named,
// or every rank reads the checkpoint the agent chose. RankRun decides when (its
// step loop and the transition); this room moves the bytes.
#pragma once

#include <string>
#include <vector>

#include "moe/layer_spec/job_layers.h"
#include "moe/node/model_stack.h"
#include "moe/transport/communicator.h"
#include "moe/v1/job_run.pb.h"
#include "moe/v1/rpc.pb.h"

namespace moe::node {

// A stack this rank holds from an earlier world, and its rank there.
struct HeldStack {
  ModelStack& stack;
  int rank;
};

// The new world's side: its stack, this rank's number in it, its host
// communicator, its job.
struct WorldTarget {
  ModelStack& stack;
  int rank;
  transport::Communicator& comm;
  const layer_spec::JobView& job;
  const std::string& job_id;
};

// What a halted rank tells the agent (RankHalted): its place, what it applied,
// why, and every expert it holds in any stack it keeps.
struct Halted {
  const std::string& job_id;
  int rank;
  int64_t world_epoch;
  int applied_steps;
  bool pending;  // it holds the reduced gradients of the step after them
  const std::string& why;
  int failed_peer;  // -1: none named
};
v1::Envelope rank_halted(const Halted& h, const std::vector<HeldStack>& held);

// Every rank of the new world, together: what every rank holds alike (router,
// shared experts, their optimizer state, the selection bias) from the first rank
// that has it, and each slot's expert from `held` (in order: the world left, then
// the retired ones) or from the rank `next` names. from_a_world: held.front() is
// the world this rank leaves (false: a joining rank, holding nothing).
void move_state(const std::vector<HeldStack>& held, bool from_a_world, const WorldTarget& to, const v1::NewWorld& next,
                transport::Deadline until);
// An expert was lost with no surviving copy: every rank of the new world reads
// the checkpoint the agent chose (a consistent cut), whatever shape wrote it.
void roll_back(const WorldTarget& to, const v1::NewWorld& next, transport::Deadline until);

}  // namespace moe::node
