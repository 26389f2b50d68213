// A rank's transport bootstrap through the agent (docs/transport.md#bootstrap).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/rpc/client.h"
#include "moe/transport/bootstrap.h"

namespace moe::node {

// The transport bootstrap through the agent: publish our bytes, get everyone's.
class AgentBootstrap final : public transport::Bootstrap {
 public:
  AgentBootstrap(rpc::RpcClient& agent, std::string job_id, int rank, int64_t world_epoch)
      : agent_(agent), job_id_(std::move(job_id)), rank_(rank), world_epoch_(world_epoch) {}
  std::vector<std::string> all_gather(const std::string& mine) override;

 private:
  rpc::RpcClient& agent_;
  std::string job_id_;
  int rank_;
  int64_t world_epoch_;
};

}  // namespace moe::node
