// The daemon's side of a live rebalance (docs/placement.md#live-rebalance), in one
// place:
//   RebalanceMailbox  what the daemon's control thread received (PREPARE, COMMIT,
//                     ABORT) for its ranks to act on; the node's READY.
//   RebalanceSession  one rank's side: its vote in the step's own all-reduce, the
//                     staged epoch, the action every rank takes before the same
//                     step (stage, drop or switch), and READY / NO to the agent.
// The layers' part (copies, shadow replicas, the switch itself) is EpLayer's,
// in daemon/ep/ep_rebalance.cc; ModelStack applies it to every layer.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "moe/metrics/daemon_metrics.h"
#include "moe/node/model_stack.h"
#include "moe/rpc/client.h"
#include "moe/v1/rebalance.pb.h"
#include "moe/v1/rpc.pb.h"

namespace moe::node {

// Test hooks (moed reads MOE_FAULT_INJECT="node1:refuse-copy,node2:stall-copy"):
// a node that refuses every copy it gains, whose copies never complete, or that
// dies the moment a COMMIT reaches it.
struct FaultInjection {
  bool refuse_copy = false;
  bool stall_copy = false;
  bool die_on_commit = false;
  // The faults of `node` in a MOE_FAULT_INJECT value; throws moe::Error naming
  // an unknown fault.
  static FaultInjection parse(const std::string& spec, const std::string& node);
};

// Thread-safe: written by the control thread, read by the ranks at step
// boundaries.
class RebalanceMailbox {
 public:
  RebalanceMailbox(std::string job_id, int local_ranks) : job_id_(std::move(job_id)), local_ranks_(local_ranks) {}

  // Control thread: the agent's PREPARE, COMMIT or ABORT (the one the envelope
  // holds), logged. Throws rpc::RpcError(FAILED_PRECONDITION) naming another job.
  void deliver(const v1::Envelope& message);
  // The job a PREPARE, COMMIT or ABORT names.
  static const std::string& job_of(const v1::Envelope& message);
  // Control thread: the agent that sent the PREPARE in hand is gone (a new
  // incarnation registered us), or the ranks it named are (an elastic job
  // changed its world): abort it, as if its ABORT had come.
  void abandon(const std::string& why);

  // Ranks, at step boundaries.
  struct View {
    std::optional<v1::PrepareRebalance> prepare;
    int64_t committed = 0, aborted = 0;
  };
  View view() const;
  // One local rank's copies of `epoch` are in. True for exactly one rank: the
  // one that makes the node ready (it tells the agent).
  bool rank_ready(int64_t epoch);
  // The first caller for `epoch` gets true (one refusal per node).
  bool claim_refusal(int64_t epoch);
  // The epoch switched or was dropped: forget it.
  void done(int64_t epoch);

 private:
  void prepare(const v1::PrepareRebalance& p);
  void commit(int64_t epoch);
  void abort(int64_t epoch);

  mutable std::mutex mu_;
  const std::string job_id_;
  const int local_ranks_;
  std::optional<v1::PrepareRebalance> prepare_;
  int64_t committed_ = 0, aborted_ = 0;
  int64_t ready_epoch_ = 0, refused_epoch_ = 0;
  int ready_ranks_ = 0;
};

// Who a session is and where it reports.
struct RebalanceSessionEnv {
  std::string job_id;
  std::string node_name;
  int rank = 0;
  int world = 1;
  FaultInjection faults;
  metrics::DaemonMetrics* metrics = nullptr;  // may be null
};

// One rank's rebalances of one job. Every rank calls vote(), then (with the sum of
// every rank's vote, after the step's all-reduce) act() before the same step, and
// after_step() after it; so all ranks stage, drop and switch at one boundary.
class RebalanceSession {
 public:
  // Floats of a vote: [holds a PREPARE, its epoch (low 20 bits, exact in fp32),
  // holds COMMIT of the staged epoch, holds ABORT of it].
  static constexpr int kVoteFloats = 4;

  RebalanceSession(RebalanceSessionEnv env, ModelStack& stack, RebalanceMailbox& mailbox, rpc::RpcClient& agent);

  // Writes this rank's vote into vote[0, kVoteFloats), from the mailbox as it is now.
  void vote(float* vote);
  // Turns a vote into one that neither stages nor switches (an ABORT still
  // counts): a serving job holds its map while gradients are summed on it.
  static void hold(float* vote) { vote[0] = vote[1] = vote[2] = 0; }
  // sum: every rank's vote, summed. Stages a PREPARE every rank holds, drops the
  // staged epoch when any rank got its ABORT, or switches when every rank got its
  // COMMIT; before step `step` runs.
  void act(const float* sum, int step);
  // After a step: the staged copies progressed with the step's transfers; once
  // this rank has all of its, it counts itself ready (the node's last one tells
  // the agent).
  void after_step();

 private:
  void stage(const v1::PrepareRebalance& p, int step);  // every layer's map and copies from p
  void drop(int step);
  void switch_staged(int step);
  void tell_agent_ready(bool ok, const std::string& reason);

  const RebalanceSessionEnv env_;
  ModelStack& stack_;
  RebalanceMailbox& mailbox_;
  rpc::RpcClient& agent_;
  std::optional<v1::PrepareRebalance> voted_prepare_;  // what this rank voted for (the mailbox may change)
  std::optional<v1::PrepareRebalance> staged_;        // the epoch being staged
  bool staged_ready_ = false;
};

}  // namespace moe::node
