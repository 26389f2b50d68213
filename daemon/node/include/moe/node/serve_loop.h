// The serve steps of one rank of a serving job (docs/serving.md). Each step the
// ranks agree, in one all-reduce, on whether to stop, on the live rebalance's
// votes, on the lane to run (a layer's forward or backward calls: the one whose
// oldest queued row has waited longest summed over the ranks, the lowest on a
// tie) and on the requests due (an optimizer step, a weight read). Each rank
// then runs that lane on up to tokens_per_rank of its node's queued rows of it,
// zero rows being a rank's share when it has none, and hands the results back;
// then the due requests run, every rank taking part, and the node's first
// rank answers them. About every second the ranks agree to close a reporting
// window (ServeWindow) and each sends it to the agent. A training job writes a
// checkpoint every checkpoint_every optimizer steps, and when cancelled after
// steps the last one did not cover (docs/serving.md#checkpoints).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "moe/node/model_stack.h"
#include "moe/node/rebalance_session.h"
#include "moe/node/serving_node.h"
#include "moe/transport/communicator.h"
#include "moe/v1/job_run.pb.h"

namespace moe::node {

struct ServeRank {
  transport::Communicator& comm;  // host memory: the step's vote
  ModelStack& stack;
  RebalanceSession& rebalance;
  ServingNode& node;
  bool first_on_node;  // counts and answers the node's requests, reports its calls
  std::chrono::milliseconds timeout;  // of each transport wait
  int rank;
  int device;  // the rank's device on this node, for the metrics' labels
  int64_t world_epoch;
  int first_window;  // the world's first reporting window's number (the job's count so far)
  const v1::StartJob& start;  // for checkpoints
  int64_t optimizer_steps;    // applied before this world (a resumed job's checkpoint's)
  metrics::DaemonMetrics* metrics;  // may be null
  std::function<void(const v1::StepStats&)> report;  // a closed window, to the agent (its step numbers it)
  std::function<void()> after_step;                  // every rank of the world completed a step; may be empty
};

// Runs serve steps until every rank agreed to stop (a cancel); returns how many ran.
int64_t serve_until_cancelled(const ServeRank& r, const std::function<bool()>& cancel_requested);

}  // namespace moe::node
