// The serve steps of one rank of a serving job (docs/serving.md). Each step the
// ranks agree, in one all-reduce, on whether to stop, on the live rebalance's
// votes and on the layer to run: the one whose oldest queued row has waited
// longest summed over the ranks (the lowest on a tie). Each rank then runs that
// layer on up to tokens_per_rank of its node's queued rows of it, zero rows
// being a rank's share when it has none, and hands the results back.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "moe/node/model_stack.h"
#include "moe/node/rebalance_session.h"
#include "moe/node/serve_queue.h"
#include "moe/transport/communicator.h"

namespace moe::node {

struct ServeRank {
  transport::Communicator& comm;  // host memory: the step's vote
  ModelStack& stack;
  RebalanceSession& rebalance;
  ServeQueue& queue;  // the node's
  std::chrono::milliseconds timeout;  // of each transport wait
};

// Runs serve steps until every rank agreed to stop (a cancel); returns how many ran.
int64_t serve_until_cancelled(const ServeRank& r, const std::function<bool()>& cancel_requested);

}  // namespace moe::node
