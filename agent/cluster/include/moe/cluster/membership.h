// Membership: the nodes that registered, their global ranks, liveness by
// heartbeat, and which job each node is still busy with. Node i holds global
// ranks [i x D, (i + 1) x D) for the cluster's D devices per node
// (docs/architecture.md#processes). A node keeps its index by name across
// restarts. No I/O: the agent feeds it requests and the clock.
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "moe/v1/agent_state.pb.h"
#include "moe/v1/membership.pb.h"

namespace moe::agent {

using Clock = std::chrono::steady_clock;

struct NodeRecord {
  std::string name;
  int index = 0;
  v1::NodeState state = v1::NODE_STATE_ALIVE;
  int devices = 0;
  v1::Backend backend = v1::BACKEND_UNSPECIFIED;
  std::string gemm_engine;
  std::vector<std::string> device_names;  // per local rank
  std::string control_address, metrics_address;  // HOST:PORT
  Clock::time_point last_heartbeat;
  // The job whose ranks on this node have not all reported done: the daemon is
  // still busy with it even if the agent already recorded its end.
  std::string busy_job;
  std::set<int> busy_ranks;  // global ranks; a repeated RankDone counts once
  // Read back by a restarted agent and not re-registered since (UNHEARD, then
  // DEAD if it never comes back).
  bool restored = false;
  double dead_since_unix_ms = 0;  // when expire() declared it dead (wall clock, for people)
};

class Membership {
 public:
  explicit Membership(Clock::duration heartbeat_timeout) : heartbeat_timeout_(heartbeat_timeout) {}

  // Registers a node, or re-registers one by name. A new name is refused while a
  // job runs (job_running). Throws rpc::RpcError naming the field.
  const NodeRecord& register_node(const v1::RegisterNodeRequest& r, bool job_running, Clock::time_point now);
  // True when the heartbeat names a live node under its index.
  bool heartbeat(const v1::HeartbeatRequest& r, Clock::time_point now);
  // Marks nodes whose last heartbeat (or restore) is older than the timeout dead
  // (a dead daemon runs nothing) and returns their indices.
  std::vector<int> expire(Clock::time_point now) { return expire(now, heartbeat_timeout_); }
  // ... with another timeout: a running job's own (JobSpec.dead_node_timeout_ms).
  std::vector<int> expire(Clock::time_point now, Clock::duration timeout);
  // The agent itself did not run from `from` to `to` (stopped, its VM paused):
  // the nodes it waits for that it last heard before `from` have their silence
  // shortened by the stall (never past `to`), since what they sent meanwhile waits
  // unread in its sockets and only the agent's running time counts.
  void forgive_stall(Clock::time_point from, Clock::time_point to);

  // Every node (or node `node` only: one joining an elastic job) is busy with
  // job_id until each of its ranks reports done.
  void mark_busy(const std::string& job_id, int node = -1);
  // A rank reported done; true when its node has no rank left busy.
  bool rank_done(const std::string& job_id, int rank);
  // At least one node, every node alive and idle: a job may start.
  bool ready_for_job() const;
  // What a job waits for before it can start ("" for nothing): "node node1:
  // dead since 12:03:04 UTC (...)", "a node to register", "node node0: still
  // finishing job-3".
  std::string not_ready_reason() const;
  // "" when every node registered the same backend, else which differ: a job's
  // ranks share one data path (NCCL between GPUs, UCX between CPU ranks).
  std::string backend_mismatch() const;
  bool any_dead() const;

  int world_size() const { return static_cast<int>(nodes_.size()) * devices_per_node_; }
  int alive_ranks() const;
  int devices_per_node() const { return devices_per_node_; }
  int num_nodes() const { return static_cast<int>(nodes_.size()); }
  const std::vector<NodeRecord>& nodes() const { return nodes_; }

  // "rank 3 (node node1)"; "node node1 (ranks 2-3)".
  std::string describe_rank(int rank) const;
  std::string describe_node(const NodeRecord& n) const;
  // Nodes by state, every state present (for metrics).
  std::map<v1::NodeState, int> counts() const;
  void fill_status(v1::ClusterStatus& s, Clock::time_point now) const;

  // The nodes for the agent's state directory, and back: restored nodes are
  // UNHEARD until they re-register, and dead if they do not within the
  // heartbeat timeout from `now`. Throws moe::Error naming the bad field.
  v1::MembershipState state() const;
  void restore(const v1::MembershipState& s, Clock::time_point now);

 private:
  Clock::duration heartbeat_timeout_;
  std::vector<NodeRecord> nodes_;  // by node index
  int devices_per_node_ = 0;
};

}  // namespace moe::agent
