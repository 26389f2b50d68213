// One world of a job on one rank (RankRun's; private to daemon/node): the rank's
// number in it, its transports (bootstrapped among the world's ranks through the
// agent), the stack on the world's maps and the rebalance session. `start` is
// this world's: the spec's tokens_per_rank, the size, the maps and the
// data-plane key are the world's own. An elastic job builds one per world.
#pragma once

#include <string>

#include "moe/node/agent_bootstrap.h"
#include "moe/node/job_runner.h"
#include "moe/node/model_stack.h"
#include "moe/node/rebalance_session.h"
#include "moe/transport/transport_factory.h"

namespace moe::node {

// What every world of a rank is built from.
struct RankWorldEnv {
  rpc::RpcClient& agent;
  JobRunner& runner;
  kernels::Backend& backend;
  kernels::ThreadPool& pool;
  int local;  // the rank's device on this node
  const RunnerEnv& env;
};

struct RankWorld {
  RankWorld(v1::StartJob start, int rank, const RankWorldEnv& env);
  // A wait on the world's transports fails now with `why`. Thread-safe.
  void abort(const std::string& why);
  // The world's job (its spec's derived view).
  const layer_spec::JobView& job() const { return stack.job(); }

  const v1::StartJob start;
  const int rank;
  AgentBootstrap boot;
  transport::RankTransports transports;  // host, and the backend's memory (null: host)
  transport::Communicator& comm;         // transports.host: control, counts, copies
  ModelStack stack;
  RebalanceSession rebalance;
};

}  // namespace moe::node
