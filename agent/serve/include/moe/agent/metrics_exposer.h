// The agent's Prometheus metrics (docs/metrics.md#agent-metrics):
// moe_placement_epoch{layer}, moe_placement_balancedness{layer},
// moe_expert_replicas{layer,expert}, moe_expert_load{layer,expert},
// moe_rebalances_total{result}, moe_rebalance_seconds, moe_world_changes_total{cause},
// moe_world_change_recovery_seconds, moe_nodes{state},
// moe_jobs{state}, moe_build_info. Values are read from the Agent on its io thread
// once a second.
#pragma once

#include <memory>
#include <string>

#include "moe/agent/agent.h"

namespace moe::agent {

class MetricsExposer {
 public:
  // listen: "PORT" (loopback only) or "HOST:PORT"; port 0 picks one.
  MetricsExposer(rpc::asio::io_context& io, const Agent& agent, const std::string& listen);
  ~MetricsExposer();
  std::string address() const;  // HOST:PORT a scraper can reach

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::agent
