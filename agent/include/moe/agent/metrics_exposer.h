// The agent's Prometheus metrics (DESIGN 8): moe_placement_epoch,
// moe_placement_balancedness{layer}, moe_expert_replicas{layer,expert},
// moe_rebalances_total, moe_nodes{state}, moe_jobs{state}, moe_build_info.
// Values are read from the Agent on its io thread once a second.
#pragma once

#include <memory>
#include <string>

#include "moe/agent/agent.h"

namespace moe::agent {

class MetricsExposer {
 public:
  // listen: "PORT" (all interfaces) or "HOST:PORT"; port 0 picks one.
  MetricsExposer(rpc::asio::io_context& io, const Agent& agent, const std::string& listen);
  ~MetricsExposer();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Balancedness of a map under per-expert loads: mean rank load / max rank load,
// a replica taking an equal share of its expert's load (DESIGN 7).
double balancedness(const v1::PlacementMap& map, const std::vector<double>& loads);

}  // namespace moe::agent
