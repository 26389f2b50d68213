// What a daemon's control thread received of a live rebalance (DESIGN 7), for
// its ranks to act on at step boundaries: the pending PREPARE, and whether its
// epoch was committed or aborted. Ranks also count themselves ready here; the
// rank that completes the node tells the agent. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "moe/v1/cluster.pb.h"

namespace moe::node {

// Test hooks (moed reads MOE_FAULT_INJECT="node1:refuse-copy,node2:stall-copy"):
// a node that refuses every copy it gains, or whose copies never complete.
struct FaultInjection {
  bool refuse_copy = false;
  bool stall_copy = false;
  // The faults of `node` in a MOE_FAULT_INJECT value; throws moe::Error naming
  // an unknown fault.
  static FaultInjection parse(const std::string& spec, const std::string& node);
};

class RebalanceMailbox {
 public:
  explicit RebalanceMailbox(int local_ranks) : local_ranks_(local_ranks) {}

  // Control thread.
  void prepare(const v1::PrepareRebalance& p);
  void commit(int64_t epoch);
  void abort(int64_t epoch);

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
  mutable std::mutex mu_;
  const int local_ranks_;
  std::optional<v1::PrepareRebalance> prepare_;
  int64_t committed_ = 0, aborted_ = 0;
  int64_t ready_epoch_ = 0, refused_epoch_ = 0;
  int ready_ranks_ = 0;
};

}  // namespace moe::node
